package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/internal/testclock"
	"github.com/idemdb/idem/internal/vfstest"
)

var bg = context.Background()

func openMem(t testing.TB, fs vfs.FS, o *Options) *Engine {
	t.Helper()
	var opts Options
	if o != nil {
		opts = *o
	}
	opts.FS = fs
	e, err := Open("db", &opts)
	if err != nil {
		t.Fatalf("open: %v", err)
	}
	return e
}

func mustBegin(t testing.TB, e *Engine, r Request, want Status) Result {
	t.Helper()
	res, err := e.Begin(bg, r)
	if err != nil {
		t.Fatalf("begin %q: %v", r.ID, err)
	}
	if res.Status != want {
		t.Fatalf("begin %q: status %v, want %v", r.ID, res.Status, want)
	}
	return res
}

func id(s string) []byte { return []byte(s) }

func TestStatusesAndFingerprints(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	r := Request{Scope: "s", ID: id("a"), Fingerprint: id("fp1")}
	res := mustBegin(t, e, r, Fresh)
	in := mustBegin(t, e, r, InFlight)
	if !in.LeaseUntil.Equal(res.LeaseUntil) {
		t.Fatalf("lease %v != %v", in.LeaseUntil, res.LeaseUntil)
	}
	if _, err := e.Begin(bg, Request{Scope: "s", ID: id("a"), Fingerprint: id("other")}); !errors.Is(err, ErrConflict) {
		t.Fatalf("in-flight conflict: %v", err)
	}
	if err := res.Claim.Commit(bg, id("reply-a")); err != nil {
		t.Fatal(err)
	}
	d := mustBegin(t, e, r, Done)
	if string(d.Reply) != "reply-a" {
		t.Fatalf("reply %q", d.Reply)
	}
	// Unchecked retry of a checked entry is fine; a different fingerprint is not.
	mustBegin(t, e, Request{Scope: "s", ID: id("a")}, Done)
	if _, err := e.Begin(bg, Request{Scope: "s", ID: id("a"), Fingerprint: id("fp2")}); !errors.Is(err, ErrConflict) {
		t.Fatalf("conflict: %v", err)
	}
	// An entry stored without a fingerprint never satisfies a checked request.
	res = mustBegin(t, e, Request{Scope: "s", ID: id("u")}, Fresh)
	if err := res.Claim.Commit(bg, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Begin(bg, Request{Scope: "s", ID: id("u"), Fingerprint: id("x")}); !errors.Is(err, ErrConflict) {
		t.Fatalf("unchecked entry, checked request: %v", err)
	}
	if d := mustBegin(t, e, Request{Scope: "s", ID: id("u")}, Done); d.Reply == nil || len(d.Reply) != 0 {
		t.Fatalf("empty reply should be empty, got %v", d.Reply)
	}
	// Scopes are separate id spaces.
	mustBegin(t, e, Request{Scope: "t", ID: id("a")}, Fresh)
	// Lookup.
	if l, _ := e.Lookup(context.Background(), Request{Scope: "s", ID: id("a")}); l.Status != Done || string(l.Reply) != "reply-a" {
		t.Fatalf("lookup %+v", l)
	}
	if l, _ := e.Lookup(context.Background(), Request{Scope: "s", ID: id("zz")}); l.Status != Absent {
		t.Fatalf("lookup absent %+v", l)
	}
	if l, _ := e.Lookup(context.Background(), Request{Scope: "t", ID: id("a")}); l.Status != InFlight {
		t.Fatalf("lookup in flight %+v", l)
	}
	st := e.Stats()
	if st.Hits != 3 || st.Misses != 3 || st.Conflicts != 3 || st.InFlightCollisions != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestAbortFreesID(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	r := Request{ID: id("a")}
	res := mustBegin(t, e, r, Fresh)
	if err := res.Claim.Abort(bg); err != nil {
		t.Fatal(err)
	}
	if err := res.Claim.Commit(bg, id("x")); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("commit after abort: %v", err)
	}
	res = mustBegin(t, e, r, Fresh)
	if err := res.Claim.Commit(bg, id("x")); err != nil {
		t.Fatal(err)
	}
	mustBegin(t, e, r, Done)
}

func TestLeaseTakeoverFencing(t *testing.T) {
	clk := testclock.New()
	e := openMem(t, vfs.NewMem(), &Options{Clock: clk.Now, Lease: time.Minute})
	defer e.Close()
	r := Request{ID: id("a")}
	old := mustBegin(t, e, r, Fresh)
	clk.Advance(30 * time.Second)
	mustBegin(t, e, r, InFlight)
	clk.Advance(31 * time.Second)
	nw := mustBegin(t, e, r, Fresh) // lease ran out: taken over
	if err := old.Claim.Commit(bg, id("old")); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("fenced commit: %v", err)
	}
	if err := nw.Claim.Commit(bg, id("new")); err != nil {
		t.Fatal(err)
	}
	if d := mustBegin(t, e, r, Done); string(d.Reply) != "new" {
		t.Fatalf("reply %q", d.Reply)
	}
	// A claim whose lease ran out but was not taken over still commits.
	c := mustBegin(t, e, Request{ID: id("b")}, Fresh)
	clk.Advance(2 * time.Minute)
	if err := c.Claim.Commit(bg, id("late")); err != nil {
		t.Fatalf("late commit: %v", err)
	}
	if st := e.Stats(); st.Takeovers != 1 || st.LeaseLost != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestInvalidRequests(t *testing.T) {
	e := openMem(t, vfs.NewMem(), &Options{MaxIDLen: 16})
	defer e.Close()
	for name, r := range map[string]Request{
		"empty":          {},
		"both":           {ID: id("a"), Client: "c", Seq: 1},
		"seq only":       {Seq: 3},
		"client no seq":  {Client: "c"},
		"long id":        {ID: bytes.Repeat(id("x"), 17)},
		"long scope":     {Scope: strings.Repeat("s", 17), ID: id("a")},
		"ack self":       {ID: id("a"), Acked: [][]byte{id("a")}},
		"empty ack":      {ID: id("a"), Acked: [][]byte{{}}},
		"long fp":        {ID: id("a"), Fingerprint: bytes.Repeat(id("f"), 17)},
		"id and seq":     {ID: id("a"), Seq: 2},
		"long client":    {Client: strings.Repeat("c", 17), Seq: 1},
		"id with client": {ID: id("a"), Client: "c"},
	} {
		if _, err := e.Begin(bg, r); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("%s: %v", name, err)
		}
	}
	if _, err := e.Do(bg, Request{}, nil); !errors.Is(err, ErrInvalidRequest) {
		t.Errorf("do: %v", err)
	}
}

