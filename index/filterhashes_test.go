package index

import (
	"math/rand/v2"
	"testing"
)

// TestAddHashesSetsWhatAddSets: keyFilter.addHashes (addPending's, a
// chunk's new keys at once, their blocks loaded first in runs of addRun)
// leaves a filter bit for bit as add called once per hash does, and counts
// every hash, for lengths around the run's size.
func TestAddHashesSetsWhatAddSets(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{0, 1, addRun - 1, addRun, addRun + 1, 3*addRun + 5, 1000} {
		hs := make([]uint64, n)
		for i := range hs {
			hs[i] = rng.Uint64()
		}
		one, all := newKeyFilter(64<<10), newKeyFilter(64<<10)
		for _, h := range hs {
			one.add(h)
		}
		all.addHashes(hs)
		if a, b := one.added.Load(), all.added.Load(); a != b || b != int64(n) {
			t.Fatalf("%d hashes: added %d one by one, %d by addHashes", n, a, b)
		}
		for i := range one.words {
			if a, b := one.words[i].Load(), all.words[i].Load(); a != b {
				t.Fatalf("%d hashes: word %d is %#x one by one, %#x by addHashes", n, i, a, b)
			}
		}
		for _, h := range hs {
			if !all.mayContain(h) {
				t.Fatalf("%d hashes: %#x added but not found", n, h)
			}
		}
	}
}
