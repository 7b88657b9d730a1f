package idem

import (
	"errors"
	"path/filepath"

	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/internal/recovery"
	"github.com/idemdb/idem/wal"
)

// recover brings the open index ix up to the end of the WAL and opens the
// WAL for appends: Open's recovery steps (docs/design.md, "Recovery
// (Open)"). They are package recovery's, which the idem command runs
// read-only on a copy of the index, so that what `idem verify` and `idem
// stats` report is what Open finds. A torn tail cut from the WAL is logged.
func (e *Engine) recover(ix *index.Index) (*wal.WAL, error) {
	o := e.o
	res, err := recovery.Recover(recovery.Options{
		FS:     o.FS,
		Dir:    e.dir,
		Index:  ix,
		Logger: o.Logger,
		WAL: &wal.Options{
			FS:           o.FS,
			Dir:          filepath.Join(e.dir, "wal"),
			SegmentSize:  o.SegmentSize,
			Preallocate:  o.preallocate(),
			SyncMode:     o.Sync.wal(),
			SyncInterval: o.SyncInterval,
			// Records are retained (and their slots pinned) until their
			// fsync: in SyncNever mode that was up to a whole segment,
			// 300-700 MiB of Go heap with 64 MiB segments. An fsync per
			// 1/128 of the budget of log (2 MiB by default) bounds that at
			// a few tens of MiB.
			MaxUnsyncedBytes: max(o.MemoryBudget/128, 1<<20),
			Logger:           o.Logger,
			OnSynced:         e.onSynced,
		},
	})
	if err != nil {
		return nil, wrapCorrupt(err)
	}
	if t := res.Scan.TornTail; t != nil {
		o.Logger.Warn("idem: cut torn WAL tail", "segment", t.Segment, "offset", t.Offset, "bytes", t.Bytes, "saved_as", t.SavedAs)
	}
	return res.WAL, nil
}

// isRecoveryCorrupt reports a directory that recovery cannot bring up as
// it is (a *recovery.CorruptError).
func isRecoveryCorrupt(err error) bool {
	var ce *recovery.CorruptError
	return errors.As(err, &ce)
}
