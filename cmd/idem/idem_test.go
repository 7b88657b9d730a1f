package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/internal/testclock"
)

// TestMain lets the demo start this test binary as its child process: with
// demoChildEnv set, the binary is idem, not the tests.
func TestMain(m *testing.M) {
	if os.Getenv(demoChildEnv) == "1" {
		os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

var bg = context.Background()

func runCmd(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	var out, errb bytes.Buffer
	code := run(args, &out, &errb)
	return code, out.String(), errb.String()
}

// wantCode fails the test unless the command exits with code.
func wantCode(t *testing.T, code int, args ...string) (string, string) {
	t.Helper()
	got, out, errs := runCmd(t, args...)
	if got != code {
		t.Fatalf("idem %s: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), got, code, out, errs)
	}
	return out, errs
}

// jsonLines parses one JSON object per line.
func jsonLines(t *testing.T, s string) []map[string]any {
	t.Helper()
	var out []map[string]any
	sc := bufio.NewScanner(strings.NewReader(s))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("not JSON: %q: %v", sc.Text(), err)
		}
		out = append(out, m)
	}
	return out
}

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// makeFixture writes a small directory whose every record is known:
//
//	LSN  1, 2   t0     scope a  id order-1 (fingerprint f1)  claim, commit
//	LSN  3, 4   t0+1m  scope a  id order-2                   claim, commit
//	LSN  5, 6   t0+2m  scope b  id 0x0001ff (binary)         claim, commit
//	LSN  7      t0+3m  scope a  id order-3                   claim, left in flight
//	LSN  8..11  t0+4m  scope c  client worker-7 seq 1, 2     claim, commit each
//	LSN 12      t0+5m  scope a  ack order-2
//
// Live entries: a/order-1, a/order-3 (in flight), b/0x0001ff, c/worker-7.
func makeFixture(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "db")
	clk := testclock.At(t0)
	e, err := idem.Open(dir, &idem.Options{Clock: clk.Now, SegmentSize: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	do := func(r idem.Request, reply string) {
		t.Helper()
		if _, err := e.Do(bg, r, func(context.Context) ([]byte, error) { return []byte(reply), nil }); err != nil {
			t.Fatal(err)
		}
	}
	do(idem.Request{Scope: "a", ID: []byte("order-1"), Fingerprint: []byte("f1")}, "r1")
	clk.Set(t0.Add(time.Minute))
	do(idem.Request{Scope: "a", ID: []byte("order-2")}, "r2")
	clk.Set(t0.Add(2 * time.Minute))
	do(idem.Request{Scope: "b", ID: []byte{0, 1, 0xff}}, "bin")
	clk.Set(t0.Add(3 * time.Minute))
	if res, err := e.Begin(bg, idem.Request{Scope: "a", ID: []byte("order-3")}); err != nil || res.Status != idem.Fresh {
		t.Fatalf("begin order-3: %v %v", res.Status, err)
	}
	clk.Set(t0.Add(4 * time.Minute))
	do(idem.Request{Scope: "c", Client: "worker-7", Seq: 1}, "s1")
	do(idem.Request{Scope: "c", Client: "worker-7", Seq: 2}, "s2")
	clk.Set(t0.Add(5 * time.Minute))
	if err := e.Ack(bg, "a", []byte("order-2")); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	return dir
}

func countLines(s string) int { return strings.Count(s, "\n") }

// wantContains reports each of want that out, what a command printed,
// lacks.
func wantContains(t *testing.T, what, out string, want ...string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(out, w) {
			t.Errorf("%s lacks %q:\n%s", what, w, out)
		}
	}
}

// A filterCase is a dump's filter arguments and how many lines (records
// or entries) of the fixture they select.
type filterCase struct {
	args []string
	want int
}

// wantFiltered runs `idem dump <what> dir` with each case's filter and
// reports a count of printed noun (records, entries) other than the case's.
func wantFiltered(t *testing.T, dir, what, noun string, cases []filterCase) {
	t.Helper()
	for _, tc := range cases {
		args := append([]string{"dump", what, dir}, tc.args...)
		o, _ := wantCode(t, 0, args...)
		if n := countLines(o); n != tc.want {
			t.Errorf("dump %s %v: %d %s, want %d:\n%s", what, tc.args, n, noun, tc.want, o)
		}
	}
}

func TestDumpWAL(t *testing.T) {
	dir := makeFixture(t)
	out, _ := wantCode(t, 0, "dump", "wal", dir)
	if n := countLines(out); n != 12 {
		t.Fatalf("%d records, want 12:\n%s", n, out)
	}
	wantContains(t, "dump wal", out,
		"lsn=1 type=claim time=2026-01-01T00:00:00Z scope=a id=order-1 fp=6631",
		"lsn=2 type=commit time=2026-01-01T00:00:00Z scope=a id=order-1 claim_lsn=1 reply_size=2 segment=00000000000000000001.wal offset=",
		"id=0x0001ff",
		"client=worker-7 seq=2",
		"lsn=12 type=ack time=2026-01-01T00:05:00Z scope=a acked=[order-2]",
	)
	recs := jsonLines(t, func() string { o, _ := wantCode(t, 0, "dump", "wal", dir, "--json"); return o }())
	if len(recs) != 12 {
		t.Fatalf("%d JSON records, want 12", len(recs))
	}
	r5 := recs[4]
	if r5["kind"] != "record" || r5["lsn"].(float64) != 5 || r5["id"] != "0x0001ff" || r5["scope"] != "b" || r5["segment"] != "00000000000000000001.wal" || r5["offset"].(float64) < 32 {
		t.Errorf("record 5: %v", r5)
	}
	if r := recs[1]; r["reply_size"].(float64) != 2 || r["claim_lsn"].(float64) != 1 {
		t.Errorf("record 2: %v", r)
	}
	wantFiltered(t, dir, "wal", "records", []filterCase{
		{[]string{"--scope", "a"}, 6},
		{[]string{"--scope", ""}, 0},
		{[]string{"--id", "order-"}, 6}, // claims and commits of order-1..3, and the ack naming order-2
		{[]string{"--id", "0x0001"}, 2},
		{[]string{"--client", "worker-7"}, 4},
		{[]string{"--from-lsn", "3", "--to-lsn", "4"}, 2},
		{[]string{"--since", "2026-01-01T00:02:00Z", "--until", "2026-01-01T00:04:00Z"}, 3},
		{[]string{"--type", "ack,abort"}, 1},
		{[]string{"--scope", "a", "--type", "claim"}, 3},
	})
}

func TestDumpIndex(t *testing.T) {
	dir := makeFixture(t)
	out, _ := wantCode(t, 0, "dump", "index", dir)
	if n := countLines(out); n != 4 {
		t.Fatalf("%d entries, want 4:\n%s", n, out)
	}
	wantContains(t, "dump index", out,
		"entry scope=a id=order-1 state=committed committed=2026-01-01T00:00:00Z commit_lsn=2 reply_size=2 fp=6631",
		"entry scope=a id=order-3 state=in-flight claimed=2026-01-01T00:03:00Z claim_lsn=7 lease_until=2026-01-01T01:03:00Z",
		"entry scope=b id=0x0001ff state=committed",
		"entry scope=c client=worker-7 state=committed seq=2",
	)
	o, _ := wantCode(t, 0, "dump", "index", dir, "--json")
	ents := jsonLines(t, o)
	if len(ents) != 4 {
		t.Fatalf("%d JSON entries", len(ents))
	}
	var client map[string]any
	for _, e := range ents {
		if e["kind"] != "entry" {
			t.Errorf("kind %v", e["kind"])
		}
		if e["client"] == "worker-7" {
			client = e
		}
	}
	if client == nil || client["seq"].(float64) != 2 || client["reply_size"].(float64) != 2 || client["state"] != "committed" {
		t.Errorf("client entry %v", client)
	}
	wantFiltered(t, dir, "index", "entries", []filterCase{
		{[]string{"--state", "in-flight"}, 1},
		{[]string{"--state", "committed"}, 3},
		{[]string{"--scope", "a"}, 2},
		{[]string{"--id", "order-1"}, 1},
		{[]string{"--client", "worker-7"}, 1},
		{[]string{"--since", "2026-01-01T00:02:00Z"}, 3},
		{[]string{"--from-lsn", "7", "--to-lsn", "7"}, 1},
	})
	// dump <dir>: the WAL, then the index.
	o, _ = wantCode(t, 0, "dump", dir, "--json")
	kinds := map[string]int{}
	for _, m := range jsonLines(t, o) {
		kinds[m["kind"].(string)]++
	}
	if kinds["record"] != 12 || kinds["entry"] != 4 {
		t.Errorf("dump <dir>: %v", kinds)
	}
}

func TestStatsJSON(t *testing.T) {
	dir := makeFixture(t)
	out, _ := wantCode(t, 0, "stats", dir, "--json")
	var s statsOut
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		t.Fatalf("stats --json: %v\n%s", err, out)
	}
	e := s.Entries
	if e.Total != 4 || e.InFlight != 1 || e.Committed != 3 || e.IDs != 3 || e.Clients != 1 || e.RepliesKept != 3 {
		t.Errorf("entries %+v", e)
	}
	if s.WAL.LastLSN != 12 || s.WAL.FirstLSN != 1 || s.WAL.Segments != 1 || s.Index.AppliedLSN != 12 || s.Index.StoredEntries != 4 {
		t.Errorf("wal %+v index %+v", s.WAL, s.Index)
	}
	if len(s.ByScope) != 3 || s.ByScope[0].Scope != "a" || s.ByScope[0].Entries != 2 {
		t.Errorf("by scope %+v", s.ByScope)
	}
	var aged int64
	for _, b := range s.Age {
		aged += b.Count
	}
	if aged != 3 {
		t.Errorf("age histogram counts %d replies, want 3: %+v", aged, s.Age)
	}
	out, _ = wantCode(t, 0, "stats", dir)
	wantContains(t, "stats", out, "4 live: 1 in flight, 3 committed", "LSN 1..12", "applied LSN 12")
}

