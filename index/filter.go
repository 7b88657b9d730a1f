package index

import (
	"fmt"
	"hash/maphash"
	"math/bits"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2"
)

// Most lookups are of ids never seen before, and a miss must look
// everywhere: the pending sets, then every level of Pebble (an iterator
// built and torn down, a bloom filter probed per level and per L0 table).
// That was about a fifth of the CPU of a fresh Do, in the critical path of
// every request. The key filter answers most of those misses in memory.
//
// It is a split-block bloom filter over every entry key that may be in
// Pebble or present in a pending set: one 64-byte block per key, one bit
// set in each of its eight 64-bit words (about 1% false positives at 10
// bits per key). A key is added before it can be read anywhere: when an
// update in a pending set makes it present (addPending, before
// the set shows it), when Load writes it, and, when the filter is built,
// from the pending sets and by a scan of Pebble's entry keys. A key that
// is present is in the filter already, so changes of present keys (a
// commit after its claim, a forget batch rewriting an entry) add nothing.
// So "not in the filter" means "in no pending set and not in Pebble", and
// Get answers it first, before the pending sets' maps; a false positive
// only costs the lookups that every miss paid before.
//
// Removals do not clear bits (a bloom filter cannot). Once more keys were
// added than the filter holds at 10 bits per key, and more than twice the
// entries now stored, a new filter is built in the background. The memory
// is fixed (Options.FilterBytes, twice that during a build); with more
// live entries than that holds, the false-positive rate rises and lookups
// fall back to Pebble's own filters, as without this one.
//
// Building: under applyMu the new filter is installed as "building" (every
// add from then on goes to it as well), the keys of the pending sets are
// added to it, and a Pebble iterator is opened; that iterator sees every
// ingest and batch made before, and everything after goes through an add.
// The scan then runs without the lock, and the filter replaces the old one
// (or becomes the first one: StartFilter, called by the engine after
// replay) when it is done. Until the first one is ready, Get asks Pebble.

// filterBitsPerKey sizes a filter's nominal capacity.
const filterBitsPerKey = 10

// filterSaturation: with more live entries than this many times its
// capacity, a filter answers "maybe" for most absent keys (2.5 bits per
// key at 4x: about 70% false positives; at 100 million ids and the default
// 16 MiB, 98%). Past it the filter is dropped, or not built (a build scans
// the whole index: 7 GiB at 100 million ids), and lookups ask Pebble's own
// filters, as with the filter turned off; its memory is returned. It is
// built again when the entries fall below half that (forgets, acks,
// expiry). The margin keeps a count near the line from building and
// dropping it again and again.
const filterSaturation = 4

// filterCapKeys is the nominal capacity of a filter of size bytes.
func filterCapKeys(size int64) int64 { return max(size/64, 1) * 512 / filterBitsPerKey }

// keyFilter is a split-block bloom filter, safe for concurrent adds and
// lookups (its words are atomic).
type keyFilter struct {
	words   []atomic.Uint64 // 8 per block
	nblocks uint64
	capKeys int64        // keys it holds at filterBitsPerKey
	added   atomic.Int64 // keys added (with repeats)
}

// newKeyFilter returns an empty filter of about size bytes (at least one
// 64-byte block).
func newKeyFilter(size int64) *keyFilter {
	nblocks := uint64(max(size/64, 1))
	return &keyFilter{
		words:   make([]atomic.Uint64, nblocks*8),
		nblocks: nblocks,
		capKeys: filterCapKeys(size),
	}
}

// The salts of the Parquet split-block bloom filter: one odd multiplier per
// word picks the bit set in that word.
var filterSalts = [8]uint32{0x47b6137b, 0x44974d91, 0x8824ad5b, 0xa2b7289d, 0x705495c7, 0x2df1424b, 0x9efc4947, 0x5c6bfb31}

func (f *keyFilter) block(h uint64) []atomic.Uint64 {
	b, _ := bits.Mul64(h, f.nblocks) // the high half: h scaled to [0, nblocks)
	return f.words[b*8 : b*8+8]
}

func (f *keyFilter) add(h uint64) {
	w := f.block(h)
	x := uint32(h)
	for i := range w {
		w[i].Or(1 << ((x * filterSalts[i]) >> 26))
	}
	f.added.Add(1)
}

func (f *keyFilter) mayContain(h uint64) bool {
	w := f.block(h)
	x := uint32(h)
	for i := range w {
		if w[i].Load()&(1<<((x*filterSalts[i])>>26)) == 0 {
			return false
		}
	}
	return true
}