func TestSequenceMode(t *testing.T) {
	fs := vfs.NewMem()
	e := openMem(t, fs, nil)
	seq := func(n uint64) Request { return Request{Scope: "ns", Client: "c1", Seq: n} }
	if n, _ := e.ClientState(context.Background(), "ns", "c1"); n != 0 {
		t.Fatalf("fresh client state %d", n)
	}
	var gap *SequenceGapError
	if _, err := e.Begin(bg, seq(2)); !errors.As(err, &gap) || gap.Last != 0 || !errors.Is(err, ErrSequenceGap) {
		t.Fatalf("gap on a new client: %v", err)
	}
	r := mustBegin(t, e, seq(1), Fresh)
	mustBegin(t, e, seq(1), InFlight)
	if _, err := e.Begin(bg, seq(2)); !errors.As(err, &gap) || gap.Last != 0 {
		t.Fatalf("gap while 1 in flight: %v", err)
	}
	if err := r.Claim.Commit(bg, id("r1")); err != nil {
		t.Fatal(err)
	}
	if d := mustBegin(t, e, seq(1), Done); string(d.Reply) != "r1" || d.Seq != 1 {
		t.Fatalf("dup %+v", d)
	}
	if _, err := e.Begin(bg, seq(3)); !errors.As(err, &gap) || gap.Last != 1 {
		t.Fatalf("gap: %v", err)
	}
	// An aborted sequence number is not consumed.
	r = mustBegin(t, e, seq(2), Fresh)
	if err := r.Claim.Abort(bg); err != nil {
		t.Fatal(err)
	}
	if n, _ := e.ClientState(context.Background(), "ns", "c1"); n != 1 {
		t.Fatalf("state after abort %d", n)
	}
	r = mustBegin(t, e, seq(2), Fresh)
	if err := r.Claim.Commit(bg, id("r2")); err != nil {
		t.Fatal(err)
	}
	// Starting seq 2 promised seq 1 is never retried: its reply is gone.
	// The error says where the client stands.
	_, err := e.Begin(bg, seq(1))
	var ac *AlreadyCommittedError
	if !errors.Is(err, ErrAlreadyCommitted) || !errors.As(err, &ac) ||
		*ac != (AlreadyCommittedError{Scope: "ns", Client: "c1", Seq: 1, Last: 2}) {
		t.Fatalf("old seq: %v (%+v)", err, ac)
	}
	if want := `idem: sequence number already committed and its reply is no longer kept: scope "ns" client "c1" seq 1 (last committed 2)`; err.Error() != want {
		t.Fatalf("old seq: %q, want %q", err, want)
	}
	if d := mustBegin(t, e, seq(2), Done); string(d.Reply) != "r2" {
		t.Fatalf("dup 2 %+v", d)
	}
	// Other scope, other client: separate streams.
	mustBegin(t, e, Request{Scope: "other", Client: "c1", Seq: 1}, Fresh)
	mustBegin(t, e, Request{Scope: "ns", Client: "c2", Seq: 1}, Fresh)
	// Do in sequence mode.
	out, err := e.Do(bg, seq(3), func(context.Context) ([]byte, error) { return id("r3"), nil })
	if err != nil || string(out) != "r3" {
		t.Fatalf("do: %q %v", out, err)
	}
	if d := mustBegin(t, e, seq(3), Done); string(d.Reply) != "r3" {
		t.Fatalf("dup 3 %+v", d)
	}
	// A failure consumes no sequence number.
	_, err = e.Do(bg, seq(4), func(context.Context) ([]byte, error) { return nil, errors.New("boom") })
	if err == nil || err.Error() != "boom" {
		t.Fatalf("do failure: %v", err)
	}
	if n, _ := e.ClientState(context.Background(), "ns", "c1"); n != 3 {
		t.Fatalf("state %d", n)
	}
	// Starting seq 4 (even if it failed) promised seq 3 is never retried.
	if _, err := e.Begin(bg, seq(3)); !errors.Is(err, ErrAlreadyCommitted) {
		t.Fatalf("seq 3 after seq 4 started: %v", err)
	}
	e.Close()
	e = openMem(t, fs, nil)
	defer e.Close()
	if n, _ := e.ClientState(context.Background(), "ns", "c1"); n != 3 {
		t.Fatalf("state after reopen %d", n)
	}
	if _, err := e.Begin(bg, seq(2)); !errors.Is(err, ErrAlreadyCommitted) {
		t.Fatalf("after reopen old seq: %v", err)
	}
	r = mustBegin(t, e, seq(4), Fresh)
	if err := r.Claim.Commit(bg, id("r4")); err != nil {
		t.Fatal(err)
	}
	if d := mustBegin(t, e, seq(4), Done); string(d.Reply) != "r4" {
		t.Fatalf("after reopen %+v", d)
	}
	mustBegin(t, e, Request{Scope: "ns", Client: "c2", Seq: 1}, InFlight)
}

