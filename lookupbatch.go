package idem

import (
	"context"
	mbits "math/bits"
	"sync"
	"unsafe"

	"github.com/idemdb/idem/wal"
)

// LookupHints is LookupHint of each of reqs, made together: out[i] and
// hints[i] are what LookupHint(ctx, reqs[i], &hints[i]) would return and
// fill, as if the lookups ran one after another at one moment, with
// nothing changed between them (a lookup changes no result, so two
// requests of one key get the same answer). out and hints must be as long
// as reqs.
//
// It is for a caller that looks many requests up before it writes any of
// them (idemraft's FSM, with the commands of a raft batch that share a log
// time and no key): it validates them, locks the shards of all of them
// at once (in shard order, as a batch does), then loads the word of each
// shard's table where each key's probe starts, in one loop of independent
// loads, before it probes the tables one key after another. A new id's
// probe is nearly always a cache miss (its key lands anywhere in
// megabytes of tables); loaded together, the misses of many lookups
// overlap instead of coming one per lookup. The engine's clock is read
// once. A key the key filter may hold is read from the index under its
// shard's lock, as a batch's run reads it.
func (e *Engine) LookupHints(ctx context.Context, reqs []Request, hints []PutHint, out []BatchResult) {
	if len(hints) != len(reqs) || len(out) != len(reqs) {
		panic("idem: LookupHints needs as many hints and results as requests")
	}
	lb := lookupBatchPool.Get().(*lookupBatch)
	lb.run(e, ctx, reqs, hints, out)
	lookupBatchPool.Put(lb)
}

// lookupBatch is LookupHints' working state, pooled: the requests' keys,
// shards and tags, cleared after each call (they hold the requests' key
// bytes).
type lookupBatch struct {
	keys []lookupKey
}

// lookupKey is a request of LookupHints: its validated key, the key's
// shard and tag, or the request's error; done and lsn, a Done result and
// its commit's LSN, waited for once the shards are unlocked.
type lookupKey struct {
	k    reqKey
	sh   *shard
	tag  uint32
	err  error
	done bool
	lsn  wal.LSN
	pos  int32 // prefetch's: the slab position a new slot of sh would take
}

// lookupBatchPool holds lookupBatch values between LookupHints calls.
var lookupBatchPool = sync.Pool{New: func() any { return new(lookupBatch) }}

// maxKeptLookupKeys bounds the keys a pooled lookupBatch keeps room for.
const maxKeptLookupKeys = 4096

func (lb *lookupBatch) run(e *Engine, ctx context.Context, reqs []Request, hints []PutHint, out []BatchResult) {
	clear(hints)
	clear(out)
	if cap(lb.keys) < len(reqs) {
		lb.keys = make([]lookupKey, len(reqs))
	}
	keys := lb.keys[:len(reqs)]
	defer func() {
		clear(keys)
		if cap(lb.keys) > maxKeptLookupKeys {
			lb.keys = nil
		}
	}()
	// As lookup: a request's own validation first, then the context and
	// the engine's state, which every valid request gets.
	valid := 0
	for i := range reqs {
		lk := &keys[i]
		if lk.k, lk.err = e.validate(&reqs[i]); lk.err == nil {
			valid++
		}
	}
	if valid == 0 {
		for i := range keys {
			out[i].Err = keys[i].err
		}
		return
	}
	fail := ctx.Err()
	if fail == nil {
		if fail = e.enter(); fail == nil {
			defer e.leave()
		}
	}
	if fail != nil {
		for i := range keys {
			if out[i].Err = keys[i].err; out[i].Err == nil {
				out[i].Err = fail
			}
		}
		return
	}
	var set shardSet
	for i := range keys {
		if lk := &keys[i]; lk.err == nil {
			lk.sh, lk.tag = e.keyTag(lk.k.key)
			set.addShard(lk.sh.idx)
		}
	}
	for w, bits := range set {
		for ; bits != 0; bits &= bits - 1 {
			e.shards[w*64+mbits.TrailingZeros64(bits)].mu.Lock()
		}
	}
	lb.prefetch(keys)
	now := e.o.Clock()
	for i := range keys {
		lk := &keys[i]
		if lk.err != nil {
			out[i].Err = lk.err
			continue
		}
		sl, err := e.slotLockedIn(lk.sh, lk.k.key, lk.tag, true)
		if err != nil {
			out[i].Err = err
			continue
		}
		cur := e.current(sl, lk.k.mode)
		fp := fingerprint(&reqs[i])
		v, res, verr := e.readLocked(cur, lk.k, fp, now)
		hints[i] = PutHint{e: e, req: reqs[i], k: lk.k, fp: fp, sl: sl}
		out[i] = BatchResult{Result: res, Err: verr}
		if v == vDone {
			lk.done, lk.lsn = true, cur.CommitLSN
		}
	}
	for w := len(set) - 1; w >= 0; w-- {
		for bits := set[w]; bits != 0; {
			top := 63 - mbits.LeadingZeros64(bits)
			e.shards[w*64+top].mu.Unlock()
			bits &^= 1 << top
		}
	}
	// As lookup: a Done result is given once its commit's record is
	// durable, waited for without the locks.
	for i := range keys {
		if keys[i].done {
			if err := e.waitDurable(keys[i].lsn); err != nil {
				out[i] = BatchResult{Err: err}
			}
		}
	}
}

// prefetch loads, for every key, the word of its shard's table where its
// probe will start (shard.probeStart) and the slab position a new slot of
// the shard would take (shard.nextPos: the free list's last entry and the
// slab's word there), in loops of independent loads, so that their cache
// misses overlap. It reads and decides nothing. The keys' shards are
// locked.
func (lb *lookupBatch) prefetch(keys []lookupKey) {
	var x uint64
	for i := range keys {
		if lk := &keys[i]; lk.err == nil {
			x += lk.sh.probeStart(lk.tag)
			lk.pos = lk.sh.nextFree()
		}
	}
	for i := range keys {
		if lk := &keys[i]; lk.err == nil && lk.pos >= 0 {
			x += uint64(uintptr(unsafe.Pointer(lk.sh.slab[lk.pos])))
		}
	}
	if x == 1 { // rarely: a store only to keep the loads above
		prefetchSink.Store(x)
	}
}

// nextFree is the slab position sh.add gives the next slot (-1: the
// slab's end). sh's lock is held.
func (sh *shard) nextFree() int32 {
	if k := len(sh.free); k > 0 {
		return sh.free[k-1]
	}
	return -1
}
