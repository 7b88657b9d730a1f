package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	mbits "math/bits"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
)

// Batcher is implemented by a Store that can run many requests at once
// (one record and one pass over its state per batch). It is not part of
// Store: an integration checks for it and batches when the store has it,
// one request at a time otherwise:
//
//	if bs, ok := store.(idem.Batcher); ok {
//		b := bs.NewBatch()
//		...
//	}
type Batcher interface {
	NewBatch() Batch
}

// Batch collects requests that a Store runs together with Run. Each call
// adds one item; Run returns one BatchResult per item, in the order the
// items were added, with exactly the result and error the single call
// would have given. Items of one batch that name the same key see each
// other in order (a second Begin of an id claimed earlier in the batch is
// InFlight). A Batch is used by one goroutine and run once. An item keeps
// the slices it is given (a Request's id, fingerprint and acked ids, a
// reply) until Run returns: the engine copies what it stores when the
// batch runs, so the caller must not change those buffers before then
// (after Run they are the caller's again, as after a single call). The engine's
// batch also implements RunAppender, which runs it into a results slice
// the caller reuses from batch to batch.
type Batch interface {
	// Begin is Store.Begin as an item of the batch.
	Begin(req Request)
	// Put claims req and commits reply (with the advances adv) in one
	// step: for a request whose side effect another log holds (a raft
	// entry, a stream checkpoint) no claim is ever visible alone. Its
	// result is what Begin would say, except that a new request gives
	// Status Fresh with no Claim (it is committed already): Done with the
	// stored reply, InFlight, ErrConflict, *SequenceGapError,
	// *AlreadyCommittedError as Begin.
	Put(req Request, reply []byte, adv ...Advance)
	// Commit is c.Commit (c.CommitAdvance with adv) as an item.
	Commit(c *Claim, reply []byte, adv ...Advance)
	// Abort is c.Abort as an item.
	Abort(c *Claim)
	// Ack is Store.Ack as an item.
	Ack(scope string, ids ...[]byte)
	// Advance is Store.Advance as an item.
	Advance(adv ...Advance)
	// Len is the number of items added.
	Len() int
	// Run runs the items and waits for them to be durable. err is for the
	// batch as a whole (ErrClosed, ErrFailed, ctx ended before anything
	// was written, the batch was run before): then nothing of it was
	// written. Otherwise each item has its own result and error.
	Run(ctx context.Context) ([]BatchResult, error)
}

// RunAppender is implemented by a Batch that can append its results to a
// slice the caller gives (the engine's batch does), as io.WriterTo is by
// a Writer that can do better than Copy's loop. It is not part of Batch:
// a caller that runs many batches checks for it and reuses one slice for
// the results of all of them, Run otherwise:
//
//	if ra, ok := b.(idem.RunAppender); ok {
//		buf, err = ra.AppendRun(ctx, buf[:0])
//	} else {
//		buf, err = b.Run(ctx)
//	}
type RunAppender interface {
	// AppendRun is Run with the results appended to dst, one per item in
	// the order the items were added, and the extended slice returned,
	// as append does: the results are dst[len(dst):] of what it returns,
	// written in dst's spare capacity when it has room for them all (no
	// allocation), else in a new array holding dst's elements first. Its
	// items, semantics and errors are Run's; Run is AppendRun(ctx, nil).
	// On an error for the batch as a whole it returns dst as given (its
	// spare capacity is left cleared). The results are the caller's, as
	// Run's are (a Claim to finish, a Reply to keep): the Batch keeps no
	// reference to dst or to any of its elements once AppendRun returns,
	// and a caller reusing dst clears it after use (clear(buf)) so that
	// it holds no claim or reply until the next run.
	AppendRun(ctx context.Context, dst []BatchResult) ([]BatchResult, error)
}

// BatchResult is the outcome of one item of a Batch: Result as the single
// call returns it (Begin, Put), and its error.
type BatchResult struct {
	Result Result
	Err    error
}

var (
	_ Batcher     = (*Engine)(nil)
	_ RunAppender = (*engineBatch)(nil)
)

// batchKind is what an item of an engine batch does.
type batchKind uint8

const (
	bBegin batchKind = iota
	bPut
	bCommit
	bAbort
	bAck
	bAdvance
)

// batchCall is one call added to a batch.
type batchCall struct {
	kind  batchKind
	req   Request
	claim *Claim
	reply []byte
	adv   []Advance
	scope string
	ids   [][]byte
	hint  *PutHint // Put: what LookupHint read of req (PutHint.Put); nil: none
}

// batchItem is a call and what Run found out about it.
type batchItem struct {
	batchCall
	// sl is k.key's slot as Run read it (nil: not read through the
	// table by this item); flush hands it on to spare a lookup.
	sl *slot
	k  reqKey // Begin, Put: the request's key; Commit, Abort: the claim's
	// shard and tag are k.key's lock shard and table tag (Begin, Put),
	// as check found them (keyTag), so that the run does not hash the
	// key again to find its slot.
	shard int32
	tag   uint32
	fp    []byte        // Begin, Put: the fingerprint as stored
	wadv  []wal.Advance // Put, Commit, Advance: the checked advances
	// keys are the keys the item locks besides k.key: the advanced
	// clients (Put, Commit: after k.key, as checkAdvances returns them),
	// the acked ids (Ack).
	keys     [][]byte
	swapped  bool // Commit, Abort: Run marked the claim finished
	noop     bool // nothing to do (an Ack or Advance of nothing)
	wake     bool // finishes a claim: wake its waiters
	rec      int  // the record (of this Run) holding the item's operations; -1: none
	waitRec  int  // the record whose LSN the result waits for; -1: none
	waitLSN  wal.LSN
	lease    time.Time
	expires  time.Time
	resolved bool // Run has its result (or error)
}

