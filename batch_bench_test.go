package idem

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/idemdb/idem/internal/cputime"
)

// BenchmarkBatchPut: Batch.Run of 1,024 Puts (16-byte random ids,
// 128-byte replies) from one goroutine, as idemstream's sink and
// idemraft's BatchingFSM apply them, on a real directory. ns/op and
// allocs/op are per item (b.N counts items). Compare with BenchmarkDoFresh
// (64 callers, one claim and one commit record per request) in the same
// run. cpu-ns/item is the process's CPU time (every goroutine: the WAL's
// flusher, the applier, Pebble) per item, which a machine shared with
// other work measures better than the wall clock. run-cpu-ns/item is the
// CPU time of the benchmark's own thread per item (its goroutine is
// locked to it): building and running the batches, with the GC assists
// they are charged, without the WAL's flusher, the applier and Pebble,
// which run on other threads (Linux only; 0 elsewhere):
//
//	go test -run xxx -bench 'BatchPut|DoFresh$' -benchmem .
func BenchmarkBatchPut(b *testing.B) {
	for _, c := range []struct {
		name string
		o    Options
	}{
		{"SyncNever+RelaxedClaims", Options{Sync: SyncNever, RelaxedClaims: true}},
		{"SyncAlways", Options{}},
	} {
		b.Run(c.name, func(b *testing.B) { benchBatchPut(b, c.o, 1024, false) })
	}
	// Each Put advances its partition's offset (a client per partition,
	// 4 partitions), as idemstream's sink does.
	b.Run("SyncNever+RelaxedClaims+advance", func(b *testing.B) {
		benchBatchPut(b, Options{Sync: SyncNever, RelaxedClaims: true}, -1024, false)
	})
	// Each id claimed by a batch of Begins, then committed by a batch of
	// Commits advancing its partition's offset, as idemstream's sink
	// does (the commits find the claims' slots through the claims).
	b.Run("SyncNever+RelaxedClaims+claim-commit", func(b *testing.B) {
		benchBatchPut(b, Options{Sync: SyncNever, RelaxedClaims: true}, -1024, true)
	})
	// The same items, one Engine.Do each (a claim and a commit record),
	// from one goroutine: what batching saves per item.
	b.Run("singly-SyncNever+RelaxedClaims", func(b *testing.B) {
		benchBatchPut(b, Options{Sync: SyncNever, RelaxedClaims: true}, 0, false)
	})
}

// benchBatchPut puts b.N new ids per at a time (0: one Do each; below 0:
// -per at a time, each advancing a partition's offset); with claims, each
// batch is a batch of Begins and then one of their Commits.
func benchBatchPut(b *testing.B, o Options, per int, claims bool) {
	advance := per < 0
	per = max(per, -per)
	e, err := Open(b.TempDir(), &o)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	ids := newIDs(b.N)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	b.ReportAllocs()
	b.ResetTimer()
	start, cpu0, tcpu0 := time.Now(), cputime.Process(), cputime.Thread()
	fn := func(context.Context) ([]byte, error) { return benchReply, nil }
	for done := 0; done < b.N && per == 0; done++ {
		if _, err := e.Do(bg, Request{ID: ids[done]}, fn); err != nil {
			b.Fatal(err)
		}
	}
	for done := 0; done < b.N && per > 0; {
		n := min(per, b.N-done)
		if claims {
			benchClaimCommit(b, e, ids[done:done+n], done)
			done += n
			continue
		}
		bt := e.NewBatch()
		for j, x := range ids[done : done+n] {
			if advance {
				off := uint64(done + j + 1)
				bt.Put(Request{ID: x}, benchReply, Advance{Scope: "stream", Client: partitions[off%4], Seq: off})
				continue
			}
			bt.Put(Request{ID: x}, benchReply)
		}
		runFresh(b, bt)
		done += n
	}
	tcpu := cputime.Thread() - tcpu0
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "items/s")
	b.ReportMetric(float64(tcpu.Nanoseconds())/float64(b.N), "run-cpu-ns/item")
	b.ReportMetric(float64((cputime.Process()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/item")
}

var partitions = []string{"p0", "p1", "p2", "p3"}

// newIDs is n new ids (newIDGen's).
func newIDs(n int) [][]byte {
	g := newIDGen()
	ids := make([][]byte, n)
	for i := range ids {
		ids[i] = g.next()
	}
	return ids
}

// runFresh runs a benchmark's batch of new ids and fails b unless it
// succeeds and every item comes back Fresh.
func runFresh(b *testing.B, bt Batch) []BatchResult {
	out, err := bt.Run(bg)
	if err != nil {
		b.Fatal(err)
	}
	for _, r := range out {
		if r.Err != nil || r.Result.Status != Fresh {
			b.Fatalf("%v %v", r.Result.Status, r.Err)
		}
	}
	return out
}

// benchClaimCommit claims ids (the first numbered done) in one batch and
// commits them in another, each commit advancing its partition's offset.
func benchClaimCommit(b *testing.B, e *Engine, ids [][]byte, done int) {
	bt := e.NewBatch()
	for _, x := range ids {
		bt.Begin(Request{ID: x})
	}
	fin := e.NewBatch()
	for j, r := range runFresh(b, bt) {
		off := uint64(done + j + 1)
		fin.Commit(r.Result.Claim, benchReply, Advance{Scope: "stream", Client: partitions[off%4], Seq: off})
	}
	fout, err := fin.Run(bg)
	if err != nil {
		b.Fatal(err)
	}
	for _, r := range fout {
		if r.Err != nil {
			b.Fatal(r.Err)
		}
	}
}