func TestVerifyGood(t *testing.T) {
	dir := makeFixture(t)
	out, _ := wantCode(t, 0, "verify", dir)
	wantContains(t, "verify", out, "12 records, every frame and payload checked", "4 entries, identical to the index", "\nok\n")
}

// recordOffset returns the segment offset of the record at lsn.
func recordOffset(t *testing.T, dir string, lsn int) int64 {
	t.Helper()
	o, _ := wantCode(t, 0, "dump", "wal", dir, "--json", "--from-lsn", fmt.Sprint(lsn), "--to-lsn", fmt.Sprint(lsn))
	recs := jsonLines(t, o)
	if len(recs) != 1 {
		t.Fatalf("record %d: %v", lsn, recs)
	}
	return int64(recs[0]["offset"].(float64))
}

func TestVerifyFlippedByte(t *testing.T) {
	dir := makeFixture(t)
	off := recordOffset(t, dir, 6)
	seg := filepath.Join(dir, "wal", "00000000000000000001.wal")
	b, err := os.ReadFile(seg)
	if err != nil {
		t.Fatal(err)
	}
	b[off+20] ^= 0x40 // a payload byte of record 6, in the middle of the segment
	if err := os.WriteFile(seg, b, 0o644); err != nil {
		t.Fatal(err)
	}
	out, _ := wantCode(t, 1, "verify", dir)
	want := fmt.Sprintf("PROBLEM wal: segment 00000000000000000001.wal offset %d:", off)
	if !strings.Contains(out, want) || !strings.Contains(out, "FAILED") {
		t.Errorf("verify does not report %q:\n%s", want, out)
	}
	_, errs := wantCode(t, 1, "dump", "wal", dir)
	if !strings.Contains(errs, fmt.Sprintf("segment 00000000000000000001.wal offset %d", off)) || countLines(errs) != 1 {
		t.Errorf("dump on a corrupt WAL: %q", errs)
	}
	wantCode(t, 1, "stats", dir)
}

