package idem

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cockroachdb/pebble/v2/vfs"
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
	if o.Ephemeral {
		// No log: the index (empty, or loaded by Restore) is the whole
		// state, and records go on from its applied LSN.
		w, _, err := wal.Open(wal.Options{
			FS:        o.FS,
			Dir:       filepath.Join(e.dir, "wal"),
			Ephemeral: true,
			FirstLSN:  ix.Applied() + 1,
			Logger:    o.Logger,
			OnSynced:  e.onSynced,
		}, 0, nil)
		return w, err
	}
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

// ephemeralMarker names the file that marks an Ephemeral engine's
// directory (see Options.Ephemeral).
const ephemeralMarker = "EPHEMERAL"

const ephemeralMarkerText = "This directory holds an idem engine opened with Options.Ephemeral: it writes no log, and its state is lost with its process (its owner rebuilds it).\n"

// prepareDir checks, before the index is opened, that the directory's
// contents fit the mode (Options.Ephemeral): a normal engine refuses an
// ephemeral engine's directory, an ephemeral one refuses a directory
// holding a normal engine's WAL, index or snapshots. An ephemeral engine
// marks the directory (durably, before its index can hold anything) and
// removes the index an earlier one left, unless Restore just loaded it
// (restored).
func (e *Engine) prepareDir(restored bool) error {
	fs, dir := e.fs, e.dir
	marker := filepath.Join(dir, ephemeralMarker)
	_, err := fs.Stat(marker)
	marked := err == nil
	if !e.o.Ephemeral {
		if marked {
			return fmt.Errorf("%w: %s holds an Ephemeral engine (its %s file): its index is not durable and was not written by a log; open it with Options.Ephemeral (which starts empty), or give another directory", ErrInvalidRequest, dir, ephemeralMarker)
		}
		return nil
	}
	if marked {
		if restored {
			return nil
		}
		if err := fs.RemoveAll(filepath.Join(dir, "index")); err != nil {
			return fmt.Errorf("idem: removing the index an earlier Ephemeral engine left in %s: %w", dir, err)
		}
		return nil
	}
	for _, sub := range []string{"wal", "index", "snapshot"} {
		if names, err := fs.List(filepath.Join(dir, sub)); err == nil && len(names) > 0 {
			return fmt.Errorf("%w: %s holds the %s/ of an engine that was not Ephemeral, which an Ephemeral engine would not keep; open it without Options.Ephemeral, or give an empty directory", ErrInvalidRequest, dir, sub)
		}
	}
	f, err := fs.Create(marker, vfs.WriteCategoryUnspecified)
	if err == nil {
		_, err = f.Write([]byte(ephemeralMarkerText))
		if err == nil {
			err = f.Sync()
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err == nil {
		err = wal.SyncDir(fs, dir)
	}
	if err != nil {
		return fmt.Errorf("idem: marking %s as Ephemeral: %w", dir, err)
	}
	return nil
}

// removeEphemeral removes, at Close, what an Ephemeral engine leaves: its
// index, then (once the directory no longer lists it) the marker, so that
// no crash leaves an index without its marker.
func (e *Engine) removeEphemeral() error {
	fs, dir := e.fs, e.dir
	if err := fs.RemoveAll(filepath.Join(dir, "index")); err != nil {
		return fmt.Errorf("idem: removing the Ephemeral engine's index in %s: %w", dir, err)
	}
	if err := wal.SyncDir(fs, dir); err != nil {
		return fmt.Errorf("idem: syncing %s: %w", dir, err)
	}
	if err := fs.Remove(filepath.Join(dir, ephemeralMarker)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("idem: removing %s: %w", filepath.Join(dir, ephemeralMarker), err)
	}
	return nil
}