func commitID(t testing.TB, e *Engine, r Request, reply string) {
	t.Helper()
	res := mustBegin(t, e, r, Fresh)
	if err := res.Claim.Commit(bg, []byte(reply)); err != nil {
		t.Fatal(err)
	}
}

func TestAckAndForgetSurviveReplay(t *testing.T) {
	fs := vfs.NewMem()
	clk := testclock.New()
	e := openMem(t, fs, &Options{Clock: clk.Now})
	for i := 0; i < 10; i++ {
		commitID(t, e, Request{Scope: "s", ID: []byte(fmt.Sprint("old", i))}, "r")
	}
	commitID(t, e, Request{Client: "c", Seq: 1, Scope: "s"}, "seq1")
	clk.Advance(time.Hour)
	cut := clk.Now()
	clk.Advance(time.Minute)
	for i := 0; i < 10; i++ {
		commitID(t, e, Request{Scope: "s", ID: []byte(fmt.Sprint("new", i))}, "r")
	}
	// Ack via a request's Acked list and via Ack.
	commitID(t, e, Request{Scope: "s", ID: id("carrier"), Acked: [][]byte{id("new0"), id("new1"), id("unknown")}}, "r")
	if err := e.Ack(bg, "s", id("new2"), id("new3")); err != nil {
		t.Fatal(err)
	}
	if err := e.Forget(bg, cut); err != nil {
		t.Fatal(err)
	}
	check := func(e *Engine) {
		t.Helper()
		for i := 0; i < 10; i++ {
			want := Done
			if i < 4 {
				want = Absent
			}
			if l, _ := e.Lookup(context.Background(), Request{Scope: "s", ID: []byte(fmt.Sprint("new", i))}); l.Status != want {
				t.Fatalf("new%d: %v want %v", i, l.Status, want)
			}
			if l, _ := e.Lookup(context.Background(), Request{Scope: "s", ID: []byte(fmt.Sprint("old", i))}); l.Status != Absent {
				t.Fatalf("old%d: %v", i, l.Status)
			}
		}
		if n, _ := e.ClientState(context.Background(), "s", "c"); n != 1 {
			t.Fatalf("forget must keep the sequence number, got %d", n)
		}
		if _, err := e.Begin(bg, Request{Scope: "s", Client: "c", Seq: 1}); !errors.Is(err, ErrAlreadyCommitted) {
			t.Fatalf("forgotten seq reply: %v", err)
		}
	}
	check(e)
	// Let the applier catch up, then check what the index counts.
	waitApplied(t, e)
	if st := e.Stats(); st.LiveEntries != 6+1+1 || st.Cleanups != 11 {
		t.Fatalf("stats after forget: live %d cleanups %d", st.LiveEntries, st.Cleanups)
	}
	e.Close()
	e = openMem(t, fs, &Options{Clock: clk.Now})
	defer e.Close()
	check(e)
	if st := e.Stats(); st.LiveEntries != 8 {
		t.Fatalf("live after reopen %d", st.LiveEntries)
	}
	// A forgotten id runs again as new.
	mustBegin(t, e, Request{Scope: "s", ID: id("old1")}, Fresh)
}

func waitApplied(t testing.TB, e *Engine) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		st := e.Stats()
		if st.AppliedLSN >= st.LastLSN {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("applier stuck: %+v", st)
		}
		time.Sleep(time.Millisecond)
	}
}

// snapshotState collects every Lookup answer for the given ids.
func snapshotState(t testing.TB, e *Engine, scopes []string, ids [][]byte) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, s := range scopes {
		for _, i := range ids {
			l, err := e.Lookup(context.Background(), Request{Scope: s, ID: i})
			if err != nil {
				t.Fatal(err)
			}
			out[s+"/"+string(i)] = fmt.Sprintf("%v:%s", l.Status, l.Reply)
		}
	}
	return out
}

func TestReopenReplayEqualsState(t *testing.T) {
	for _, c := range []struct {
		name string
		o    Options
	}{
		{"default", Options{}},
		// Every applied batch, or every few KiB of them, is ingested into
		// Pebble as an sstable while the program runs, and a tiny slot
		// cache sends lookups to the pending sets and the ingested tables.
		{"ingest-every-batch", Options{IndexIngestBytes: 1, CacheSize: 4 << 10}},
		{"ingest-4KiB", Options{IndexIngestBytes: 4 << 10, CacheSize: 4 << 10}},
		// A 192-byte key filter (about 150 keys; up to 600 live here, under
		// the 4x at which it would be dropped) is rebuilt over and over and
		// has many false positives; one turned off asks Pebble always.
		{"filter-192B", Options{IndexIngestBytes: 4 << 10, CacheSize: 4 << 10, IndexFilterBytes: 192}},
		{"no-filter", Options{CacheSize: 4 << 10, IndexFilterBytes: -1}},
	} {
		t.Run(c.name, func(t *testing.T) { testReopenReplayEqualsState(t, c.o) })
	}
}

