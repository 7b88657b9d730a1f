package idem

// Benchmarks for the figures in README.md. Run:
//
//	go test -run xxx -bench . -benchtime 3s .
//
// Every benchmark uses 64 concurrent callers (RunParallel with parallelism
// 64/GOMAXPROCS), 16-byte ids and 128-byte replies on a real directory.

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"slices"

	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/bloom"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/cputime"
)

const benchCallers = 64

func parallelism() int {
	p := benchCallers / runtime.GOMAXPROCS(0)
	if p < 1 {
		p = 1
	}
	return p
}

var benchReply = make([]byte, 128)

// idGen hands out random 16-byte ids (as UUIDv4 would be): lookups of
// fresh ids then cost what they cost in production, for idem and for the
// Pebble baseline alike (sequential ids would let Pebble skip every table
// by its key bounds).
type idGen struct{}

func newIDGen() *idGen { return &idGen{} }

func (g *idGen) next() []byte {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return b
}

func opsPerSec(b *testing.B, start time.Time) {
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "ops/s")
}

func benchDoFresh(b *testing.B, o Options) {
	e, err := Open(b.TempDir(), &o)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	g := newIDGen()
	fn := func(context.Context) ([]byte, error) { return benchReply, nil }
	b.SetParallelism(parallelism())
	b.ResetTimer()
	start := time.Now()
	// The process's CPU per request (every goroutine: the WAL's flusher,
	// the applier, Pebble), as BenchmarkBatchPut reports it per item.
	cpu0 := cputime.Process()
	defer func() {
		b.ReportMetric(float64((cputime.Process()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
	}()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := e.Do(bg, Request{ID: g.next()}, fn); err != nil {
				b.Error(err)
				return
			}
		}
	})
	opsPerSec(b, start)
	ws := e.w.Stats()
	b.ReportMetric(float64(ws.LastLSN)/float64(ws.Syncs), "recs/sync")
	b.ReportMetric(float64(time.Since(start).Microseconds())/float64(ws.Syncs), "us/sync")
}

// BenchmarkDoFresh: Do of new ids, fsync before acknowledging (claim and
// commit both durable).
func BenchmarkDoFresh(b *testing.B) { benchDoFresh(b, Options{}) }

func BenchmarkDoFreshBigCache(b *testing.B) { benchDoFresh(b, Options{IndexCacheSize: 128 << 20}) }

// BenchmarkDoFreshIngest64: Do of new ids with 64 MiB pending sets (fewer,
// larger ingested tables; up to 128 MiB of pending updates in memory).
func BenchmarkDoFreshIngest64(b *testing.B) { benchDoFresh(b, Options{IndexIngestBytes: 64 << 20}) }

// BenchmarkDoFreshRelaxed: Do with RelaxedClaims (one fsync wait per request).
func BenchmarkDoFreshRelaxed(b *testing.B) { benchDoFresh(b, Options{RelaxedClaims: true}) }

// BenchmarkDuplicateHit: Begin of committed ids (replays of a stored reply).
func BenchmarkDuplicateHit(b *testing.B) {
	e, err := Open(b.TempDir(), nil)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	const n = 100_000
	ids := fill(b, e, n)
	var ctr atomic.Uint64
	b.SetParallelism(parallelism())
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		i := ctr.Add(7919)
		for pb.Next() {
			i += 104729
			res, err := e.Begin(bg, Request{ID: ids[i%n]})
			if err != nil || res.Status != Done {
				b.Errorf("%v %v", res.Status, err)
				return
			}
		}
	})
	opsPerSec(b, start)
}

// BenchmarkReplay: Open of a directory whose index is gone, so every WAL
// record is replayed (and the rebuilt index written). Reports records/s.
// The directory is on disk (its WAL is in the page cache after the fill,
// as after a process crash); BenchmarkReplayMem uses vfs.NewMem.
func BenchmarkReplay(b *testing.B) { benchReplay(b, vfs.Default, b.TempDir()) }

// BenchmarkReplayMem is BenchmarkReplay on vfs.NewMem (which pays for
// growing its in-memory files when the index writes sstables).
func BenchmarkReplayMem(b *testing.B) { benchReplay(b, vfs.NewMem(), "db") }

