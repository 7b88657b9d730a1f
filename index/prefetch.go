package index

// PrefetchFilter loads the key filter's blocks of keys into the
// processor's cache, in one run of independent loads whose misses overlap
// (see addHashes), so that the Gets of those keys that follow find them
// there: a filter of megabytes is probed at random, and a lookup of a
// new id otherwise waits for one cache miss (and a TLB miss) of its own
// in the middle of its work, under its shard's lock. It changes nothing
// and answers nothing: a Get still asks the filter itself. Without a
// filter it does nothing.
func (ix *Index) PrefetchFilter(keys [][]byte) {
	f := ix.filter.Load()
	if f == nil || len(keys) == 0 {
		return
	}
	var x uint64
	for _, k := range keys {
		x += f.block(ix.keyHash(k))[0].Load()
	}
	if x == 1 { // rarely: a store only to keep the loads above
		filterSink.Store(x)
	}
}