// engineBatch is the Engine's Batch.
type engineBatch struct {
	e *Engine
	// items holds one item per call, from batchItemsPool; Run gives it
	// back (n keeps the count for Len).
	items []batchItem
	n     int
	ran   bool
	bufs  *batchBufs // items' buffers, from batchItemsPool (nil: none yet)
}

// batchBufs are the buffers of a batch's items, reused: a batch's items
// are Run's working state only (its results are copied out), so reusing
// them spares allocating and growing ~500 bytes per item; wadv and keys
// hold the items' checked advances and keys (batchItem.wadv, keys),
// which nothing keeps after Run (the record is encoded, the index batch
// copies what it keeps, the slots' keys are the keys' own bytes).
type batchBufs struct {
	items []batchItem
	wadv  []wal.Advance
	keys  [][]byte
	ck    clientKeys // the advanced clients' keys, built once per batch
}

var batchItemsPool = sync.Pool{New: func() any { return new(batchBufs) }}

// batchItemsPoolMax is the largest item slice (in items) kept for reuse.
const batchItemsPoolMax = 8192

// NewBatch returns an empty batch of the engine (see Batch).
func (e *Engine) NewBatch() Batch { return &engineBatch{e: e} }

// add adds the call c (after Run: counted but dropped, since Run refuses
// to run again and the items' memory went back to batchItemsPool).
func (b *engineBatch) add(c batchCall) {
	b.n++
	if b.ran {
		return
	}
	if b.bufs == nil {
		b.bufs = batchItemsPool.Get().(*batchBufs)
		b.items = b.bufs.items[:0]
	}
	b.items = append(b.items, batchItem{batchCall: c})
}

func (b *engineBatch) Begin(req Request) { b.add(batchCall{kind: bBegin, req: req}) }
func (b *engineBatch) Put(req Request, reply []byte, adv ...Advance) {
	b.add(batchCall{kind: bPut, req: req, reply: reply, adv: adv})
}
func (b *engineBatch) Commit(c *Claim, reply []byte, adv ...Advance) {
	b.add(batchCall{kind: bCommit, claim: c, reply: reply, adv: adv})
}
func (b *engineBatch) Abort(c *Claim) { b.add(batchCall{kind: bAbort, claim: c}) }
func (b *engineBatch) Ack(scope string, ids ...[]byte) {
	b.add(batchCall{kind: bAck, scope: scope, ids: ids})
}
func (b *engineBatch) Advance(adv ...Advance) { b.add(batchCall{kind: bAdvance, adv: adv}) }
func (b *engineBatch) Len() int               { return b.n }

// release gives the items back to batchItemsPool, cleared so that the
// pool holds no caller's memory.
func (b *engineBatch) release() {
	bufs := b.bufs
	if bufs == nil {
		return
	}
	items := b.items
	b.items, b.bufs = nil, nil
	if cap(items) > batchItemsPoolMax || cap(bufs.wadv) > batchItemsPoolMax || cap(bufs.keys) > batchItemsPoolMax {
		return
	}
	clear(items)
	clear(bufs.wadv[:cap(bufs.wadv)])
	clear(bufs.keys[:cap(bufs.keys)])
	bufs.ck.reset()
	bufs.items, bufs.wadv, bufs.keys = items[:0], bufs.wadv[:0], bufs.keys[:0]
	batchItemsPool.Put(bufs)
}

// checkAdvances is Engine.checkAdvances into the batch's buffers.
func (b *engineBatch) checkAdvances(adv []Advance, own []byte) ([]wal.Advance, [][]byte, error) {
	bufs := b.bufs
	if len(bufs.wadv) == 0 && len(bufs.keys) == 0 {
		// Size them for the whole batch at its first advance.
		n := 0
		for i := range b.items {
			n += len(b.items[i].adv)
		}
		if cap(bufs.wadv) < n {
			bufs.wadv = make([]wal.Advance, 0, n)
		}
		if cap(bufs.keys) < n+len(b.items) {
			bufs.keys = make([][]byte, 0, n+len(b.items))
		}
	}
	wadv, keys, err := b.e.checkAdvancesInto(bufs.wadv, bufs.keys, &bufs.ck, adv, own)
	if err == nil {
		bufs.wadv = appendShared(bufs.wadv, len(wadv))
		bufs.keys = appendShared(bufs.keys, len(keys))
	}
	return wadv, keys, err
}

// appendShared extends s by n elements that a sub-slice of its spare
// capacity was given out for (by checkAdvancesInto), when they fit.
func appendShared[T any](s []T, n int) []T {
	if cap(s)-len(s) >= n {
		return s[:len(s)+n]
	}
	return s
}

// batchRecordBytes is the encoded size from which Run starts another
// record (a batch record's operations, besides its head). An item's
// operations are never split: a record holds whole items, and an item
// larger than this (a reply of up to MaxReplySize) goes alone.
const batchRecordBytes = 4 << 20

