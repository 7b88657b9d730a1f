package snapshot

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/wal"
)

// File names (frozen): a snapshot at LSN n is fmt.Sprintf("%020d.snap", n);
// while it is being written it is that name plus ".tmp".
const (
	fileSuffix  = ".snap"
	tmpSuffix   = ".tmp"
	fileNameLen = 20 + len(fileSuffix)

	// writeBufferSize is the buffer between Writer and the file in
	// WriteFile: a few chunks per write call.
	writeBufferSize = 256 << 10
)

// FileName is the base name of the snapshot at lsn.
func FileName(lsn uint64) string { return fmt.Sprintf("%020d%s", lsn, fileSuffix) }

// parseFileName returns the LSN of a snapshot base name. Only names that
// FileName produces parse.
func parseFileName(name string) (uint64, bool) {
	if len(name) != fileNameLen || !strings.HasSuffix(name, fileSuffix) {
		return 0, false
	}
	digits := name[:20]
	for i := 0; i < len(digits); i++ {
		if digits[i] < '0' || digits[i] > '9' {
			return 0, false
		}
	}
	lsn, err := strconv.ParseUint(digits, 10, 64)
	return lsn, err == nil
}

// Info describes one snapshot file.
type Info struct {
	Path string // dir joined with FileName(LSN)
	LSN  uint64
	Size int64
}

// WriteFile writes the snapshot at lsn into dir so that it appears
// atomically under FileName(lsn): it creates dir if needed (fsyncing the
// parent of every directory it creates), writes "<name>.tmp" through a
// buffer with write, fsyncs and closes it, renames it to <name> and fsyncs
// dir. A crash at any point leaves either no file under <name> or a
// complete one (possibly a stale .tmp, which List ignores and Prune
// removes). An existing snapshot of the same LSN is replaced atomically.
//
// write receives the (buffered) file; it normally runs NewWriter, Add and
// Close. On any error before the rename the temp file is removed and no
// snapshot is left under <name>. If only the final directory fsync fails,
// the complete file is in place but may not survive a crash; the error
// says so.
func WriteFile(fs vfs.FS, dir string, lsn uint64, write func(io.Writer) error) (path string, err error) {
	dir = fs.PathJoin(dir) // clean it ("./x" confuses MemFS)
	if err := wal.EnsureDir(fs, dir); err != nil {
		return "", fmt.Errorf("snapshot: create directory %s: %w", dir, err)
	}
	path = fs.PathJoin(dir, FileName(lsn))
	tmp := path + tmpSuffix
	f, err := fs.Create(tmp, vfs.WriteCategoryUnspecified)
	if err != nil {
		return "", fmt.Errorf("snapshot: create %s: %w", tmp, err)
	}
	defer func() {
		if err == nil {
			return
		}
		if f != nil {
			_ = f.Close()
		}
		// The temp file holds nothing anyone may use; a failed removal
		// leaves a .tmp file that Prune removes later.
		_ = fs.Remove(tmp)
	}()
	bw := bufio.NewWriterSize(f, writeBufferSize)
	if err := write(bw); err != nil {
		return "", fmt.Errorf("snapshot: write %s: %w", tmp, err)
	}
	if err := bw.Flush(); err != nil {
		return "", fmt.Errorf("snapshot: write %s: %w", tmp, err)
	}
	if err := f.Sync(); err != nil {
		return "", fmt.Errorf("snapshot: fsync %s: %w", tmp, err)
	}
	err = f.Close()
	f = nil
	if err != nil {
		return "", fmt.Errorf("snapshot: close %s: %w", tmp, err)
	}
	if err := fs.Rename(tmp, path); err != nil {
		return "", fmt.Errorf("snapshot: rename %s to %s: %w", tmp, path, err)
	}
	if err := wal.SyncDir(fs, dir); err != nil {
		// The rename happened: there is no temp file left to remove, and
		// the file under path is complete.
		return path, fmt.Errorf("snapshot: %s is complete but fsync of directory %s failed (it may not survive a crash): %w", path, dir, err)
	}
	return path, nil
}

// List returns the snapshots in dir, newest (highest LSN) first. Names
// other than FileName's (temp files included) are ignored. A missing dir
// holds no snapshots (nil, nil).
func List(fs vfs.FS, dir string) ([]Info, error) {
	dir = fs.PathJoin(dir)
	names, err := fs.List(dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil
		}
		return nil, fmt.Errorf("snapshot: list %s: %w", dir, err)
	}
	var out []Info
	for _, name := range names {
		lsn, ok := parseFileName(name)
		if !ok {
			continue
		}
		p := fs.PathJoin(dir, name)
		st, err := fs.Stat(p)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				continue // removed meanwhile
			}
			return nil, fmt.Errorf("snapshot: stat %s: %w", p, err)
		}
		if st.IsDir() {
			continue
		}
		out = append(out, Info{Path: p, LSN: lsn, Size: st.Size()})
	}
	slices.SortFunc(out, func(a, b Info) int {
		switch {
		case a.LSN > b.LSN:
			return -1
		case a.LSN < b.LSN:
			return 1
		}
		return 0
	})
	return out, nil
}