// TestVerifyIndexMismatch changes the index behind the WAL's back: verify
// names the missing, extra and different entries.
func TestVerifyIndexMismatch(t *testing.T) {
	dir := makeFixture(t)
	ix, err := index.Open(index.Options{Dir: filepath.Join(dir, "index"), FS: vfs.Default})
	if err != nil {
		t.Fatal(err)
	}
	db := ix.DB()
	mustDo := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	mustDo(db.Delete(index.EntryKey(nil, "b", index.ModeID, []byte{0, 1, 0xff}), pebble.NoSync))
	mustDo(db.Set(index.EntryKey(nil, "a", index.ModeID, []byte("ghost")), index.EncodeEntry(nil, &index.Entry{Committed: true, CommitTime: 1, ReplyKept: true, Reply: []byte("x"), LSN: 3}), pebble.NoSync))
	k1 := index.EntryKey(nil, "a", index.ModeID, []byte("order-1"))
	e1, err := ix.Get(k1)
	if err != nil || e1 == nil {
		t.Fatal(err)
	}
	e1.Reply = []byte("tampered")
	mustDo(db.Set(k1, index.EncodeEntry(nil, e1), pebble.NoSync))
	mustDo(ix.Close(true))

	out, _ := wantCode(t, 1, "verify", dir)
	for _, want := range []string{
		"missing from the index: scope b id 0x0001ff",
		"extra in the index (the WAL never created it or removed it): scope a id ghost",
		"differs from the replay: scope a id order-1: reply: index 0x74616d7065726564, replay 0x7231",
		"scope a id ghost keeps a reply committed at",
		"entry count says 4 but it holds 4", // deleted one, added one: the count happens to match
	} {
		if strings.HasPrefix(want, "entry count") {
			if strings.Contains(out, want) {
				t.Errorf("false count problem:\n%s", out)
			}
			continue
		}
		if !strings.Contains(out, want) {
			t.Errorf("verify lacks %q:\n%s", want, out)
		}
	}
}

