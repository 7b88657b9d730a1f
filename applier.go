package idem

import (
	"context"
	"fmt"
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
		ups = e.applyBatch(batch, ups)
		clear(batch)
		e.backlogBytes.Add(-held)
		e.backlog.Release(held)
	}
}

// applyBatch applies durable records to the index and unpins the slots
// they changed. After a failure it does nothing: the applier keeps
// draining so that the WAL never blocks.
func (e *Engine) applyBatch(batch []*pinnedUpdate, ups []*index.Update) []*index.Update {
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
	for _, u := range batch {
		if sl := u.slot; sl != nil {
			sl.sh.mu.Lock()
			if sl.dirty == u.LSN {
				sl.dirty = 0
				sl.sh.queueClean(sl)
			}
			sl.sh.mu.Unlock()
			continue
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
						sh.queueClean(sl)
					}
					sh.mu.Unlock()
					continue
				}
			} else {
				sh = e.shardOf(t.Key)
				sh.mu.Lock()
			}
			if sl := sh.m[string(t.Key)]; sl != nil && sl.dirty == u.LSN {
				sl.dirty = 0
				sh.queueClean(sl)
			}
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
