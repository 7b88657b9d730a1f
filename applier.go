package idem

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
)

// applyBatch is what one fsync made durable, for the applier: the updates
// and the backlog bytes they hold (released once applied).
type applyBatch struct {
	ups   []*pinnedUpdate
	bytes int64
}

// onSynced runs on the WAL's sync goroutine: hand the records it made
// durable to the applier, in order. While the applier is behind by the
// backlog's bound, it waits: the sync goroutine held back holds back the
// callers waiting for durability, which bounds the memory of records not
// yet applied (their updates, and the entries they pin in the table).
// The applier takes shard locks to unpin what it applied, so nothing may
// wait for durability (or for the applier) while holding a shard lock:
// that would stop the three of them (TestClientStateWhileApplierBehind).
func (e *Engine) onSynced(recs []wal.Synced) {
	ups := make([]*pinnedUpdate, 0, len(recs))
	var n int64
	for _, r := range recs {
		switch u := r.Value.(type) {
		case *pinnedUpdate: // appendRecord's
			ups = append(ups, u)
			n += u.mem
		case *index.Update: // Forget's
			if u != nil {
				ups = append(ups, &pinnedUpdate{Update: *u})
				n += u.MemSize()
			}
		}
	}
	if len(ups) == 0 {
		return
	}
	n = min(n, e.backlogCap) // a batch larger than the bound goes alone
	// The applier releases what it applied whatever happens (it keeps
	// draining after a failure, and Close closes the channel only after
	// the WAL delivered its last batch), so this wait ends.
	_ = e.backlog.Acquire(context.Background(), n)
	e.backlogBytes.Add(n)
	e.applyCh <- applyBatch{ups: ups, bytes: n}
}

// applier writes durable records into the index, in LSN order, and then
// unpins the slots they changed.
func (e *Engine) applier() {
	defer close(e.applyDone)
	var (
		batch []*pinnedUpdate
		ups   []*index.Update // batch's updates, for the index
		us    unpinScratch    // applyBatch's grouping of slots by shard
		held  int64           // backlog bytes of batch
		open  = true          // applyCh is not closed
	)
	// drain takes what is waiting in applyCh, without blocking.
	drain := func() {
		for open && len(batch) < applyBatchMax {
			select {
			case more, ok := <-e.applyCh:
				if !ok {
					open = false
					return
				}
				batch = append(batch, more.ups...)
				held += more.bytes
			default:
				return
			}
		}
	}
	gather := time.NewTimer(applyGather)
	gather.Stop()
	for open {
		first, ok := <-e.applyCh
		if !ok {
			return
		}
		batch = append(batch[:0], first.ups...)
		held = first.bytes
		// Gather for a little while: a claim and its commit usually arrive
		// within a few fsyncs of each other, and applying them in one batch
		// writes the entry once instead of twice (and never writes its
		// in-doubt row). The slots stay pinned in memory meanwhile. The
		// applier sleeps meanwhile rather than receiving each fsync's
		// records as they come: one wakeup per batch, not one per fsync.
		// Close (stopBg) ends the wait.
		drain()
		if open && len(batch) < applyBatchMax {
			gather.Reset(applyGather)
			select {
			case <-gather.C:
			case <-e.stopBg:
				gather.Stop()
			}
			drain()
		}
		ups = e.applyBatch(batch, ups, &us)
		clear(batch)
		e.backlogBytes.Add(-held)
		e.backlog.Release(held)
	}
}

// applyBatch applies durable records to the index and unpins the slots
// they changed. After a failure it does nothing: the applier keeps
// draining so that the WAL never blocks.
func (e *Engine) applyBatch(batch []*pinnedUpdate, ups []*index.Update, us *unpinScratch) []*index.Update {
	if e.failed.Load() != nil {
		return ups
	}
	ups = ups[:0]
	for _, u := range batch {
		ups = append(ups, &u.Update)
	}
	err := e.ix.Apply(ups)
	clear(ups) // the updates go once applied
	if err != nil {
		err = fmt.Errorf("%w: applying to the index: %w", ErrFailed, err)
		e.failed.Store(&err)
		e.o.Logger.Error("idem: index apply failed; the engine stops accepting writes", "err", err)
		return ups
	}
	e.unpinSlots(batch, us)
	if e.o.MaxEntries > 0 && e.ix.Replies() > e.o.MaxEntries {
		select {
		case e.evictC <- struct{}{}:
		default:
		}
	}
	return ups
}