// TestReadWhileOpen: the read-only commands work while an engine has the
// directory open, take no lock, and say that they may be behind.
func TestReadWhileOpen(t *testing.T) {
	dir := makeFixture(t)
	e, err := idem.Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if _, err := e.Do(bg, idem.Request{Scope: "live", ID: []byte("live-1")}, func(context.Context) ([]byte, error) { return []byte("hot"), nil }); err != nil {
		t.Fatal(err)
	}
	out, errs := wantCode(t, 0, "dump", "index", dir)
	if !strings.Contains(errs, "may be behind") {
		t.Errorf("no note about the writer: %q", errs)
	}
	if !strings.Contains(out, "id=live-1") {
		t.Errorf("the record written by the open engine is missing:\n%s", out)
	}
	out, errs = wantCode(t, 0, "dump", "wal", dir, "--scope", "live")
	if countLines(out) != 2 || !strings.Contains(errs, "may be behind") {
		t.Errorf("dump wal while open: %q %q", out, errs)
	}
	wantCode(t, 0, "verify", dir)
	wantCode(t, 0, "stats", dir, "--json")
	// The engine still works, and still holds its lock.
	if _, err := e.Do(bg, idem.Request{ID: []byte("live-2")}, func(context.Context) ([]byte, error) { return nil, nil }); err != nil {
		t.Fatal(err)
	}
	_, errs = wantCode(t, 1, "forget", dir, "--before", "1h")
	if !strings.Contains(errs, "ErrLocked") || countLines(errs) != 1 {
		t.Errorf("forget on a locked directory: %q", errs)
	}
}

func TestForget(t *testing.T) {
	dir := makeFixture(t)
	out, _ := wantCode(t, 0, "forget", dir, "--before", "2026-01-01T00:01:30Z", "--dry-run")
	if !strings.Contains(out, "would drop 1 of 4") {
		t.Errorf("dry run: %s", out)
	}
	out, _ = wantCode(t, 0, "forget", dir, "--before", "2026-01-01T00:01:30Z")
	if !strings.Contains(out, "forget appended at LSN 13") {
		t.Errorf("forget: %s", out)
	}
	out, _ = wantCode(t, 0, "dump", "index", dir)
	if strings.Contains(out, "order-1") || countLines(out) != 3 {
		t.Errorf("after forget:\n%s", out)
	}
	out, _ = wantCode(t, 0, "dump", "wal", dir, "--type", "forget")
	if !strings.Contains(out, "before=2026-01-01T00:01:30Z") {
		t.Errorf("forget record: %s", out)
	}
	wantCode(t, 0, "verify", dir)
}

func TestBadInput(t *testing.T) {
	dir := makeFixture(t)
	notIdem := t.TempDir()
	file := filepath.Join(notIdem, "f")
	os.WriteFile(file, []byte("x"), 0o644)
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{nil, 2, "Usage"},
		{[]string{"frobnicate"}, 2, "unknown command"},
		{[]string{"dump"}, 2, "missing the idem directory"},
		{[]string{"dump", "wal", dir, "extra"}, 2, "unexpected arguments"},
		{[]string{"dump", "--bogus", dir}, 2, "flag provided but not defined"},
		{[]string{"dump", filepath.Join(notIdem, "nope")}, 1, "no such directory"},
		{[]string{"stats", notIdem}, 1, "not an idem directory"},
		{[]string{"verify", file}, 1, "not a directory"},
		{[]string{"dump", "wal", dir, "--since", "yesterday"}, 2, "bad time \"yesterday\""},
		{[]string{"dump", "wal", dir, "--type", "nap"}, 2, "unknown record type"},
		{[]string{"dump", "index", dir, "--state", "gone"}, 2, "unknown --state"},
		{[]string{"forget", dir}, 2, "--before is required"},
		{[]string{"forget", dir, "--before", "soon"}, 2, "bad time"},
		{[]string{"forget", notIdem, "--before", "1h"}, 1, "not an idem directory"},
		{[]string{"bench", "--sync", "sometimes", "--requests", "1"}, 2, "unknown --sync"},
		{[]string{"bench", "--requests", "10", "--duration", "1s"}, 2, "not both"},
		{[]string{"demo", "--requests", "1"}, 2, "at least 2"},
		{[]string{"help", "nothing"}, 2, "unknown command"},
	} {
		code, out, errs := runCmd(t, tc.args...)
		if code != tc.code || !strings.Contains(out+errs, tc.want) {
			t.Errorf("idem %v: exit %d, want %d with %q\nstdout: %s\nstderr: %s", tc.args, code, tc.code, tc.want, out, errs)
		}
		if code != 0 && tc.args != nil && countLines(errs) != 1 {
			t.Errorf("idem %v: error is not one line: %q", tc.args, errs)
		}
	}
}

// TestGarbageWAL: no input makes a command panic.
func TestGarbageWAL(t *testing.T) {
	for name, content := range map[string][]byte{
		"empty":   nil,
		"zeros":   make([]byte, 4096),
		"garbage": bytes.Repeat([]byte("idem"), 1000),
		"header":  append([]byte("IDEMWAL1"), bytes.Repeat([]byte{0xff}, 100)...),
	} {
		dir := filepath.Join(t.TempDir(), "db")
		os.MkdirAll(filepath.Join(dir, "wal"), 0o755)
		os.WriteFile(filepath.Join(dir, "wal", "00000000000000000001.wal"), content, 0o644)
		for _, cmd := range [][]string{{"verify", dir}, {"dump", dir}, {"stats", dir, "--json"}} {
			code, out, errs := runCmd(t, cmd...)
			if strings.Contains(errs, "internal error") || code > 1 {
				t.Errorf("%s: idem %v: exit %d\n%s\n%s", name, cmd, code, out, errs)
			}
		}
	}
}

