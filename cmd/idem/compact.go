package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"path/filepath"
	"time"

	"github.com/idemdb/idem"
)

var compactCmd = &command{
	name:    "compact",
	args:    "<dir>",
	summary: "bound the disk: snapshot the index, remove WAL segments it no longer needs",
	help: `
Opens the engine (this takes the directory's lock: it fails if an application
has the directory open; a running engine compacts by itself every
CompactInterval) and runs one compaction: it makes the index durable, writes
an on-disk snapshot under <dir>/snapshot/ (keeping the newest
--keep-snapshots), removes the WAL segments the index no longer needs and
compacts the index where removals left tombstones.

--retention and --max-entries apply an expiry or capacity policy first, as
the engine options Retention and MaxEntries do (a logged forget record): give
the application's own settings, or nothing to remove only what acks and
forgets already removed.`,
	examples: []string{
		"idem compact /var/lib/app/idem",
		"idem compact /var/lib/app/idem --retention 720h --json",
		"idem compact /var/lib/app/idem --keep-snapshots -1   # no snapshot",
	},
	setup: func(fs *flag.FlagSet) func(*cli, []string) error {
		o := &compactOpts{}
		fs.IntVar(&o.keep, "keep-snapshots", 2, "keep the newest `n` on-disk snapshots; -1 writes none")
		fs.DurationVar(&o.retention, "retention", 0, "first expire replies committed more than `d` ago (Options.Retention)")
		fs.Int64Var(&o.maxEntries, "max-entries", 0, "first evict the oldest replies beyond `n` kept (Options.MaxEntries)")
		fs.BoolVar(&o.json, "json", false, "print one JSON object")
		return o.run
	},
}

type compactOpts struct {
	keep       int
	retention  time.Duration
	maxEntries int64
	json       bool
}

type compactOut struct {
	Dir             string  `json:"dir"`
	EntriesRemoved  uint64  `json:"entries_removed"`
	SegmentsRemoved int     `json:"segments_removed"`
	BytesReclaimed  int64   `json:"bytes_reclaimed"`
	DurableLSN      uint64  `json:"durable_lsn"`
	Snapshot        string  `json:"snapshot,omitempty"`
	Seconds         float64 `json:"seconds"`
	BytesBefore     int64   `json:"bytes_before"`
	BytesAfter      int64   `json:"bytes_after"`
}

// openForWriting opens dir's engine, turning ErrLocked into a message that
// says what to do.
func openForWriting(dir string, opts *idem.Options) (*idem.Engine, error) {
	e, err := idem.Open(dir, opts)
	if errors.Is(err, idem.ErrLocked) {
		return nil, fmt.Errorf("%s is locked by another engine (ErrLocked): close the application that has it open", dir)
	}
	return e, err
}

// idemDirBytes is the disk used by an idem directory's WAL, index and
// snapshots.
func idemDirBytes(dir string) int64 {
	var n int64
	for _, sub := range []string{"wal", "index", "snapshot"} {
		n += dirBytes(filepath.Join(dir, sub))
	}
	return n
}

func (o *compactOpts) run(c *cli, pos []string) error {
	dir, err := oneDir(pos)
	if err != nil {
		return err
	}
	if o.keep == 0 || o.keep < -1 {
		return usagef("--keep-snapshots must be -1 (none) or at least 1")
	}
	if o.retention < 0 || o.maxEntries < 0 {
		return usagef("--retention and --max-entries must not be negative")
	}
	out := compactOut{Dir: dir, BytesBefore: idemDirBytes(dir)}
	e, err := openForWriting(dir, &idem.Options{KeepSnapshots: o.keep, Retention: o.retention, MaxEntries: o.maxEntries})
	if err != nil {
		return err
	}
	st, cerr := e.Compact(context.Background())
	if err := e.Close(); cerr == nil {
		cerr = err
	}
	if cerr != nil {
		return cerr
	}
	out.EntriesRemoved, out.SegmentsRemoved, out.BytesReclaimed = st.EntriesRemoved, st.SegmentsRemoved, st.BytesReclaimed
	out.DurableLSN, out.Snapshot, out.Seconds = st.DurableLSN, st.Snapshot, st.Duration.Seconds()
	out.BytesAfter = idemDirBytes(dir)
	if o.json {
		return writeJSONLine(c.stdout, &out)
	}
	fmt.Fprintf(c.stdout, "compact   %s: %d entries removed, %d WAL segments removed, %s reclaimed, index durable through LSN %d (%.2fs)\n",
		dir, out.EntriesRemoved, out.SegmentsRemoved, humanBytes(out.BytesReclaimed), out.DurableLSN, out.Seconds)
	if out.Snapshot != "" {
		fmt.Fprintf(c.stdout, "snapshot  %s\n", out.Snapshot)
	}
	fmt.Fprintf(c.stdout, "disk      %s before, %s after (wal, index, snapshots)\n", humanBytes(out.BytesBefore), humanBytes(out.BytesAfter))
	return nil
}