func benchReplay(b *testing.B, fs vfs.FS, dir string) {
	e, err := Open(dir, &Options{FS: fs, Sync: SyncNever})
	if err != nil {
		b.Fatal(err)
	}
	const reqs = 200_000 // 400k records: claim + commit each
	fill(b, e, reqs)
	records := e.Stats().LastLSN
	if err := e.Close(); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	var total time.Duration
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		if err := fs.RemoveAll(fs.PathJoin(dir, "index")); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		start := time.Now()
		e, err := Open(dir, &Options{FS: fs, Sync: SyncNever})
		if err != nil {
			b.Fatal(err)
		}
		total += time.Since(start)
		b.StopTimer()
		if got := e.Stats().LiveEntries; got != reqs {
			b.Fatalf("replayed %d entries, want %d", got, reqs)
		}
		e.Close()
		b.StartTimer()
	}
	b.ReportMetric(float64(records)*float64(b.N)/total.Seconds(), "records/s")
}

// pebbleDedup is the hand-rolled alternative: Pebble used directly for the
// same job with the same guarantee. Per request: look the id up; if absent
// write the claim with Sync; run; write the reply with Sync. A striped lock
// makes concurrent duplicates safe (exactly one claims).
type pebbleDedup struct {
	db    *pebble.DB
	locks [256]sync.Mutex
}

func (p *pebbleDedup) do(id []byte, fn func() []byte, syncClaim bool) ([]byte, error) {
	l := &p.locks[int(id[len(id)-1])]
	l.Lock()
	v, c, err := p.db.Get(id)
	if err == nil {
		reply := append([]byte(nil), v...)
		c.Close()
		l.Unlock()
		if len(reply) > 0 && reply[0] == 'c' {
			return reply[1:], nil
		}
		return nil, errors.New("in flight")
	}
	if !errors.Is(err, pebble.ErrNotFound) {
		l.Unlock()
		return nil, err
	}
	wo := pebble.Sync
	if !syncClaim {
		wo = pebble.NoSync
	}
	if err := p.db.Set(id, []byte{'p'}, wo); err != nil {
		l.Unlock()
		return nil, err
	}
	l.Unlock()
	reply := fn()
	if err := p.db.Set(id, append([]byte{'c'}, reply...), pebble.Sync); err != nil {
		return nil, err
	}
	return reply, nil
}

// baselineOptions configure the Pebble baseline as well as idem's index:
// same block cache, bloom filters on every level, same memtable size. The
// cache has room for the memtables Pebble charges to it (see index.Open)
// on top of the 64 MiB for blocks.
func baselineOptions() *pebble.Options {
	o := &pebble.Options{Logger: quietPebble{}, Cache: pebble.NewCache(64<<20 + 3*32<<20), MemTableSize: 32 << 20}
	for i := range o.Levels {
		o.Levels[i].FilterPolicy = bloom.FilterPolicy(10)
	}
	return o
}

func benchPebble(b *testing.B, syncClaim bool) {
	db, err := pebble.Open(b.TempDir(), baselineOptions())
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	p := &pebbleDedup{db: db}
	g := newIDGen()
	fn := func() []byte { return benchReply }
	b.SetParallelism(parallelism())
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := p.do(g.next(), fn, syncClaim); err != nil {
				b.Error(err)
				return
			}
		}
	})
	opsPerSec(b, start)
}

// BenchmarkPebbleDirect: the baseline for BenchmarkDoFresh (claim and reply
// both synced).
func BenchmarkPebbleDirect(b *testing.B) { benchPebble(b, true) }

// BenchmarkPebbleDirectOneSync: the baseline for BenchmarkDoFreshRelaxed
// (one synced write per request).
func BenchmarkPebbleDirectOneSync(b *testing.B) { benchPebble(b, false) }

func BenchmarkPebbleDuplicateGet(b *testing.B) {
	db, err := pebble.Open(b.TempDir(), baselineOptions())
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	p := &pebbleDedup{db: db}
	const n = 100_000
	ids := make([][]byte, n)
	g := newIDGen()
	for i := range ids {
		ids[i] = g.next()
		if err := db.Set(ids[i], append([]byte{'c'}, benchReply...), pebble.NoSync); err != nil {
			b.Fatal(err)
		}
	}
	var ctr atomic.Uint64
	b.SetParallelism(parallelism())
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		i := ctr.Add(7919)
		for pb.Next() {
			i += 104729
			if _, err := p.do(ids[i%n], nil, true); err != nil {
				b.Error(err)
				return
			}
		}
	})
	opsPerSec(b, start)
}