func TestBench(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "bench")
	out, _ := wantCode(t, 0, "bench", "--requests", "200", "--concurrency", "4", "--json", "--dir", dir, "--reply-size", "2000")
	var b benchOut
	if err := json.Unmarshal([]byte(out), &b); err != nil {
		t.Fatalf("bench --json: %v\n%s", err, out)
	}
	if len(b.Phases) != 2 || b.Phases[0].Phase != "fresh" || b.Phases[0].Ops != 200 || b.Phases[1].Ops != 200 || b.Phases[1].Errors != 0 {
		t.Fatalf("phases %+v", b.Phases)
	}
	if b.Phases[0].P50us <= 0 || b.Phases[0].P999us < b.Phases[0].P50us || b.LiveEntries != 200 || !b.Kept {
		t.Errorf("bench %+v", b)
	}
	wantCode(t, 0, "verify", dir)
	out, _ = wantCode(t, 0, "bench", "--requests", "50", "--concurrency", "2", "--relaxed-claims", "--sync", "never")
	if !strings.Contains(out, "fresh") || !strings.Contains(out, "duplicate") || !strings.Contains(out, "p99.9") {
		t.Errorf("bench text:\n%s", out)
	}
}

func TestDemo(t *testing.T) {
	for _, mode := range []string{"child process", "in-process"} {
		t.Run(mode, func(t *testing.T) {
			args := []string{"demo", "--requests", "80", "--clients", "4", "--seed", "7", "--dir", filepath.Join(t.TempDir(), "demo")}
			if mode == "in-process" {
				args = append(args, "--in-process")
			}
			out, _ := wantCode(t, 0, args...)
			wantContains(t, "demo output", out, "requests            80 from 4 clients", "executions          80 (ledger lines)",
				"CHECK no request executed twice (ledger ids unique)", "recover-and-commit", "exactly-once: ok")
			if strings.Contains(out, "FAILED") {
				t.Errorf("demo failed:\n%s", out)
			}
			if mode == "child process" && !strings.Contains(out, "signal: killed") {
				t.Errorf("the child did not die by SIGKILL:\n%s", out)
			}
		})
	}
	// No flags but small: a temporary directory that is removed.
	out, _ := wantCode(t, 0, "demo", "--requests", "20")
	if !strings.Contains(out, "removed at the end") || !strings.Contains(out, "exactly-once: ok") {
		t.Errorf("demo:\n%s", out)
	}
}

func TestHelp(t *testing.T) {
	out, _ := wantCode(t, 0, "--help")
	for _, c := range commands {
		if !strings.Contains(out, "  "+c.name+" ") {
			t.Errorf("--help does not list %s", c.name)
		}
	}
	for _, c := range commands {
		for _, args := range [][]string{{c.name, "--help"}, {"help", c.name}, {c.name, "-h"}} {
			o, _ := wantCode(t, 0, args...)
			if !strings.Contains(o, "Usage: idem "+c.name) || !strings.Contains(o, "Examples:") {
				t.Errorf("idem %v:\n%s", args, o)
			}
			if strings.Contains(o, "--child") || strings.Contains(o, "(hidden)") {
				t.Errorf("idem %v shows a hidden flag", args)
			}
			// Every visible flag is explained.
			fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
			c.setup(fs)
			fs.VisitAll(func(f *flag.Flag) {
				if !strings.HasPrefix(f.Usage, "(hidden)") && !strings.Contains(o, "\n  "+flagSpelling(f.Name)) {
					t.Errorf("idem help %s does not explain %s", c.name, flagSpelling(f.Name))
				}
			})
		}
	}
}

// TestHelpFlagsMatchExamples: every flag an example uses is listed under
// Flags exactly as the example writes it (idem snapshot listed "--o file"
// while its examples said "-o").
func TestHelpFlagsMatchExamples(t *testing.T) {
	// shown returns the flags a command's --help lists, as it writes them.
	shown := func(name string) map[string]bool {
		o, _ := wantCode(t, 0, name, "--help")
		_, flags, ok := strings.Cut(o, "\nFlags:\n")
		if !ok {
			return nil
		}
		flags, _, _ = strings.Cut(flags, "\nExamples:")
		m := map[string]bool{}
		for _, line := range strings.Split(flags, "\n") {
			if strings.HasPrefix(line, "  -") {
				m[strings.Fields(line)[0]] = true
			}
		}
		return m
	}
	checked := 0
	for _, c := range commands {
		for _, ex := range c.examples {
			ex, _, _ = strings.Cut(ex, "#") // a comment
			// Each idem command of a pipeline or list, against its own flags.
			for _, part := range regexp.MustCompile(`\|\||&&|[|;]`).Split(ex, -1) {
				words := strings.Fields(part)
				if len(words) < 2 || words[0] != "idem" || lookupCommand(words[1]) == nil {
					continue
				}
				flags := shown(words[1])
				for _, w := range words[2:] {
					w, _, _ = strings.Cut(w, "=")
					if !strings.HasPrefix(w, "-") || w == "-" || regexp.MustCompile(`^-[0-9]`).MatchString(w) {
						continue // an argument, standard input/output or a negative number
					}
					checked++
					if !flags[w] {
						t.Errorf("idem %s: the example %q uses %s, but --help lists %v", words[1], ex, w, flags)
					}
				}
			}
		}
	}
	if checked < 20 {
		t.Fatalf("only %d flags found in the examples: the parsing is broken", checked)
	}
}

