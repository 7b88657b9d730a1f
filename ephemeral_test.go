package idem

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/testclock"
)

// listFiles returns every file under dir in fs (paths relative to dir).
func listFiles(t testing.TB, fs vfs.FS, dir string) []string {
	t.Helper()
	var out []string
	var walk func(d, rel string)
	walk = func(d, rel string) {
		names, err := fs.List(d)
		if err != nil {
			return
		}
		for _, n := range names {
			p, r := fs.PathJoin(d, n), n
			if rel != "" {
				r = rel + "/" + n
			}
			if st, err := fs.Stat(p); err == nil && st.IsDir() {
				walk(p, r)
				continue
			}
			out = append(out, r)
		}
	}
	walk(dir, "")
	sort.Strings(out)
	return out
}

// ephemeralRun applies one seeded sequence of operations (Begin, Commit,
// Abort, Put and Begin in batches, Ack, Forget, per-request TTL and its
// cleanup, Compact) to e and returns a transcript of every answer.
func ephemeralRun(t *testing.T, e *Engine, clk *testclock.Clock) []string {
	t.Helper()
	rng := rand.New(rand.NewPCG(7, 11))
	var out []string
	rec := func(format string, a ...any) { out = append(out, fmt.Sprintf(format, a...)) }
	res := func(r Result, err error) string {
		if err != nil {
			return "err:" + err.Error()
		}
		return fmt.Sprintf("%v:%s", r.Status, r.Reply)
	}
	scopes := []string{"a", "b"}
	var open []*Claim
	for i := 0; i < 4000; i++ {
		s := scopes[rng.IntN(2)]
		x := []byte(fmt.Sprint("id", rng.IntN(400)))
		switch op := rng.IntN(20); {
		case op == 0:
			rec("ack %v", e.Ack(bg, s, x))
		case op == 1 && len(open) > 0:
			rec("abort %v", open[0].Abort(bg))
			open = open[1:]
		case op == 2:
			b := e.NewBatch()
			for j := 0; j < 1+rng.IntN(8); j++ {
				y := []byte(fmt.Sprint("id", rng.IntN(400)))
				if rng.IntN(2) == 0 {
					b.Put(Request{Scope: s, ID: y}, []byte(fmt.Sprint("put", i, j)))
				} else {
					b.Begin(Request{Scope: s, ID: y, Fingerprint: []byte{byte(j % 2)}})
				}
			}
			rs, err := b.Run(bg)
			rec("batch %v", err)
			for _, r := range rs {
				rec("  %s", res(r.Result, r.Err))
				if r.Err == nil && r.Result.Status == Fresh && r.Result.Claim != nil {
					open = append(open, r.Result.Claim)
				}
			}
		case op == 3:
			r, err := e.Begin(bg, Request{Scope: s, ID: x, TTL: time.Duration(1+rng.IntN(60)) * time.Second})
			rec("ttl %s", res(r, err))
			if err == nil && r.Status == Fresh {
				rec("commit %v", r.Claim.Commit(bg, []byte(fmt.Sprint("ttl", i))))
			}
		case op == 4 && i%40 == 4:
			// The cleanup finds expired entries in the index: what it
			// removes depends on what the applier applied.
			waitApplied(t, e)
			n, err := e.CleanupExpired(bg)
			rec("cleanup %d %v", n, err)
		case op == 5 && i%100 == 5:
			rec("forget %v", e.Forget(bg, clk.Now().Add(-20*time.Minute)))
		case op == 6 && i%200 == 6:
			_, err := e.Compact(bg)
			rec("compact %v", err)
		case op == 7:
			r, err := e.Lookup(bg, Request{Scope: s, ID: x})
			rec("lookup %s", res(r, err))
		default:
			r, err := e.Begin(bg, Request{Scope: s, ID: x})
			rec("begin %s", res(r, err))
			if err == nil && r.Status == Fresh {
				if rng.IntN(4) == 0 {
					open = append(open, r.Claim)
				} else {
					rec("commit %v", r.Claim.Commit(bg, []byte(fmt.Sprint("reply", i))))
				}
			}
		}
		clk.Advance(time.Second)
	}
	for _, s := range scopes {
		for j := 0; j < 400; j++ {
			r, err := e.Lookup(bg, Request{Scope: s, ID: []byte(fmt.Sprint("id", j))})
			rec("final %s/%d %s", s, j, res(r, err))
		}
	}
	return out
}