type quietPebble struct{}

func (quietPebble) Infof(string, ...any)  {}
func (quietPebble) Errorf(string, ...any) {}
func (quietPebble) Fatalf(f string, a ...any) {
	panic(fmt.Sprintf(f, a...))
}

// snapshotSource builds an engine holding n committed ids (16-byte ids,
// 128-byte replies).
func snapshotSource(b *testing.B, n int) *Engine {
	e, err := Open("src", &Options{FS: vfs.NewMem(), Sync: SyncNever})
	if err != nil {
		b.Fatal(err)
	}
	fill(b, e, n)
	return e
}

// fill commits n new ids with Do from benchCallers goroutines and returns
// the ids.
func fill(b testing.TB, e *Engine, n int) [][]byte {
	ids := make([][]byte, n)
	g := newIDGen()
	var wg sync.WaitGroup
	for w := 0; w < benchCallers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := w; i < n; i += benchCallers {
				ids[i] = g.next()
				if _, err := e.Do(bg, Request{ID: ids[i]}, func(context.Context) ([]byte, error) { return benchReply, nil }); err != nil {
					b.Error(err)
					return
				}
			}
		}(w)
	}
	wg.Wait()
	return ids
}

// BenchmarkSnapshotWrite: Engine.Snapshot of 200k entries, entries/s.
func BenchmarkSnapshotWrite(b *testing.B) {
	const n = 200_000
	e := snapshotSource(b, n)
	defer e.Close()
	b.ResetTimer()
	start := time.Now()
	var size int64
	for i := 0; i < b.N; i++ {
		var buf bytes.Buffer
		info, err := e.Snapshot(bg, &buf)
		if err != nil || info.Entries != n {
			b.Fatal(info, err)
		}
		size = info.Bytes
	}
	b.ReportMetric(float64(n)*float64(b.N)/time.Since(start).Seconds(), "entries/s")
	b.ReportMetric(float64(size)/n, "bytes/entry")
}

// BenchmarkRestore: Restore of a 200k-entry snapshot into a new directory
// (index built and flushed), entries/s.
func BenchmarkRestore(b *testing.B) {
	const n = 200_000
	e := snapshotSource(b, n)
	var buf bytes.Buffer
	if _, err := e.Snapshot(bg, &buf); err != nil {
		b.Fatal(err)
	}
	e.Close()
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < b.N; i++ {
		r, err := Restore(fmt.Sprint("dst", i), bytes.NewReader(buf.Bytes()), &Options{FS: vfs.NewMem()})
		if err != nil {
			b.Fatal(err)
		}
		if got := r.Stats().LiveEntries; got != n {
			b.Fatalf("restored %d entries", got)
		}
		r.Close()
	}
	b.ReportMetric(float64(n)*float64(b.N)/time.Since(start).Seconds(), "entries/s")
}

// BenchmarkWakeIdleP measures the machine, not idem: how long a goroutine
// made runnable by a channel send waits before it runs while the sender
// keeps its processor busy, so that another, idle processor (its thread
// parked) must wake up to run it. Every group-commit cycle pays this once
// when the flusher wakes the callers. Reports the median in µs: ~90 µs on
// the 2-vCPU development VM (a halted vCPU), a few µs on bare metal.
func BenchmarkWakeIdleP(b *testing.B) {
	ch := make(chan time.Time, 1)
	lat := make(chan time.Duration, b.N)
	go func() {
		for t := range ch {
			lat <- time.Since(t)
		}
		close(lat)
	}()
	for i := 0; i < b.N; i++ {
		s := time.Now() // stay busy: the receiver must run elsewhere
		for time.Since(s) < 200*time.Microsecond {
		}
		ch <- time.Now()
	}
	close(ch)
	ds := make([]time.Duration, 0, b.N)
	for d := range lat {
		ds = append(ds, d)
	}
	slices.Sort(ds)
	b.ReportMetric(float64(ds[len(ds)/2].Microseconds()), "p50-µs")
}
