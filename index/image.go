package index

import (
	"context"
	"errors"
	"fmt"

	"github.com/cockroachdb/pebble/v2"
	"github.com/idemdb/idem/wal"
)

// Image is a consistent point-in-time view of the index: every record up to
// LSN applied, nothing after.
type Image struct {
	ix   *Index
	snap *pebble.Snapshot
	LSN  wal.LSN
	Mark Mark
}

// Image takes a point-in-time view. Writes go on meanwhile; Close it soon,
// since it pins the Pebble state it sees.
func (ix *Index) Image() (*Image, error) {
	ix.applyMu.Lock()
	defer ix.applyMu.Unlock()
	if err := ix.persistLocked(); err != nil {
		return nil, err
	}
	// NewSnapshot and Snapshot.Close take Pebble's DB.mu, which a
	// goroutine parked by Fatalf may hold for good: guarded.
	var snap *pebble.Snapshot
	if err := ix.guard(func() error { snap = ix.db.NewSnapshot(); return nil }); err != nil {
		return nil, err
	}
	return &Image{ix: ix, snap: snap, LSN: ix.Applied(), Mark: ix.Mark()}, nil
}

// Entries calls fn for every entry of the image in key order. The key and
// value are only valid during the call.
func (im *Image) Entries(fn func(key, value []byte) error) error {
	it, err := im.snap.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixEntry}, UpperBound: []byte{prefixEntry + 1}})
	if err != nil {
		return err
	}
	defer it.Close()
	for ok := it.First(); ok; ok = it.Next() {
		v, err := it.ValueAndErr()
		if err != nil {
			return err
		}
		if err := fn(it.Key(), v); err != nil {
			return err
		}
	}
	return it.Error()
}

// Close releases the image. After a failure in Pebble's background work it
// returns that failure without waiting for Pebble (the snapshot is then
// left to the stopped store).
func (im *Image) Close() error { return im.ix.guard(im.snap.Close) }

// ErrNotEmpty is returned by Load into an index that holds entries.
var ErrNotEmpty = errors.New("index: not empty")

// Load fills an empty index with entries read from next (until it returns
// ok=false), records lsn as applied and m as the forget mark. It builds the
// time and in-doubt indexes and the counts. Used to restore a snapshot.
func (ix *Index) Load(lsn wal.LSN, m Mark, next func() (key, value []byte, ok bool, err error)) error {
	ix.applyMu.Lock()
	defer ix.applyMu.Unlock()
	if ix.Applied() != 0 || ix.Count() != 0 {
		return fmt.Errorf("%w: applied LSN %d, %d entries", ErrNotEmpty, ix.Applied(), ix.Count())
	}
	var count, replies int64
	ix.memDirty = true // batches follow: they must be flushed before any ingest
	b := ix.db.NewBatch()
	defer func() { b.Close() }()
	var kb []byte
	for {
		k, v, ok, err := next()
		if err != nil {
			return err
		}
		if !ok {
			break
		}
		if _, _, _, err := ParseEntryKey(k); err != nil {
			return fmt.Errorf("%w: %v", ErrCorrupt, err)
		}
		e, err := DecodeEntry(v)
		if err != nil {
			return fmt.Errorf("%w: key %x: %v", ErrCorrupt, k, err)
		}
		ix.filterAddLocked(k)
		if err := b.Set(k, v, nil); err != nil {
			return err
		}
		count++
		if e.HasTimeKey() {
			replies++
			kb = timeKey(kb[:0], e.CommitTime, k)
			if err := b.Set(kb, nil, nil); err != nil {
				return err
			}
		}
		if e.HasExpiryKey() {
			kb = expiryKey(kb[:0], e.ExpiresAt, k)
			if err := b.Set(kb, nil, nil); err != nil {
				return err
			}
		}
		if e.InFlight {
			kb = inDoubtKey(kb[:0], k)
			if err := b.Set(kb, nil, nil); err != nil {
				return err
			}
		}
		if b.Len() > 4<<20 {
			if err := b.Commit(pebble.NoSync); err != nil {
				return err
			}
			b.Close()
			b = ix.db.NewBatch()
		}
	}
	if err := ix.putMeta(b, lsn, count, replies, &m); err != nil {
		return err
	}
	if err := b.Commit(pebble.NoSync); err != nil {
		return err
	}
	ix.count.Store(count)
	ix.replies.Store(replies)
	ix.mark.Store(&m)
	ix.applied.Store(uint64(lsn))
	if err := ix.flushMemtables(); err != nil {
		return err
	}
	ix.memDirty = false
	return nil
}

// NthOldest returns the commit time of the k-th oldest kept reply (k >= 1),
// walking k rows of the time index: the cost is what eviction removes.
func (ix *Index) NthOldest(k int64) (int64, bool, error) {
	if k < 1 {
		return 0, false, nil
	}
	if err := ix.persist(); err != nil {
		return 0, false, err
	}
	it, err := ix.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixTime}, UpperBound: []byte{prefixTime + 1}})
	if err != nil {
		return 0, false, err
	}
	defer it.Close()
	var n int64
	for ok := it.First(); ok; ok = it.Next() {
		if n++; n == k {
			t, _, valid := parseTimeKey(it.Key())
			return t, valid, nil
		}
	}
	return 0, false, it.Error()
}

// CompactRemoved compacts the key ranges where removals left tombstones,
// so that Pebble reclaims their space now rather than when its own
// compactions get there: the time index below the forget mark (where its
// range deletes are) when the mark moved since the last call, and, if
// entries is set, the whole entry range. A manual compaction rewrites every
// table it overlaps, so the caller asks for the entry range only when
// removals since the last time are a large part of the set (the cost then
// stays proportional to what changed, amortized).
func (ix *Index) CompactRemoved(ctx context.Context, entries bool) error {
	if entries {
		if err := ix.guard(func() error { return ix.db.Compact(ctx, []byte{prefixEntry}, []byte{prefixEntry + 1}, false) }); err != nil {
			return fmt.Errorf("index: compact entries: %w", err)
		}
	}
	before := ix.Mark().Before
	if before > ix.compactedMark.Load() {
		upper := timeKey(nil, before, nil)
		if err := ix.guard(func() error { return ix.db.Compact(ctx, []byte{prefixTime}, upper, false) }); err != nil {
			return fmt.Errorf("index: compact time index: %w", err)
		}
		ix.compactedMark.Store(before)
	}
	return nil
}

// ExpiredKeys returns up to limit entry keys from the expiry index whose TTL
// ran out before before, starting after the row from (nil: the first), and
// the row to start the next call from (nil when there are no more). The
// pending sets are persisted first, so every applied entry is seen. Rows
// may be stale by the time the caller acts: it must check each entry again
// under its lock.
func (ix *Index) ExpiredKeys(before int64, from []byte, limit int) (keys [][]byte, next []byte, err error) {
	if err := ix.persist(); err != nil {
		return nil, nil, err
	}
	lower := from
	if lower == nil {
		lower = []byte{prefixExpiry}
	}
	it, err := ix.db.NewIter(&pebble.IterOptions{LowerBound: lower, UpperBound: expiryKey(nil, before, nil)})
	if err != nil {
		return nil, nil, err
	}
	defer it.Close()
	for ok := it.First(); ok; ok = it.Next() {
		if len(keys) == limit {
			return keys, append([]byte(nil), it.Key()...), it.Error()
		}
		_, ek, valid := parseExpiryKey(it.Key())
		if !valid {
			continue
		}
		keys = append(keys, append([]byte(nil), ek...))
	}
	return keys, nil, it.Error()
}