// An Ephemeral engine answers every operation as a normal one does, writes
// no WAL file and no fsync, and still moves its entries into Pebble (the
// index ingests by bytes), so its memory stays bounded.
func TestEphemeralSameResults(t *testing.T) {
	start := testclock.New().Now()
	run := func(eph bool) ([]string, vfs.FS, Stats, []byte) {
		fs := vfs.NewMem()
		clk := testclock.New()
		clk.Set(start)
		e := openMem(t, fs, &Options{Clock: clk.Now, Ephemeral: eph, IndexIngestBytes: 4 << 10, CacheSize: 8 << 10})
		out := ephemeralRun(t, e, clk)
		waitApplied(t, e)
		var snap bytes.Buffer
		if _, err := e.Snapshot(bg, &snap); err != nil {
			t.Fatal(err)
		}
		st := e.Stats()
		if eph {
			var ingested uint64
			for _, l := range e.ix.DB().Metrics().Levels {
				ingested += l.TablesIngested
			}
			if ingested < 10 {
				t.Fatalf("ephemeral: %d sstables ingested; entries must reach Pebble", ingested)
			}
			if files := listFiles(t, fs, "db"); len(files) == 0 || !containsPrefix(files, "index/") {
				t.Fatalf("ephemeral: files %v, want the index", files)
			}
			for _, f := range listFiles(t, fs, "db") {
				if !strings.HasPrefix(f, "index/") && f != "LOCK" && f != ephemeralMarker {
					t.Fatalf("ephemeral engine wrote %s", f)
				}
			}
		}
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		return out, fs, st, snap.Bytes()
	}
	want, _, _, _ := run(false)
	got, fs, st, snap := run(true)
	if len(got) != len(want) {
		t.Fatalf("transcripts of %d and %d lines", len(got), len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("line %d: ephemeral %q, normal %q", i, got[i], want[i])
		}
	}
	if st.WALBytes != 0 || st.WALSegments != 0 || st.WALSyncs != 0 || st.DurableLSN != st.LastLSN || st.LastLSN == 0 {
		t.Fatalf("ephemeral stats: %+v", st)
	}
	// Close leaves nothing but the lock file.
	if files := listFiles(t, fs, "db"); len(files) != 1 || files[0] != "LOCK" {
		t.Fatalf("after Close: %v", files)
	}
	// Restore into an Ephemeral engine: the snapshot's state, and new
	// records go on after its LSN.
	fs2 := vfs.NewMem()
	e, err := Restore("db", bytes.NewReader(snap), &Options{FS: fs2, Ephemeral: true})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	found := 0
	for j := 0; j < 400; j++ {
		if r, err := e.Lookup(bg, Request{Scope: "a", ID: []byte(fmt.Sprint("id", j))}); err != nil {
			t.Fatal(err)
		} else if r.Status == Done {
			found++
		}
	}
	if found == 0 {
		t.Fatal("restored ephemeral engine knows no id")
	}
	if e.Stats().LastLSN != st.LastLSN {
		t.Fatalf("restored LastLSN %d, want %d", e.Stats().LastLSN, st.LastLSN)
	}
	commitID(t, e, Request{Scope: "a", ID: id("after-restore")}, "r")
	if got := e.Stats().LastLSN; got != st.LastLSN+2 {
		t.Fatalf("LastLSN after a claim and a commit: %d, want %d", got, st.LastLSN+2)
	}
}

func containsPrefix(list []string, p string) bool {
	for _, s := range list {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

// What Open does with the directory in each mode, and the options an
// Ephemeral engine refuses.
func TestEphemeralDirectoryAndOptions(t *testing.T) {
	fs := vfs.NewMem()
	e := openMem(t, fs, nil) // a normal engine: a WAL and an index
	commitID(t, e, Request{Scope: "s", ID: id("x")}, "r")
	e.Close()
	if _, err := Open("db", &Options{FS: fs, Ephemeral: true}); !errors.Is(err, ErrInvalidRequest) || !strings.Contains(err.Error(), "db") || !strings.Contains(err.Error(), "not Ephemeral") {
		t.Fatalf("ephemeral Open of a normal engine's directory: %v", err)
	}
	e = openMem(t, fs, nil) // untouched by the refused Open
	mustBegin(t, e, Request{Scope: "s", ID: id("x")}, Done)
	e.Close()

	// An ephemeral engine that crashed leaves its index and marker: a
	// normal Open refuses them, an ephemeral one starts empty.
	cfs := vfs.NewCrashableMem()
	e = openMem(t, cfs, &Options{Ephemeral: true, IndexIngestBytes: 1})
	commitID(t, e, Request{Scope: "s", ID: id("y")}, "r")
	waitApplied(t, e)
	if _, err := e.Compact(bg); err != nil { // the index on "disk"
		t.Fatal(err)
	}
	crashed := cfs.CrashClone(vfs.CrashCloneCfg{})
	e.Close()
	if _, err := Open("db", &Options{FS: crashed}); !errors.Is(err, ErrInvalidRequest) || !strings.Contains(err.Error(), ephemeralMarker) {
		t.Fatalf("normal Open of an ephemeral engine's directory: %v", err)
	}
	e = openMem(t, crashed, &Options{Ephemeral: true})
	mustBegin(t, e, Request{Scope: "s", ID: id("y")}, Fresh)
	if st := e.Stats(); st.LastLSN != 1 {
		t.Fatalf("ephemeral Open after a crash: LastLSN %d, want 1 (empty)", st.LastLSN)
	}
	e.Close()

	for _, c := range []struct {
		o     Options
		field string
	}{
		{Options{Sync: SyncNever}, "Options.Sync"},
		{Options{SyncInterval: time.Second}, "Options.SyncInterval"},
		{Options{KeepSnapshots: 2}, "Options.KeepSnapshots"},
	} {
		o := c.o
		o.FS, o.Ephemeral = vfs.NewMem(), true
		if _, err := Open("db", &o); !errors.Is(err, ErrInvalidRequest) || !strings.Contains(err.Error(), c.field) {
			t.Fatalf("%s: %v", c.field, err)
		}
	}
	// Options that have no use are accepted.
	e = openMem(t, vfs.NewMem(), &Options{Ephemeral: true, SegmentSize: 1 << 20, NoPreallocate: true, RelaxedClaims: true, KeepSnapshots: -1})
	e.Close()
}
