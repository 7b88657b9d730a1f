package idem

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"sync"
	"time"

	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/internal/recovery"
	"github.com/idemdb/idem/snapshot"
	"github.com/idemdb/idem/wal"
)

// SnapshotInfo describes a snapshot written by Snapshot.
type SnapshotInfo struct {
	LSN     uint64 // every record up to LSN is in the snapshot, none after
	Entries uint64
	Bytes   int64
	Created time.Time
}

// Snapshot streams a point-in-time image of the dedup set to w (for
// backups and for replicated state machines) while writes go on. It holds
// every record up to SnapshotInfo.LSN, which covers everything acknowledged
// before the call: a replica restores it and applies the log after that LSN. Acked and forgotten entries are never in it, and
// neither are replies expired by Retention (a client keeps its sequence
// number). The format is described in snapshot/doc.go.
func (e *Engine) Snapshot(ctx context.Context, w io.Writer) (SnapshotInfo, error) {
	if err := e.enter(); err != nil {
		return SnapshotInfo{}, err
	}
	defer e.leave()
	// Include everything acknowledged so far: in SyncInterval/SyncNever
	// modes records reach the index only once fsynced.
	if err := e.w.Sync(); err != nil {
		return SnapshotInfo{}, e.failure(err)
	}
	if err := e.waitApplied(ctx, e.w.SyncedLSN()); err != nil {
		return SnapshotInfo{}, err
	}
	img, err := e.ix.Image()
	if err != nil {
		return SnapshotInfo{}, fmt.Errorf("idem: snapshot: %w", err)
	}
	defer img.Close()
	return e.writeImage(ctx, w, img)
}

// SnapshotImage is a point-in-time image of the dedup set captured by
// Engine.SnapshotImage, to be written later (once) while writes go on: what
// a replicated state machine needs when it must capture its state at one
// log index quickly and persist it concurrently with later applies. Close
// it when done: it pins a Pebble snapshot (and the files it reads).
type SnapshotImage struct {
	e    *Engine
	img  *index.Image
	mu   sync.Mutex
	used bool
	done bool
}

// SnapshotImage captures every record acknowledged before the call (as
// Snapshot does) and returns at once; WriteTo streams it.
func (e *Engine) SnapshotImage(ctx context.Context) (*SnapshotImage, error) {
	if err := e.enter(); err != nil {
		return nil, err
	}
	defer e.leave()
	if err := e.w.Sync(); err != nil {
		return nil, e.failure(err)
	}
	if err := e.waitApplied(ctx, e.w.SyncedLSN()); err != nil {
		return nil, err
	}
	img, err := e.ix.Image()
	if err != nil {
		return nil, fmt.Errorf("idem: snapshot: %w", err)
	}
	s := &SnapshotImage{e: e, img: img}
	e.imagesMu.Lock()
	if e.images == nil {
		e.images = map[*SnapshotImage]struct{}{}
	}
	e.images[s] = struct{}{}
	e.imagesMu.Unlock()
	return s, nil
}

// LSN is the image's LSN: every record up to it is in the image, none after.
func (s *SnapshotImage) LSN() uint64 { return uint64(s.img.LSN) }

// WriteTo streams the image to w in the snapshot format (snapshot/doc.go).
// It can be called once, from any goroutine, while the engine serves other
// calls; it fails with ErrClosed if the engine was closed meanwhile.
func (s *SnapshotImage) WriteTo(ctx context.Context, w io.Writer) (SnapshotInfo, error) {
	if err := s.e.enter(); err != nil {
		return SnapshotInfo{}, err
	}
	defer s.e.leave()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		return SnapshotInfo{}, errors.New("idem: snapshot image already closed")
	}
	if s.used {
		return SnapshotInfo{}, errors.New("idem: snapshot image already written")
	}
	s.used = true
	return s.e.writeImage(ctx, w, s.img)
}

// Close releases the image. It is safe to call more than once, and after
// the engine was closed (Engine.Close releases the images left open).
func (s *SnapshotImage) Close() error {
	s.e.imagesMu.Lock()
	delete(s.e.images, s)
	s.e.imagesMu.Unlock()
	return s.release()
}

func (s *SnapshotImage) release() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		return nil
	}
	s.done = true
	return s.img.Close()
}

// releaseImages closes the images still open (Engine.Close).
func (e *Engine) releaseImages() {
	e.imagesMu.Lock()
	imgs := e.images
	e.images = nil
	e.imagesMu.Unlock()
	for s := range imgs {
		_ = s.release()
	}
}

