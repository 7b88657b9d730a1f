package idem

import (
	"context"
	"fmt"
	"os"
	"runtime"
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
// It checks the engine's accounting against its own bound only: an
// allocation the accounting does not see passes it;
// TestMemoryRSSWithinBudget measures the process from outside.
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
		if l, err := e.Lookup(context.Background(), Request{Scope: "", ID: []byte(fmt.Sprintf("budget-%010d", i))}); err != nil || l.Status != Done {
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
// 1 MiB), not only at rotation, so that wait is bounded. The test checks
// the bound itself, after every commit: the records appended but not yet
// fsynced (Stats.LastLSN - Stats.DurableLSN) never hold more than that
// 1 MiB of log plus the request in flight. The commits run one at a time
// and each returns once its record is written, so the unsynced tail does
// not depend on how the flusher goroutine is scheduled (counting fsyncs
// did: a flush that takes several commits at once crosses the threshold
// fewer times).
func TestSyncNeverBoundsUnsyncedLog(t *testing.T) {
	const (
		budget      = 32 << 20
		maxUnsynced = 1 << 20 // max(budget/128, 1 MiB): what Open gives the WAL
		replySize   = 512
	)
	e := openMem(t, vfs.NewMem(), &Options{Sync: SyncNever, MemoryBudget: budget, SegmentSize: 64 << 20})
	defer e.Close()
	reply := make([]byte, replySize)
	// A request writes at most two records (its claim and its commit), and
	// the commit carries the reply: maxUnsynced bytes of log hold at most
	// maxUnsynced/replySize requests. One more request may be in the flush
	// that crosses the threshold, between its write and its fsync.
	const bound = 2 * (maxUnsynced/replySize + 1)
	var worst uint64
	for i := range 8000 { // about 5 MiB of log, well inside one segment
		commitID(t, e, Request{ID: []byte(fmt.Sprintf("id-%06d", i))}, string(reply))
		st := e.Stats()
		if n := st.LastLSN - st.DurableLSN; n > worst {
			worst = n
			if n > bound {
				t.Fatalf("after request %d: %d records appended but not fsynced (LSN %d, durable %d, %d bytes of log, %d fsyncs), more than the %d that %d bytes of log can hold: unsynced records are not bounded",
					i, n, st.LastLSN, st.DurableLSN, st.WALBytes, st.WALSyncs, bound, maxUnsynced)
			}
		}
	}
	st := e.Stats()
	if st.WALBytes < 4*maxUnsynced {
		t.Fatalf("only %d bytes of log written: the test needs several times %d", st.WALBytes, maxUnsynced)
	}
	t.Logf("%d bytes of log, %d records, %d fsyncs, at most %d records unsynced (bound %d)", st.WALBytes, st.LastLSN, st.WALSyncs, worst, bound)
}

// gatedFS holds every file creation under the index directory while the
// gate is shut: ingests and flushes wait, and the applier falls behind
// the WAL whatever the speed of the machine (or the race detector).
type gatedFS struct {
	vfs.FS
	mu   sync.Mutex
	open chan struct{} // closed while the gate is open
}

func newGatedFS() *gatedFS {
	fs := &gatedFS{FS: vfs.NewMem(), open: make(chan struct{})}
	close(fs.open)
	return fs
}

func (fs *gatedFS) Unwrap() vfs.FS { return fs.FS }

func (fs *gatedFS) shut() { fs.mu.Lock(); fs.open = make(chan struct{}); fs.mu.Unlock() }

func (fs *gatedFS) release() {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	select {
	case <-fs.open:
	default:
		close(fs.open)
	}
}

func (fs *gatedFS) Create(name string, c vfs.DiskWriteCategory) (vfs.File, error) {
	if strings.Contains(name, "index") {
		fs.mu.Lock()
		open := fs.open
		fs.mu.Unlock()
		<-open
	}
	return fs.FS.Create(name, c)
}

// freshWriters runs fresh Dos (replies of replySize bytes) from workers
// goroutines until the returned stop is called (which waits for them).
func freshWriters(t *testing.T, e *Engine, workers, replySize int) (stop func()) {
	reply := make([]byte, replySize)
	quit := make(chan struct{})
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-quit:
					return
				default:
				}
				r := Request{ID: []byte(fmt.Sprintf("fresh-%03d-%08d", w, i))}
				if _, err := e.Do(bg, r, func(context.Context) ([]byte, error) { return reply, nil }); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	return func() { close(quit); wg.Wait() }
}

// backlogWatch samples Stats.Memory.Backlog every millisecond and keeps
// its peak.
type backlogWatch struct {
	peak atomic.Int64
	stop chan struct{}
	done chan struct{}
}

func watchBacklog(e *Engine) *backlogWatch {
	w := &backlogWatch{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		for {
			if b := e.Stats().Memory.Backlog; b > w.peak.Load() {
				w.peak.Store(b)
			}
			select {
			case <-w.stop:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	return w
}

// reach waits until the peak is at least n (failing after 60 s).
func (w *backlogWatch) reach(t *testing.T, n int64) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for w.peak.Load() < n {
		if time.Now().After(deadline) {
			hung(t, fmt.Sprintf("the backlog peaked at %d bytes in 60 s with the index held: the applier never fell behind, or the engine is stuck (Stats waits for shard locks)", w.peak.Load()))
		}
		time.Sleep(time.Millisecond)
	}
}

// hung reports a test stuck for good: it prints the message and every
// goroutine, and ends the test binary at once (a panic or t.Fatal would
// run the deferred Close of a deadlocked engine, which hangs too).
func hung(t *testing.T, msg string) {
	buf := make([]byte, 4<<20)
	fmt.Fprintf(os.Stderr, "--- FAIL: %s: %s (a deadlock?)\n%s", t.Name(), msg, buf[:runtime.Stack(buf, true)])
	os.Exit(1)
}

// waitBacklogFull waits until the WAL's goroutine is blocked in onSynced
// on the backlog's semaphore, waiting for room (failing after 60 s), and
// returns the backlog then: while the applier cannot apply, it is the
// most the backlog ever holds.
func waitBacklogFull(t *testing.T, e *Engine) int64 {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !anyBlockedIn("idem.(*Engine).onSynced(", "semaphore.(*Weighted).Acquire(") {
		if time.Now().After(deadline) {
			hung(t, fmt.Sprintf("the WAL's goroutine never waited for backlog room in 60 s (backlog %d bytes)", e.Stats().Memory.Backlog))
		}
		time.Sleep(time.Millisecond)
	}
	return e.Stats().Memory.Backlog
}

func (w *backlogWatch) end() int64 { close(w.stop); <-w.done; return w.peak.Load() }

// TestApplierBacklogBounded: while the index takes no writes, the durable
// records waiting for the applier grow to their bound
// (IndexIngestBytes/2, at least 1 MiB) and no further: the WAL holds
// writers back instead of queueing records without limit. Once the index
// takes writes again every request completes.
func TestApplierBacklogBounded(t *testing.T) {
	fs := newGatedFS()
	e := openMem(t, fs, &Options{MemoryBudget: 32 << 20})
	defer e.Close()
	capBytes := max(e.o.IndexIngestBytes/2, 1<<20)
	w := watchBacklog(e)
	fs.shut()
	stop := freshWriters(t, e, 64, 256)
	w.reach(t, capBytes/2)
	// The backlog is as full as it gets: with the index held, it can only
	// grow until the WAL's goroutine waits for room (a 100 ms sleep
	// instead let a bound doubled by a mutant pass, 3 runs in 10 on a
	// loaded machine: the backlog had not got past the bound yet).
	full := waitBacklogFull(t, e)
	fs.release()
	stop()
	waitApplied(t, e)
	peak := max(w.end(), full)
	t.Logf("peak backlog %d KiB, bound %d KiB", peak>>10, capBytes>>10)
	if peak > capBytes {
		t.Fatalf("backlog reached %d bytes, over its bound %d", peak, capBytes)
	}
	// The applier releases a batch's backlog bytes after it unpinned the
	// batch's slots, which is after AppliedLSN moved: wait (bounded) for
	// the release rather than read it at the instant AppliedLSN arrives.
	deadline := time.Now().Add(10 * time.Second)
	for b := e.Stats().Memory.Backlog; b != 0; b = e.Stats().Memory.Backlog {
		if time.Now().After(deadline) {
			t.Fatalf("backlog %d, 10 s after everything was applied", b)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestClientStateWhileApplierBehind: ClientState waits for the durability
// of the number it read without holding the key's shard lock. While the
// applier is behind, the WAL's sync goroutine waits for it at the
// backlog's bound, and the applier takes shard locks to unpin what it
// applied: a reader waiting for durability under a shard lock would hold
// all three still. Sequence-mode clients commit while others read their
// numbers, with the index held until the backlog is full; everything must
// finish once it is released.
func TestClientStateWhileApplierBehind(t *testing.T) {
	fs := newGatedFS()
	e := openMem(t, fs, &Options{MemoryBudget: 32 << 20})
	defer e.Close()
	const clients, perClient = 32, 100
	reply := make([]byte, 1024)
	var wg sync.WaitGroup
	var reads atomic.Int64
	w := watchBacklog(e)
	fs.shut()
	stopFresh := freshWriters(t, e, 16, 1024)
	for c := range clients {
		name := fmt.Sprint("client-", c)
		wg.Add(2)
		go func() { // commits 1..perClient
			defer wg.Done()
			for n := uint64(1); n <= perClient; n++ {
				if _, err := e.Do(bg, Request{Scope: "s", Client: name, Seq: n}, func(context.Context) ([]byte, error) { return reply, nil }); err != nil {
					t.Error(err)
					return
				}
			}
		}()
		go func() { // reads the number while it moves
			defer wg.Done()
			last := uint64(0)
			for last < perClient {
				n, err := e.ClientState(context.Background(), "s", name)
				if err != nil {
					t.Error(err)
					return
				}
				if n < last {
					t.Errorf("%s: ClientState went back from %d to %d", name, last, n)
					return
				}
				last = n
				reads.Add(1)
				time.Sleep(50 * time.Microsecond)
			}
		}()
	}
	w.reach(t, max(e.o.IndexIngestBytes/2, 1<<20)/2)
	waitBacklogFull(t, e)             // the WAL's goroutine waits for the applier
	time.Sleep(50 * time.Millisecond) // and readers go on reading meanwhile
	fs.release()
	done := make(chan struct{})
	go func() { wg.Wait(); stopFresh(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		hung(t, "commits and ClientState reads did not finish in 60 s")
	}
	w.end()
	t.Logf("%d ClientState reads, %d sstables ingested", reads.Load(), ingested(e))
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

// ingested counts the sstables ingested into the index since Open.
func ingested(e *Engine) (n uint64) {
	for _, l := range e.ix.DB().Metrics().Levels {
		n += l.TablesIngested
	}
	return n
}
