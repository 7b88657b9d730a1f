package idem

import (
	"context"
	"errors"
	"fmt"
	"github.com/idemdb/idem/internal/cmem"
	"time"

	"github.com/idemdb/idem/compaction"
	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
)

// CompactStats describe one compaction.
type CompactStats struct {
	// EntriesRemoved counts replies and abandoned claims removed from the
	// index (acks, forget, retention, eviction) since the previous
	// compaction.
	EntriesRemoved  uint64
	SegmentsRemoved int
	// BytesReclaimed is the WAL bytes removed plus the shrinkage of the
	// index's sstables (measured after the flush, so memtables written out
	// do not count against it).
	BytesReclaimed int64
	DurableLSN     uint64 // the index is durable through this LSN
	Snapshot       string // on-disk snapshot written, if any
	Duration       time.Duration
}

// Compact bounds the disk now: it appends the retention and capacity
// forget records that are due (so expired and evicted entries leave the
// index), makes the index durable, writes an on-disk snapshot (unless
// Options.KeepSnapshots < 0), removes WAL segments the index no longer
// needs and compacts Pebble where removals left tombstones. It also runs in
// the background every Options.CompactInterval. Safe to call concurrently
// with everything; compactions run one at a time.
func (e *Engine) Compact(ctx context.Context) (CompactStats, error) {
	e.compactMu.Lock()
	defer e.compactMu.Unlock()
	if err := e.retire(ctx); err != nil {
		return CompactStats{}, err
	}
	if err := e.enter(); err != nil {
		return CompactStats{}, err
	}
	defer e.leave()
	removedBefore := e.ix.Forgotten() + e.st.acked.Load() + e.st.ttlRemoved.Load()
	// The entry range is rewritten whole by a manual compaction: only once
	// removals since the last one are a quarter of the set, so its cost is
	// amortized over them (Pebble's own compactions drop tombstones too).
	pendingRemovals := e.removedSinceEntryCompact + (removedBefore - e.lastRemoved)
	compactEntries := pendingRemovals > 0 && int64(pendingRemovals) >= e.ix.Count()/4
	cfg := compaction.Config{
		Index:          e.ix,
		WAL:            e.w,
		WaitApplied:    e.waitApplied,
		CompactIndex:   true,
		CompactEntries: compactEntries,
	}
	if e.o.KeepSnapshots > 0 {
		cfg.WriteSnapshot = e.writeDiskSnapshot
	}
	st, err := compaction.Run(ctx, cfg)
	removed := e.ix.Forgotten() + e.st.acked.Load() + e.st.ttlRemoved.Load()
	out := CompactStats{
		EntriesRemoved:  removed - e.lastRemoved,
		SegmentsRemoved: st.SegmentsRemoved,
		BytesReclaimed:  st.WALBytesRemoved + max(0, int64(st.IndexBytesBefore)-int64(st.IndexBytesAfter)),
		DurableLSN:      uint64(st.DurableLSN),
		Snapshot:        st.Snapshot,
		Duration:        st.Duration,
	}
	if err != nil {
		// ErrFailed only when the engine did stop (the WAL or the index
		// failed); a snapshot that could not be written, or a cancelled
		// context, leaves it serving, and the error says so.
		if e.failed.Load() != nil || errors.Is(err, wal.ErrFailed) || errors.Is(err, wal.ErrClosed) || errors.Is(err, index.ErrBackground) {
			return out, e.failure(err)
		}
		return out, fmt.Errorf("idem: compaction did not finish (the engine goes on): %w", err)
	}
	if compactEntries {
		e.removedSinceEntryCompact = removed - removedBefore // applied during the run
	} else {
		e.removedSinceEntryCompact += removed - e.lastRemoved
	}
	e.lastRemoved = removed
	e.walAfterCompact.Store(e.w.Stats().Bytes)
	e.o.Logger.Debug("idem: compaction", "entries_removed", out.EntriesRemoved, "segments_removed", out.SegmentsRemoved,
		"bytes_reclaimed", out.BytesReclaimed, "durable_lsn", out.DurableLSN, "duration", out.Duration)
	return out, nil
}

// expireBatch bounds the keys named by one expire record (about 40 KiB
// of record for 16-byte ids).
const expireBatch = 1024

// CleanupExpired removes every entry whose per-request TTL (Request.TTL) has
// run out, by logged expire records (so replay removes them too), and
// returns how many it removed. The periodic cleanup (every
// Options.CleanupInterval) and Compact call it; an expired entry already
// behaves as gone before that, so calling it only frees storage sooner.
// Durable when it returns (SyncAlways).
func (e *Engine) CleanupExpired(ctx context.Context) (int, error) {
	if err := e.enter(); err != nil {
		return 0, err
	}
	defer e.leave()
	now := e.o.Clock()
	removed := 0
	var from []byte
	for {
		if err := ctx.Err(); err != nil {
			return removed, err
		}
		keys, next, err := e.ix.ExpiredKeys(now.UnixNano(), from, expireBatch)
		if err != nil {
			return removed, e.failure(err)
		}
		if len(keys) > 0 {
			n, err := e.expireKeys(keys, now)
			removed += n
			if err != nil {
				return removed, err
			}
		}
		if next == nil {
			break
		}
		from = next
	}
	if removed > 0 {
		e.o.Logger.Info("idem: TTL cleanup removed expired entries", "count", removed)
	}
	return removed, nil
}

