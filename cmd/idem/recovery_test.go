package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemgrpc"
	"github.com/idemdb/idem/idemhttp"
	"github.com/idemdb/idem/internal/recovery"
	"github.com/idemdb/idem/internal/testclock"
	"github.com/idemdb/idem/wal"
)

// treeState describes every file and directory under dir: path, type,
// mode, size, modification time and the SHA-256 of the contents. Two equal
// states mean nothing under dir was created, removed, renamed or written.
func treeState(t *testing.T, dir string) string {
	t.Helper()
	var b strings.Builder
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		fmt.Fprintf(&b, "%s %v %d %d", rel, info.Mode(), info.Size(), info.ModTime().UnixNano())
		if info.Mode().IsRegular() {
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			sum := sha256.Sum256(data)
			fmt.Fprintf(&b, " %s", hex.EncodeToString(sum[:]))
		}
		b.WriteByte('\n')
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// readOnlyView is what the read-only commands said about a directory.
type readOnlyView struct {
	stats   statsOut
	entries []entryOut
	verify  string
}

// viewDir runs every read-only command on dir (dump, stats, verify,
// snapshot --read-only, forget --dry-run) and fails t if any of them
// changed anything under dir.
func viewDir(t *testing.T, dir string) readOnlyView {
	t.Helper()
	before := treeState(t, dir)
	var v readOnlyView
	var out string
	out, _ = wantCode(t, 0, "stats", dir, "--json")
	if err := json.Unmarshal([]byte(out), &v.stats); err != nil {
		t.Fatalf("stats --json: %v\n%s", err, out)
	}
	out, _ = wantCode(t, 0, "dump", "index", dir, "--json")
	for _, m := range jsonLines(t, out) {
		b, _ := json.Marshal(m)
		var e entryOut
		if err := json.Unmarshal(b, &e); err != nil {
			t.Fatal(err)
		}
		v.entries = append(v.entries, e)
	}
	v.verify, _ = wantCode(t, 0, "verify", dir)
	wantCode(t, 0, "dump", "wal", dir, "--json")
	wantCode(t, 0, "snapshot", dir, "--read-only", "-o", filepath.Join(t.TempDir(), "ro.snap"))
	wantCode(t, 0, "forget", dir, "--before", "1h", "--dry-run")
	if after := treeState(t, dir); after != before {
		t.Fatalf("the read-only commands changed %s:\nbefore:\n%s\nafter:\n%s", dir, before, after)
	}
	return v
}

// checkAgrees opens dir's engine (clock at now) and checks that it finds
// what the read-only commands reported: the same live entries, each in the
// same state, the same claims in doubt, the same last LSN.
func checkAgrees(t *testing.T, dir string, now time.Time, v readOnlyView) idem.Stats {
	t.Helper()
	e, err := idem.Open(dir, &idem.Options{Clock: testclock.At(now).Now})
	if err != nil {
		t.Fatalf("Open after the tool read the directory: %v", err)
	}
	defer e.Close()
	ctx := context.Background()
	st := e.Stats()
	if st.LiveEntries != v.stats.Entries.Total || len(v.entries) != int(st.LiveEntries) {
		t.Errorf("Open finds %d live entries; stats said %d, dump listed %d", st.LiveEntries, v.stats.Entries.Total, len(v.entries))
	}
	if st.AppliedLSN != v.stats.WAL.LastLSN {
		t.Errorf("Open applied through LSN %d; stats said the WAL ends at LSN %d", st.AppliedLSN, v.stats.WAL.LastLSN)
	}
	doubts, err := e.InDoubt(ctx, "")
	if err != nil {
		t.Fatal(err)
	}
	var openInFlight, toolInFlight []string
	for _, d := range doubts {
		openInFlight = append(openInFlight, d.Scope+"/"+readable(d.ID)+d.Client)
	}
	for _, en := range v.entries {
		switch {
		case en.State == "in-flight":
			toolInFlight = append(toolInFlight, en.Scope+"/"+en.ID+en.Client)
		case en.Client != "":
			seq, err := e.ClientState(ctx, en.Scope, en.Client)
			if err != nil || seq != en.Seq {
				t.Errorf("client %s/%s: Open has seq %d (%v), dump said %d", en.Scope, en.Client, seq, err, en.Seq)
			}
		default:
			id := []byte(en.ID)
			if strings.HasPrefix(en.ID, "0x") {
				id = parseIDArg(en.ID)
			}
			res, err := e.Lookup(ctx, idem.Request{Scope: en.Scope, ID: id})
			if err != nil || res.Status != idem.Done || len(res.Reply) != *en.ReplySize {
				t.Errorf("%s/%s: Open says %v with %d reply bytes (%v); dump said committed with %d", en.Scope, en.ID, res.Status, len(res.Reply), err, *en.ReplySize)
			}
		}
	}
	slices.Sort(openInFlight)
	slices.Sort(toolInFlight)
	if !slices.Equal(openInFlight, toolInFlight) || int64(len(doubts)) != v.stats.Entries.InFlight {
		t.Errorf("claims in doubt: Open %v, dump %v, stats %d", openInFlight, toolInFlight, v.stats.Entries.InFlight)
	}
	return st
}

// TestToolAgreesWithOpen: on directories where recovery has work to do (a
// torn tail, a deleted index, an index rebuilt from a snapshot), what
// stats, dump and verify report is what Open then finds, and none of the
// read-only commands writes anything into the directory.
func TestToolAgreesWithOpen(t *testing.T) {
	ctx := context.Background()
	fixtureNow := t0.Add(10 * time.Minute)

	t.Run("torn tail", func(t *testing.T) {
		dir := makeFixture(t)
		// Non-zero bytes after the last valid frame of the last segment:
		// a write cut by a crash.
		res, err := wal.Scan(vfs.Default, filepath.Join(dir, "wal"), 0, 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		last := res.Segments[len(res.Segments)-1]
		f, err := os.OpenFile(filepath.Join(dir, "wal", last.Name), os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt([]byte(strings.Repeat("\xab", 100)), last.Size); err != nil {
			t.Fatal(err)
		}
		f.Close()
		v := viewDir(t, dir)
		if v.stats.WAL.TornTail == "" || !strings.Contains(v.verify, "torn tail") {
			t.Errorf("the tool does not report the torn tail: stats %+v\nverify:\n%s", v.stats.WAL, v.verify)
		}
		if st := checkAgrees(t, dir, fixtureNow, v); st.TornTailsCut != 1 {
			t.Errorf("Open cut %d torn tails, want 1", st.TornTailsCut)
		}
	})

	t.Run("deleted index", func(t *testing.T) {
		dir := makeFixture(t)
		if err := os.RemoveAll(filepath.Join(dir, "index")); err != nil {
			t.Fatal(err)
		}
		v := viewDir(t, dir)
		if v.stats.Index.Replayed != 12 || v.stats.Entries.Total != 4 {
			t.Errorf("stats without the index: %d records replayed, %d entries; want 12, 4", v.stats.Index.Replayed, v.stats.Entries.Total)
		}
		if _, err := os.Stat(filepath.Join(dir, "index")); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("the tool created the index directory: %v", err)
		}
		checkAgrees(t, dir, fixtureNow, v)
	})

	t.Run("snapshot-seeded index", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "db")
		clk := testclock.At(t0)
		opts := &idem.Options{Clock: clk.Now, SegmentSize: 32 << 10, KeepSnapshots: 1}
		e, err := idem.Open(dir, opts)
		if err != nil {
			t.Fatal(err)
		}
		fill(t, e, "a", 300)
		if _, err := e.Compact(ctx); err != nil {
			t.Fatal(err)
		}
		fill(t, e, "b", 40)
		if _, err := e.Begin(ctx, idem.Request{Scope: "s", ID: []byte("pending")}); err != nil {
			t.Fatal(err)
		}
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		first, err := recovery.FirstLSN(vfs.Default, filepath.Join(dir, "wal"))
		if err != nil || first <= 1 {
			t.Fatalf("setup: the WAL starts at LSN %d (%v): compaction removed nothing", first, err)
		}
		if err := os.RemoveAll(filepath.Join(dir, "index")); err != nil {
			t.Fatal(err)
		}
		v := viewDir(t, dir)
		if v.stats.Index.SeededFrom == "" || v.stats.Entries.Total != 341 {
			t.Errorf("stats: %d entries, seeded from %q; want 341 entries from a snapshot", v.stats.Entries.Total, v.stats.Index.SeededFrom)
		}
		checkAgrees(t, dir, t0.Add(time.Minute), v)
	})
}

