package index

import (
	"fmt"
	"hash/maphash"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/alloctest"
	"github.com/idemdb/idem/wal"
)

// TestPendingSetAllocations: a key new to the pending set costs no
// allocation of its own in the set (its pendEntry and key bytes come out of
// the set's chunks), and every key reads back through the set and, once
// ingested, through Pebble.
//
// The allocation count is process-wide (runtime.MemStats.Mallocs counts
// every goroutine's), so a count over the bound may be someone else's: as
// alloctest does for bytes, the Apply is measured again on a new index, up
// to alloctest.Runs times, and the test fails only if every run is over.
func TestPendingSetAllocations(t *testing.T) {
	const n = 10_000
	ups := make([]*Update, n)
	for i := range ups {
		lsn := wal.LSN(i + 1)
		k := EntryKey(nil, "s", ModeID, []byte(fmt.Sprintf("id-%06d", i)))
		e := &Entry{Committed: true, CommitTime: int64(lsn), CommitLSN: lsn, LSN: lsn, ReplyKept: true, Reply: []byte("reply")}
		ups[i] = &Update{LSN: lsn, Transitions: []Transition{{Key: k, Mode: ModeID, Next: e}}}
	}
	// Before: a pendEntry and a key string per key (2 per key). Now the
	// chunks and the map's growth: a few hundred in all. The bound leaves
	// room for whatever Pebble's idle goroutines allocate meanwhile.
	var ix *Index
	var pers []float64
	for len(pers) < alloctest.Runs {
		if ix != nil {
			ix.Close(false)
		}
		var err error
		ix, err = Open(Options{FS: vfs.NewMem(), Dir: "ix", IngestBytes: 1 << 30, FilterBytes: -1})
		if err != nil {
			t.Fatal(err)
		}
		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		if err := ix.Apply(ups); err != nil {
			t.Fatal(err)
		}
		runtime.ReadMemStats(&m1)
		pers = append(pers, float64(m1.Mallocs-m0.Mallocs)/n)
		if pers[len(pers)-1] <= 0.5 {
			break
		}
	}
	defer ix.Close(false)
	if per := slices.Min(pers); per > 0.5 {
		t.Fatalf("%.2f allocations per new pending key, want < 0.5 (each of %d runs: %v)", per, len(pers), pers)
	}
	check := func(where string) {
		t.Helper()
		for _, u := range ups {
			tr := u.Transitions[0]
			got, err := ix.Get(tr.Key)
			if err != nil {
				t.Fatal(err)
			}
			if got == nil || got.CommitLSN != tr.Next.CommitLSN {
				t.Fatalf("%s: key %q: got %+v, want the entry of LSN %d", where, tr.Key, got, tr.Next.CommitLSN)
			}
		}
	}
	check("pending")
	if err := ix.Flush(); err != nil {
		t.Fatal(err)
	}
	check("ingested")
}

