package main

// Reading an idem directory without disturbing its writer.
//
// The WAL is read with wal.Scan, which opens segments read-only and validates
// every frame. The index is a Pebble store: opening it, even read-only,
// takes Pebble's LOCK, which a running engine holds, and its files change
// while the engine flushes and compacts. So the read-only commands work on a
// private copy: the metadata files (CURRENT, marker.*, MANIFEST-*, OPTIONS-*)
// are copied first, then the sstables and blob files are hard-linked (they
// are immutable once written; copied when a link is impossible). A table
// deleted by a compaction between the two steps makes the copy fail to open,
// and the copy is retried. The engine keeps Pebble's WAL disabled and flushes
// its memtable only from time to time, so the copy is a prefix of what the
// engine applied: the commands bring the copy up to the end of the WAL with
// Open's own recovery code (package recovery, run read-only: the directory
// is read through recovery.ReadOnlyFS, the WAL with wal.Scan), unless asked
// for the stored state (--stored). So what they show is what Open would
// find, and they never write into the directory.

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/internal/recovery"
	"github.com/idemdb/idem/wal"
)

// dirFS is how the read-only commands read an idem directory: a view that
// refuses every change (recovery.ReadOnlyFS), so that they cannot write
// into it. Only the private index copy (openIndexCopy) is written.
var dirFS = recovery.ReadOnlyFS(vfs.Default)

// checkIdemDir fails with a one-line error unless dir is an idem directory
// (the directory given to idem.Open: see isIdemDir). An
// application's data directory is usually not one, its engine lives in a
// subdirectory (<dir>/idem in the examples, <dir>/dedup/gen-N under
// idemraft), so the error (a *notIdemDirError) says where it looked and
// names the idem directories found inside dir, or the one dir is part of.
func checkIdemDir(dir string) error {
	st, err := os.Stat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%s: no such directory", dir)
	}
	if err != nil {
		return err
	}
	if !st.IsDir() {
		return fmt.Errorf("%s is not a directory", dir)
	}
	if isIdemDir(dir) {
		return nil
	}
	e := &notIdemDirError{dir: dir}
	if parent := filepath.Dir(filepath.Clean(dir)); isIdemDir(parent) {
		switch filepath.Base(filepath.Clean(dir)) {
		case "wal", "index", "snapshot":
			e.parent = parent
		}
	}
	if e.parent == "" {
		e.found, e.more = findIdemDirs(dir)
	}
	return e
}

// isIdemDir says whether dir is an idem directory: it holds a wal/
// subdirectory and either the LOCK file Open creates or a WAL segment (a
// source checkout of idem has a wal/ directory too).
func isIdemDir(dir string) bool {
	st, err := os.Stat(filepath.Join(dir, "wal"))
	if err != nil || !st.IsDir() {
		return false
	}
	if _, err := os.Stat(filepath.Join(dir, "LOCK")); err == nil {
		return true
	}
	first, err := recovery.FirstLSN(dirFS, filepath.Join(dir, "wal"))
	return err == nil && first > 0
}

// Bounds of findIdemDirs: how deep it looks, how many directories it reads
// and how many idem directories it names.
const (
	findDepth   = 3
	findVisits  = 2000
	findResults = 5
)

// findIdemDirs returns the idem directories under dir (not descending into
// them), breadth first and sorted within a level, at most findResults of
// them (more says there were others).
func findIdemDirs(dir string) (found []string, more bool) {
	level, visits := []string{dir}, 0
	for depth := 0; depth < findDepth && len(level) > 0; depth++ {
		var next []string
		for _, d := range level {
			if visits++; visits > findVisits {
				return found, more
			}
			ents, err := os.ReadDir(d)
			if err != nil {
				continue
			}
			for _, e := range ents {
				if !e.IsDir() {
					continue
				}
				p := filepath.Join(d, e.Name())
				if !isIdemDir(p) {
					next = append(next, p)
				} else if len(found) < findResults {
					found = append(found, p)
				} else {
					more = true
				}
			}
		}
		level = next
	}
	return found, more
}

// notIdemDirError is a directory argument that is not an idem directory.
type notIdemDirError struct {
	dir    string
	parent string   // the idem directory dir is the wal/, index/ or snapshot/ of
	found  []string // idem directories inside dir
	more   bool     // and more than those
}