// Run runs the items as one WAL record (docs/design.md, "The batch
// path"): it checks every item (an invalid one gets its error and the
// others go on), locks the keys of the whole batch in shard order,
// classifies each item with classifyLocked against what the items before
// it left, appends one batch record holding the operations of every item
// that changes something (none: no record), publishes its transitions,
// unlocks and waits once for what the items need to be durable: the
// record under SyncAlways when it holds a claim (unless
// Options.RelaxedClaims), a commit, abort, ack or advance, the records of
// the replies Done items return. A batch whose operations take more than
// batchRecordBytes (4 MiB) encoded, or more than wal.MaxBatchCost decoded,
// is written as several records, each holding whole items and each whole
// or absent after a crash.
//
// A Commit or Abort item must name a claim made by this engine: a Claim
// of another store (NewClaim with a backend) is ErrInvalidRequest (finish
// it with its own Commit or Abort; the batch cannot make another store's
// write part of its record), and a claim already finished (also by an
// earlier item) is ErrLeaseLost.
func (b *engineBatch) Run(ctx context.Context) ([]BatchResult, error) {
	return b.AppendRun(ctx, nil)
}

// AppendRun is Run appending its results to dst (see RunAppender). The
// run writes the results in place, in dst's spare capacity (grown first
// when it is too small), and keeps no reference to them once it returns:
// the batchRun's out is dropped by putBatchRun.
func (b *engineBatch) AppendRun(ctx context.Context, dst []BatchResult) ([]BatchResult, error) {
	if b.ran {
		return dst, fmt.Errorf("%w: the batch was run already", ErrInvalidRequest)
	}
	b.ran = true
	defer b.release()
	if err := ctx.Err(); err != nil {
		return dst, err
	}
	e := b.e
	all := slices.Grow(dst, len(b.items))[:len(dst)+len(b.items)]
	out := all[len(dst):]
	clear(out) // a reused dst's spare capacity may hold an earlier run's results
	var set shardSet
	for i := range b.items {
		if err := b.check(i, &set); err != nil {
			out[i].Err = err
			b.items[i].resolved = true
		}
	}
	if err := e.enter(); err != nil {
		b.reopenClaims(0)
		clear(out)
		return dst, err
	}
	defer e.leave()
	r := e.getBatchRun(len(b.items))
	r.b, r.out, r.now = b, out, e.o.Clock()
	defer e.putBatchRun(r)
	unlock := e.lockShards(&set)
	for i := range b.items {
		if i%prefetchRun == 0 && len(b.items) >= prefetchMin {
			r.prefetch(i)
		}
		if b.items[i].resolved {
			continue
		}
		if err := r.item(i); err != nil {
			b.items[i].resolved = false // its result is err
			r.abandon(err)
			break
		}
	}
	if r.fatal == nil {
		if err := r.flush(len(b.items)); err != nil {
			r.abandon(err)
		}
	}
	unlock()
	if r.fatal != nil && len(r.lsns) == 0 {
		clear(out)
		return dst, r.fatal
	}
	r.finish()
	return all, nil
}

// prefetchRun is the number of keys whose key filter blocks (and, in a
// batch run, table words) are loaded at once, by Prefetch and
// batchRun.prefetch: about the misses a core keeps in flight; prefetchMin
// the smallest batch a batch run prefetches for (a request or two gain
// nothing from overlapping their misses).
const (
	prefetchRun = 32
	prefetchMin = 8
)

// prefetch loads what the Begin and Put items from the from-th on
// (prefetchRun of them) read first into the processor's cache, in runs of
// independent loads, before the items are classified one by one: the
// shard table's slot where the probe for the item's key starts, and the
// key filter's block of the key (index.PrefetchFilter). Both lie at
// random in tables of megabytes, and each item would otherwise take its
// cache misses alone, in the middle of its work. A key that has a slot,
// or is not new, only costs the filter's load. The run holds the lock of
// every item's shard.
func (r *batchRun) prefetch(from int) {
	var hs [prefetchRun]uint64
	n := 0
	var x uint64
	items := r.b.items[from:min(from+prefetchRun, len(r.b.items))]
	for j := range items {
		if it := &items[j]; !it.resolved && (it.kind == bBegin || it.kind == bPut) && it.hintSlot() == nil {
			x += r.e.shards[it.shard].probeStart(it.tag)
			hs[n] = r.e.ix.FilterHash(it.k.key)
			n++
		}
	}
	if x == 1 { // rarely: a store only to keep the loads above
		prefetchSink.Store(x)
	}
	r.e.ix.PrefetchFilter(hs[:n])
}

// prefetchSink keeps prefetch's loads from being optimized away.
var prefetchSink atomic.Uint64

// probeStart returns the word of sh's table where find's probe for a key
// of tag tag starts (batchRun.prefetch loads it ahead). sh's lock is held.
func (sh *shard) probeStart(tag uint32) uint64 {
	if len(sh.tab) == 0 {
		return 0
	}
	return sh.tab[uint64(tag)&uint64(len(sh.tab)-1)]
}