func testReopenReplayEqualsState(t *testing.T, o Options) {
	fs := vfs.NewMem()
	clk := testclock.New()
	opts := &o
	opts.Clock, opts.SegmentSize = clk.Now, 16<<10
	e := openMem(t, fs, opts)
	rng := rand.New(rand.NewPCG(1, 2))
	scopes := []string{"a", "b"}
	var ids [][]byte
	for i := 0; i < 300; i++ {
		ids = append(ids, []byte(fmt.Sprint("id", i)))
	}
	var open []*Claim
	for i := 0; i < 3000; i++ {
		s := scopes[rng.IntN(2)]
		x := ids[rng.IntN(len(ids))]
		switch rng.IntN(10) {
		case 0:
			_ = e.Ack(bg, s, x)
		case 1:
			if len(open) > 0 {
				_ = open[0].Abort(bg)
				open = open[1:]
			}
		default:
			res, err := e.Begin(bg, Request{Scope: s, ID: x})
			if err != nil {
				t.Fatal(err)
			}
			if res.Status == Fresh {
				if rng.IntN(4) == 0 {
					open = append(open, res.Claim)
				} else if err := res.Claim.Commit(bg, []byte(fmt.Sprint("reply", i))); err != nil {
					t.Fatal(err)
				}
			}
		}
		clk.Advance(time.Second)
		if o.IndexIngestBytes > 0 && i%50 == 49 {
			waitApplied(t, e) // many applier batches, so many ingests
		}
		if i == 1500 {
			if err := e.Forget(bg, clk.Now().Add(-10*time.Minute)); err != nil {
				t.Fatal(err)
			}
		}
	}
	before := snapshotState(t, e, scopes, ids)
	waitApplied(t, e)
	live := e.Stats().LiveEntries
	if o.IndexIngestBytes > 0 {
		var ingested uint64
		for _, l := range e.ix.DB().Metrics().Levels {
			ingested += l.TablesIngested
		}
		if ingested < 10 {
			t.Fatalf("%d sstables ingested while running; the ingest path was not exercised", ingested)
		}
		t.Logf("%d sstables ingested", ingested)
	}
	if o.IndexFilterBytes > 0 {
		// The first build and at least one rebuild (most keys here are
		// committed again and again, and only a key's first appearance is
		// added; TestKeyFilterNeverHidesACommittedID rebuilds dozens of times).
		if n := e.Stats().IndexFilterBuilds; n < 2 {
			t.Fatalf("%d key filter builds; the rebuild path was not exercised", n)
		} else {
			t.Logf("%d key filter builds", n)
		}
	}
	e.Close()
	// Reopen: the index was flushed; then again from scratch by deleting
	// the index, which replays the whole WAL.
	e = openMem(t, fs, opts)
	if after := snapshotState(t, e, scopes, ids); !equalMaps(before, after) {
		t.Fatalf("state differs after reopen")
	}
	e.Close()
	if err := fs.RemoveAll("db/index"); err != nil {
		t.Fatal(err)
	}
	e = openMem(t, fs, opts)
	defer e.Close()
	if after := snapshotState(t, e, scopes, ids); !equalMaps(before, after) {
		t.Fatalf("state differs after full replay")
	}
	if got := e.Stats().LiveEntries; got != live {
		t.Fatalf("live entries %d after full replay, want %d", got, live)
	}
}

// TestKeyFilterNeverHidesACommittedID: with a 64-byte key filter (about 50
// keys), ids come and go (acked right after their reply) and the filter is
// rebuilt dozens of times while lookups go to the index (a 4 KiB slot
// cache); every id still committed must stay Done, never Fresh.
func TestKeyFilterNeverHidesACommittedID(t *testing.T) {
	e := openMem(t, vfs.NewMem(), &Options{IndexFilterBytes: 64, IndexIngestBytes: 4 << 10, CacheSize: 4 << 10})
	defer e.Close()
	var kept [][]byte
	for i := 0; i < 2000; i++ {
		id := []byte(fmt.Sprint("id", i))
		if _, err := e.Do(bg, Request{ID: id}, func(context.Context) ([]byte, error) { return id, nil }); err != nil {
			t.Fatal(err)
		}
		if i%50 == 0 {
			kept = append(kept, id)
		} else if err := e.Ack(bg, "", id); err != nil {
			t.Fatal(err)
		}
		if i%100 == 99 {
			waitApplied(t, e)
			for _, k := range kept {
				res, err := e.Begin(bg, Request{ID: k})
				if err != nil || res.Status != Done || string(res.Reply) != string(k) {
					t.Fatalf("after %d requests, Begin(%s) = %v %q, %v (filter builds %d)", i+1, k, res.Status, res.Reply, err, e.Stats().IndexFilterBuilds)
				}
			}
		}
	}
	if n := e.Stats().IndexFilterBuilds; n < 10 {
		t.Fatalf("%d key filter builds; the rebuild path was not exercised", n)
	} else {
		t.Logf("%d key filter builds", n)
	}
}

func equalMaps(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestConcurrentDoRunsOnce(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	var runs atomic.Int64
	var wg sync.WaitGroup
	replies := make([][]byte, 1000)
	errs := make([]error, 1000)
	start := make(chan struct{})
	for i := 0; i < 1000; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			<-start
			replies[i], errs[i] = e.Do(bg, Request{Scope: "s", ID: id("one")}, func(context.Context) ([]byte, error) {
				runs.Add(1)
				time.Sleep(5 * time.Millisecond)
				return id("the reply"), nil
			})
		}(i)
	}
	close(start)
	wg.Wait()
	if runs.Load() != 1 {
		t.Fatalf("fn ran %d times", runs.Load())
	}
	for i := range replies {
		if errs[i] != nil || string(replies[i]) != "the reply" {
			t.Fatalf("caller %d: %q %v", i, replies[i], errs[i])
		}
	}
}