func (e *notIdemDirError) Error() string { return e.message("") }

// message describes the error; with the command's name it suggests running
// the command on the idem directory when there is exactly one.
func (e *notIdemDirError) message(cmd string) string {
	msg := fmt.Sprintf("%s is not an idem directory: there is no WAL in %s", e.dir, filepath.Join(e.dir, "wal"))
	target := ""
	switch {
	case e.parent != "":
		msg += fmt.Sprintf("; it is the %s/ subdirectory of the idem directory %s", filepath.Base(filepath.Clean(e.dir)), e.parent)
		target = e.parent
	case len(e.found) == 1 && !e.more:
		msg += fmt.Sprintf("; the idem directory inside it is %s", e.found[0])
		target = e.found[0]
	case len(e.found) > 0:
		msg += fmt.Sprintf("; idem directories inside it: %s", strings.Join(e.found, ", "))
		if e.more {
			msg += ", ..."
		}
	}
	if target != "" && cmd != "" {
		msg += fmt.Sprintf(": run 'idem %s %s'", cmd, target)
	}
	return msg
}

// oneDir checks that exactly one positional argument, an idem directory,
// was given.
func oneDir(pos []string) (string, error) {
	if len(pos) == 0 {
		return "", usagef("missing the idem directory argument")
	}
	if len(pos) > 1 {
		return "", usagef("unexpected arguments after %s: %s", pos[0], strings.Join(pos[1:], " "))
	}
	return pos[0], checkIdemDir(pos[0])
}

// writerActive reports whether an engine holds dir's lock (the POSIX record
// lock the engine takes on <dir>/LOCK). It asks without taking the lock and
// without creating or touching the LOCK file (see lockHeld): without one no
// engine has the directory open. When it cannot tell, it says no.
func writerActive(dir string) bool {
	held, err := lockHeld(filepath.Join(dir, "LOCK"))
	return err == nil && held
}

// noteWriter prints, when an engine has dir open, that what is shown may be
// behind it.
func noteWriter(c *cli, dir string) bool {
	if !writerActive(dir) {
		return false
	}
	fmt.Fprintf(c.stderr, "idem: note: %s is open by a running engine (its LOCK is held); what is shown is read from the files and may be behind the writer\n", dir)
	return true
}

// storedMeta is what the index files themselves say.
type storedMeta struct {
	applied wal.LSN
	count   int64
	mark    index.Mark
	missing bool // there was no index directory: an empty index was used
	bytes   int64
}

// indexCopy is a private copy of a directory's index, opened.
type indexCopy struct {
	tmp    string
	ix     *index.Index
	stored storedMeta
}

func (ic *indexCopy) close() {
	if ic == nil {
		return
	}
	if ic.ix != nil {
		_ = ic.ix.Close(false)
	}
	_ = os.RemoveAll(ic.tmp)
}

const copyAttempts = 5

// openIndexCopy copies dir's index (see the top of this file) and opens the
// copy.
func openIndexCopy(dir string) (*indexCopy, error) {
	src := filepath.Join(dir, "index")
	st, err := os.Stat(src)
	missing := errors.Is(err, fs.ErrNotExist)
	if err != nil && !missing {
		return nil, err
	}
	if !missing && !st.IsDir() {
		return nil, fmt.Errorf("%s is not a directory", src)
	}
	var lastErr error
	for attempt := 0; attempt < copyAttempts; attempt++ {
		tmp, err := os.MkdirTemp("", "idem-index-")
		if err != nil {
			return nil, err
		}
		ic := &indexCopy{tmp: tmp}
		ic.stored.missing = missing
		if !missing {
			ic.stored.bytes, err = copyPebbleDir(src, tmp)
		}
		if err == nil {
			// The copy is private, so it is opened writable even when only
			// read: a read-only open of a store that never flushed its
			// metadata (an engine killed before its first flush) leaves
			// index.Index without a forget mark.
			err = guard(func() (err error) {
				ic.ix, err = index.Open(index.Options{FS: vfs.Default, Dir: tmp, CacheSize: 8 << 20, MemTableSize: 8 << 20})
				return err
			})
		}
		if err == nil {
			ic.stored.applied, ic.stored.count, ic.stored.mark = ic.ix.Applied(), ic.ix.Count(), ic.ix.Mark()
			return ic, nil
		}
		ic.close()
		// Name the directory the user gave, not the private copy.
		lastErr = errors.New(strings.ReplaceAll(err.Error(), tmp, src))
		if errors.Is(err, index.ErrCorrupt) || errors.Is(err, errCorruptIndex) {
			break // a copy again would not help
		}
	}
	return nil, fmt.Errorf("cannot read the index in %s: %w", src, lastErr)
}