func (e *Engine) writeImage(ctx context.Context, w io.Writer, img *index.Image) (SnapshotInfo, error) {
	now := e.o.Clock()
	h := snapshot.Header{LSN: uint64(img.LSN), Created: now, ForgetBefore: img.Mark.Before, ForgetLSN: uint64(img.Mark.LSN)}
	var n uint64
	var vb []byte
	tr, size, err := snapshot.WriteStream(w, h, func(add func(key, value []byte) error) error {
		return img.Entries(func(key, value []byte) error {
			if n++; n%4096 == 0 {
				if err := ctx.Err(); err != nil {
					return err
				}
			}
			if e.o.Retention > 0 {
				en, err := index.DecodeEntry(value)
				if err != nil {
					return fmt.Errorf("%w: key %x: %v", ErrCorrupt, key, err)
				}
				if e.expired(en, now) {
					_, mode, _, err := index.ParseEntryKey(key)
					if err != nil {
						return fmt.Errorf("%w: %v", ErrCorrupt, err)
					}
					// As the next retention forget will leave it.
					if en = index.DropReply(en, mode); en == nil {
						return nil
					}
					vb = index.EncodeEntry(vb[:0], en)
					value = vb
				}
			}
			return add(key, value)
		})
	})
	if err != nil {
		return SnapshotInfo{}, err
	}
	return SnapshotInfo{LSN: uint64(img.LSN), Entries: tr.Count, Bytes: size, Created: now}, nil
}

// Restore builds a new engine directory dir from a snapshot read from r and
// opens it. dir must not hold an idem directory already. The new WAL starts
// after the snapshot's LSN, so a replica can go on applying the log. A
// truncated or corrupt snapshot is refused (ErrCorrupt, saying where) and
// what Restore created is removed.
func Restore(dir string, r io.Reader, opts *Options) (*Engine, error) {
	if err := checkEphemeral(opts); err != nil {
		return nil, err
	}
	o := opts.withDefaults()
	fs := o.FS
	for _, sub := range []string{"wal", "index"} {
		if names, err := fs.List(filepath.Join(dir, sub)); err == nil && len(names) > 0 {
			return nil, fmt.Errorf("idem: restore into %s: it already holds an idem directory (%s/ is not empty)", dir, sub)
		}
	}
	e := &Engine{o: o, dir: dir, fs: fs}
	if err := e.lockDir(); err != nil {
		return nil, err
	}
	if err := e.prepareDir(false); err != nil {
		e.unlockDir()
		return nil, err
	}
	ixDir := filepath.Join(dir, "index")
	err := func() error {
		sr, err := snapshot.NewReader(r)
		if err != nil {
			return wrapSnapshotErr(err)
		}
		ix, err := index.Open(index.Options{FS: fs, Dir: ixDir, CacheSize: o.IndexCacheSize, MemTableSize: o.memTableSize(), IngestBytes: o.IndexIngestBytes, FilterBytes: -1, Logger: o.Logger})
		if err != nil {
			return err
		}
		err = loadSnapshot(ix, sr)
		if cerr := ix.Close(err == nil); err == nil {
			err = cerr
		}
		return err
	}()
	e.unlockDir()
	if err != nil {
		_ = fs.RemoveAll(ixDir)
		return nil, fmt.Errorf("idem: restore into %s: %w", dir, wrapCorrupt(err))
	}
	return open(dir, opts, true)
}

func wrapSnapshotErr(err error) error {
	if errors.Is(err, snapshot.ErrCorrupt) && !errors.Is(err, ErrCorrupt) {
		return fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return err
}

// snapshotDir is where on-disk snapshots live.
func (e *Engine) snapshotDir() string { return filepath.Join(e.dir, "snapshot") }

// writeDiskSnapshot writes img under <dir>/snapshot/ atomically, keeps the
// newest Options.KeepSnapshots and returns the oldest kept one's LSN.
func (e *Engine) writeDiskSnapshot(ctx context.Context, img *index.Image) (string, int, wal.LSN, error) {
	path, err := snapshot.WriteFile(e.fs, e.snapshotDir(), uint64(img.LSN), func(w io.Writer) error {
		_, err := e.writeImage(ctx, w, img)
		return err
	})
	if err != nil {
		return "", 0, 0, err
	}
	removed, err := snapshot.Prune(e.fs, e.snapshotDir(), e.o.KeepSnapshots)
	if err != nil {
		return path, len(removed), 0, err
	}
	infos, err := snapshot.List(e.fs, e.snapshotDir())
	if err != nil || len(infos) == 0 {
		return path, len(removed), 0, err
	}
	return path, len(removed), wal.LSN(infos[len(infos)-1].LSN), nil
}

// loadSnapshot fills the empty index ix with the snapshot sr.
func loadSnapshot(ix *index.Index, sr *snapshot.Reader) error {
	return wrapSnapshotErr(recovery.Load(ix, sr))
}