// Prune removes every snapshot but the newest keep ones (by LSN, whether
// they verify or not), and every stale "<snapshot name>.tmp", then fsyncs
// dir. It returns the paths it removed. It must not run concurrently with
// WriteFile on the same dir (it would remove the temp file being written).
// A missing dir is not an error.
func Prune(fs vfs.FS, dir string, keep int) (removed []string, err error) {
	if keep < 0 {
		return nil, fmt.Errorf("snapshot: Prune: keep = %d", keep)
	}
	dir = fs.PathJoin(dir)
	infos, err := List(fs, dir)
	if err != nil {
		return nil, err
	}
	var doomed []string
	if len(infos) > keep {
		for _, in := range infos[keep:] {
			doomed = append(doomed, in.Path)
		}
	}
	names, err := fs.List(dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("snapshot: list %s: %w", dir, err)
	}
	slices.Sort(names)
	for _, name := range names {
		if base, ok := strings.CutSuffix(name, tmpSuffix); ok {
			if _, ok := parseFileName(base); ok {
				doomed = append(doomed, fs.PathJoin(dir, name))
			}
		}
	}
	for _, p := range doomed {
		if err := fs.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			err = fmt.Errorf("snapshot: remove %s: %w", p, err)
			if len(removed) > 0 {
				if serr := wal.SyncDir(fs, dir); serr != nil {
					err = errors.Join(err, fmt.Errorf("snapshot: fsync directory %s: %w", dir, serr))
				}
			}
			return removed, err
		}
		removed = append(removed, p)
	}
	if len(removed) > 0 {
		if err := wal.SyncDir(fs, dir); err != nil {
			return removed, fmt.Errorf("snapshot: fsync directory %s: %w", dir, err)
		}
	}
	return removed, nil
}

// Verify reads the snapshot at path completely and returns its header and
// trailer. Damage is an error wrapping ErrCorrupt (a *CorruptError) and
// naming path.
func Verify(fs vfs.FS, path string) (Header, Trailer, error) {
	f, err := fs.Open(path)
	if err != nil {
		return Header{}, Trailer{}, fmt.Errorf("snapshot: open %s: %w", path, err)
	}
	defer f.Close()
	h, t, err := verifyStream(f)
	if err != nil {
		return h, Trailer{}, fmt.Errorf("snapshot %s: %w", path, err)
	}
	return h, t, nil
}

func verifyStream(f io.Reader) (Header, Trailer, error) {
	r, err := NewReader(bufio.NewReaderSize(f, writeBufferSize))
	if err != nil {
		return Header{}, Trailer{}, err
	}
	for {
		if _, _, err := r.Next(); err == io.EOF {
			return r.Header(), r.Trailer(), nil
		} else if err != nil {
			return r.Header(), Trailer{}, err
		}
	}
}

// OpenNewestValid opens the newest snapshot in dir that verifies (it is read
// completely first, so the snapshot chosen is read twice) and returns a
// Reader positioned after its header, its Info, and the Closer of the
// underlying file (the caller closes it). As Kafka does with producer-state
// snapshots, a corrupt (ErrCorrupt) snapshot is logged with its path and
// error and the next older one is tried; so is one that vanished after it
// was listed. Other errors (I/O) are returned: an older snapshot is not a
// safe answer to a transient failure. With no valid snapshot the error
// wraps os.ErrNotExist. A nil logger discards.
//
// Falling back to an older snapshot is only useful if the WAL still holds
// the records after that older LSN; deciding that is the caller's job.
func OpenNewestValid(fs vfs.FS, dir string, logger *slog.Logger) (*Reader, Info, io.Closer, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	dir = fs.PathJoin(dir)
	infos, err := List(fs, dir)
	if err != nil {
		return nil, Info{}, nil, err
	}
	skipped := 0
	for _, in := range infos {
		r, c, err := openVerified(fs, in.Path)
		if err == nil {
			return r, in, c, nil
		}
		if !errors.Is(err, ErrCorrupt) && !errors.Is(err, os.ErrNotExist) {
			return nil, Info{}, nil, err
		}
		skipped++
		logger.Warn("snapshot: skipping invalid snapshot, trying the next older one",
			"path", in.Path, "lsn", in.LSN, "error", err)
	}
	return nil, Info{}, nil, fmt.Errorf("snapshot: no valid snapshot in %s (%d listed, %d invalid): %w",
		dir, len(infos), skipped, os.ErrNotExist)
}

// openVerified verifies the file at path and then opens it again for
// reading, checking that the header read the second time is the same.
func openVerified(fs vfs.FS, path string) (*Reader, io.Closer, error) {
	h, _, err := Verify(fs, path)
	if err != nil {
		return nil, nil, err
	}
	f, err := fs.Open(path)
	if err != nil {
		return nil, nil, fmt.Errorf("snapshot: open %s: %w", path, err)
	}
	r, err := NewReader(bufio.NewReaderSize(f, writeBufferSize))
	if err == nil && !sameHeader(r.Header(), h) {
		err = &CorruptError{Offset: 0, Chunk: -1, Reason: "header changed between verification and open"}
	}
	if err != nil {
		_ = f.Close()
		return nil, nil, fmt.Errorf("snapshot %s: %w", path, err)
	}
	return r, f, nil
}

func sameHeader(a, b Header) bool {
	return a.Version == b.Version && a.LSN == b.LSN && a.Created.Equal(b.Created) &&
		a.ForgetBefore == b.ForgetBefore && a.ForgetLSN == b.ForgetLSN
}