// fill runs n fresh requests with ids prefix-0..n-1 on e.
func fill(t *testing.T, e *idem.Engine, prefix string, n int) {
	t.Helper()
	reply := bytes.Repeat([]byte("r"), 100)
	for i := 0; i < n; i++ {
		id := []byte(fmt.Sprintf("%s-%04d", prefix, i))
		if _, err := e.Do(bg, idem.Request{Scope: "s", ID: id}, func(context.Context) ([]byte, error) { return reply, nil }); err != nil {
			t.Fatal(err)
		}
	}
}

func entryIDs(t *testing.T, dir string) map[string]bool {
	t.Helper()
	o, _ := wantCode(t, 0, "dump", "index", dir, "--json")
	ids := map[string]bool{}
	for _, m := range jsonLines(t, o) {
		ids[m["id"].(string)] = true
	}
	return ids
}

func TestCompactSnapshotRestore(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "db")
	small := &idem.Options{SegmentSize: 32 << 10}
	e, err := idem.Open(dir, small)
	if err != nil {
		t.Fatal(err)
	}
	fill(t, e, "a", 400)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	out, _ := wantCode(t, 0, "compact", dir, "--json")
	var cs compactOut
	if err := json.Unmarshal([]byte(out), &cs); err != nil {
		t.Fatal(err)
	}
	if cs.SegmentsRemoved < 1 || cs.Snapshot == "" || cs.DurableLSN != 800 {
		t.Fatalf("compact: %+v", cs)
	}
	// More records after the snapshot, so the WAL starts after LSN 1 and
	// holds records the snapshot does not.
	if e, err = idem.Open(dir, small); err != nil {
		t.Fatal(err)
	}
	fill(t, e, "b", 50)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	out, _ = wantCode(t, 0, "verify", dir)
	wantContains(t, "verify after compaction", out, "snapshots 1 files, newest at LSN 800", "plus the WAL after it, replayed into a fresh index: 450 entries, identical")
	ids := entryIDs(t, dir)
	if len(ids) != 450 {
		t.Fatalf("%d entries, want 450", len(ids))
	}

	// Snapshot (with the engine), restore, same entries.
	snap := filepath.Join(t.TempDir(), "x.snap")
	out, _ = wantCode(t, 0, "snapshot", dir, "-o", snap)
	if !strings.Contains(out, "450 entries as of LSN 900") {
		t.Errorf("snapshot: %s", out)
	}
	_, errs := wantCode(t, 1, "snapshot", dir, "-o", snap)
	if !strings.Contains(errs, "exists") {
		t.Errorf("snapshot over a file: %q", errs)
	}
	dir2 := filepath.Join(t.TempDir(), "restored")
	out, _ = wantCode(t, 0, "restore", snap, dir2)
	if !strings.Contains(out, "450 live entries as of LSN 900; its WAL continues at LSN 901") {
		t.Errorf("restore: %s", out)
	}
	if got := entryIDs(t, dir2); len(got) != len(ids) {
		t.Errorf("restored %d entries, want %d", len(got), len(ids))
	}
	wantCode(t, 0, "verify", dir2)
	_, errs = wantCode(t, 1, "restore", snap, dir2)
	if !strings.Contains(errs, "already holds an idem directory") || countLines(errs) != 1 {
		t.Errorf("restore over a directory: %q", errs)
	}
	// A truncated snapshot is refused and leaves nothing behind.
	b, _ := os.ReadFile(snap)
	cut := filepath.Join(t.TempDir(), "cut.snap")
	os.WriteFile(cut, b[:len(b)/2], 0o644)
	dir3 := filepath.Join(t.TempDir(), "r3")
	_, errs = wantCode(t, 1, "restore", cut, dir3)
	if !strings.Contains(errs, "corrupt") || countLines(errs) != 1 {
		t.Errorf("restore of a truncated snapshot: %q", errs)
	}
	if ents, _ := os.ReadDir(filepath.Join(dir3, "index")); len(ents) != 0 {
		t.Errorf("a failed restore left %d index files", len(ents))
	}

	// While an engine has the directory open: the read-only snapshot works,
	// the others say ErrLocked.
	if e, err = idem.Open(dir, small); err != nil {
		t.Fatal(err)
	}
	fill(t, e, "c", 10)
	snap2 := filepath.Join(t.TempDir(), "live.snap")
	out, errs = wantCode(t, 0, "snapshot", dir, "--read-only", "-o", snap2)
	if !strings.Contains(out, "460 entries as of LSN 920") || !strings.Contains(errs, "may be behind") {
		t.Errorf("read-only snapshot: %q %q", out, errs)
	}
	for _, args := range [][]string{{"compact", dir}, {"snapshot", dir, "-o", filepath.Join(t.TempDir(), "y")}} {
		if _, errs := wantCode(t, 1, args...); !strings.Contains(errs, "ErrLocked") {
			t.Errorf("idem %v on a locked directory: %q", args, errs)
		}
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	dir4 := filepath.Join(t.TempDir(), "r4")
	wantCode(t, 0, "restore", snap2, dir4)
	if got := entryIDs(t, dir4); len(got) != 460 {
		t.Errorf("restored from the read-only snapshot: %d entries, want 460", len(got))
	}

	// Without its index files the directory is read as Open would: from the
	// newest snapshot plus the WAL.
	if err := os.RemoveAll(filepath.Join(dir, "index")); err != nil {
		t.Fatal(err)
	}
	out, errs = wantCode(t, 0, "dump", "index", dir)
	if countLines(out) != 460 || !strings.Contains(errs, "loaded snapshot") {
		t.Errorf("dump index without index files: %d entries, %q", countLines(out), errs)
	}
}