func TestConcurrentBeginExactlyOneFresh(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	for round := 0; round < 50; round++ {
		var fresh atomic.Int64
		var wg sync.WaitGroup
		for g := 0; g < 16; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				res, err := e.Begin(bg, Request{ID: []byte(fmt.Sprint("k", round))})
				if err != nil {
					t.Error(err)
					return
				}
				if res.Status == Fresh {
					fresh.Add(1)
				}
			}()
		}
		wg.Wait()
		if fresh.Load() != 1 {
			t.Fatalf("round %d: %d callers got Fresh", round, fresh.Load())
		}
	}
}

func TestDoAbortsOnErrorAndPanic(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	r := Request{ID: id("p")}
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("panic not propagated")
			}
		}()
		_, _ = e.Do(bg, r, func(context.Context) ([]byte, error) { panic("fn panics") })
	}()
	if l, _ := e.Lookup(context.Background(), Request{Scope: "", ID: id("p")}); l.Status != Absent {
		t.Fatalf("after panic: %v", l.Status)
	}
	out, err := e.Do(bg, r, func(context.Context) ([]byte, error) { return id("ok"), nil })
	if err != nil || string(out) != "ok" {
		t.Fatal(out, err)
	}
	// Do waits for a concurrent owner, bounded by ctx.
	res := mustBegin(t, e, Request{ID: id("w")}, Fresh)
	ctx, cancel := context.WithTimeout(bg, 20*time.Millisecond)
	defer cancel()
	if _, err := e.Do(ctx, Request{ID: id("w")}, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("wait bounded by ctx: %v", err)
	}
	w, err := waitAcross(t, e, Request{Scope: "", ID: id("w")}, func() { _ = res.Claim.Commit(bg, id("w-reply")) })
	if err != nil || w.Status != Done || string(w.Reply) != "w-reply" {
		t.Fatalf("wait: %+v %v", w, err)
	}
}

// waitAcross calls e.Wait(r) for a request in flight and, once Wait is
// blocked waiting for it, runs finish (a commit or an abort); it returns
// what Wait returned. A Wait that returns before finish ran fails the test.
// (Finishing after a sleep instead let a starved Wait start after the
// commit: it then proved nothing about waking up.)
func waitAcross(t *testing.T, e *Engine, r Request, finish func()) (Result, error) {
	t.Helper()
	type result struct {
		res Result
		err error
	}
	gidc, done := make(chan string, 1), make(chan result, 1)
	go func() {
		gidc <- goroutineID()
		res, err := e.Wait(bg, r)
		done <- result{res, err}
	}()
	gid := <-gidc
	for deadline := time.Now().Add(10 * time.Second); !blockedIn(gid, "idem.(*Engine).waitKey("); time.Sleep(time.Millisecond) {
		select {
		case out := <-done:
			t.Fatalf("Wait returned %+v %v while the request was in flight", out.res, out.err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("Wait did not block within 10 s")
		}
	}
	finish()
	select {
	case out := <-done:
		return out.res, out.err
	case <-time.After(10 * time.Second):
		t.Fatal("Wait still blocked 10 s after the request finished")
		return Result{}, nil
	}
}

// TestWaitSeq: Wait of a sequence number blocks while the client's request is in flight and
// returns what Lookup then says: the reply after a commit, Absent after
// an abort; a request not in flight returns at once; ctx bounds the wait.
func TestWaitSeq(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	seq := func(n uint64) Request { return Request{Scope: "s", Client: "c", Seq: n} }

	// Not in flight: at once.
	if r, err := e.Wait(bg, Request{Scope: "s", Client: "c", Seq: 1}); err != nil || r.Status != Absent {
		t.Fatalf("wait on a free number: %+v %v", r, err)
	}
	// Committed meanwhile.
	res := mustBegin(t, e, seq(1), Fresh)
	ctx, cancel := context.WithTimeout(bg, 20*time.Millisecond)
	if _, err := e.Wait(ctx, Request{Scope: "s", Client: "c", Seq: 1}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("wait bounded by ctx: %v", err)
	}
	cancel()
	if r, err := waitAcross(t, e, seq(1), func() { _ = res.Claim.Commit(bg, id("r1")) }); err != nil || r.Status != Done || string(r.Reply) != "r1" || r.Seq != 1 {
		t.Fatalf("wait for a commit: %+v %v", r, err)
	}
	// Aborted meanwhile: the number is free again.
	res = mustBegin(t, e, seq(2), Fresh)
	if r, err := waitAcross(t, e, seq(2), func() { _ = res.Claim.Abort(bg) }); err != nil || r.Status != Absent {
		t.Fatalf("wait for an abort: %+v %v", r, err)
	}
	mustBegin(t, e, seq(2), Fresh)
	// Another number of the same client is not waited for: seq 1 is
	// answered at once, as Lookup does (its reply went when seq 2 was
	// claimed: ErrAlreadyCommitted, as Begin says).
	ctx, cancel = context.WithTimeout(bg, 5*time.Second)
	defer cancel()
	r, err := e.Wait(ctx, Request{Scope: "s", Client: "c", Seq: 1})
	if l, lerr := e.Lookup(bg, Request{Scope: "s", Client: "c", Seq: 1}); !errors.Is(err, ErrAlreadyCommitted) || fmt.Sprint(lerr) != fmt.Sprint(err) || r.Status != l.Status {
		t.Fatalf("wait on seq 1 while seq 2 is claimed: %+v %v; Lookup says %+v %v", r, err, l, lerr)
	}
	if _, err := e.Wait(bg, Request{Scope: "s", Client: "", Seq: 1}); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("wait without a client: %v", err)
	}
}

