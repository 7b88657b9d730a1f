package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/snapshot"
	"github.com/idemdb/idem/wal"
)

var snapshotCmd = &command{
	name:    "snapshot",
	args:    "<dir>",
	summary: "write a point-in-time image of the dedup set to a file (a backup)",
	help: `
Writes a snapshot of the directory's dedup set: every live entry as of one
LSN, in the checksummed format of package snapshot. 'idem restore' builds a
new directory from it, whose WAL continues after that LSN.

By default the engine is opened (this takes the directory's lock: it fails
if an application has the directory open). With --read-only no lock is
taken: the snapshot is built from a private copy of the index plus the WAL
records it has not applied (what Open would see), so it works while an
application runs, as of the last WAL record written when the command read it.

The file is written under a temporary name, fsynced and renamed into place,
so it never exists half written; -o - writes to standard output.`,
	examples: []string{
		"idem snapshot /var/lib/app/idem -o /backup/idem-$(date +%F).snap",
		"idem snapshot /var/lib/app/idem --read-only -o /backup/idem.snap",
		"idem snapshot /var/lib/app/idem -o - | ssh backup 'cat > idem.snap'",
	},
	setup: func(fs *flag.FlagSet) func(*cli, []string) error {
		o := &snapshotOpts{}
		fs.StringVar(&o.out, "o", "", "write the snapshot to `file` (- for standard output); required")
		fs.BoolVar(&o.force, "force", false, "replace the output file if it exists")
		fs.BoolVar(&o.readOnly, "read-only", false, "take no lock: build the snapshot from the files (works while an application has the directory open)")
		fs.BoolVar(&o.json, "json", false, "print the result as one JSON object")
		return o.run
	},
}

type snapshotOpts struct {
	out      string
	force    bool
	readOnly bool
	json     bool
}

type snapshotOut struct {
	Dir     string `json:"dir"`
	File    string `json:"file"`
	LSN     uint64 `json:"lsn"`
	Entries uint64 `json:"entries"`
	Bytes   int64  `json:"bytes"`
	Created string `json:"created"`
}

func (o *snapshotOpts) run(c *cli, pos []string) error {
	if o.out == "" {
		return usagef("-o <file> is required (- for standard output)")
	}
	dir, err := oneDir(pos)
	if err != nil {
		return err
	}
	if o.out != "-" && !o.force {
		if _, err := os.Stat(o.out); err == nil {
			return fmt.Errorf("%s exists (--force replaces it)", o.out)
		}
	}
	var info idem.SnapshotInfo
	write := func(w io.Writer) error {
		if o.readOnly {
			info, err = snapshotFromFiles(c, dir, w)
			return err
		}
		e, err := openForWriting(dir, nil)
		if err != nil {
			return err
		}
		info, err = e.Snapshot(context.Background(), w)
		if cerr := e.Close(); err == nil {
			err = cerr
		}
		return err
	}
	report := c.stdout
	if o.out == "-" {
		report = c.stderr // standard output carries the snapshot
		if err := write(c.stdout); err != nil {
			return err
		}
	} else if err := writeFileAtomic(o.out, write); err != nil {
		return err
	}
	out := snapshotOut{Dir: dir, File: o.out, LSN: info.LSN, Entries: info.Entries, Bytes: info.Bytes, Created: info.Created.UTC().Format(time.RFC3339Nano)}
	if o.json {
		return writeJSONLine(report, &out)
	}
	fmt.Fprintf(report, "snapshot  %s: %d entries as of LSN %d, %s, written to %s\n", dir, out.Entries, out.LSN, humanBytes(out.Bytes), o.out)
	return nil
}

// snapshotFromFiles writes a snapshot of dir without the engine: the index
// copy brought up to the end of the WAL, in the engine's snapshot format.
func snapshotFromFiles(c *cli, dir string, w io.Writer) (idem.SnapshotInfo, error) {
	noteWriter(c, dir)
	ri, err := loadIndex(c, dir, false, "reading the WAL")
	if err != nil {
		return idem.SnapshotInfo{}, err
	}
	defer ri.close()
	img, err := ri.ix.Image()
	if err != nil {
		return idem.SnapshotInfo{}, err
	}
	defer img.Close()
	now := c.now()
	h := snapshot.Header{LSN: uint64(img.LSN), Created: now, ForgetBefore: img.Mark.Before, ForgetLSN: uint64(img.Mark.LSN)}
	tr, size, err := snapshot.WriteStream(w, h, img.Entries)
	if err != nil {
		return idem.SnapshotInfo{}, err
	}
	return idem.SnapshotInfo{LSN: uint64(img.LSN), Entries: tr.Count, Bytes: size, Created: now}, nil
}

// writeFileAtomic writes path through write: into a temporary file in the
// same directory, fsynced, renamed over path, and the directory fsynced.
func writeFileAtomic(path string, write func(io.Writer) error) (err error) {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(tmp)
		}
	}()
	if err = write(f); err != nil {
		return err
	}
	if err = f.Sync(); err != nil {
		return err
	}
	if err = f.Close(); err != nil {
		return err
	}
	if err = os.Rename(tmp, path); err != nil {
		return err
	}
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

var restoreCmd = &command{
	name:    "restore",
	args:    "<file> <dir>",
	summary: "build a new idem directory from a snapshot file",
	help: `
Builds a new idem directory <dir> from a snapshot written by 'idem snapshot'
(or Engine.Snapshot), checking every chunk and checksum on the way: a
truncated or corrupt file is refused, saying where, and nothing is left
behind. <dir> must not hold an idem directory already. Its WAL starts after
the snapshot's LSN. <file> - reads standard input.`,
	examples: []string{
		"idem restore /backup/idem.snap /var/lib/app/idem-restored",
		"ssh backup 'cat idem.snap' | idem restore - /var/lib/app/idem",
	},
	setup: func(fs *flag.FlagSet) func(*cli, []string) error {
		o := &restoreOpts{}
		fs.BoolVar(&o.json, "json", false, "print the result as one JSON object")
		return o.run
	},
}

type restoreOpts struct{ json bool }

type restoreOut struct {
	File        string `json:"file"`
	Dir         string `json:"dir"`
	LSN         uint64 `json:"lsn"`
	LiveEntries int64  `json:"live_entries"`
}

func (o *restoreOpts) run(c *cli, pos []string) error {
	if len(pos) != 2 {
		return usagef("want a snapshot file and a new directory, got %d arguments", len(pos))
	}
	file, dir := pos[0], pos[1]
	var r io.Reader = os.Stdin
	if file != "-" {
		f, err := os.Open(file)
		if errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("%s: no such file", file)
		}
		if err != nil {
			return err
		}
		defer f.Close()
		r = f
	}
	e, err := idem.Restore(dir, r, nil)
	if errors.Is(err, idem.ErrLocked) {
		return fmt.Errorf("%s is locked by another engine (ErrLocked)", dir)
	}
	if err != nil {
		return err
	}
	st := e.Stats()
	if err := e.Close(); err != nil {
		return err
	}
	out := restoreOut{File: file, Dir: dir, LSN: st.AppliedLSN, LiveEntries: st.LiveEntries}
	if o.json {
		return writeJSONLine(c.stdout, &out)
	}
	fmt.Fprintf(c.stdout, "restore   %s from %s: %d live entries as of LSN %d; its WAL continues at LSN %d\n", dir, file, out.LiveEntries, out.LSN, wal.LSN(out.LSN)+1)
	return nil
}
