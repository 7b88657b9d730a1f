package idem

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/internal/testclock"
	"github.com/idemdb/idem/wal"
)

// TestLeaseBoundaryExact: a claim owns its id while now < LeaseUntil. One
// nanosecond before LeaseUntil another Begin is told InFlight (with that
// LeaseUntil); at exactly LeaseUntil it takes the id over (Fresh, a new
// lease from now); the old claim's Commit and Abort then return
// ErrLeaseLost and change nothing, and the new claim's reply is the one
// kept, after a reopen too. The same holds for a sequence-mode claim.
func TestLeaseBoundaryExact(t *testing.T) {
	const lease = time.Minute
	for _, tc := range []struct {
		name string
		req  Request
	}{
		{"id", Request{Scope: "s", ID: id("x")}},
		{"sequence", Request{Scope: "s", Client: "c", Seq: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := testclock.New()
			fs := vfs.NewMem()
			opts := &Options{Clock: clk.Now, Lease: lease}
			e := openMem(t, fs, opts)
			defer func() { e.Close() }()
			t0 := clk.Now()
			old := mustBegin(t, e, tc.req, Fresh)
			until := t0.Add(lease)
			if !old.LeaseUntil.Equal(until) || !old.Claim.LeaseUntil().Equal(until) {
				t.Fatalf("lease until %v (claim %v), want %v", old.LeaseUntil, old.Claim.LeaseUntil(), until)
			}

			clk.Set(until.Add(-time.Nanosecond))
			if l, err := e.Lookup(bg, tc.req); err != nil || l.Status != InFlight || !l.LeaseUntil.Equal(until) {
				t.Fatalf("Lookup 1ns before the lease ends: %v until %v, %v", l.Status, l.LeaseUntil, err)
			}
			in := mustBegin(t, e, tc.req, InFlight)
			if !in.LeaseUntil.Equal(until) {
				t.Fatalf("in flight until %v, want %v", in.LeaseUntil, until)
			}
			if st := e.Stats(); st.Takeovers != 0 || st.InFlightCollisions != 1 {
				t.Fatalf("1ns before the lease ends: %+v", st)
			}

			clk.Set(until)
			// A read does not take over: the claim, not taken over yet, is
			// still in flight (its owner may still commit), its lease over.
			if l, err := e.Lookup(bg, tc.req); err != nil || l.Status != InFlight || !l.LeaseUntil.Equal(until) {
				t.Fatalf("Lookup at the lease's end: %v until %v, %v", l.Status, l.LeaseUntil, err)
			}
			nw := mustBegin(t, e, tc.req, Fresh)
			if want := until.Add(lease); !nw.LeaseUntil.Equal(want) {
				t.Fatalf("new lease until %v, want %v", nw.LeaseUntil, want)
			}
			if st := e.Stats(); st.Takeovers != 1 {
				t.Fatalf("takeovers %d at the lease's end", st.Takeovers)
			}
			mustBegin(t, e, tc.req, InFlight) // the new owner holds it now

			if err := old.Claim.Commit(bg, id("old")); !errors.Is(err, ErrLeaseLost) {
				t.Fatalf("commit of the taken-over claim: %v, want ErrLeaseLost", err)
			}
			if err := old.Claim.Abort(bg); !errors.Is(err, ErrLeaseLost) {
				t.Fatalf("abort of the taken-over claim: %v, want ErrLeaseLost", err)
			}
			if st := e.Stats(); st.LeaseLost != 1 {
				t.Fatalf("lease lost %d", st.LeaseLost)
			}
			mustBegin(t, e, tc.req, InFlight) // the stale calls freed nothing
			if err := nw.Claim.Commit(bg, id("new")); err != nil {
				t.Fatalf("commit of the new claim: %v", err)
			}
			if d := mustBegin(t, e, tc.req, Done); string(d.Reply) != "new" {
				t.Fatalf("reply %q, want the new claim's", d.Reply)
			}
			e.Close()
			e = openMem(t, fs, opts)
			if d := mustBegin(t, e, tc.req, Done); string(d.Reply) != "new" {
				t.Fatalf("reply after reopen %q, want the new claim's", d.Reply)
			}
		})
	}
}

// TestReplayRefusesStaleFinish: the engine never appends a commit or abort
// naming a claim that is not the key's current one (Claim.Commit returns
// ErrLeaseLost first), so such a record in the log is corruption, and
// replay must refuse it (index.ErrNoClaim, reported as ErrCorrupt with
// where it is) instead of letting a fenced-off claim's reply (or abort)
// replace the claim that took the id over. The record is written here
// straight into the WAL after a takeover.
func TestReplayRefusesStaleFinish(t *testing.T) {
	for _, typ := range []byte{wal.OpCommit, wal.OpAbort} {
		t.Run(wal.OpName(typ), func(t *testing.T) {
			clk := testclock.New()
			fs := vfs.NewMem()
			opts := &Options{FS: fs, Clock: clk.Now, Lease: time.Minute}
			e := openMem(t, fs, opts)
			old := mustBegin(t, e, Request{ID: id("x")}, Fresh) // the claim at LSN 1
			clk.Advance(time.Minute)
			mustBegin(t, e, Request{ID: id("x")}, Fresh) // taken over at LSN 2
			if err := e.Close(); err != nil {
				t.Fatal(err)
			}
			if old.Claim.ec.lsn != 1 {
				t.Fatalf("the first claim is at LSN %d", old.Claim.ec.lsn)
			}
			// What Commit (or Abort) of the old claim would append without
			// the engine's own check.
			op := &wal.Op{Type: typ, ID: id("x"), ClaimLSN: old.Claim.ec.lsn, Time: clk.Now().UnixNano()}
			if typ == wal.OpCommit {
				op.Reply = id("old")
			}
			appendRecord(t, fs, op)

			e, err := Open("db", opts)
			if err == nil {
				l, lerr := lookupID(e, "", id("x"))
				st := e.Stats()
				e.Close()
				t.Fatalf("opened a log whose %s names the taken-over claim (x is now %v %q, %v; last LSN %d)", wal.OpName(typ), l.Status, l.Reply, lerr, st.LastLSN)
			}
			if !errors.Is(err, ErrCorrupt) || !errors.Is(err, index.ErrNoClaim) {
				t.Fatalf("open: %v, want ErrCorrupt and index.ErrNoClaim", err)
			}
			if !strings.Contains(err.Error(), "segment") || !strings.Contains(err.Error(), "names claim 1") {
				t.Fatalf("the error does not say where and what: %v", err)
			}
			t.Logf("refused: %v", err)
		})
	}
}

// appendRecord appends op to the (closed) engine's WAL in db.
func appendRecord(t *testing.T, fs vfs.FS, op *wal.Op) {
	t.Helper()
	w, _, err := wal.Open(wal.Options{FS: fs, Dir: filepath.Join("db", "wal")}, 0, func(wal.Record) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	payload, err := wal.EncodeOp(nil, op)
	if err != nil {
		t.Fatal(err)
	}
	lsn, err := w.Append(op.Type, payload, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.WaitDurable(lsn); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
}
