package main

import (
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"path/filepath"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/internal/recovery"
	"github.com/idemdb/idem/snapshot"
	"github.com/idemdb/idem/wal"
)

var verifyCmd = &command{
	name:    "verify",
	args:    "<dir>",
	summary: "check every WAL frame, and the index against a replay of the WAL",
	help: `
Checks an idem directory without changing it (no lock is taken; it works
while an application has the directory open):

  1. every frame of every WAL segment (checksum, length, LSN sequence,
     padding) and every record's payload;
  2. the index files: Open's own recovery (the same code, run read-only on
     a private copy) must succeed: the WAL must continue the index, and the
     records the index has not applied must apply cleanly;
  3. the whole WAL is replayed from LSN 1 into a fresh in-memory index, which
     must equal the index entry by entry (missing, extra and different
     entries are named by scope and id), with the same entry count and
     forget mark. When compaction removed the older segments, the fresh
     index starts from the newest valid on-disk snapshot instead; without
     one the comparison is skipped and the report says so;
  4. every on-disk snapshot (<dir>/snapshot/), chunk by chunk;
  5. the index's own structure: every kept reply has its time-index row and
     every claim its in-doubt row, no row is stale, the stored entry count
     is right.

Open itself reads only the WAL the index has not applied, so damage in the
already-applied part of the WAL is found here, not by Open. A torn tail (the
end of the last segment cut by a crash) is reported as a note: Open cuts it.
A damaged region followed by a frame that was written after the region had
been fsynced is a problem (fsynced records lost by the disk), never a torn
tail. Exit status 0 when everything checks out, 1 with a
report naming each problem (segment, offset, LSN, scope and id) otherwise.`,
	examples: []string{
		"idem verify /var/lib/app/idem",
		"idem verify /var/lib/app/idem --max-problems 100",
	},
	setup: func(fs *flag.FlagSet) func(*cli, []string) error {
		v := &verifier{}
		fs.IntVar(&v.maxShown, "max-problems", 20, "show at most `n` problems of each kind (all are counted)")
		return v.run
	},
}

type verifier struct {
	c        *cli
	maxShown int
	problems int
	shown    map[string]int // problems shown per kind
}

// problem reports one problem of kind (kinds are capped separately so one
// flood does not hide the rest).
func (v *verifier) problem(kind, format string, args ...any) {
	v.problems++
	if v.shown[kind] < v.maxShown {
		fmt.Fprintf(v.c.stdout, "PROBLEM %s: %s\n", kind, fmt.Sprintf(format, args...))
	} else if v.shown[kind] == v.maxShown {
		fmt.Fprintf(v.c.stdout, "PROBLEM %s: ... more problems of this kind are counted but not shown (--max-problems)\n", kind)
	}
	v.shown[kind]++
}

func (v *verifier) ok(what, format string, args ...any) {
	fmt.Fprintf(v.c.stdout, "%-9s %s\n", what, fmt.Sprintf(format, args...))
}

// describeOp names what a record is about: scope and id, or client and seq.
func describeOp(op *wal.Op) string {
	switch {
	case op.Type == wal.OpForget:
		return "forget before " + fmtTime(op.Before)
	case op.Type == wal.OpExpire:
		return fmt.Sprintf("TTL expiry of %d entries", len(op.Keys))
	case op.Type == wal.OpBatch:
		return fmt.Sprintf("batch of %d operations", len(op.Ops))
	case op.Type == wal.OpAdvance:
		return fmt.Sprintf("advance of %d clients", len(op.Advances))
	case len(op.ID) > 0:
		return fmt.Sprintf("scope %s id %s", showScope(op.Scope), readableText(op.ID))
	case op.Client != "":
		return fmt.Sprintf("scope %s client %s seq %d", showScope(op.Scope), readableText([]byte(op.Client)), op.Seq)
	}
	return fmt.Sprintf("scope %s", showScope(op.Scope))
}

func describeKey(key []byte) string {
	scope, mode, ident, err := index.ParseEntryKey(key)
	if err != nil {
		return "unparsable key 0x" + hex.EncodeToString(key)
	}
	if mode == index.ModeID {
		return fmt.Sprintf("scope %s id %s", showScope(scope), readableText(ident))
	}
	return fmt.Sprintf("scope %s client %s", showScope(scope), readableText(ident))
}

