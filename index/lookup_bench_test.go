package index

import (
	"crypto/rand"
	mrand "math/rand/v2"
	"runtime"
	"testing"
	"time"

	"github.com/idemdb/idem/internal/cputime"
	"github.com/idemdb/idem/wal"
)

// BenchmarkLookupWhileWriting is the cost of the index's lookups in the
// LSM a steady stream of fresh ids leaves, which is what Pebble's
// compaction settings (tuning.go) trade against the writes' cost. The
// index is first filled with 2 million fresh ids (128-byte random
// replies, batches of 1,024, as BenchmarkApplyFresh applies them; not
// timed). In the writing sub-benchmark, 8 more batches of 1,024 fresh ids
// are then applied per 1,024 lookups of each kind, so that L0 fills and
// compacts under the lookups as it does under load (200,000 lookups span
// about 40 ingests). Kinds, each reported as CPU time of the looking-up
// thread per lookup (cputime.Thread, Linux only: compactions, ingests and
// the writes excluded):
//
//   - present-ns: ids stored earlier (uniformly at random: most in the
//     last levels, some in L0);
//   - absent-ns: ids never stored, with the key filter (nearly all
//     answered by it);
//   - absent-pebble-ns: ids never stored, the key filter set aside:
//     what Pebble costs for a miss (an iterator over every level and L0
//     sublevel, a bloom filter probe in each).
//
// l0-sublevels is L0's read amplification, averaged over the batches.
//
// The idle sub-benchmark writes nothing during the lookups: the fill is
// flushed and Pebble's compactions have stopped (none ran for 200 ms), so
// L0 holds what the compaction settings leave there when the writes pause.
//
//	go test -run '^$' -bench LookupWhileWriting -benchtime 200000x ./index/
func BenchmarkLookupWhileWriting(b *testing.B) {
	b.Run("writing", func(b *testing.B) { benchLookups(b, 8) })
	b.Run("idle", func(b *testing.B) { benchLookups(b, 0) })
}

// benchLookups: see BenchmarkLookupWhileWriting; writeRatio batches of
// fresh ids are applied per batch of lookups of each kind.
func benchLookups(b *testing.B, writeRatio int) {
	const fill, per = 2_000_000, 1024
	if b.N == 1 {
		return // the testing package's first, probing run: not worth a fill
	}
	ix := openBenchIndex(b)
	pool := make([]byte, 4<<20)
	_, _ = rand.Read(pool)
	total := fill + writeRatio*b.N
	ids := make([]byte, 16*total)
	_, _ = rand.Read(ids)
	key := func(i int) []byte { return EntryKey(nil, "", ModeID, ids[16*i:16*i+16]) }
	lsn := wal.LSN(0)
	ops := make([]wal.Op, 2*per)
	apply := func(from, n int) {
		lsn++
		now := time.Now().UnixNano()
		bt := NewBatch(lsn, func(k []byte, _ byte) (*Entry, error) { return ix.Get(k) }, n)
		for j := range n {
			i := from + j
			id := ids[16*i : 16*i+16]
			at := i * 128 % (len(pool) - 128)
			ops[2*j] = wal.Op{Type: wal.OpClaim, ID: id, Time: now, LeaseUntil: now + int64(time.Minute), Flags: wal.ClaimFlagNew}
			ops[2*j+1] = wal.Op{Type: wal.OpCommit, ID: id, Time: now, Reply: pool[at : at+128]}
			k := key(i)
			if _, err := bt.Add(&ops[2*j], k); err != nil {
				b.Fatal(err)
			}
			if _, err := bt.Add(&ops[2*j+1], k); err != nil {
				b.Fatal(err)
			}
		}
		if err := ix.Apply([]*Update{{LSN: lsn, Transitions: bt.Transitions()}}); err != nil {
			b.Fatal(err)
		}
	}
	for done := 0; done < fill; done += per {
		apply(done, min(per, fill-done))
	}
	if writeRatio == 0 {
		if err := ix.Flush(); err != nil {
			b.Fatal(err)
		}
		for idle := 0; idle < 20; {
			if ix.db.Metrics().Compact.NumInProgress == 0 {
				idle++
			} else {
				idle = 0
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	rng := mrand.New(mrand.NewPCG(1, 2))
	absent := make([]byte, 16)
	keys := make([][]byte, per)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var present, miss, missPebble time.Duration
	sublevels, batches := 0, 0
	lookups := func(d *time.Duration, want bool) {
		t0 := cputime.Thread()
		for _, k := range keys {
			e, err := ix.Get(k)
			if err != nil || (e != nil) != want {
				b.Fatalf("lookup %x: %v %v, want present=%v", k, e, err, want)
			}
		}
		*d += cputime.Thread() - t0
	}
	b.ResetTimer()
	for done := 0; done < b.N; done += per {
		n := min(per, b.N-done)
		keys = keys[:n]
		stored := fill + writeRatio*done
		for j := range keys {
			keys[j] = key(rng.IntN(stored))
		}
		lookups(&present, true)
		for j := range keys {
			_, _ = rand.Read(absent)
			keys[j] = EntryKey(keys[j][:0:0], "", ModeID, absent)
		}
		lookups(&miss, false)
		// The key filter is set aside while no Apply runs (nothing is
		// added to it meanwhile), so that Get asks the pending sets and
		// Pebble.
		f := ix.filter.Swap(nil)
		lookups(&missPebble, false)
		ix.filter.Store(f)
		sublevels += int(ix.db.Metrics().Levels[0].Sublevels)
		batches++
		for w := range writeRatio {
			apply(stored+w*n, n)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(present.Nanoseconds())/float64(b.N), "present-ns")
	b.ReportMetric(float64(miss.Nanoseconds())/float64(b.N), "absent-ns")
	b.ReportMetric(float64(missPebble.Nanoseconds())/float64(b.N), "absent-pebble-ns")
	b.ReportMetric(float64(sublevels)/float64(max(batches, 1)), "l0-sublevels")
	if testing.Verbose() {
		b.Logf("LSM at the end:\n%s", ix.db.Metrics())
	}
}