// check validates item i and adds the keys it locks to set.
func (b *engineBatch) check(i int, set *shardSet) error {
	e := b.e
	it := &b.items[i]
	it.rec, it.waitRec = -1, -1
	switch it.kind {
	case bBegin, bPut:
		k, fp, err := e.batchKey(&it.batchCall)
		if err != nil {
			return err
		}
		it.k, it.fp = k, fp
		if h := it.hint; h != nil && h.sl != nil {
			it.shard, it.tag = int32(h.sl.shard), h.sl.tag // without hashing the key again
		} else {
			sh, tag := e.keyTag(k.key)
			it.shard, it.tag = int32(sh.idx), tag
		}
		set.addShard(int(it.shard))
		for _, a := range k.ackKey {
			set.add(e, a)
		}
		if it.kind == bBegin {
			return nil
		}
		if len(it.reply) > e.o.MaxReplySize {
			return invalid("reply of %d bytes exceeds %d", len(it.reply), e.o.MaxReplySize)
		}
		if len(it.adv) > 0 {
			if it.wadv, it.keys, err = b.checkAdvances(it.adv, k.key); err != nil {
				return err
			}
			for _, a := range it.keys[1:] {
				set.add(e, a)
			}
		}
	case bCommit, bAbort:
		c := it.claim
		switch {
		case c == nil:
			return invalid("batch item %d: nil claim", i)
		case c.b != nil || c.ec.e != e:
			return invalid("batch item %d: the claim was not made by this engine (finish it with its own Commit or Abort)", i)
		case c.finished.Swap(true):
			return fmt.Errorf("%w: the claim was already committed or aborted", ErrLeaseLost)
		}
		it.swapped = true
		it.k = c.ec.k
		set.add(e, it.k.key)
		if it.kind == bAbort {
			it.reply = nil
			return nil
		}
		if it.reply == nil {
			it.reply = []byte{}
		}
		if len(it.reply) > e.o.MaxReplySize {
			it.reopen()
			return invalid("reply of %d bytes exceeds %d", len(it.reply), e.o.MaxReplySize)
		}
		if len(it.adv) > 0 {
			var err error
			if it.wadv, it.keys, err = b.checkAdvances(it.adv, it.k.key); err != nil {
				it.reopen()
				return err
			}
			for _, a := range it.keys[1:] {
				set.add(e, a)
			}
		}
	case bAck:
		if len(it.ids) == 0 {
			it.noop, it.resolved = true, true
			return nil
		}
		if len(it.scope) > e.o.MaxIDLen {
			return invalid("scope of %d bytes exceeds %d", len(it.scope), e.o.MaxIDLen)
		}
		it.keys = make([][]byte, 0, len(it.ids))
		for _, id := range it.ids {
			if len(id) == 0 || len(id) > e.o.MaxIDLen {
				return invalid("acked id of %d bytes (want 1..%d)", len(id), e.o.MaxIDLen)
			}
			it.keys = append(it.keys, index.EntryKey(nil, it.scope, index.ModeID, id))
		}
		for _, k := range it.keys {
			set.add(e, k)
		}
	case bAdvance:
		if len(it.adv) == 0 {
			it.noop, it.resolved = true, true
			return nil
		}
		var err error
		if it.wadv, it.keys, err = b.checkAdvances(it.adv, nil); err != nil {
			return err
		}
		for _, k := range it.keys {
			set.add(e, k)
		}
	}
	return nil
}

// reopen leaves the item's claim open: nothing of it was written.
func (it *batchItem) reopen() {
	if it.swapped {
		it.claim.finished.Store(false)
		it.swapped = false
	}
}

// reopenClaims reopens the claims of the Commit and Abort items from the
// from-th on, which nothing was written for.
func (b *engineBatch) reopenClaims(from int) {
	for i := from; i < len(b.items); i++ {
		b.items[i].reopen()
	}
}

// batchRun is one Run's work under the locks: the record being built and
// what the records appended so far need. The engine keeps them for reuse
// (getBatchRun): the index batch's key map and the record's buffer are
// sized for the batches seen.
type batchRun struct {
	e   *Engine
	b   *engineBatch
	out []BatchResult
	now time.Time

	bt *index.Batch // the record's transitions so far (over get)
	// reset says that bt holds an appended record: Reset it before use.
	reset bool
	// lastKey and lastSl are the key get looked up last and its slot.
	lastKey []byte
	lastSl  *slot
	// itemKey and itemSl are the key of the item being classified and its
	// slot once known (a Commit's or Abort's claim hands it on, a Begin's
	// or Put's first read finds it): get answers itemKey from itemSl
	// without probing the shard's table again (the overlay reads the key a
	// second time when the item's operation is added). nil: unknown.
	itemKey []byte
	itemSl  *slot
	// itemNone says that itemKey has no slot in itemShard's table:
	// getItem probed for it, so get installs one without probing again.
	itemNone bool
	// mark is the run's mark (Engine.batchMarks), which get leaves in
	// every slot it reads (slot.batch). Every key that the record being
	// built changed was read through get first (an item's own key by its
	// getItem, the other keys by their operations' transitions), and only
	// eviction takes a slot out of its table. So while no slot carrying
	// the mark was evicted since the run began (evicted false), a key
	// whose slot lacks the mark, or which has no slot, is one the record
	// has not changed: getItem reads it without looking it up among the
	// record's keys (index.Batch.GetUnchanged). A mark on a key the record
	// did not change (read and left as it was, or changed by a record the
	// run appended already) only costs that lookup.
	mark uint32
	// evicted says that a slot carrying the mark may have been evicted
	// since the run began: the slot of a key the record changed, whose
	// new slot would lack the mark. Then every item's key is looked up
	// among the record's. While a record is built only get installs slots
	// (and so evicts), and it notes when an install evicted a marked slot
	// (shard.markEvicted); publishing a record (flush) may evict too,
	// when a run is split into records (add).
	evicted bool
	// itemShard and itemTag are itemKey's shard and tag when known (nil:
	// get hashes the key).
	itemShard *shard
	itemTag   uint32
	buf       []byte    // wal.MaxBatchHeader reserved, then the record's operations
	nops      int       // operations in buf
	cost      int       // their wal.BatchCost
	ops       [2]wal.Op // the operations of the item being added
	// into are the entries that ops' claim or commit fill (nil: the
	// index batch allocates one); add hands them on and clears them.
	into [2]*index.Entry
	// items are the items with operations in the record being built.
	items []int
	// first is the first item not in an appended record.
	first int
	// st counts what the record being built does, added to the stats
	// once it is appended.
	st struct{ misses, takeovers, expired, acked, seq uint64 }

	lsns  []wal.LSN // the records appended, in order
	fatal error     // the error that stopped the run
	wake  []chan struct{}
}