// TestPendingChunksUnderReaders: the applier publishes a run of updates in
// chunks (addPending) while readers look keys up. Every key of a run whose
// Apply returned reads back as its last update left it, and at every
// moment a key that the pending set shows is in the key filter (the
// filter learns a key before the set shows it, else Get, which asks the
// filter first, would call a stored key absent). Each run claims 1,000
// new keys and then commits them, so a key's claim and commit are in
// different chunks, and a small IngestBytes freezes and ingests sets as
// it goes. Run it with -race too: the set is written under pmu only.
func TestPendingChunksUnderReaders(t *testing.T) {
	m := &filterModel{t: t, fs: vfs.NewMem()}
	ix, err := Open(Options{FS: m.fs, Dir: "ix", IngestBytes: 512 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close(false)
	m.ix = ix
	ix.StartFilter()
	m.waitReady()
	const runs, perRun, readers = 40, 1000, 2
	key := func(i int) []byte { return EntryKey(nil, "s", ModeID, []byte(fmt.Sprintf("id-%07d", i))) }
	keys := make([][]byte, runs*perRun)
	for i := range keys {
		keys[i] = key(i)
	}
	// The commit of key i: LSN run*2*perRun + perRun + j + 1 (j: its place
	// in its run); its claim's is perRun less.
	commitLSN := func(i int) wal.LSN { return wal.LSN(i/perRun*2*perRun + perRun + i%perRun + 1) }
	var applied atomic.Int64 // runs whose Apply returned
	var stop atomic.Bool
	var wg sync.WaitGroup
	errs := make(chan string, readers)
	for r := range readers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(r), 5))
			for !stop.Load() {
				done := int(applied.Load())
				// A key of the run being applied: shown by the set
				// means held by the filter.
				if done < runs {
					k := keys[done*perRun+rng.IntN(perRun)]
					if e, ok := ix.lookupPending(k); ok && e != nil && !ix.MayContain(k) {
						errs <- fmt.Sprintf("key %q is in the pending set (%+v) but not in the key filter", k, e)
						return
					}
				}
				// A key of a run applied before the read began: its commit.
				if done > 0 {
					i := rng.IntN(done * perRun)
					got, err := ix.Get(keys[i])
					if err != nil || got == nil || !got.Committed || got.CommitLSN != commitLSN(i) {
						errs <- fmt.Sprintf("Get(%q) after its run was applied: %+v, %v; want the commit of LSN %d", keys[i], got, err, commitLSN(i))
						return
					}
				}
			}
		}()
	}
	for run := range runs {
		// Apply wants LSN order: the run's claims, then its commits.
		ups := make([]*Update, 0, 2*perRun)
		claims := make([]*Entry, perRun)
		for j := range perRun {
			i := run*perRun + j
			lsn := commitLSN(i) - perRun
			claims[j] = &Entry{InFlight: true, ClaimLSN: lsn, LeaseUntil: 1 << 62, LSN: lsn}
			ups = append(ups, &Update{LSN: lsn, Transitions: []Transition{{Key: keys[i], Mode: ModeID, Next: claims[j]}}})
		}
		for j := range perRun {
			i := run*perRun + j
			lsn := commitLSN(i)
			c := &Entry{Committed: true, CommitTime: int64(lsn), CommitLSN: lsn, ReplyKept: true, Reply: []byte("r"), LSN: lsn}
			ups = append(ups, &Update{LSN: lsn, Transitions: []Transition{{Key: keys[i], Mode: ModeID, Prev: claims[j], Next: c}}})
		}
		if err := ix.Apply(ups); err != nil {
			t.Fatal(err)
		}
		applied.Store(int64(run + 1))
		select {
		case e := <-errs:
			stop.Store(true)
			wg.Wait()
			t.Fatal(e)
		default:
		}
	}
	stop.Store(true)
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
}

// TestPendingSetIndex: a set started with a small hint grows its index
// past it and still finds every key it holds at its own pendEntry, and no
// key it lacks (including prefixes and extensions of its keys).
func TestPendingSetIndex(t *testing.T) {
	s := newPendingSet(4)
	const n = 5000
	key := func(i int) []byte { return fmt.Appendf(nil, "key-%d", i) }
	added := make([]*pendEntry, n)
	for i := range n {
		k := key(i)
		if s.get(string(k)) != nil {
			t.Fatalf("key %q found before it was added", k)
		}
		added[i] = s.add(k, maphash.Bytes(pendSeed, k), nil)
	}
	if s.n != n {
		t.Fatalf("set holds %d keys, want %d", s.n, n)
	}
	for i := range n {
		if got := s.get(string(key(i))); got != added[i] {
			t.Fatalf("key %d: got pendEntry %p, want %p", i, got, added[i])
		}
		for _, absent := range []string{fmt.Sprintf("key-%d", i+n), fmt.Sprintf("key-%dx", i), fmt.Sprintf("ke-%d", i)} {
			if s.get(absent) != nil {
				t.Fatalf("absent key %q found", absent)
			}
		}
	}
}
