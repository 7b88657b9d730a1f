package idem

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestMemoryBudgetHonoured: with a 64 MiB budget, the memory the engine
// accounts for (Stats.Memory) never exceeds the budget while 100,000 fresh
// requests fill every part (in-memory table, pending sets, key filter,
// block cache, memtables), and a smaller budget still serves every request.
func TestMemoryBudgetHonoured(t *testing.T) {
	const budget = 64 << 20
	e := openMem(t, vfs.NewMem(), &Options{MemoryBudget: budget})
	defer e.Close()
	var (
		peak    atomic.Int64
		peakAt  atomic.Pointer[MemoryStats]
		stop    = make(chan struct{})
		sampler sync.WaitGroup
	)
	sample := func() {
		m := e.Stats().Memory
		if m.Budget != budget {
			t.Errorf("Stats.Memory.Budget %d", m.Budget)
		}
		if m.Total > peak.Load() {
			peak.Store(m.Total)
			peakAt.Store(&m)
		}
	}
	sampler.Add(1)
	go func() {
		defer sampler.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
				sample()
			}
		}
	}()
	const n = 100_000
	doFresh(t, e, "budget", n, 16, 128)
	// Lookups of committed ids fill the block cache and the table.
	for i := 0; i < n; i += 7 {
		if l, err := e.Lookup("", []byte(fmt.Sprintf("budget-%010d", i))); err != nil || l.Status != Done {
			t.Fatalf("lookup %d: %v %v", i, l.Status, err)
		}
	}
	waitApplied(t, e)
	sample()
	close(stop)
	sampler.Wait()
	m := peakAt.Load()
	t.Logf("peak accounted memory %d MiB of a %d MiB budget: %+v", peak.Load()>>20, budget>>20, *m)
	if peak.Load() > budget {
		t.Fatalf("accounted memory %d exceeds the budget %d: %+v", peak.Load(), budget, *m)
	}
	if m.Cache > budget/16+(1<<20) {
		t.Fatalf("in-memory table %d over its share %d", m.Cache, budget/16)
	}
	if st := e.Stats(); st.LiveEntries != n {
		t.Fatalf("live entries %d", st.LiveEntries)
	}
}

// In SyncNever mode records wait in memory (their entries pinned) until an
// fsync: the WAL fsyncs after every MemoryBudget/128 of log (at least
// 1 MiB), not only at rotation, so that wait is bounded.
func TestSyncNeverBoundsUnsyncedLog(t *testing.T) {
	e := openMem(t, vfs.NewMem(), &Options{Sync: SyncNever, MemoryBudget: 32 << 20, SegmentSize: 64 << 20})
	defer e.Close()
	reply := make([]byte, 512)
	for i := range 8000 { // about 5 MiB of log, well inside one segment
		commitID(t, e, Request{ID: []byte(fmt.Sprintf("id-%06d", i))}, string(reply))
	}
	st := e.Stats()
	if st.WALBytes < 4<<20 {
		t.Fatalf("only %d bytes of log written", st.WALBytes)
	}
	if st.WALSyncs < 3 {
		t.Fatalf("%d fsyncs for %d bytes of log in one segment: unsynced records are not bounded", st.WALSyncs, st.WALBytes)
	}
}

// slowCreateFS delays every file created under the index directory while
// slow is set: ingests and flushes take longer, and the applier falls
// behind the WAL.
type slowCreateFS struct {
	vfs.FS
	slow atomic.Bool
}

func (fs *slowCreateFS) Unwrap() vfs.FS { return fs.FS }

func (fs *slowCreateFS) Create(name string, c vfs.DiskWriteCategory) (vfs.File, error) {
	if fs.slow.Load() && strings.Contains(name, "index") {
		time.Sleep(20 * time.Millisecond)
	}
	return fs.FS.Create(name, c)
}

// TestApplierBacklogBounded: while the index is slow to take writes, the
// durable records waiting for the applier stay within their bound
// (IndexIngestBytes/2, at least 1 MiB): the WAL holds writers back instead
// of queueing records without limit. Every request still completes.
func TestApplierBacklogBounded(t *testing.T) {
	fs := &slowCreateFS{FS: vfs.NewMem()}
	o := &Options{MemoryBudget: 32 << 20}
	e := openMem(t, fs, o)
	defer e.Close()
	capBytes := max(e.o.IndexIngestBytes/2, 1<<20)
	fs.slow.Store(true)
	var peak atomic.Int64
	stop := make(chan struct{})
	var sampler sync.WaitGroup
	sampler.Add(1)
	go func() {
		defer sampler.Done()
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
				if b := e.Stats().Memory.Backlog; b > peak.Load() {
					peak.Store(b)
				}
			}
		}
	}()
	const n = 60_000
	doFresh(t, e, "backlog", n, 64, 256)
	fs.slow.Store(false)
	waitApplied(t, e)
	close(stop)
	sampler.Wait()
	t.Logf("peak backlog %d KiB, bound %d KiB", peak.Load()>>10, capBytes>>10)
	if peak.Load() > capBytes {
		t.Fatalf("backlog reached %d bytes, over its bound %d", peak.Load(), capBytes)
	}
	if peak.Load() < capBytes/2 {
		t.Fatalf("backlog peaked at %d bytes: the applier never fell behind, the bound was not exercised", peak.Load())
	}
	if b := e.Stats().Memory.Backlog; b != 0 {
		t.Fatalf("backlog %d after everything was applied", b)
	}
	if st := e.Stats(); st.LiveEntries != n {
		t.Fatalf("live entries %d, want %d", st.LiveEntries, n)
	}
}

// doFresh runs n fresh Dos (ids prefix-0000000000 on, replies of
// replySize bytes) from workers goroutines.
func doFresh(t *testing.T, e *Engine, prefix string, n, workers, replySize int) {
	t.Helper()
	reply := make([]byte, replySize)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += workers {
				r := Request{ID: []byte(fmt.Sprintf("%s-%010d", prefix, i))}
				if _, err := e.Do(bg, r, func(context.Context) ([]byte, error) { return reply, nil }); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
}