// getBatchRun returns a batchRun for a batch of about n items.
func (e *Engine) getBatchRun(n int) *batchRun {
	r, ok := e.batchRuns.Get().(*batchRun)
	if ok {
		if r.reset {
			r.bt.Reset(0)
			r.reset = false
		}
	} else {
		r = &batchRun{e: e}
		r.bt = index.NewBatch(0, r.get, n)
		r.buf = make([]byte, wal.MaxBatchHeader, max(64<<10, wal.MaxBatchHeader))
	}
	if r.mark = e.batchMarks.Add(1); r.mark == 0 { // 0 is a new slot's
		r.mark = e.batchMarks.Add(1)
	}
	r.evicted = false
	return r
}

// putBatchRun keeps r for the next Run, holding nothing of this one.
func (e *Engine) putBatchRun(r *batchRun) {
	if cap(r.buf) > 2*batchRecordBytes {
		return
	}
	r.b, r.out, r.lastKey, r.lastSl, r.itemKey, r.itemSl, r.itemShard = nil, nil, nil, nil, nil, nil, nil
	r.buf = r.buf[:wal.MaxBatchHeader]
	r.nops, r.cost, r.first, r.fatal = 0, 0, 0, nil
	r.st = struct{ misses, takeovers, expired, acked, seq uint64 }{}
	r.items, r.lsns = r.items[:0], r.lsns[:0]
	clear(r.wake)
	r.wake = r.wake[:0]
	if r.bt.Len() > 0 { // abandoned: the operations added are dropped
		r.reset = true
	}
	e.batchRuns.Put(r)
}

// get is the table lookup that the run's index batch reads through (the
// key's shard is locked): it installs a slot with key's bytes as its
// key, since a key a batch reads is never changed (validate's,
// checkAdvances', an index.EntryKey or SeqKey the transitions made), and
// remembers it for the item being classified.
func (r *batchRun) get(key []byte, mode byte) (*index.Entry, error) {
	sl := r.itemSl
	if item := sameSlice(key, r.itemKey); sl == nil || sl.evicted || !item {
		sh, tag := r.itemShard, r.itemTag
		switch {
		case !item:
			sh, tag = r.e.keyTag(key)
		case sh == nil:
			sh, tag = r.e.keyTagOf(key, sl) // sl, when set, is key's (evicted)
		}
		sh.evictMark, sh.markEvicted = r.mark, false
		var err error
		if item && r.itemNone {
			r.itemNone = false
			sl, err = r.e.loadSlotLocked(sh, key, tag, true)
		} else {
			sl, err = r.e.slotLockedIn(sh, key, tag, true)
		}
		if err != nil {
			return nil, err
		}
		if sh.markEvicted { // installing sl evicted a slot the run read
			r.evicted = true
		}
	}
	sl.batch = r.mark
	r.lastKey, r.lastSl = key, sl
	return r.e.current(sl, mode), nil
}

// getItem returns the entry of item it's key as the batch so far leaves
// it, and notes the key's slot in it.sl when it is read from the table.
// The slot of a Commit's or Abort's claim, while not evicted (an
// in-flight slot never is, unless it was taken over), is the key's slot
// in its shard's table (only eviction takes a slot out): get takes it
// without a lookup.
func (r *batchRun) getItem(it *batchItem) (*index.Entry, error) {
	r.lastSl, r.itemKey, r.itemSl, r.itemShard, r.itemNone = nil, it.k.key, nil, nil, false
	if it.kind == bBegin || it.kind == bPut {
		r.itemShard, r.itemTag = &r.e.shards[it.shard], it.tag
	}
	if it.claim != nil && it.claim.ec.sl != nil && !it.claim.ec.sl.evicted {
		r.itemSl = it.claim.ec.sl
	}
	if sl := it.hintSlot(); sl != nil {
		r.itemSl = sl
	}
	var cur *index.Entry
	var err error
	if r.unchanged() {
		cur, err = r.bt.GetUnchanged(it.k.key, it.k.mode)
	} else {
		cur, err = r.bt.Get(it.k.key, it.k.mode)
	}
	if err == nil && r.lastSl != nil && sameSlice(r.lastKey, it.k.key) {
		it.sl = r.lastSl
		r.itemSl = it.sl
	}
	return cur, err
}

// unchanged says whether the record being built has certainly not
// changed the item's key (itemKey) yet, from the key's slot (see mark):
// the item's own (a claim's, a hint's), else the slot found by probing
// its shard's table, which it notes in itemSl (none: itemNone) so that
// get does not probe again. A Commit or Abort whose claim's slot was
// evicted is not known (false).
func (r *batchRun) unchanged() bool {
	if r.evicted {
		return false
	}
	sl := r.itemSl
	if sl == nil {
		if r.itemShard == nil {
			return false
		}
		if sl = r.itemShard.find(r.itemKey, r.itemTag); sl == nil {
			r.itemNone = true
			return true
		}
		r.itemSl = sl
	}
	return sl.batch != r.mark
}