func TestTwoOpensLocked(t *testing.T) {
	dir := t.TempDir()
	e, err := Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Open(dir, nil); !errors.Is(err, ErrLocked) {
		t.Fatalf("second open: %v", err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	e, err = Open(dir, nil)
	if err != nil {
		t.Fatalf("reopen after close: %v", err)
	}
	defer e.Close()
	fs := vfs.NewMem()
	m := openMem(t, fs, nil)
	defer m.Close()
	if _, err := Open("db", &Options{FS: fs}); !errors.Is(err, ErrLocked) {
		t.Fatalf("second open on memfs: %v", err)
	}
}

func TestClosedEngine(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	res := mustBegin(t, e, Request{ID: id("a")}, Fresh)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
	if _, err := e.Begin(bg, Request{ID: id("b")}); !errors.Is(err, ErrClosed) {
		t.Fatal(err)
	}
	if err := res.Claim.Commit(bg, nil); !errors.Is(err, ErrClosed) {
		t.Fatal(err)
	}
}

// segmentFiles lists the WAL segments of dir/wal in order.
func segmentFiles(t testing.TB, fs vfs.FS, dir string) []string {
	names, err := fs.List(filepath.Join(dir, "wal"))
	if err != nil {
		t.Fatal(err)
	}
	var segs []string
	for _, n := range names {
		if strings.HasSuffix(n, ".wal") {
			segs = append(segs, filepath.Join(dir, "wal", n))
		}
	}
	sort.Strings(segs)
	return segs
}

func TestTornTailIsCut(t *testing.T) {
	fs := vfs.NewMem()
	e := openMem(t, fs, nil)
	for i := 0; i < 20; i++ {
		commitID(t, e, Request{ID: []byte(fmt.Sprint("id", i))}, "reply")
	}
	e.Close()
	segs := segmentFiles(t, fs, "db")
	last := segs[len(segs)-1]
	b := vfstest.ReadFile(t, fs, last)
	// A partial frame: a plausible header and half a payload.
	torn := append(b, 0xde, 0xad, 0xbe, 0xef, 40, 0, 0, 0, 1, 2, 3)
	vfstest.WriteFile(t, fs, last, torn)
	e = openMem(t, fs, nil)
	defer e.Close()
	if st := e.Stats(); st.TornTailsCut != 1 {
		t.Fatalf("torn tails cut %d", st.TornTailsCut)
	}
	for i := 0; i < 20; i++ {
		mustBegin(t, e, Request{ID: []byte(fmt.Sprint("id", i))}, Done)
	}
	commitID(t, e, Request{ID: id("after")}, "r")
}

func TestFlippedByteRefusesToOpen(t *testing.T) {
	fs := vfs.NewMem()
	e := openMem(t, fs, nil)
	for i := 0; i < 200; i++ {
		commitID(t, e, Request{ID: []byte(fmt.Sprint("id", i))}, "reply")
	}
	e.Close()
	// Replay everything: remove the index so the WAL is read in full.
	if err := fs.RemoveAll("db/index"); err != nil {
		t.Fatal(err)
	}
	segs := segmentFiles(t, fs, "db")
	last := segs[len(segs)-1]
	b := vfstest.ReadFile(t, fs, last)
	b[len(b)/2] ^= 0x40
	vfstest.WriteFile(t, fs, last, b)
	_, err := Open("db", &Options{FS: fs})
	if !errors.Is(err, ErrCorrupt) {
		t.Fatalf("open with a flipped byte: %v", err)
	}
	if !strings.Contains(err.Error(), filepath.Base(last)) {
		t.Fatalf("error does not name the segment: %v", err)
	}
	t.Logf("refused as expected: %v", err)
}

func TestInDoubtRecovery(t *testing.T) {
	mem := vfs.NewCrashableMem()
	clk := testclock.New()
	opts := &Options{Clock: clk.Now, Lease: time.Minute}
	e := openMem(t, mem, opts)
	mustBegin(t, e, Request{ID: id("commit-me")}, Fresh)
	mustBegin(t, e, Request{ID: id("abort-me")}, Fresh)
	mustBegin(t, e, Request{Client: "c", Seq: 1}, Fresh)
	mustBegin(t, e, Request{ID: id("expire-me")}, Fresh)
	crashed := mem.CrashClone(vfs.CrashCloneCfg{})
	e.Close()
	e = openMem(t, crashed, opts)
	defer e.Close()
	// Retries see InFlight, not Fresh.
	mustBegin(t, e, Request{ID: id("commit-me")}, InFlight)
	mustBegin(t, e, Request{Client: "c", Seq: 1}, InFlight)
	ds, err := e.InDoubt(context.Background(), "")
	if err != nil {
		t.Fatal(err)
	}
	if len(ds) != 4 {
		t.Fatalf("in doubt: %d", len(ds))
	}
	if st := e.Stats(); st.InDoubt != 4 {
		t.Fatalf("stats in doubt %d", st.InDoubt)
	}
	for _, d := range ds {
		switch {
		case string(d.ID) == "commit-me":
			if err := d.Claim.Commit(bg, id("recovered")); err != nil {
				t.Fatal(err)
			}
		case string(d.ID) == "abort-me":
			if err := d.Claim.Abort(bg); err != nil {
				t.Fatal(err)
			}
		case d.Client == "c":
			if d.Seq != 1 {
				t.Fatalf("seq %d", d.Seq)
			}
			if err := d.Claim.Commit(bg, id("seq-recovered")); err != nil {
				t.Fatal(err)
			}
		}
	}
	if d := mustBegin(t, e, Request{ID: id("commit-me")}, Done); string(d.Reply) != "recovered" {
		t.Fatal(string(d.Reply))
	}
	mustBegin(t, e, Request{ID: id("abort-me")}, Fresh)
	if n, _ := e.ClientState(context.Background(), "", "c"); n != 1 {
		t.Fatalf("client state %d", n)
	}
	// The unresolved one is taken over once its lease ran out.
	clk.Advance(2 * time.Minute)
	mustBegin(t, e, Request{ID: id("expire-me")}, Fresh)
	if ds, _ := e.InDoubt(context.Background(), ""); len(ds) != 0 {
		t.Fatalf("still in doubt: %d", len(ds))
	}
}

func TestRetentionExpiresExactly(t *testing.T) {
	clk := testclock.New()
	fs := vfs.NewMem()
	opts := &Options{Clock: clk.Now, Retention: time.Hour}
	e := openMem(t, fs, opts)
	commitID(t, e, Request{ID: id("k")}, "v1")
	commitID(t, e, Request{Client: "c", Seq: 1}, "s1")
	clk.Advance(60 * time.Minute)
	mustBegin(t, e, Request{ID: id("k")}, Done) // T+60m: cached
	clk.Advance(time.Minute + time.Nanosecond)
	// T+61m: runs as new, with no forget record or compaction yet.
	res := mustBegin(t, e, Request{ID: id("k")}, Fresh)
	if err := res.Claim.Commit(bg, id("v2")); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Begin(bg, Request{Client: "c", Seq: 1}); !errors.Is(err, ErrAlreadyCommitted) {
		t.Fatalf("expired seq: %v", err)
	}
	e.Close()
	e = openMem(t, fs, opts)
	defer e.Close()
	if d := mustBegin(t, e, Request{ID: id("k")}, Done); string(d.Reply) != "v2" {
		t.Fatal(string(d.Reply))
	}
}

func TestFailStopOnSyncError(t *testing.T) {
	mem := vfs.NewMem()
	var fail atomic.Bool
	inj := errorfs.InjectorFunc(func(op errorfs.Op) error {
		if fail.Load() && (op.Kind == errorfs.OpFileSync || op.Kind == errorfs.OpFileSyncData) && strings.Contains(op.Path, "wal") {
			return errorfs.ErrInjected
		}
		return nil
	})
	fs := errorfs.Wrap(mem, inj)
	e := openMem(t, fs, nil)
	commitID(t, e, Request{ID: id("before")}, "r")
	res := mustBegin(t, e, Request{ID: id("x")}, Fresh)
	fail.Store(true)
	if err := res.Claim.Commit(bg, id("r")); !errors.Is(err, ErrFailed) {
		t.Fatalf("commit with failing fsync: %v", err)
	}
	fail.Store(false)
	// Fail-stop: even with a healthy disk again, nothing more is accepted.
	if _, err := e.Begin(bg, Request{ID: id("y")}); !errors.Is(err, ErrFailed) {
		t.Fatalf("begin after failure: %v", err)
	}
	e.Close()
	e = openMem(t, mem, nil)
	defer e.Close()
	mustBegin(t, e, Request{ID: id("before")}, Done)
	// x's commit may or may not have reached the disk; it is never Fresh.
	if l, _ := e.Lookup(context.Background(), Request{Scope: "", ID: id("x")}); l.Status == Absent {
		t.Fatalf("x is absent after a failed commit")
	}
}

func TestDiskDirectory(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "nested", "db")
	e, err := Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	commitID(t, e, Request{ID: id("a")}, "r")
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "wal")); err != nil {
		t.Fatal(err)
	}
	e, err = Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	mustBegin(t, e, Request{ID: id("a")}, Done)
}

