// Package recovery brings an idem index up to the end of its write-ahead
// log: the part of idem.Open that runs once the index is open. It finds the
// log's first LSN, fills an empty index from the newest valid on-disk
// snapshot when compaction removed the head of the log, checks that the log
// continues the index, replays the records the index has not applied and
// checks that the log reaches the index's applied LSN.
//
// There is one implementation, used two ways:
//
//   - idem.Open runs Recover on the directory it has locked, with
//     Options.WAL set: the log is opened for writing with wal.Open, which
//     cuts a torn tail;
//   - the idem command (cmd/idem: dump, stats, verify, snapshot --read-only,
//     forget --dry-run) runs Recover read-only, on a private copy of the
//     index, reading the directory through ReadOnlyFS with wal.Scan, so what
//     it reports is what Open would find, and it never writes into the
//     directory.
//
// The steps are documented in docs/design.md, "Recovery (Open)".
package recovery

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/snapshot"
	"github.com/idemdb/idem/wal"
)

// Options says what to recover and how.
type Options struct {
	// FS and Dir locate the idem directory: Recover reads its wal/ and
	// snapshot/ subdirectories. Read-only (WAL nil), FS is wrapped with
	// ReadOnlyFS.
	FS  vfs.FS
	Dir string
	// Index is the open index to bring up to date: the directory's own
	// (Open) or a private copy of it (the idem command).
	Index *index.Index
	// IndexDir names the index in messages (default Dir/index): a copy is
	// named by the directory it was copied from.
	IndexDir string
	// WAL, when set, makes Recover open the log for writing: wal.Open with
	// these options (FirstLSN is set by Recover: the LSN after the
	// index's), which cuts a torn tail and leaves the log ready for
	// appends in Result.WAL. Nil: read-only (wal.Scan, or Scan).
	WAL *wal.Options
	// Scan, read-only only, reads the log in place of wal.Scan on
	// ReadOnlyFS(FS): it must call fn for every record with LSN > after,
	// in LSN order, and return fn's first error (it may go on reading
	// without calling fn again: idem verify checks every frame in the
	// same pass). It lets a caller draw progress or look at every record.
	Scan func(after wal.LSN, fn func(wal.Record) error) (wal.ScanResult, error)
	// Logger receives the warnings (a snapshot skipped as invalid, the
	// index rebuilt from a snapshot); nil discards them.
	Logger *slog.Logger
}

// Result says what Recover found and did.
type Result struct {
	// WAL is the log opened for writing (Options.WAL set); nil read-only.
	WAL *wal.WAL
	// Scan describes the log: its segments, last LSN, torn tail (cut and
	// saved when WAL is set, only reported read-only).
	Scan wal.ScanResult
	// FirstLSN is the first LSN of the oldest segment before recovery (0:
	// no segment).
	FirstLSN wal.LSN
	// Stored is the index's applied LSN as it was opened.
	Stored wal.LSN
	// Seeded is the snapshot the empty index was loaded from; nil when
	// none was needed.
	Seeded *snapshot.Info
	// Base is the LSN replay started after: Stored, or Seeded's LSN.
	Base wal.LSN
	// Replayed is the number of log records replayed onto the index.
	Replayed int
}

// CorruptError is a directory that cannot be recovered as it is: the log
// does not continue the index, a record does not apply, or an empty index
// has no snapshot to start from. idem.Open reports it as idem.ErrCorrupt.
type CorruptError struct {
	Msg string
	Err error // the underlying error, if any
}

func (e *CorruptError) Error() string {
	if e.Err != nil {
		return e.Msg + ": " + e.Err.Error()
	}
	return e.Msg
}

// Unwrap returns the underlying error.
func (e *CorruptError) Unwrap() error { return e.Err }

func corruptf(err error, format string, args ...any) error {
	return &CorruptError{Msg: fmt.Sprintf(format, args...), Err: err}
}