func (v *verifier) run(c *cli, pos []string) error {
	v.c, v.shown = c, map[string]int{}
	dir, err := oneDir(pos)
	if err != nil {
		return err
	}
	fmt.Fprintf(c.stdout, "verify    %s\n", dir)
	noteWriter(c, dir)
	v.snapshots(dir)

	// The index copy is taken before the WAL is scanned, so the scan sees
	// every record the copy has applied.
	ic, err := openIndexCopy(dir)
	if err != nil {
		v.problem("index", "%v", err)
	}
	defer ic.close()
	fresh, err := index.Open(index.Options{FS: vfs.NewMem(), Dir: "fresh", CacheSize: 8 << 20, MemTableSize: 4 << 20})
	if err != nil {
		return err
	}
	defer fresh.Close(false)

	firstLSN, err := recovery.FirstLSN(dirFS, filepath.Join(dir, "wal"))
	if err != nil {
		return err
	}
	// The fresh index starts empty when the log starts at LSN 1, else from
	// the newest valid snapshot that reaches the log's start, loaded by
	// Open's own code.
	var freshBase wal.LSN
	freshFrom, seedNote := "the whole WAL", false
	if firstLSN > 1 {
		info, err := recovery.Seed(dirFS, dir, fresh, firstLSN, nil)
		if err != nil {
			fmt.Fprintf(c.stdout, "note      the WAL starts at LSN %d and the index cannot be rebuilt independently (%v): the entry-by-entry comparison is skipped; frames, the records after the index and the index structure are checked\n", firstLSN, err)
			seedNote = true
		} else {
			freshBase, freshFrom = wal.LSN(info.LSN), fmt.Sprintf("snapshot %s (LSN %d) plus the WAL after it", filepath.Base(info.Path), info.LSN)
		}
	}
	var freshRep *index.Replayer
	if !seedNote {
		freshRep = fresh.NewReplayer()
	}

	// One pass over the whole WAL checks every frame and payload, feeds the
	// fresh replay and, as the Scan of Open's recovery run on the index
	// copy, feeds that recovery the records after the copy's applied LSN.
	records, undecodable := 0, 0
	var scan wal.ScanResult
	var scanErr error
	scanned := false
	pass := func(after wal.LSN, copyFn func(wal.Record) error) (wal.ScanResult, error) {
		scanned = true
		var copyErr error
		scan, scanErr = scanWAL(c, dir, 0, "verify", func(r wal.Record) error {
			records++
			op, err := wal.DecodeOp(r.Type, r.Payload)
			if err != nil {
				undecodable++
				v.problem("wal", "segment %s offset %d LSN %d: undecodable %s record: %v", r.Segment, r.Offset, r.LSN, wal.OpName(r.Type), err)
				freshRep = nil // replaying past a lost record proves nothing
				if copyFn != nil && r.LSN > after {
					copyFn, copyErr = nil, errReported // reported just now
				}
				return nil
			}
			if freshRep != nil && r.LSN > freshBase {
				if err := freshRep.ApplyOp(r.LSN, op); err != nil {
					v.problem("wal", "segment %s offset %d LSN %d (%s %s): does not replay: %v", r.Segment, r.Offset, r.LSN, wal.OpName(r.Type), describeOp(op), err)
					freshRep = nil
				}
			}
			if copyFn != nil && r.LSN > after {
				if err := copyFn(r); err != nil {
					copyFn, copyErr = nil, fmt.Errorf("LSN %d (%s %s): %w", r.LSN, wal.OpName(r.Type), describeOp(op), err)
				}
			}
			return nil
		})
		if scanErr != nil {
			return scan, scanErr
		}
		return scan, copyErr
	}
	copyOK, replayed := false, 0
	if ic != nil {
		res, err := recovery.Recover(recovery.Options{FS: dirFS, Dir: dir, Index: ic.ix, IndexDir: filepath.Join(dir, "index"), Scan: pass})
		switch {
		case err == nil:
			copyOK, replayed = true, res.Replayed
		case errors.Is(err, errReported), scanErr != nil && errors.Is(err, scanErr):
			// reported by the pass (the WAL's problem)
		default:
			v.problem("index", "Open's recovery fails on it: %v", err)
		}
	}
	if !scanned { // no index copy, or its recovery stopped before the WAL
		pass(0, nil)
	}
	if freshRep != nil {
		if err := freshRep.Flush(); err != nil {
			return err
		}
	}
	walOK := scanErr == nil
	if scanErr != nil {
		var ce *wal.CorruptError
		if errors.As(scanErr, &ce) {
			v.problem("wal", "segment %s offset %d: %s", ce.Segment, ce.Offset, ce.Reason)
		} else {
			v.problem("wal", "%v", scanErr)
		}
	}
	walBytes := int64(0)
	for _, s := range scan.Segments {
		walBytes += s.Size
	}
	if walOK && undecodable == 0 {
		v.ok("wal", "%d segments, %s, %s: %d records, every frame and payload checked", len(scan.Segments), humanBytes(walBytes), lsnRange(uint64(firstLSN), uint64(scan.LastLSN)), records)
	}
	if t := scan.TornTail; t != nil {
		fmt.Fprintf(c.stdout, "note      segment %s ends with %d bytes of torn tail at offset %d: a write cut by a crash, which Open cuts (not an error)\n", t.Segment, t.Bytes, t.Offset)
	}
	if ic == nil {
		return v.verdict()
	}
	if copyOK {
		v.ok("index", "applied LSN %d in the files; %d later records replayed onto a copy by Open's own recovery: ok", ic.stored.applied, replayed)
	}
	switch {
	case seedNote:
		// said above
	case freshRep == nil || !walOK || undecodable > 0:
		fmt.Fprintf(c.stdout, "note      the entry-by-entry comparison was skipped: the WAL could not be replayed to its end\n")
	case !copyOK:
		fmt.Fprintf(c.stdout, "note      the entry-by-entry comparison was skipped: Open's recovery of the index failed (above)\n")
	default:
		if err := guard(func() error { v.compare(fresh, ic.ix, freshFrom); return nil }); err != nil {
			v.problem("index", "%v", err)
		}
	}
	if err := guard(func() error { v.structure(ic.ix); return nil }); err != nil {
		v.problem("index", "%v", err)
	}
	return v.verdict()
}