// copyPebbleDir copies a Pebble directory that may be in use: metadata
// first, then the immutable tables (hard links when possible). It returns
// the bytes of the source files.
func copyPebbleDir(src, dst string) (int64, error) {
	isTable := func(n string) bool { return strings.HasSuffix(n, ".sst") || strings.HasSuffix(n, ".blob") }
	var total int64
	ents, err := os.ReadDir(src)
	if err != nil {
		return 0, err
	}
	for _, e := range ents {
		n := e.Name()
		if e.IsDir() || n == "LOCK" || isTable(n) {
			continue
		}
		sz, err := copyFile(filepath.Join(src, n), filepath.Join(dst, n))
		if err != nil {
			return 0, err // a MANIFEST replaced meanwhile: the caller retries
		}
		total += sz
	}
	// List again: tables written since the first listing may be named by
	// the MANIFEST just copied.
	if ents, err = os.ReadDir(src); err != nil {
		return 0, err
	}
	for _, e := range ents {
		n := e.Name()
		if e.IsDir() || !isTable(n) {
			continue
		}
		s, d := filepath.Join(src, n), filepath.Join(dst, n)
		if err := os.Link(s, d); err == nil {
			if st, err := os.Stat(d); err == nil {
				total += st.Size()
			}
			continue
		}
		sz, err := copyFile(s, d)
		if errors.Is(err, fs.ErrNotExist) {
			continue // compacted away; if the copy needs it, opening fails and we retry
		}
		if err != nil {
			return 0, err
		}
		total += sz
	}
	return total, nil
}

func copyFile(src, dst string) (int64, error) {
	in, err := os.Open(src)
	if err != nil {
		return 0, err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return 0, err
	}
	n, err := io.Copy(out, in)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	return n, err
}

var errCorruptIndex = errors.New("corrupt index")

// guard runs fn, turning a panic into an error. Pebble reports some
// corruption of its files by a fatal log message, which the index package
// turns into a panic; a reading tool reports it instead (on one line).
func guard(fn func() error) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: %s", errCorruptIndex, oneLine(fmt.Sprint(r)))
		}
	}()
	return fn()
}

// walFile is one file of the WAL directory.
type walFile struct {
	name    string
	size    int64
	segment bool // a %020d.wal segment (else *.torn or other)
	base    int64
}

// listWAL returns the files of dir's WAL, segments in LSN order with their
// cumulative byte offsets (for progress), and the total segment bytes.
func listWAL(dir string) ([]walFile, int64, error) {
	ents, err := os.ReadDir(filepath.Join(dir, "wal"))
	if err != nil {
		return nil, 0, err
	}
	var files []walFile
	for _, e := range ents {
		if e.IsDir() {
			continue
		}
		info, err := e.Info()
		if err != nil {
			continue // removed meanwhile
		}
		n := e.Name()
		_, seg := wal.ParseSegmentName(n)
		files = append(files, walFile{name: n, size: info.Size(), segment: seg})
	}
	slices.SortFunc(files, func(a, b walFile) int { return cmp.Compare(a.name, b.name) })
	var total int64
	for i := range files {
		if files[i].segment {
			files[i].base = total
			total += files[i].size
		}
	}
	return files, total, nil
}