// Recover brings o.Index up to the end of the log in o.Dir (see the package
// comment). On failure the index may hold part of the replay (the caller
// closes it without flushing) and a log opened for writing is closed.
func Recover(o Options) (*Result, error) {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.IndexDir == "" {
		o.IndexDir = filepath.Join(o.Dir, "index")
	}
	fs := o.FS
	if o.WAL == nil {
		fs = ReadOnlyFS(fs)
	}
	ix := o.Index
	walDir := filepath.Join(o.Dir, "wal")
	res := &Result{Stored: ix.Applied()}
	var err error
	if res.FirstLSN, err = FirstLSN(fs, walDir); err != nil {
		return res, err
	}
	// An empty index in front of a log that no longer starts at LSN 1 (its
	// head was removed by compaction) must start from a snapshot.
	if first := res.FirstLSN; first > 1 && ix.Applied() == 0 && ix.Count() == 0 {
		info, err := Seed(fs, o.Dir, ix, first, o.Logger)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return res, corruptf(err, "the index (%s) is missing or empty and compaction removed the WAL before LSN %d, but no valid snapshot is available to rebuild it from (on-disk snapshots are kept only with Options.KeepSnapshots > 0); restore a backup (idem restore) or move the index back", o.IndexDir, first)
			}
			return res, err
		}
		res.Seeded = &info
	}
	res.Base = ix.Applied()
	if first := res.FirstLSN; first > res.Base+1 {
		return res, corruptf(nil, "the index (%s) has applied LSN %d but the WAL starts at LSN %d: records %d..%d are in neither (WAL segments removed past the index?)", o.IndexDir, res.Base, first, res.Base+1, first-1)
	}
	rep := ix.NewReplayer()
	apply := func(r wal.Record) error {
		res.Replayed++
		if err := rep.Apply(r.LSN, r.Type, r.Payload); err != nil {
			return corruptf(err, "replaying the WAL onto the index: segment %s offset %d", r.Segment, r.Offset)
		}
		return nil
	}
	if o.WAL != nil {
		wo := *o.WAL
		wo.FirstLSN = res.Base + 1
		res.WAL, res.Scan, err = wal.Open(wo, res.Base, apply)
	} else if o.Scan != nil {
		res.Scan, err = o.Scan(res.Base, apply)
	} else {
		res.Scan, err = wal.Scan(fs, walDir, res.Base, 0, apply)
	}
	if err != nil {
		rep.Discard()
		return res, err
	}
	fail := func(err error) (*Result, error) {
		if res.WAL != nil {
			_ = res.WAL.Close()
			res.WAL = nil
		}
		return res, err
	}
	if err := rep.Flush(); err != nil {
		return fail(err)
	}
	if res.Scan.LastLSN < res.Base {
		return fail(corruptf(nil, "the index (%s) has applied LSN %d but the WAL ends at LSN %d (WAL segments lost?)", o.IndexDir, res.Base, res.Scan.LastLSN))
	}
	return res, nil
}

// FirstLSN returns the first LSN of the oldest segment in the WAL directory
// walDir, or 0 when there is none (a segment is named by its first LSN).
func FirstLSN(fs vfs.FS, walDir string) (wal.LSN, error) {
	names, err := fs.List(walDir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return 0, nil
		}
		return 0, err
	}
	var first wal.LSN
	for _, n := range names {
		if v, ok := wal.ParseSegmentName(n); ok && (first == 0 || v < first) {
			first = v
		}
	}
	return first, nil
}

// Seed fills the empty index ix from the newest valid snapshot in
// dir/snapshot that reaches back to the WAL's first LSN first (its LSN is
// at least first-1). A corrupt newest snapshot is logged and the next older
// one used, as Kafka does with its producer-state snapshots. Without a
// valid snapshot the error matches os.ErrNotExist. It returns the snapshot
// loaded.
func Seed(fs vfs.FS, dir string, ix *index.Index, first wal.LSN, logger *slog.Logger) (snapshot.Info, error) {
	sr, info, closer, err := snapshot.OpenNewestValid(fs, filepath.Join(dir, "snapshot"), logger)
	if err != nil {
		return snapshot.Info{}, err
	}
	defer closer.Close()
	if wal.LSN(info.LSN)+1 < first {
		return snapshot.Info{}, corruptf(nil, "the newest valid snapshot %s (LSN %d) does not reach the WAL's first LSN %d", info.Path, info.LSN, first)
	}
	if logger != nil {
		logger.Warn("idem: rebuilding the index from a snapshot", "snapshot", info.Path, "lsn", info.LSN)
	}
	if err := Load(ix, sr); err != nil {
		return snapshot.Info{}, fmt.Errorf("loading snapshot %s: %w", info.Path, err)
	}
	return info, nil
}

// Load fills the empty index ix with the snapshot read by sr: its entries,
// its LSN as the applied LSN and its forget mark (Open from an on-disk
// snapshot, idem.Restore from any).
func Load(ix *index.Index, sr *snapshot.Reader) error {
	h := sr.Header()
	return ix.Load(wal.LSN(h.LSN), index.Mark{Before: h.ForgetBefore, LSN: wal.LSN(h.ForgetLSN)},
		func() ([]byte, []byte, bool, error) {
			k, v, err := sr.Next()
			if errors.Is(err, io.EOF) {
				return nil, nil, false, nil
			}
			if err != nil {
				return nil, nil, false, err
			}
			return k, v, true, nil
		})
}