// sameSlice says whether a and b are the same bytes in memory (keys are
// never changed once made, so the same slice is the same key).
func sameSlice(a, b []byte) bool {
	return len(a) == len(b) && len(a) > 0 && unsafe.SliceData(a) == unsafe.SliceData(b)
}

// item classifies item i against the batch so far and adds its
// operations to the record. It returns an error only when the run must
// stop (the current record cannot be built or appended).
func (r *batchRun) item(i int) error {
	e, it, res := r.e, &r.b.items[i], &r.out[i]
	it.resolved = true
	switch it.kind {
	case bBegin, bPut:
		cur, err := r.getItem(it)
		if err != nil {
			res.Err = err
			return nil
		}
		v, rr, verr, takeover, expired := e.classifyLocked(cur, it.k, it.fp, r.now, r.bt)
		switch v {
		case vDone:
			e.st.hits.Add(1)
			res.Result = rr
			r.waitCommit(it, cur)
		case vInFlight:
			e.st.collisions.Add(1)
			res.Result = rr
		case vConflict:
			e.st.conflicts.Add(1)
			res.Err = verr
		case vAlreadyCommitted:
			e.st.alreadyCommitted.Add(1)
			res.Result, res.Err = rr, verr
		case vGap:
			e.st.gaps.Add(1)
			res.Err = verr
		case vFailed:
			res.Err = verr
		}
		if v != vClaim {
			return nil
		}
		if len(it.wadv) > 0 {
			if err := e.advancesInFlightLocked(it.wadv, it.keys[1:], r.bt); err != nil {
				res.Err = err
				return nil
			}
		}
		it.lease, it.expires = e.claimOp(&r.ops[0], it.k, &it.req, it.fp, cur, r.now)
		n := 1
		if it.kind == bBegin {
			// The entry keeps its own copy of the fingerprint.
			r.ops[0].Fingerprint = bytes.Clone(r.ops[0].Fingerprint)
		} else {
			typ := wal.OpCommit
			if len(it.wadv) > 0 {
				typ = wal.OpCommitAdvance
			}
			// Claim LSN 0: the claim just before, in the same record.
			// The fingerprint's copy, which the claim and then its
			// commit keep, is made in the commit's allocation.
			en, fp := r.finishOp(&r.ops[1], typ, &it.k, 0, it.reply, r.ops[0].Fingerprint, it.wadv)
			r.ops[0].Fingerprint = fp
			// An id's claim with no acks is the record's only change
			// of its key: the commit right after it fills the claim's
			// entry in place (index.Batch), so that entry is the one
			// allocated with the reply. Otherwise (a client's claim,
			// acks before it) the commit's own entry is.
			if it.k.mode == index.ModeID && len(it.k.acked) == 0 {
				r.into[0] = en
			} else {
				r.into[1] = en
			}
			n = 2
			it.wake = takeover // the claim it took over may have waiters
		}
		if _, err := r.add(i, r.ops[:n], it.k.key, false); err != nil {
			return err
		}
		r.st.misses++
		if takeover {
			r.st.takeovers++
		}
		if expired {
			r.st.expired++
		}
		if it.kind == bPut || !e.o.RelaxedClaims {
			it.waitRec = it.rec
		}
	case bCommit, bAbort:
		cur, err := r.getItem(it)
		if err != nil {
			res.Err = err
			return nil
		}
		c := it.claim
		if cur == nil || !cur.InFlight || cur.ClaimLSN != c.ec.lsn {
			e.st.leaseLost.Add(1)
			res.Err = fmt.Errorf("%w: scope %q %s", ErrLeaseLost, it.k.scope, printable(it.k.ident))
			return nil
		}
		typ := wal.OpAbort
		if it.kind == bCommit {
			typ = wal.OpCommit
			if len(it.wadv) > 0 {
				var err error
				if it.wadv, err = r.raising(it.wadv, it.keys[1:]); err != nil {
					if errors.Is(err, ErrInFlight) {
						it.reopen()
					}
					res.Err = err
					return nil
				}
				if len(it.wadv) > 0 {
					typ = wal.OpCommitAdvance
				}
			}
		}
		if typ == wal.OpAbort {
			r.ops[0] = wal.Op{}
			setFinish(&r.ops[0], typ, &it.k, c.ec.lsn, r.now.UnixNano(), nil, nil)
		} else {
			r.into[0], _ = r.finishOp(&r.ops[0], typ, &it.k, c.ec.lsn, it.reply, nil, it.wadv)
		}
		if _, err := r.add(i, r.ops[:1], it.k.key, false); err != nil {
			return err
		}
		it.wake = true
		it.waitRec = it.rec
	case bAck:
		r.ops[0] = wal.Op{Type: wal.OpAck, Scope: it.scope, Acked: it.ids, Time: r.now.UnixNano()}
		kept, err := r.add(i, r.ops[:1], nil, true)
		if err != nil {
			return err
		}
		if kept {
			it.waitRec = it.rec
		} // else nothing to remove: nothing to log, nothing to wait for
	case bAdvance:
		if err := e.advancesInFlightLocked(it.wadv, it.keys, r.bt); err != nil {
			res.Err = err
			return nil
		}
		r.ops[0] = wal.Op{Type: wal.OpAdvance, Time: r.now.UnixNano(), Advances: it.wadv}
		kept, err := r.add(i, r.ops[:1], nil, true)
		if err != nil {
			return err
		}
		if kept {
			it.waitRec = it.rec
			return nil
		}
		// Nothing to raise: wait for the records that raised them.
		for _, k := range it.keys {
			en, err := r.bt.Get(k, index.ModeClient)
			if err != nil {
				res.Err = err
				return nil
			}
			r.waitCommit(it, en)
		}
	}
	return nil
}

