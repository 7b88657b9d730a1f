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
	// The records of several keys (batches) are unpinned one transition at
	// a time, and the shard of each evicts past its share: the slots that a
	// batch's run or LookupHint installed left that eviction to the applier
	// (installForBatchLocked).
	for _, u := range batch {
		if u.slot != nil {
			continue // unpinned above
		}
		for i, t := range u.Transitions {
			var sh *shard
			if u.slots != nil && u.slots[i] != nil {
				sl := u.slots[i]
				sh = sl.sh // key's shard
				sh.mu.Lock()
				if !sl.evicted {
					if sl.dirty == u.LSN {
						sl.dirty = 0
					}
					e.evictLocked(sh, nil)
					sh.mu.Unlock()
					continue
				}
			} else {
				sh = e.shardOf(t.Key)
				sh.mu.Lock()
			}
			if sl := sh.m[string(t.Key)]; sl != nil && sl.dirty == u.LSN {
				sl.dirty = 0
			}
			e.evictLocked(sh, nil)
			sh.mu.Unlock()
		}
	}
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
}

// unpinRec is a slot to unpin if it still carries lsn, its record's LSN.
type unpinRec struct {
	sl  *slot
	lsn wal.LSN
}

// unpinSlots unpins the slots of the records of one key in batch (those
// with u.slot: claims, commits, aborts), applied to the index: a slot
// whose newest change is that record is clean (evictable unless in flight
// or waited on). They are grouped by shard (a counting sort), so that
// each shard's lock is taken once per batch rather than once per record:
// at hundreds of callers a batch holds thousands of records over the 256
// shards, whose locks the callers contend for.
func (e *Engine) unpinSlots(batch []*pinnedUpdate, us *unpinScratch) {
	n := 0
	for _, u := range batch {
		if u.slot != nil {
			us.next[u.slot.sh.idx+1]++
			n++
		}
	}
	if n == 0 {
		return
	}
	for i := 1; i <= numShards; i++ {
		us.next[i] += us.next[i-1] // next[i]: where shard i's records start
	}
	us.recs = slices.Grow(us.recs[:0], n)[:n]
	for _, u := range batch {
		if sl := u.slot; sl != nil {
			us.recs[us.next[sl.sh.idx]] = unpinRec{sl: sl, lsn: u.LSN}
			us.next[sl.sh.idx]++
		}
	}
	// Now next[i] is where shard i's records end (and shard i+1's start).
	start := int32(0)
	for i := range numShards {
		end := us.next[i]
		if end == start {
			continue
		}
		sh := &e.shards[i]
		sh.mu.Lock()
		for _, r := range us.recs[start:end] {
			if r.sl.dirty == r.lsn {
				r.sl.dirty = 0
			}
		}
		sh.mu.Unlock()
		start = end
	}
	clear(us.next[:])
	clear(us.recs) // the slots may be evicted: hold no pointer to them
}