// TestCorruptIndex: a damaged index file is reported on one line, never a
// panic, and verify still checks the WAL.
func TestCorruptIndex(t *testing.T) {
	dir := makeFixture(t)
	ssts, _ := filepath.Glob(filepath.Join(dir, "index", "*.sst"))
	if len(ssts) == 0 {
		t.Fatal("no sstable in the fixture's index")
	}
	for _, p := range ssts {
		b, _ := os.ReadFile(p)
		for i := 40; i < 80 && i < len(b); i++ {
			b[i] ^= 0xff
		}
		os.WriteFile(p, b, 0o644)
	}
	for _, args := range [][]string{{"dump", "index", dir}, {"stats", dir}} {
		_, errs := wantCode(t, 1, args...)
		if !strings.Contains(errs, "cannot read the index in "+filepath.Join(dir, "index")) || countLines(errs) != 1 {
			t.Errorf("idem %v: %q", args, errs)
		}
	}
	out, _ := wantCode(t, 1, "verify", dir)
	if !strings.Contains(out, "PROBLEM index: cannot read the index") || !strings.Contains(out, "12 records, every frame and payload checked") {
		t.Errorf("verify:\n%s", out)
	}
}

func TestScale(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "scale")
	out, _ := wantCode(t, 0, "scale", "--ids", "3000", "--every", "1000", "--concurrency", "8", "--lookups", "200ms",
		"--memory-budget", "64MiB", "--dir", dir, "--json")
	var s scaleOut
	if err := json.Unmarshal([]byte(out), &s); err != nil {
		t.Fatalf("scale --json: %v\n%s", err, out)
	}
	// The fill is sampled every 100 ms: a fast machine passes several
	// marks between two samples, so there may be fewer lines than marks.
	if s.IDs != 3000 || len(s.Fill) < 1 || s.Fill[len(s.Fill)-1].IDs != 3000 || s.MemoryBudget != 64<<20 {
		t.Fatalf("scale %+v", s)
	}
	for i := 1; i < len(s.Fill); i++ {
		if s.Fill[i].IDs <= s.Fill[i-1].IDs || s.Fill[i].IDs/1000 == s.Fill[i-1].IDs/1000 {
			t.Fatalf("fill lines %d and %d: %d then %d ids (one line per --every 1000 passed)", i-1, i, s.Fill[i-1].IDs, s.Fill[i].IDs)
		}
	}
	if s.IndexBytes <= 0 || s.DiskPerID <= 0 || s.Duplicate.Ops == 0 || s.Duplicate.Errors != 0 || s.ReopenSeconds <= 0 {
		t.Fatalf("scale %+v", s)
	}
	if s.GoBytes <= 0 || s.GoBytes > s.RSSBytes || s.Fill[0].GoBytes <= 0 {
		t.Fatalf("scale: Go's share of RSS %d (RSS %d), in the first fill line %d", s.GoBytes, s.RSSBytes, s.Fill[0].GoBytes)
	}
	wantCode(t, 0, "verify", dir)
	out, _ = wantCode(t, 0, "scale", "--ids", "500", "--every", "500", "--concurrency", "4", "--lookups", "50ms", "--pprof", "127.0.0.1:0")
	if !regexp.MustCompile(`pprof +http://127\.0\.0\.1:\d+/debug/pprof/`).MatchString(out) || !strings.Contains(out, " go ") {
		t.Errorf("scale --pprof 127.0.0.1:0:\n%s", out)
	}
	if _, errs := wantCode(t, 2, "scale", "--ids", "10", "--pprof", "0.0.0.0:0"); !strings.Contains(errs, "loopback") {
		t.Errorf("scale --pprof 0.0.0.0:0: %s", errs)
	}
	seen := map[string]bool{}
	for i := range uint64(100000) {
		id := string(scaleID(nil, i))
		if len(id) != 16 || seen[id] {
			t.Fatalf("scale id %d: %x repeats or has the wrong size", i, id)
		}
		seen[id] = true
	}
	if _, errs := wantCode(t, 2, "scale", "--ids", "0"); !strings.Contains(errs, "--ids") {
		t.Errorf("scale --ids 0: %s", errs)
	}
	if _, errs := wantCode(t, 2, "scale", "--memory-budget", "lots"); !strings.Contains(errs, "size") {
		t.Errorf("scale --memory-budget lots: %s", errs)
	}
}

