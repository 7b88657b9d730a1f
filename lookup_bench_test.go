package idem

import (
	"runtime"
	"testing"
	"time"

	"github.com/idemdb/idem/internal/cputime"
)

// BenchmarkLookupAbsent: Lookup of ids the engine never stored (16-byte
// random ids, one goroutine), and Lookup of each id of a batch of 1,024
// followed by the batch's Puts, as idemraft's replicas and idemstream's
// two-phase commit do. b.N counts ids; cpu-ns/op is the process's CPU
// (every goroutine: the applier, Pebble) per id:
//
//	go test -run xxx -bench 'LookupAbsent|LookupThenPut' .
func BenchmarkLookupAbsent(b *testing.B) {
	benchLookupPut(b, 0)
}

// BenchmarkLookupThenPut: see BenchmarkLookupAbsent.
func BenchmarkLookupThenPut(b *testing.B) {
	benchLookupPut(b, 1024)
}

// benchLookupPut looks b.N new ids up, per at a time, and puts each
// group in one batch (per 0: lookups only).
func benchLookupPut(b *testing.B, per int) {
	e, err := Open(b.TempDir(), &Options{Sync: SyncNever, RelaxedClaims: true})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	ids := newIDs(b.N)
	b.ReportAllocs()
	b.ResetTimer()
	start, cpu0 := time.Now(), cputime.Process()
	step := max(per, 1024)
	for done := 0; done < b.N; {
		n := min(step, b.N-done)
		for _, x := range ids[done : done+n] {
			r, err := e.Lookup(bg, Request{ID: x})
			if err != nil || r.Status != Absent {
				b.Fatalf("lookup: %v %v", r.Status, err)
			}
		}
		if per > 0 {
			bt := e.NewBatch()
			for _, x := range ids[done : done+n] {
				bt.Put(Request{ID: x}, benchReply)
			}
			runFresh(b, bt)
		}
		done += n
	}
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "ids/s")
	b.ReportMetric(float64((cputime.Process()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
}

// BenchmarkLookupHints: new ids looked up 32 at a time (about a raft
// batch of idemraft's) and then put with their hints in one batch, as
// idemraft's FSM does, the groups taking turns between LookupHint of each
// id (hint-cpu-ns/id) and one LookupHints call (hints-cpu-ns/id), each
// after a Prefetch of the group, so that both see the same table and the
// same machine. The figures are the CPU
// of the benchmark's thread in the lookups alone (Linux; 0 elsewhere), on
// an ephemeral engine (idemraft's):
//
//	go test -run xxx -bench LookupHints -benchtime 400000x .
func BenchmarkLookupHints(b *testing.B) {
	e, err := Open(b.TempDir(), &Options{Ephemeral: true})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const per = 32
	ids := newIDs(b.N)
	reqs := make([]Request, per)
	hints := make([]PutHint, per)
	out := make([]BatchResult, per)
	var cpu [2]time.Duration
	var n [2]int
	b.ResetTimer()
	for done, turn := 0, 0; done < b.N; turn ^= 1 {
		k := min(per, b.N-done)
		for i, x := range ids[done : done+k] {
			reqs[i] = Request{ID: x}
		}
		t0 := cputime.Thread()
		e.Prefetch(reqs[:k]) // as idemraft does, before either
		if turn == 0 {
			for i := range k {
				out[i].Result, out[i].Err = e.LookupHint(bg, reqs[i], &hints[i])
			}
		} else {
			e.LookupHints(bg, reqs[:k], hints[:k], out[:k])
		}
		cpu[turn] += cputime.Thread() - t0
		n[turn] += k
		bt := e.NewBatch()
		for i := range k {
			if out[i].Err != nil || out[i].Result.Status != Absent {
				b.Fatalf("lookup: %v %v", out[i].Result.Status, out[i].Err)
			}
			hints[i].Put(bt, benchReply)
		}
		runFresh(b, bt)
		done += k
	}
	for t, name := range []string{"hint-cpu-ns/id", "hints-cpu-ns/id"} {
		if n[t] > 0 {
			b.ReportMetric(float64(cpu[t].Nanoseconds())/float64(n[t]), name)
		}
	}
}