// payloadPool holds record encoding buffers (see appendOp).

// unpinScratch is the applier's reusable memory for unpinSlots.
type unpinScratch struct {
	// next[i] is, while unpinSlots places the records, where shard i's
	// next one goes in recs (counted one place ahead, then summed).
	next [numShards + 1]int32
	recs []unpinRec
	tmp  []unpinRec // the records in batch order, before the sort
}

// unpinRec is a slot to unpin if it still carries lsn, its record's LSN:
// sl, or (a batch record's transition whose slot was not known, or was
// evicted since) the slot of key in its shard's table. batch says that the
// record was a batch's, whose slots the applier evicts past the shard's
// share (installForBatchLocked left that to it).
type unpinRec struct {
	sl    *slot
	key   []byte
	lsn   wal.LSN
	tag   uint32 // key's tag (keyTag), when sl is nil
	shard uint16
	batch bool
}

// unpinSlots unpins the slots of the records in batch, applied to the
// index: a slot whose newest change is that record is clean (evictable
// unless in flight or waited on). The slots are grouped by shard (a
// counting sort), so that each shard's lock is taken once per batch
// rather than once per record or per transition: at hundreds of callers a
// batch holds thousands of records over the 256 shards, whose locks the
// callers contend for, and a batch record's transitions spread over all of
// them. A shard that a batch record's transitions reached then evicts past
// its share, once it unpinned them all (as many passes as it got
// transitions, while it stays over its share).
func (e *Engine) unpinSlots(batch []*pinnedUpdate, us *unpinScratch) {
	us.tmp = us.tmp[:0]
	for _, u := range batch {
		if u.slot != nil {
			us.tmp = append(us.tmp, unpinRec{sl: u.slot, lsn: u.LSN, shard: uint16(u.slot.shard)})
			continue
		}
		for i := range u.Transitions {
			r := unpinRec{lsn: u.LSN, batch: true}
			if u.slots != nil && u.slots[i] != nil {
				r.sl = u.slots[i]
				r.shard = uint16(r.sl.shard) // the key's shard, evicted or not
			} else {
				sh, tag := e.keyTag(u.Transitions[i].Key)
				r.shard, r.tag = uint16(sh.idx), tag
			}
			r.key = u.Transitions[i].Key
			us.tmp = append(us.tmp, r)
		}
	}
	n := len(us.tmp)
	if n == 0 {
		return
	}
	for i := range us.tmp {
		us.next[us.tmp[i].shard+1]++
	}
	for i := 1; i <= numShards; i++ {
		us.next[i] += us.next[i-1] // next[i]: where shard i's records start
	}
	us.recs = slices.Grow(us.recs[:0], n)[:n]
	for _, r := range us.tmp {
		us.recs[us.next[r.shard]] = r
		us.next[r.shard]++
	}
	clear(us.tmp) // hold no pointer to slots or keys
	// Now next[i] is where shard i's records end (and shard i+1's start).
	start := int32(0)
	for i := range numShards {
		end := us.next[i]
		if end == start {
			continue
		}
		sh := &e.shards[i]
		evict := 0
		sh.mu.Lock()
		for _, r := range us.recs[start:end] {
			sl := r.sl
			if r.batch {
				evict++
				if sl == nil || sl.evicted {
					// Unknown, or evicted and so no longer the key's.
					tag := r.tag
					if sl != nil {
						tag = sl.tag
					}
					sl = sh.find(r.key, tag)
				}
			}
			if sl != nil && sl.dirty == r.lsn {
				sl.dirty = 0
			}
		}
		limit := e.o.CacheSize / numShards
		for ; evict > 0 && sh.bytes > limit; evict-- {
			e.evictLocked(sh, nil)
		}
		sh.mu.Unlock()
		start = end
	}
	clear(us.next[:])
	clear(us.recs) // the slots may be evicted: hold no pointer to them
}