// TestVerifyLostSyncedRegion zeroes fsynced frames in the middle of the log
// (a disk that dropped a written region and kept later writes): verify
// names the segment and offset, and says the records were fsynced; Open
// does too once it has to replay them (here: with the index gone).
func TestVerifyLostSyncedRegion(t *testing.T) {
	dir := makeFixture(t)
	from, to := recordOffset(t, dir, 5), recordOffset(t, dir, 9)
	seg := filepath.Join(dir, "wal", "00000000000000000001.wal")
	b, err := os.ReadFile(seg)
	if err != nil {
		t.Fatal(err)
	}
	clear(b[from:to])
	if err := os.WriteFile(seg, b, 0o644); err != nil {
		t.Fatal(err)
	}
	out, _ := wantCode(t, 1, "verify", dir)
	want := fmt.Sprintf("PROBLEM wal: segment 00000000000000000001.wal offset %d:", from)
	if !strings.Contains(out, want) || !strings.Contains(out, "fsynced records were lost") {
		t.Errorf("verify does not report %q:\n%s", want, out)
	}
	if err := os.RemoveAll(filepath.Join(dir, "index")); err != nil {
		t.Fatal(err)
	}
	_, err = idem.Open(dir, &idem.Options{SegmentSize: 1 << 20})
	if !errors.Is(err, idem.ErrCorrupt) || !strings.Contains(err.Error(), fmt.Sprintf("offset %d", from)) {
		t.Fatalf("Open: %v, want ErrCorrupt at offset %d", err, from)
	}
}

// dump shows a batch record as one line per operation, in order, and
// verify replays it.
func TestDumpBatch(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "db")
	e, err := idem.Open(dir, &idem.Options{Clock: testclock.At(t0).Now})
	if err != nil {
		t.Fatal(err)
	}
	b := e.NewBatch()
	b.Put(idem.Request{Scope: "ev", ID: []byte("e1")}, []byte("ok"))
	b.Begin(idem.Request{Client: "c", Seq: 1})
	if _, err := b.Run(bg); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	out, _ := wantCode(t, 0, "dump", "wal", dir, "--type", "batch")
	wantContains(t, "dump wal", out,
		"lsn=1 type=batch:claim time=2026-01-01T00:00:00Z scope=ev id=e1",
		"lsn=1 type=batch:commit time=2026-01-01T00:00:00Z scope=ev id=e1 reply_size=2",
		"lsn=1 type=batch:claim time=2026-01-01T00:00:00Z scope=\"\" client=c seq=1",
	)
	if countLines(out) != 3 {
		t.Errorf("dump wal: %d lines, want 3:\n%s", countLines(out), out)
	}
	wantCode(t, 0, "verify", dir)
}

// dump shows the clients a commit-advance or an advance record raises, and
// verify replays them.
func TestDumpAdvance(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "db")
	e, err := idem.Open(dir, &idem.Options{Clock: testclock.At(t0).Now})
	if err != nil {
		t.Fatal(err)
	}
	res, err := e.Begin(bg, idem.Request{Scope: "ev", ID: []byte("e1")})
	if err != nil {
		t.Fatal(err)
	}
	if err := res.Claim.CommitAdvance(bg, []byte("ok"), idem.Advance{Scope: "f", Client: "p0", Seq: 7}); err != nil {
		t.Fatal(err)
	}
	if err := e.Advance(bg, idem.Advance{Scope: "f", Client: "p0", Seq: 9}); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	out, _ := wantCode(t, 0, "dump", "wal", dir)
	wantContains(t, "dump wal", out,
		"lsn=2 type=commit-advance time=2026-01-01T00:00:00Z scope=ev id=e1",
		"advanced=[scope f client p0 to 7]",
		"lsn=3 type=advance time=2026-01-01T00:00:00Z advanced=[scope f client p0 to 9]",
	)
	if o, _ := wantCode(t, 0, "dump", "wal", dir, "--type", "advance,commit-advance"); countLines(o) != 2 {
		t.Errorf("--type advance,commit-advance:\n%s", o)
	}
	wantCode(t, 0, "verify", dir)
}