// snapshots checks every on-disk snapshot file, end to end.
func (v *verifier) snapshots(dir string) {
	infos, err := snapshot.List(dirFS, filepath.Join(dir, "snapshot"))
	if err != nil {
		v.problem("snapshot", "%v", err)
		return
	}
	if len(infos) == 0 {
		return
	}
	bad := 0
	for _, in := range infos {
		if _, _, err := snapshot.Verify(dirFS, in.Path); err != nil {
			bad++
			v.problem("snapshot", "%v (Open would fall back to an older snapshot)", err)
		}
	}
	if bad == 0 {
		v.ok("snapshots", "%d files, newest at LSN %d: every chunk and checksum checked", len(infos), infos[0].LSN)
	}
}

func (v *verifier) verdict() error {
	if v.problems == 0 {
		fmt.Fprintln(v.c.stdout, "ok")
		return nil
	}
	noun := "problems"
	if v.problems == 1 {
		noun = "problem"
	}
	fmt.Fprintf(v.c.stdout, "FAILED: %d %s\n", v.problems, noun)
	return errReported
}

// compare checks the index (after its tail replay) against the fresh replay
// of the whole WAL, entry by entry.
func (v *verifier) compare(fresh, ix *index.Index, from string) {
	before := v.problems
	p := startProgress(v.c, "compare", ix.Count()+fresh.Count(), false)
	defer p.finish()
	n := 0
	err := ix.Entries(nil, func(key []byte, e *index.Entry) error {
		n++
		p.add(1)
		want, err := fresh.Get(key)
		if err != nil {
			return err
		}
		if want == nil {
			v.problem("entry", "extra in the index (the WAL never created it or removed it): %s, %s, last LSN %d", describeKey(key), entryState(e), e.LSN)
			return nil
		}
		if d := entryDiff(want, e); d != "" {
			v.problem("entry", "differs from the replay: %s: %s", describeKey(key), d)
		}
		return nil
	})
	if err != nil {
		v.problem("index", "reading the entries: %v", err)
		return
	}
	m := 0
	err = fresh.Entries(nil, func(key []byte, e *index.Entry) error {
		m++
		p.add(1)
		got, err := ix.Get(key)
		if err != nil {
			return err
		}
		if got == nil {
			v.problem("entry", "missing from the index: %s, %s, last LSN %d", describeKey(key), entryState(e), e.LSN)
		}
		return nil
	})
	if err != nil {
		v.problem("index", "reading the replay: %v", err)
		return
	}
	if a, b := fresh.Mark(), ix.Mark(); a != b {
		v.problem("index", "forget mark differs: the index has before %s (LSN %d), the replay %s (LSN %d)", fmtTime(b.Before), b.LSN, fmtTime(a.Before), a.LSN)
	}
	if fresh.Count() != int64(m) {
		v.problem("replay", "the fresh replay counts %d entries but holds %d (an engine bug)", fresh.Count(), m)
	}
	if v.problems == before {
		v.ok("replay", "%s, replayed into a fresh index: %d entries, identical to the index (every entry, forget mark)", from, m)
	}
}