// addHashes adds the keys of the hashes hs, as add does one by one. The
// blocks lie at random places in a filter of megabytes, and each of the
// eight atomic ORs of an add waits for the block's cache line (a locked
// instruction lets nothing pass it): hs's blocks are loaded first, in runs
// of addRun independent loads whose misses overlap, and set afterwards.
func (f *keyFilter) addHashes(hs []uint64) {
	f.added.Add(int64(len(hs)))
	for len(hs) > 0 {
		run := hs[:min(len(hs), addRun)]
		hs = hs[len(run):]
		var x uint64
		for _, h := range run {
			x += f.block(h)[0].Load()
		}
		if x == 1 { // rarely: a store only to keep the loads above
			filterSink.Store(x)
		}
		for _, h := range run {
			w := f.block(h)
			x := uint32(h)
			for i := range w {
				w[i].Or(1 << ((x * filterSalts[i]) >> 26))
			}
		}
	}
}

// addRun is the number of blocks addHashes loads at once.
const addRun = 32

// prefetch loads the blocks of the hashes hs (mayContain's first reads),
// as addHashes loads them: independent loads whose cache misses overlap.
// It changes nothing.
func (f *keyFilter) prefetch(hs []uint64) {
	var x uint64
	for _, h := range hs {
		x += f.block(h)[0].Load()
	}
	if x == 1 { // rarely: a store only to keep the loads above
		filterSink.Store(x)
	}
}

// filterSink keeps addHashes' loads from being optimized away.
var filterSink atomic.Uint64

func (ix *Index) keyHash(key []byte) uint64 { return maphash.Bytes(ix.filterSeed, key) }

// filterAddHashesLocked is filterAddLocked for the keys whose keyHash are
// hs. ix.applyMu is held.
func (ix *Index) filterAddHashesLocked(hs []uint64) {
	if ix.filterBytes <= 0 || len(hs) == 0 {
		return
	}
	if f := ix.filter.Load(); f != nil {
		f.addHashes(hs)
	}
	if ix.building != nil {
		ix.building.addHashes(hs)
	}
}

// filterAddLocked adds an entry key that is about to be written to Pebble
// (or to a pending set). ix.applyMu is held.
func (ix *Index) filterAddLocked(key []byte) {
	if ix.filterBytes <= 0 {
		return
	}
	h := ix.keyHash(key)
	if f := ix.filter.Load(); f != nil {
		f.add(h)
	}
	if ix.building != nil {
		ix.building.add(h)
	}
}

// filterAbsent reports whether key is certainly not in Pebble.
func (ix *Index) filterAbsent(key []byte) bool {
	f := ix.filter.Load()
	return f != nil && !f.mayContain(ix.keyHash(key))
}

// MayContain reports whether key may be stored, from the key filter alone
// (no lock, no probe of the pending sets or Pebble): false means that Get
// would answer nil, as of the moment of the call (every key is added to
// the filter before any read can find it). It is true without a filter
// (the first one not built yet, turned off, or dropped) and once the index
// has failed, so that the caller's Get reports the failure.
func (ix *Index) MayContain(key []byte) bool {
	return !ix.filterAbsent(key) || ix.failure() != nil
}

// FilterHash returns key's hash in the key filter, for PrefetchFilter.
func (ix *Index) FilterHash(key []byte) uint64 { return ix.keyHash(key) }

// PrefetchFilter loads the key filter's blocks of the keys whose
// FilterHash are hs into the CPU's cache, and changes nothing. A check of
// a key the filter does not hold reads one block at a random place in
// megabytes, nearly always a cache miss: a caller about to check many
// keys one by one (MayContain, Get; the engine's lookups of a batch of
// requests) calls it first with all of them, so that the misses overlap
// instead of coming one per check. It is only a hint: no answer depends
// on it.
func (ix *Index) PrefetchFilter(hs []uint64) {
	if f := ix.filter.Load(); f != nil {
		f.prefetch(hs)
	}
}

// FilterBuilds returns how many key filters were built since Open.
func (ix *Index) FilterBuilds() int64 { return ix.filterBuilds.Load() }

// FilterReady reports whether lookups use the key filter (false while the
// first one is being built, and when it is disabled).
func (ix *Index) FilterReady() bool { return ix.filter.Load() != nil }

// StartFilter builds the first key filter in the background. The engine
// calls it once replay is done: replay then adds nothing to a filter, and
// the build scans only what is live.
func (ix *Index) StartFilter() {
	ix.applyMu.Lock()
	defer ix.applyMu.Unlock()
	if ix.filter.Load() != nil || ix.filterBytes <= 0 {
		return
	}
	if n, c := ix.count.Load(), filterCapKeys(ix.filterBytes); n > filterSaturation*c {
		ix.filterSaturated = true
		ix.logger.Info("index: key filter not built: the index holds more than 4x the keys it can tell apart; lookups of new ids ask Pebble (raise IndexFilterBytes to keep it)",
			"entries", n, "capacity", c)
		return
	}
	ix.startFilterBuildLocked()
}

