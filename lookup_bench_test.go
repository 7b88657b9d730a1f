package idem

import (
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