// expireKeys appends one expire record for those of keys whose TTL ran out
// before now, deciding under their locks, and waits for it.
func (e *Engine) expireKeys(keys [][]byte, now time.Time) (int, error) {
	unlock := e.lockKeys(keys...)
	var due [][]byte
	seen := make(map[string]bool, len(keys))
	for _, k := range keys {
		if seen[string(k)] {
			continue
		}
		seen[string(k)] = true
		sl, err := e.slotLocked(k)
		if err != nil {
			unlock()
			return 0, err
		}
		_, mode, _, err := index.ParseEntryKey(k)
		if err != nil {
			unlock()
			return 0, wrapCorrupt(err)
		}
		cur := e.current(sl, mode)
		if cur.HasExpiryKey() && cur.ExpiresAt < now.UnixNano() {
			due = append(due, k)
		}
	}
	if len(due) == 0 {
		unlock()
		return 0, nil
	}
	op := &wal.Op{Type: wal.OpExpire, Keys: due, Time: now.UnixNano()}
	ts, err := index.Transitions(op, 0, e.getLocked)
	if err != nil {
		unlock()
		return 0, err
	}
	lsn, err := e.appendOp(op, ts)
	unlock()
	if err != nil {
		return 0, err
	}
	e.st.ttlRemoved.Add(uint64(len(ts)))
	return len(ts), e.waitDurable(lsn)
}

// retire appends the forget records that retention and capacity call for,
// and the expire records of per-request TTLs.
func (e *Engine) retire(ctx context.Context) error {
	if _, err := e.CleanupExpired(ctx); err != nil {
		return err
	}
	if e.o.Retention > 0 {
		before := e.o.Clock().Add(-e.o.Retention).UnixNano()
		if before > e.mark.Load().Before {
			n0 := e.ix.Forgotten()
			if err := e.forget(ctx, before, wal.ForgetRetention); err != nil {
				return err
			}
			// Logged like the TTL cleanup: the replies the forget record
			// removed once the index applied it.
			if err := e.waitApplied(ctx, e.w.SyncedLSN()); err != nil {
				return err
			}
			if n := e.ix.Forgotten() - n0; n > 0 {
				e.o.Logger.Info("idem: retention cleanup removed expired entries", "count", n)
			}
		}
	}
	return e.evict(ctx)
}

// evict appends a capacity forget record when more than MaxEntries replies
// are kept: it removes the oldest ones, down to MaxEntries (entries
// committed in the same nanosecond as the cut go together).
func (e *Engine) evict(ctx context.Context) error {
	if e.o.MaxEntries <= 0 {
		return nil
	}
	if err := e.waitApplied(ctx, e.w.SyncedLSN()); err != nil {
		return err
	}
	over := e.ix.Replies() - e.o.MaxEntries
	if over <= 0 {
		return nil
	}
	t, ok, err := e.ix.NthOldest(over)
	if err != nil || !ok {
		return err
	}
	return e.forget(ctx, t+1, wal.ForgetCapacity)
}

// waitApplied blocks until the index has applied lsn (or ctx ends, or the
// engine fails).
func (e *Engine) waitApplied(ctx context.Context, lsn wal.LSN) error {
	for e.ix.Applied() < lsn {
		if f := e.failed.Load(); f != nil {
			return *f
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
	return nil
}

// memoryTrimInterval is how often maintenance returns the C heap's free
// pages to the OS (internal/cmem).
const memoryTrimInterval = 5 * time.Second

// maintenance runs retention, eviction, compaction and the C heap trim in
// the background.
func (e *Engine) maintenance() {
	defer e.bg.Done()
	cleanup := time.NewTicker(e.o.CleanupInterval)
	defer cleanup.Stop()
	compact := time.NewTicker(e.o.CompactInterval)
	defer compact.Stop()
	grown := time.NewTicker(time.Second)
	defer grown.Stop()
	var trimC <-chan time.Time
	if !e.o.NoMemoryTrim {
		trim := time.NewTicker(memoryTrimInterval)
		defer trim.Stop()
		trimC = trim.C
	}
	ixFailed := e.ix.Failed()
	for {
		var err error
		select {
		case <-e.stopBg:
			return
		case <-ixFailed:
			// Pebble failed in the background (a full or failing disk):
			// stop now rather than at the next write.
			ixFailed = nil
			ferr := fmt.Errorf("%w: %w", ErrFailed, e.ix.Failure())
			if e.failed.CompareAndSwap(nil, &ferr) {
				e.o.Logger.Error("idem: the index failed in the background; the engine stops (reopen to recover from the WAL)", "err", ferr)
			}
			continue
		case <-cleanup.C:
			e.compactMu.Lock()
			err = e.retire(context.Background())
			e.compactMu.Unlock()
		case <-e.evictC:
			e.compactMu.Lock()
			err = e.evict(context.Background())
			e.compactMu.Unlock()
		case <-compact.C:
			_, err = e.Compact(context.Background())
		case <-trimC:
			t0 := time.Now()
			if !cmem.Trim() {
				trimC = nil // no malloc_trim here
			}
			e.o.Logger.Debug("idem: returned the C heap's free memory", "took", time.Since(t0))
		case <-grown.C:
			if e.o.CompactWALBytes > 0 && e.w.Stats().Bytes-e.walAfterCompact.Load() > e.o.CompactWALBytes {
				_, err = e.Compact(context.Background())
			}
		}
		if err != nil && !errors.Is(err, ErrClosed) {
			e.o.Logger.Warn("idem: background maintenance failed", "err", err)
		}
	}
}