// raising is advancesInFlightLocked for a Commit item's advances (their
// clients' keys locked), read through the run's overlay, and returns
// those that raise their client: an advance to a number at or below the
// client's changes nothing (index's advanceTransitions skips it), so the
// record leaves it out, a commit-advance none of whose advances raise
// being a plain commit. The state after the record, and after its replay,
// is the same; the record is smaller and applies faster. A batch that
// commits a stream's events in falling order of their offsets, each
// advancing the stream's client to its own (a stream sink's frontier),
// thus writes one advance per client per record: that of the highest
// commit that applies, whichever of them fail. adv is compacted in place
// (it is the item's own).
func (r *batchRun) raising(adv []wal.Advance, keys [][]byte) ([]wal.Advance, error) {
	n := 0
	for i, a := range adv {
		en, err := r.bt.Get(keys[i], index.ModeClient)
		if err != nil {
			return nil, err
		}
		if err := advanceInFlight(a, en); err != nil {
			return nil, err
		}
		if en != nil && en.Committed && en.Seq >= a.Seq {
			continue
		}
		adv[n] = a
		n++
	}
	return adv[:n], nil
}

// waitCommit makes item it wait for the record that committed en (a
// record appended before the run, or one of the run's: CommitLSN 0).
func (r *batchRun) waitCommit(it *batchItem, en *index.Entry) {
	switch {
	case en == nil || !en.Committed:
	case en.CommitLSN == 0:
		it.waitRec = len(r.lsns) // the record being built
	default:
		it.waitLSN = max(it.waitLSN, en.CommitLSN)
	}
}

// finishOp fills op with the commit or commit-advance (typ) of the claim
// claimLSN of key k, at the run's time, with a copy of reply made in one
// allocation with the entry it returns (newCommitEntry), for the op's
// transition to fill (into): the entry keeps the reply, in the table and
// then in the index, and the caller's buffer is the caller's again once
// Run returns. The copy's capacity is its length, and it shares its
// memory with its own entry only, which lives exactly as long as it. fp,
// when not nil, is a Put's fingerprint, which its claim in the same
// record takes: its copy (the one the committed entry keeps) is returned,
// made in the same allocation when it fits.
func (r *batchRun) finishOp(op *wal.Op, typ byte, k *reqKey, claimLSN wal.LSN, reply, fp []byte, adv []wal.Advance) (*index.Entry, []byte) {
	en, cp, fcp := newCommitEntry(reply, fp)
	*op = wal.Op{}
	setFinish(op, typ, k, claimLSN, r.now.UnixNano(), cp, adv)
	return en, fcp
}

// add adds ops, the operations of item i, to the record being built,
// first appending the record built so far when ops would take it past
// its bounds. With dropEmpty, operations that change nothing are left out
// (kept false). An error stops the run.
func (r *batchRun) add(i int, ops []wal.Op, key []byte, dropEmpty bool) (kept bool, err error) {
	into := r.into
	r.into = [2]*index.Entry{}
	mark := len(r.buf)
	cost := 0
	for j := range ops {
		if r.buf, err = wal.AppendBatchOp(r.buf, &ops[j]); err != nil {
			return false, err
		}
		cost += wal.BatchCost(&ops[j])
	}
	if r.nops > 0 && (len(r.buf)-wal.MaxBatchHeader > batchRecordBytes || r.cost+cost > wal.MaxBatchCost) {
		tail := append([]byte(nil), r.buf[mark:]...)
		r.buf = r.buf[:mark]
		if err := r.flush(i); err != nil {
			return false, err
		}
		r.bt.Reset(0)
		r.reset = false
		// Publishing the record may have installed slots and evicted
		// others, among them that of item i's key, which ops (a claim
		// of a key the index has not: no read) add to the new record.
		r.evicted = true
		r.buf = append(r.buf, tail...)
		mark = wal.MaxBatchHeader
	}
	changed := 0
	for j := range ops {
		step, err := r.bt.AddInto(&ops[j], key, into[j])
		if err != nil {
			return false, err
		}
		changed += len(step)
		a, s := removals(ops[j].Type, step)
		r.st.acked += a
		r.st.seq += s
	}
	if dropEmpty && changed == 0 {
		r.buf = r.buf[:mark]
		return false, nil
	}
	r.nops += len(ops)
	r.cost += cost
	r.b.items[i].rec = len(r.lsns)
	if len(r.items) == 0 || r.items[len(r.items)-1] != i {
		r.items = append(r.items, i)
	}
	return true, nil
}