// copyTree copies the regular files under src to dst.
func copyTree(t *testing.T, src, dst string) {
	t.Helper()
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		if d.IsDir() {
			return os.MkdirAll(filepath.Join(dst, rel), 0o755)
		}
		_, err = copyFile(p, filepath.Join(dst, rel))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestToolAndOpenRefuseLostRecords: an index older than the WAL's first
// segment (compaction removed records the index never applied) is refused
// by Open and reported by the tool, with the same words. Open used to skip
// the missing records silently while verify reported them.
func TestToolAndOpenRefuseLostRecords(t *testing.T) {
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "db")
	opts := &idem.Options{SegmentSize: 32 << 10}
	e, err := idem.Open(dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	fill(t, e, "a", 100)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	old := filepath.Join(t.TempDir(), "old-index")
	copyTree(t, filepath.Join(dir, "index"), old)
	if e, err = idem.Open(dir, opts); err != nil {
		t.Fatal(err)
	}
	fill(t, e, "b", 400)
	if _, err := e.Compact(ctx); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	first, err := recovery.FirstLSN(vfs.Default, filepath.Join(dir, "wal"))
	if err != nil || first <= 201 {
		t.Fatalf("setup: the WAL starts at LSN %d (%v), not after the old index's LSN 200", first, err)
	}
	if err := os.RemoveAll(filepath.Join(dir, "index")); err != nil {
		t.Fatal(err)
	}
	copyTree(t, old, filepath.Join(dir, "index"))

	want := fmt.Sprintf("has applied LSN 200 but the WAL starts at LSN %d: records 201..%d are in neither", first, first-1)
	before := treeState(t, dir)
	_, errs := wantCode(t, 1, "stats", dir)
	if !strings.Contains(errs, want) {
		t.Errorf("stats: %q, want %q", errs, want)
	}
	out, _ := wantCode(t, 1, "verify", dir)
	if !strings.Contains(out, "PROBLEM index: Open's recovery fails on it: the index ("+filepath.Join(dir, "index")+") "+want) {
		t.Errorf("verify:\n%s\nwant %q", out, want)
	}
	if after := treeState(t, dir); after != before {
		t.Fatalf("the read-only commands changed the directory")
	}
	_, err = idem.Open(dir, opts)
	if !errors.Is(err, idem.ErrCorrupt) || !strings.Contains(err.Error(), want) {
		t.Fatalf("Open: %v, want ErrCorrupt with %q", err, want)
	}
}

// TestNotAnIdemDir: every command taking a directory, given an
// application's data directory, says where it looked and names the idem
// directory inside it (or the one it is part of), and creates nothing.
func TestNotAnIdemDir(t *testing.T) {
	app := t.TempDir()
	e, err := idem.Open(filepath.Join(app, "idem"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(app, "journal.jsonl"), []byte("{}\n"), 0o644)
	before := treeState(t, app)
	engine := filepath.Join(app, "idem")
	for _, args := range [][]string{
		{"dump", app}, {"dump", "index", app}, {"stats", app}, {"verify", app},
		{"forget", app, "--before", "1h"}, {"compact", app},
		{"snapshot", app, "-o", filepath.Join(t.TempDir(), "s")},
	} {
		_, errs := wantCode(t, 1, args...)
		want := fmt.Sprintf("idem %s: %s is not an idem directory: there is no WAL in %s; the idem directory inside it is %s: run 'idem %s %s'\n",
			args[0], app, filepath.Join(app, "wal"), engine, args[0], engine)
		if errs != want {
			t.Errorf("idem %v:\n got %q\nwant %q", args, errs, want)
		}
	}
	_, errs := wantCode(t, 1, "stats", filepath.Join(engine, "wal"))
	if !strings.Contains(errs, "it is the wal/ subdirectory of the idem directory "+engine+": run 'idem stats "+engine+"'") {
		t.Errorf("stats on the wal/ subdirectory: %q", errs)
	}
	if after := treeState(t, app); after != before {
		t.Errorf("the commands changed %s:\n%s\n%s", app, before, after)
	}
	// Several idem directories (idemraft keeps one per generation).
	for _, sub := range []string{"dedup/gen-1", "dedup/gen-2"} {
		e, err := idem.Open(filepath.Join(app, sub), nil)
		if err != nil {
			t.Fatal(err)
		}
		e.Close()
	}
	_, errs = wantCode(t, 1, "stats", app)
	want := fmt.Sprintf("idem directories inside it: %s, %s, %s\n", engine, filepath.Join(app, "dedup/gen-1"), filepath.Join(app, "dedup/gen-2"))
	if !strings.HasSuffix(errs, want) {
		t.Errorf("stats with several idem directories inside: %q, want it to end with %q", errs, want)
	}
}

// TestIntegrationScopes: the scopes idemhttp and idemgrpc write are shown
// in their own words (stats, dump), JSON keeps the raw scope beside
// them, and --scope takes either form.
func TestIntegrationScopes(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "db")
	e, err := idem.Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	scopes := map[string]string{
		idemhttp.ScopeFor("", "alice"): "idemhttp(actor=alice)",
		idemhttp.ScopeFor("api", ""):   "idemhttp(prefix=api,shared)",
		idemhttp.ScopeFor("", strings.Repeat("x", idemhttp.MaxVerbatimActor+1)): "idemhttp(actor-sha256=" + func() string {
			s := sha256.Sum256([]byte(strings.Repeat("x", idemhttp.MaxVerbatimActor+1)))
			return hex.EncodeToString(s[:])
		}() + ")",
		idemgrpc.EncodeScope("", "bob", "tenant 1"): `idemgrpc(actor=bob,fields=["tenant 1"])`,
		idemgrpc.EncodeScope("ledger", "carol"):     "idemgrpc(prefix=ledger,actor=carol)",
		"payments":                                  "payments",
	}
	for scope := range scopes {
		if _, err := e.Do(bg, idem.Request{Scope: scope, ID: []byte("k1")}, func(context.Context) ([]byte, error) { return []byte("r"), nil }); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	out, _ := wantCode(t, 0, "stats", dir)
	dumpText, _ := wantCode(t, 0, "dump", dir)
	for scope, words := range scopes {
		if !strings.Contains(out, "\n             "+words+" ") {
			t.Errorf("stats does not show %q:\n%s", words, out)
		}
		if strings.Count(dumpText, " scope="+words+" ") != 3 { // claim, commit, entry
			t.Errorf("dump does not show scope=%s three times:\n%s", words, dumpText)
		}
		if words == "payments" {
			continue
		}
		o, _ := wantCode(t, 0, "dump", "index", dir, "--json", "--scope", words)
		lines := jsonLines(t, o)
		if len(lines) != 1 || lines[0]["scope"] != scope || lines[0]["integration"] != words {
			t.Errorf("dump index --json --scope %s: %v", words, lines)
		}
	}
}