// TestSmallCacheNeverLosesAClaim: with a cache so small that every load
// evicts, a claim must stay visible (a slot just loaded is never the one
// evicted, and a pinned slot is never evicted).
func TestSmallCacheNeverLosesAClaim(t *testing.T) {
	for _, mode := range []SyncMode{SyncAlways, SyncNever} {
		e := openMem(t, vfs.NewMem(), &Options{CacheSize: 256 * 300, Sync: mode})
		for i := 0; i < 3000; i++ {
			r := Request{ID: []byte(fmt.Sprint("id", i))}
			mustBegin(t, e, r, Fresh)
			mustBegin(t, e, r, InFlight)
		}
		e.Close()
	}
}

// TestUnlockedIndexReadsStayCurrent: with a table so small that slots are
// evicted all the time, lookups read the index without their shard's lock
// (lockSlot) while other callers claim, commit, abort and ack the same ids.
// A stale read would let an id run twice or lose a reply: every id must run
// exactly once per life (between acks), and every Done must carry its reply.
func TestUnlockedIndexReadsStayCurrent(t *testing.T) {
	// A 1-byte table: every insert evicts the shard's other clean slots.
	e := openMem(t, vfs.NewMem(), &Options{CacheSize: 1})
	defer e.Close()
	var hooked atomic.Int64
	testHookUnlockedRead = func([]byte) { // widen the unlocked window
		if hooked.Add(1)%4 == 0 {
			time.Sleep(8 * time.Millisecond) // longer than a claim, commit and apply
		} else {
			runtime.Gosched()
		}
	}
	defer func() { testHookUnlockedRead = nil }()
	const ids, workers, rounds = 1000, 12, 600
	var mu sync.Mutex
	runs := map[string]int{}  // executions in the id's current life
	lives := map[string]int{} // acks seen
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for range rounds {
				key := fmt.Sprintf("id-%d", rng.IntN(ids))
				switch rng.IntN(10) {
				case 0: // the client has the reply: ack it, a new life starts
					mu.Lock()
					if err := e.Ack(bg, "", []byte(key)); err != nil {
						mu.Unlock()
						t.Error(err)
						return
					}
					if runs[key] > 0 {
						runs[key] = 0
						lives[key]++
					}
					mu.Unlock()
				case 1: // a failed attempt: aborted, runs again later
					res, err := e.Begin(bg, Request{ID: []byte(key)})
					if err != nil {
						t.Error(err)
						return
					}
					if res.Status == Fresh {
						if err := res.Claim.Abort(bg); err != nil {
							t.Error(err)
							return
						}
					}
				default:
					got, err := e.Do(bg, Request{ID: []byte(key)}, func(context.Context) ([]byte, error) {
						mu.Lock()
						runs[key]++
						n, life := runs[key], lives[key]
						mu.Unlock()
						if n > 1 {
							return nil, fmt.Errorf("%s ran %d times in life %d", key, n, life)
						}
						return []byte(key), nil
					})
					if err != nil {
						t.Error(err)
						return
					}
					if string(got) != key {
						t.Errorf("%s: reply %q", key, got)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	if hooked.Load() == 0 {
		t.Fatal("no lookup read the index without its lock: the test covers nothing")
	}
}

// TestUnlockedReadNotInstalledAfterEviction builds the one interleaving that
// would make an unlocked index read stale: the read sees a committed reply;
// before the reader takes the lock again, the id is acked, the ack is
// applied and its slot evicted. The reader must not install what it read.
func TestUnlockedReadNotInstalledAfterEviction(t *testing.T) {
	e := openMem(t, vfs.NewMem(), &Options{CacheSize: 1})
	defer e.Close()
	k := []byte("victim")
	commitID(t, e, Request{ID: k}, "v")
	// Ids in the victim's shard: loading one evicts the victim's clean slot.
	shard := e.shardIdx(index.EntryKey(nil, "", index.ModeID, k))
	n := 0
	evict := func() {
		t.Helper()
		waitApplied(t, e) // an unapplied slot is pinned
		for ; ; n++ {
			c := []byte(fmt.Sprint("other-", n))
			if e.shardIdx(index.EntryKey(nil, "", index.ModeID, c)) == shard {
				n++
				// A claim installs c's slot (a Lookup of an absent id
				// installs none), and its abort leaves c absent.
				r := mustBegin(t, e, Request{ID: c}, Fresh)
				if err := r.Claim.Abort(bg); err != nil {
					t.Fatal(err)
				}
				return
			}
		}
	}
	evict()
	reached, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	testHookUnlockedRead = func(key []byte) {
		if bytes.HasSuffix(key, k) {
			once.Do(func() { close(reached); <-release })
		}
	}
	defer func() { testHookUnlockedRead = nil }()
	got := make(chan Result, 1)
	go func() {
		l, err := e.Lookup(context.Background(), Request{Scope: "", ID: k})
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	select {
	case <-reached: // the reader has read "done: v" and let go of the lock
	case <-time.After(10 * time.Second):
		t.Fatal("the lookup never read the index without its lock (its slot was not evicted)")
	}
	if err := e.Ack(bg, "", k); err != nil {
		t.Fatal(err)
	}
	evict()
	close(release)
	if l := <-got; l.Status != Absent {
		t.Fatalf("lookup after the ack: %v %q (a stale read was installed)", l.Status, l.Reply)
	}
	if l, _ := e.Lookup(context.Background(), Request{Scope: "", ID: k}); l.Status != Absent {
		t.Fatalf("second lookup: %v", l.Status)
	}
}

// TestPreallocateFollowsSyncMode: on the OS filesystem WAL segments are
// zero-filled to SegmentSize before use, except under SyncNever (no caller
// waits for its fsyncs, so it would only write every byte twice) and with
// NoPreallocate.
func TestPreallocateFollowsSyncMode(t *testing.T) {
	const seg = 4 << 20
	for _, c := range []struct {
		o        Options
		prealloc bool
	}{
		{Options{Sync: SyncAlways}, true},
		{Options{Sync: SyncInterval}, true},
		{Options{Sync: SyncNever}, false},
		{Options{Sync: SyncAlways, NoPreallocate: true}, false},
	} {
		dir := t.TempDir()
		o := c.o
		o.SegmentSize = seg
		e, err := Open(dir, &o)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.Do(bg, Request{ID: []byte("a")}, func(context.Context) ([]byte, error) { return []byte("r"), nil }); err != nil {
			t.Fatal(err)
		}
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		fi, err := os.Stat(filepath.Join(dir, "wal", "00000000000000000001.wal"))
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Size() == seg; got != c.prealloc {
			t.Errorf("Sync %v NoPreallocate %v: first segment is %d bytes (SegmentSize %d), want preallocated %v", o.Sync, o.NoPreallocate, fi.Size(), seg, c.prealloc)
		}
	}
}