// flush appends the record built so far (if it holds anything) and
// publishes it; next is the first item not in it.
func (r *batchRun) flush(next int) error {
	if r.nops == 0 {
		r.first = next
		return nil
	}
	e := r.e
	ts := r.bt.Transitions()
	var hb [wal.MaxBatchHeader]byte
	h := wal.AppendBatchHeader(hb[:0], r.now.UnixNano(), r.nops)
	payload := r.buf[wal.MaxBatchHeader-len(h):]
	copy(payload, h)
	lsn, err := e.appendRecordSlots(wal.OpBatch, payload, ts, r.slotsFor(ts))
	if err != nil {
		return err
	}
	r.lsns = append(r.lsns, lsn)
	e.st.misses.Add(r.st.misses)
	e.st.takeovers.Add(r.st.takeovers)
	e.st.expired.Add(r.st.expired)
	e.countRemovals(r.st.acked, r.st.seq)
	r.st = struct{ misses, takeovers, expired, acked, seq uint64 }{}
	for _, i := range r.items {
		it := &r.b.items[i]
		if !it.wake {
			continue
		}
		sl := it.sl
		if sl == nil || sl.evicted {
			sh, tag := e.keyTagOf(it.k.key, sl)
			sl = sh.find(it.k.key, tag)
		}
		if sl != nil && sl.waiters != nil {
			r.wake = append(r.wake, sl.waiters)
			sl.waiters = nil
		}
	}
	r.items = r.items[:0]
	r.buf = r.buf[:wal.MaxBatchHeader]
	r.nops, r.cost = 0, 0
	r.reset = true // Reset before the next item (none, mostly: then never)
	r.first = next
	return nil
}

// slotsFor returns the slots the items of the record hold for the keys of
// its transitions ts (nil where unknown), for appendRecordSlots. The
// transition of an item's own key mostly follows those of the items
// before it in order, so a cursor over the items finds it; a transition
// it does not find (a key an ack or advance changed first) is looked up.
func (r *batchRun) slotsFor(ts []index.Transition) []*slot {
	slots := make([]*slot, len(ts))
	c := 0
	for j := range ts {
		for look := c; look < len(r.items) && look < c+3; look++ {
			it := &r.b.items[r.items[look]]
			if it.sl != nil && sameSlice(ts[j].Key, it.k.key) {
				if !it.sl.evicted {
					slots[j] = it.sl
				}
				c = look + 1
				break
			}
		}
	}
	return slots
}

// abandon stops the run with err: the items not in an appended record
// get err, and their claims stay open (nothing of them was written).
func (r *batchRun) abandon(err error) {
	r.fatal = err
	for i := r.first; i < len(r.b.items); i++ {
		it := &r.b.items[i]
		if it.rec >= len(r.lsns) || !it.resolved {
			it.rec, it.waitRec, it.waitLSN, it.wake = -1, -1, 0, false
			it.reopen()
			r.out[i] = BatchResult{Err: err}
		} else if it.waitRec >= len(r.lsns) {
			r.out[i] = BatchResult{Err: err} // waits for the record that was not written
			it.waitRec = -1
		}
	}
}

// finish sets the results that need their record's LSN, waits for what
// the items need to be durable, and wakes the waiters of the claims the
// run finished.
func (r *batchRun) finish() {
	e := r.e
	// The claims of the Begin items come from one allocation (a slab)
	// rather than one each: a caller keeping some of them keeps the
	// slab's memory (~200 bytes a claim) until it drops them all, which
	// the batch's callers do together (a sink commits a fetched batch's
	// claims in one batch).
	nclaims := 0
	for i := range r.b.items {
		if it := &r.b.items[i]; it.kind == bBegin && it.rec >= 0 {
			nclaims++
		}
	}
	var claims []Claim
	if nclaims > 0 {
		claims = make([]Claim, nclaims)
	}
	var wait wal.LSN
	for i := range r.b.items {
		it := &r.b.items[i]
		if it.waitRec >= 0 {
			it.waitLSN = max(it.waitLSN, r.lsns[it.waitRec])
		}
		wait = max(wait, it.waitLSN)
		if it.rec < 0 {
			continue
		}
		switch it.kind {
		case bBegin:
			c := &claims[0]
			claims = claims[1:]
			// sl: nil, or the key's slot when the run read it (write checks evicted).
			c.ec = engineClaim{e: e, k: it.k, lsn: r.lsns[it.rec], sl: it.sl}
			c.leaseUntil = it.lease
			r.out[i].Result = Result{Status: Fresh, Claim: c, LeaseUntil: it.lease, Seq: it.k.seq, ExpiresAt: it.expires}
		case bPut:
			r.out[i].Result = Result{Status: Fresh, LeaseUntil: it.lease, Seq: it.k.seq, ExpiresAt: it.expires}
		}
	}
	if wait != 0 {
		if err := e.waitDurable(wait); err != nil {
			// Tell each item whether its own record is durable.
			for i := range r.b.items {
				if lsn := r.b.items[i].waitLSN; lsn != 0 {
					if err := e.waitDurable(lsn); err != nil {
						r.out[i] = BatchResult{Err: err}
					}
				}
			}
		}
	}
	for _, ch := range r.wake {
		close(ch)
	}
}

// shardSet is a set of lock shards.
type shardSet [numShards / 64]uint64

func (s *shardSet) add(e *Engine, key []byte) { s.addShard(e.shardIdx(key)) }

// addShard adds shard i.
func (s *shardSet) addShard(i int) { s[i/64] |= 1 << (i % 64) }

// lockShards locks the shards of set in index order, as lockKeys does (so
// a batch never deadlocks with another operation), and returns the unlock
// function.
func (e *Engine) lockShards(set *shardSet) func() {
	for w, bits := range set {
		for ; bits != 0; bits &= bits - 1 {
			e.shards[w*64+mbits.TrailingZeros64(bits)].mu.Lock()
		}
	}
	return func() {
		for w := len(set) - 1; w >= 0; w-- {
			for bits := set[w]; bits != 0; {
				top := 63 - mbits.LeadingZeros64(bits)
				e.shards[w*64+top].mu.Unlock()
				bits &^= 1 << top
			}
		}
	}
}
