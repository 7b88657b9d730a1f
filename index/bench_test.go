package index

import (
	"crypto/rand"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/cputime"
	"github.com/idemdb/idem/wal"
)

// BenchmarkApplyFresh is the index's share of a batch of fresh Puts, as
// the engine's batch path drives it: per item a lookup of a new 16-byte
// random id (a miss: the pending sets, then the key filter), then a claim
// and a commit with a 128-byte reply in a batch record of 1,024 items
// (index.Batch computes the transitions, Apply merges them into the
// pending set), on a real directory. The figure that counts is
// cpu-ns/item: the process's CPU time (the background ingests and Pebble's
// compactions included) per item, up to the moment every item is in
// Pebble and no compaction has run for 200 ms, divided by b.N:
//
//	go test -run '^$' -bench ApplyFresh -benchtime 1000000x ./index/
//
// Sub-benchmarks: zero replies (as the engine's BenchmarkBatchPut stores,
// which compress to nothing), random ones (which do not compress), and
// zero replies with acks of earlier ids.
func BenchmarkApplyFresh(b *testing.B) {
	for _, c := range []struct {
		name  string
		reply []byte
		acks  bool
	}{
		{"zero-reply", make([]byte, 128), false},
		{"random-reply", nil, false},
		// Each claim also acks the id put 100,000 items before (as a
		// client that acknowledges the replies it got does): the sets
		// delete time rows of earlier sets.
		{"zero-reply+acks", make([]byte, 128), true},
	} {
		b.Run(c.name, func(b *testing.B) { benchApplyFresh(b, c.reply, c.acks) })
	}
}

// ackLag is how many items before its own an item of the +acks
// sub-benchmark acks.
const ackLag = 100_000