// entryDiff names the fields in which got differs from want ("" if none).
func entryDiff(want, got *index.Entry) string {
	if bytes.Equal(index.EncodeEntry(nil, want), index.EncodeEntry(nil, got)) {
		return ""
	}
	type field struct {
		name string
		w, g any
	}
	fs := []field{
		{"committed", want.Committed, got.Committed},
		{"seq", want.Seq, got.Seq},
		{"commit_time", fmtTime(want.CommitTime), fmtTime(got.CommitTime)},
		{"commit_lsn", want.CommitLSN, got.CommitLSN},
		{"reply_kept", want.ReplyKept, got.ReplyKept},
		{"reply", "0x" + hex.EncodeToString(want.Reply), "0x" + hex.EncodeToString(got.Reply)},
		{"fingerprint", hex.EncodeToString(want.Fingerprint), hex.EncodeToString(got.Fingerprint)},
		{"in_flight", want.InFlight, got.InFlight},
		{"claim_lsn", want.ClaimLSN, got.ClaimLSN},
		{"claim_seq", want.ClaimSeq, got.ClaimSeq},
		{"claim_fingerprint", hex.EncodeToString(want.ClaimFP), hex.EncodeToString(got.ClaimFP)},
		{"claim_time", fmtTime(want.ClaimTime), fmtTime(got.ClaimTime)},
		{"lease_until", fmtTime(want.LeaseUntil), fmtTime(got.LeaseUntil)},
		{"lsn", want.LSN, got.LSN},
	}
	var b bytes.Buffer
	for _, f := range fs {
		ws, gs := fmt.Sprint(f.w), fmt.Sprint(f.g)
		if ws == gs {
			continue
		}
		if len(ws) > 40 {
			ws = ws[:40] + "..."
		}
		if len(gs) > 40 {
			gs = gs[:40] + "..."
		}
		if b.Len() > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s: index %s, replay %s", f.name, gs, ws)
	}
	if b.Len() == 0 {
		return "encodings differ (nil versus empty fingerprint or reply)"
	}
	return b.String()
}

// Raw key prefixes of the index, frozen in index/keys.go and docs/design.md.
const (
	rawTime    = 0x02 // be64(commitTime ^ 1<<63) entryKey
	rawInDoubt = 0x03 // entryKey
)

// structure checks the index's secondary rows against its entries: each
// kept reply has exactly its time row, each claim its in-doubt row, and the
// stored count is the number of entries.
func (v *verifier) structure(ix *index.Index) {
	before := v.problems
	db := ix.DB()
	has := func(k []byte) bool {
		_, cl, err := db.Get(k)
		if err != nil {
			if !errors.Is(err, pebble.ErrNotFound) {
				v.problem("index", "reading key 0x%x: %v", k, err)
			}
			return false
		}
		cl.Close()
		return true
	}
	n, timed, claims := int64(0), 0, 0
	var kb []byte
	p := startProgress(v.c, "structure", ix.Count(), false)
	defer p.finish()
	err := ix.Entries(nil, func(key []byte, e *index.Entry) error {
		n++
		p.add(1)
		if e.HasTimeKey() {
			timed++
			kb = append(binary.BigEndian.AppendUint64(append(kb[:0], rawTime), uint64(e.CommitTime)^(1<<63)), key...)
			if !has(kb) {
				v.problem("structure", "%s keeps a reply committed at %s but has no time-index row (forget would miss it)", describeKey(key), fmtTime(e.CommitTime))
			}
		}
		if e.InFlight {
			claims++
			if !has(append([]byte{rawInDoubt}, key...)) {
				v.problem("structure", "%s is in flight but has no in-doubt row (Open would not list it)", describeKey(key))
			}
		}
		return nil
	})
	if err != nil {
		v.problem("index", "reading the entries: %v", err)
		return
	}
	rows := func(prefix byte, fn func(k []byte)) int {
		it, err := db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefix}, UpperBound: []byte{prefix + 1}})
		if err != nil {
			v.problem("index", "iterating: %v", err)
			return 0
		}
		defer it.Close()
		c := 0
		for ok := it.First(); ok; ok = it.Next() {
			c++
			fn(it.Key())
		}
		if err := it.Error(); err != nil {
			v.problem("index", "iterating: %v", err)
		}
		return c
	}
	rows(rawTime, func(k []byte) {
		if len(k) < 9 {
			v.problem("structure", "malformed time-index row 0x%x", k)
			return
		}
		t, ek := int64(binary.BigEndian.Uint64(k[1:9])^(1<<63)), k[9:]
		e, err := ix.Get(ek)
		if err != nil || e == nil || !e.HasTimeKey() || e.CommitTime != t {
			v.problem("structure", "stale time-index row at %s for %s", fmtTime(t), describeKey(ek))
		}
	})
	rows(rawInDoubt, func(k []byte) {
		e, err := ix.Get(k[1:])
		if err != nil || e == nil || !e.InFlight {
			v.problem("structure", "stale in-doubt row for %s", describeKey(k[1:]))
		}
	})
	if ix.Count() != n {
		v.problem("structure", "the index's entry count says %d but it holds %d entries", ix.Count(), n)
	}
	if v.problems == before {
		v.ok("structure", "%d entries: %d time-index rows and %d in-doubt rows, all matching; entry count right", n, timed, claims)
	}
}
