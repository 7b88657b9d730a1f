// Package compaction keeps idem's disk bounded. One run:
//
//  1. waits until the index has applied every fsynced WAL record;
//  2. flushes Pebble, so that the index's applied LSN is durable in its
//     sstables (Pebble's WAL is off: until a flush, the index lives in
//     memtables and the WAL is what recovers it);
//  3. optionally (opt-in: a full copy of the live set each time) writes an
//     on-disk snapshot of the index, a second copy that recovery can start
//     from if the index is lost, and prunes old ones;
//  4. removes the WAL segments whose every record is now durable in the
//     index and, when snapshots are kept, covered by the oldest kept
//     snapshot too: if the index is lost and the newest snapshot is
//     corrupt, recovery falls back to the older one and replays the WAL
//     from there (as Kafka does with producer-state snapshots);
//  5. compacts Pebble over the time index below a forget mark that moved,
//     and over the entries when removals since the last time are a large
//     part of the set, so their space comes back now.
//
// Without snapshots, a run costs what changed since the previous one: the
// flush writes the pending updates and memtables, the WAL removal deletes
// files, and the entry range is compacted only after removals of at least a
// quarter of the set (amortized over them).
//
// It is one of idem's building blocks (with packages wal, index and
// snapshot), published as Pebble publishes its record and sstable
// packages: the engine, package idem, composes them. Applications use
// package idem (Engine.Compact, Options.CompactInterval).
//
// Removing dead entries themselves is not compaction's job: acks and forget
// records (admin, retention, capacity) remove entries when they are applied,
// through the time index with range deletes, so the index never needs a
// scan of everything. Every step is crash safe on its own: a crash between
// any two leaves a state that Open recovers to the same dedup set.
package compaction

import (
	"context"
	"fmt"
	"time"

	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
)

// Config is what a run works on.
type Config struct {
	Index *index.Index
	WAL   *wal.WAL
	// WaitApplied blocks until the index has applied lsn.
	WaitApplied func(ctx context.Context, lsn wal.LSN) error
	// WriteSnapshot, if non-nil, writes an on-disk snapshot of img and
	// prunes old ones; it returns the new file, how many were removed and
	// the LSN of the oldest snapshot kept.
	WriteSnapshot func(ctx context.Context, img *index.Image) (path string, pruned int, oldest wal.LSN, err error)
	// CompactIndex asks for a Pebble compaction of the removed ranges;
	// CompactEntries includes the whole entry range.
	CompactIndex, CompactEntries bool
}

// Stats describe one run.
type Stats struct {
	DurableLSN       wal.LSN // applied LSN made durable in the index by the flush
	SegmentsRemoved  int
	WALBytesRemoved  int64
	IndexBytesBefore uint64
	IndexBytesAfter  uint64
	Snapshot         string // on-disk snapshot written, if any
	SnapshotsPruned  int
	Duration         time.Duration
}

// Run performs one compaction.
func Run(ctx context.Context, c Config) (Stats, error) {
	start := time.Now()
	var st Stats
	if err := c.WaitApplied(ctx, c.WAL.SyncedLSN()); err != nil {
		return st, err
	}
	// Everything applied before the flush starts is in the flushed
	// memtables, the applied LSN row included.
	durable := c.Index.Applied()
	if err := c.Index.Flush(); err != nil {
		return st, fmt.Errorf("compaction: flush index: %w", err)
	}
	st.DurableLSN = durable
	st.IndexBytesBefore = c.Index.DiskUsage()
	through := durable
	if c.WriteSnapshot != nil {
		img, err := c.Index.Image()
		if err != nil {
			return st, fmt.Errorf("compaction: snapshot: %w", err)
		}
		path, pruned, oldest, err := c.WriteSnapshot(ctx, img)
		img.Close()
		if err != nil {
			return st, fmt.Errorf("compaction: snapshot: %w", err)
		}
		st.Snapshot, st.SnapshotsPruned = path, pruned
		through = min(through, oldest)
	}
	n, bytes, err := c.WAL.RemoveSegmentsThrough(through)
	st.SegmentsRemoved, st.WALBytesRemoved = n, bytes
	if err != nil {
		return st, fmt.Errorf("compaction: remove WAL segments through LSN %d: %w", through, err)
	}
	if c.CompactIndex {
		if err := c.Index.CompactRemoved(ctx, c.CompactEntries); err != nil {
			return st, err
		}
	}
	st.IndexBytesAfter = c.Index.DiskUsage()
	st.Duration = time.Since(start)
	return st, nil
}