// scanWAL runs wal.Scan over dir's WAL, drawing a progress bar labelled
// label when c may.
func scanWAL(c *cli, dir string, after wal.LSN, label string, fn func(wal.Record) error) (wal.ScanResult, error) {
	files, total, err := listWAL(dir)
	if err != nil {
		return wal.ScanResult{}, err
	}
	bases := make(map[string]int64, len(files))
	for _, f := range files {
		bases[f.name] = f.base
	}
	var p *progress
	if label != "" {
		p = startProgress(c, label, total, true)
	}
	defer p.finish()
	n := 0
	return wal.Scan(dirFS, filepath.Join(dir, "wal"), after, 0, func(r wal.Record) error {
		if n++; p != nil && n%256 == 0 {
			p.set(bases[r.Segment] + r.Offset)
		}
		if fn == nil {
			return nil
		}
		return fn(r)
	})
}

// walError makes a scan error readable: where, and what the user can do.
func walError(err error) error {
	var ce *wal.CorruptError
	if errors.As(err, &ce) {
		return fmt.Errorf("corrupt WAL: segment %s offset %d: %s (run 'idem verify' for a full report)", ce.Segment, ce.Offset, ce.Reason)
	}
	return err
}

// replayedIndex is an index copy brought up to the end of the WAL by Open's
// own recovery (package recovery), or left as stored.
type replayedIndex struct {
	*indexCopy
	scan     wal.ScanResult
	replayed int    // records replayed onto the copy
	asStored bool   // the copy was left as stored (no replay)
	seeded   string // the snapshot the empty copy was loaded from, as Open would
	base     wal.LSN
}

// loadIndex copies dir's index and, unless stored, runs Open's recovery on
// the copy, read-only (recovery.Recover: an empty index is loaded from the
// newest snapshot when the WAL no longer starts at LSN 1, and the WAL
// records after the index's applied LSN are replayed onto it).
func loadIndex(c *cli, dir string, stored bool, label string) (*replayedIndex, error) {
	ic, err := openIndexCopy(dir)
	if err != nil {
		return nil, err
	}
	ri := &replayedIndex{indexCopy: ic, asStored: stored, base: ic.stored.applied}
	if stored {
		ri.scan, err = scanWAL(c, dir, ri.base, label, nil)
		if err != nil {
			ic.close()
			return nil, walError(err)
		}
		return ri, nil
	}
	res, err := recovery.Recover(recovery.Options{
		FS:       dirFS,
		Dir:      dir,
		Index:    ic.ix,
		IndexDir: filepath.Join(dir, "index"),
		Scan: func(after wal.LSN, fn func(wal.Record) error) (wal.ScanResult, error) {
			return scanWAL(c, dir, after, label, fn)
		},
	})
	if err != nil {
		ic.close()
		return nil, walError(err)
	}
	ri.scan, ri.replayed, ri.base = res.Scan, res.Replayed, res.Base
	if res.Seeded != nil {
		ri.seeded = res.Seeded.Path
	}
	return ri, nil
}

// note describes which state loadIndex produced when the index files are
// behind the WAL ("" when they are not).
func (ri *replayedIndex) note() string {
	a := ri.stored.applied
	switch {
	case ri.asStored && ri.scan.LastLSN > a:
		return fmt.Sprintf("index as stored: applied through LSN %d; the WAL holds %d later records (through LSN %d) that Open would replay", a, ri.scan.LastLSN-a, ri.scan.LastLSN)
	case ri.seeded != "":
		return fmt.Sprintf("the index files are empty and the WAL starts after LSN 1: loaded snapshot %s (LSN %d) and replayed %d WAL records (through LSN %d) onto a private copy, as Open would", ri.seeded, ri.base, ri.replayed, ri.scan.LastLSN)
	case ri.replayed > 0:
		return fmt.Sprintf("index files applied through LSN %d; the %d later WAL records (through LSN %d) were replayed onto a private copy, as Open would", a, ri.replayed, ri.scan.LastLSN)
	}
	return "" // the index files are up to date with the WAL
}

// dirBytes returns the bytes of the files in dir (0 if unreadable).
func dirBytes(dir string) int64 {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	var n int64
	for _, e := range ents {
		if info, err := e.Info(); err == nil && !e.IsDir() {
			n += info.Size()
		}
	}
	return n
}

// lsnRange renders the LSNs a WAL holds.
func lsnRange(first, last uint64) string {
	switch {
	case first == 0:
		return "no segment"
	case last < first:
		return fmt.Sprintf("no record yet (the next is LSN %d)", first)
	}
	return fmt.Sprintf("LSN %d..%d", first, last)
}