// maybeRebuildFilterLocked starts a rebuild when the filter holds more keys
// than its capacity and more than twice the entries stored (most of its
// bits are then stale); drops the filter when the entries pass
// filterSaturation times its capacity, and builds it again once they fall
// below half that. ix.applyMu is held.
func (ix *Index) maybeRebuildFilterLocked() {
	if ix.building != nil || ix.filterBytes <= 0 {
		return
	}
	count, capKeys := ix.count.Load(), filterCapKeys(ix.filterBytes)
	f := ix.filter.Load()
	if f == nil {
		if ix.filterSaturated && 2*count < filterSaturation*capKeys {
			ix.filterSaturated = false
			ix.logger.Info("index: building the key filter again", "entries", count, "capacity", capKeys)
			ix.startFilterBuildLocked()
		}
		return // or the first one is not started yet (StartFilter)
	}
	if count > filterSaturation*capKeys {
		ix.filter.Store(nil)
		ix.filterSaturated = true
		ix.logger.Info("index: key filter dropped: the index holds more than 4x the keys it can tell apart; lookups of new ids ask Pebble (raise IndexFilterBytes to keep it)",
			"entries", count, "capacity", capKeys)
		return
	}
	if n := f.added.Load(); n > f.capKeys && n > 2*count {
		ix.startFilterBuildLocked()
	}
}

// startFilterBuildLocked starts building a filter in the background.
// ix.applyMu is held.
func (ix *Index) startFilterBuildLocked() {
	if ix.filterBytes <= 0 || ix.building != nil || ix.filterClosed {
		return
	}
	nf := newKeyFilter(ix.filterBytes)
	// The mutable set changes only under applyMu (held); the frozen one is
	// read-only, and dropped (under pmu) only once Pebble has it, so that
	// the iterator opened below sees its keys if they are not added here.
	ix.pmu.RLock()
	sets := []*pendingSet{ix.mut, ix.frozen}
	ix.pmu.RUnlock()
	for _, s := range sets {
		if s == nil {
			continue
		}
		for _, slab := range s.slabs {
			for i := range slab {
				if p := &slab[i]; p.next != nil {
					nf.add(maphash.String(ix.filterSeed, p.key))
				}
			}
		}
	}
	// Counted from before the iterator opens to after it is closed, so
	// that Close never closes Pebble between the two (the scan goroutine
	// may not have started yet when Close looks).
	ix.inPebble.Add(1)
	it, err := ix.db.NewIter(&pebble.IterOptions{
		LowerBound: []byte{prefixEntry},
		UpperBound: []byte{prefixEntry + 1},
	})
	if err != nil {
		ix.inPebble.Add(-1)
		ix.logger.Warn("index: key filter not built; lookups of new ids ask Pebble", "error", err)
		return
	}
	ix.building = nf
	ix.buildingMem.Store(true)
	ix.filterWG.Add(1)
	go ix.scanFilter(nf, it)
}

// scanFilter adds every entry key of it to nf and installs nf.
// startFilterBuildLocked counted it in inPebble.
func (ix *Index) scanFilter(nf *keyFilter, it *pebble.Iterator) {
	defer ix.filterWG.Done()
	defer ix.inPebble.Add(-1)
	start := time.Now()
	n := 0
	var err error
	for valid := it.First(); valid; valid = it.Next() {
		nf.add(ix.keyHash(it.Key()))
		n++
		if n%4096 == 0 {
			select {
			case <-ix.filterStop:
				err = errFilterStopped
			default:
			}
			if err != nil {
				break
			}
		}
	}
	if err == nil {
		err = it.Error()
	}
	if cerr := it.Close(); err == nil {
		err = cerr
	}
	ix.applyMu.Lock()
	defer ix.applyMu.Unlock()
	ix.building = nil
	ix.buildingMem.Store(false)
	if err != nil {
		if err != errFilterStopped {
			ix.logger.Warn("index: key filter not built; lookups of new ids ask Pebble", "error", err)
		}
		return
	}
	ix.filter.Store(nf)
	ix.filterBuilds.Add(1)
	ix.logger.Debug("index: key filter built", "keys", n, "added", nf.added.Load(),
		"capacity", nf.capKeys, "took", time.Since(start))
}

var errFilterStopped = fmt.Errorf("index: key filter build stopped")

// stopFilter stops a build in progress and waits for it. applyMu must not
// be held (the scan takes it to finish).
func (ix *Index) stopFilter() {
	ix.applyMu.Lock()
	if !ix.filterClosed {
		ix.filterClosed = true
		close(ix.filterStop)
	}
	ix.applyMu.Unlock()
	ix.filterWG.Wait()
}