// benchApplyFresh: reply nil means a different random reply per item
// (slices of a 4 MiB random pool: no two in one block are alike).
func benchApplyFresh(b *testing.B, reply []byte, acks bool) {
	var pool []byte
	if reply == nil {
		pool = make([]byte, 4<<20)
		_, _ = rand.Read(pool)
	}
	ix := openBenchIndex(b)
	const per = 1024
	ids := make([]byte, 16*b.N)
	_, _ = rand.Read(ids)
	keys := make([][]byte, b.N)
	for i := range keys {
		keys[i] = EntryKey(nil, "", ModeID, ids[16*i:16*i+16])
	}
	get := func(k []byte, mode byte) (*Entry, error) { return ix.Get(k) }
	ops := make([]wal.Op, 2*per)
	ups := make([]*Update, 1)
	b.ReportAllocs()
	b.ResetTimer()
	start, cpu0 := time.Now(), cputime.Process()
	lsn := wal.LSN(0)
	for done := 0; done < b.N; {
		n := min(per, b.N-done)
		lsn++
		now := time.Now().UnixNano()
		bt := NewBatch(lsn, get, n)
		for j := range n {
			k := keys[done+j]
			if e, err := ix.Get(k); err != nil || e != nil {
				b.Fatalf("fresh key %x: %v %v", k, e, err)
			}
			id := ids[16*(done+j) : 16*(done+j)+16]
			ops[2*j] = wal.Op{Type: wal.OpClaim, ID: id, Time: now, LeaseUntil: now + int64(time.Minute), Flags: wal.ClaimFlagNew}
			if i := done + j - ackLag; acks && i >= 0 {
				ops[2*j].Acked = [][]byte{ids[16*i : 16*i+16]}
			}
			r := reply
			if pool != nil {
				at := (done + j) * 128 % (len(pool) - 128)
				r = pool[at : at+128]
			}
			ops[2*j+1] = wal.Op{Type: wal.OpCommit, ID: id, Time: now, Reply: r}
			if _, err := bt.Add(&ops[2*j], k); err != nil {
				b.Fatal(err)
			}
			if _, err := bt.Add(&ops[2*j+1], k); err != nil {
				b.Fatal(err)
			}
		}
		ups[0] = &Update{LSN: lsn, Transitions: bt.Transitions()}
		if err := ix.Apply(ups); err != nil {
			b.Fatal(err)
		}
		done += n
	}
	if err := ix.Flush(); err != nil {
		b.Fatal(err)
	}
	// Wait until no compaction has run for a while (Pebble starts the
	// ones it owes within 100 ms: sched.go).
	for idle := 0; idle < 20; {
		if ix.db.Metrics().Compact.NumInProgress == 0 {
			idle++
		} else {
			idle = 0
		}
		time.Sleep(10 * time.Millisecond)
	}
	b.StopTimer()
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "items/s")
	b.ReportMetric(float64((cputime.Process()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/item")
	m := ix.db.Metrics()
	var written uint64
	for _, l := range m.Levels {
		written += l.TableBytesFlushed + l.TableBytesCompacted + l.TableBytesIngested
	}
	b.ReportMetric(float64(written)/float64(b.N), "written-B/item")
	b.ReportMetric(float64(m.DiskSpaceUsage())/float64(b.N), "disk-B/item")
	if testing.Verbose() {
		b.Logf("LSM at the end:\n%s", m)
	}
}

// BenchmarkApplySteady is the index's cost per fresh item in a warm LSM
// written at a steady rate, as a long-running engine's is: BenchmarkApplyFresh
// writes as fast as it can into an empty store, so its compactions fall
// behind, L0 fills far past the compaction threshold, and each L0
// compaction brings down many tables at once; at a rate the compactions
// keep up with, each brings down only the threshold's worth, and what the
// compaction settings cost shows. The store is first filled with 2 million
// fresh ids at 150,000 items/s (about what the engine applies at 512
// callers; not measured), then b.N more are applied at that rate (claim
// and commit of a new 16-byte random id with a 128-byte reply, the same
// for every item, as bench/peers sends, in batches of 1,024):
//
//	go test -run '^$' -bench ApplySteady -benchtime 1500000x ./index/
//
// cpu-ns/item is the process's CPU time per measured item (ingests and
// compactions included, sleeps not); compacted-B/item the bytes Pebble's
// compactions wrote meanwhile, ingested-B/item the bytes ingested.
func BenchmarkApplySteady(b *testing.B) {
	const per, warm, rate = 1024, 2_000_000, 150_000
	ix := openBenchIndex(b)
	reply := make([]byte, 128)
	_, _ = rand.Read(reply)
	get := func(k []byte, mode byte) (*Entry, error) { return ix.Get(k) }
	ops := make([]wal.Op, 2*per)
	ids := make([]byte, 16*per)
	keys := make([][]byte, per)
	ups := make([]*Update, 1)
	lsn := wal.LSN(0)
	start, total := time.Now(), 0
	run := func(n int) {
		for done := 0; done < n; done += per {
			total += per
			if d := time.Duration(float64(total)/rate*float64(time.Second)) - time.Since(start); d > 0 {
				time.Sleep(d)
			}
			_, _ = rand.Read(ids)
			lsn++
			now := time.Now().UnixNano()
			bt := NewBatch(lsn, get, per)
			for j := range per {
				id := ids[16*j : 16*j+16]
				keys[j] = EntryKey(keys[j][:0], "", ModeID, id)
				ops[2*j] = wal.Op{Type: wal.OpClaim, ID: id, Time: now, LeaseUntil: now + int64(time.Minute), Flags: wal.ClaimFlagNew}
				ops[2*j+1] = wal.Op{Type: wal.OpCommit, ID: id, Time: now, Reply: reply}
				if _, err := bt.Add(&ops[2*j], keys[j]); err != nil {
					b.Fatal(err)
				}
				if _, err := bt.Add(&ops[2*j+1], keys[j]); err != nil {
					b.Fatal(err)
				}
			}
			ups[0] = &Update{LSN: lsn, Transitions: bt.Transitions()}
			if err := ix.Apply(ups); err != nil {
				b.Fatal(err)
			}
		}
	}
	run(warm)
	m0 := ix.db.Metrics()
	b.ResetTimer()
	cpu0 := cputime.Process()
	run(b.N)
	cpu := cputime.Process() - cpu0
	b.StopTimer()
	m1 := ix.db.Metrics()
	var ingested, compacted uint64
	for l := range m1.Levels {
		ingested += m1.Levels[l].TableBytesIngested - m0.Levels[l].TableBytesIngested
		compacted += m1.Levels[l].TableBytesCompacted - m0.Levels[l].TableBytesCompacted
	}
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/item")
	b.ReportMetric(float64(ingested)/float64(b.N), "ingested-B/item")
	b.ReportMetric(float64(compacted)/float64(b.N), "compacted-B/item")
	b.ReportMetric(float64(m1.Levels[0].Sublevels), "l0-sublevels")
	if testing.Verbose() {
		b.Logf("LSM at the end:\n%s", m1)
	}
}

// openBenchIndex opens an index on disk for a benchmark (closed when it
// ends), with a 64 MiB block cache and its key filter built.
func openBenchIndex(b *testing.B) *Index {
	ix, err := Open(Options{FS: vfs.Default, Dir: b.TempDir(), CacheSize: 64 << 20})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ix.Close(false) })
	ix.StartFilter()
	for !ix.FilterReady() {
		time.Sleep(time.Millisecond)
	}
	return ix
}
