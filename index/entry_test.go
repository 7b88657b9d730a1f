package index

import (
	"errors"
	"reflect"
	"testing"
	"unsafe"

	"github.com/idemdb/idem/internal/alloctest"
	"github.com/idemdb/idem/wal"
)

// TestTransitionsFenceStaleClaims: a commit or abort record must name the
// key's current claim (its ClaimLSN). This is the second line of lease
// fencing: the engine refuses a stale Claim.Commit with ErrLeaseLost before
// appending, and Transitions refuses the record itself with ErrNoClaim,
// which is what replay of a log holding such a record meets (the engine
// then refuses to open: see TestReplayRefusesStaleFinish in the root
// package). A record naming the current claim goes through.
func TestTransitionsFenceStaleClaims(t *testing.T) {
	idKey := EntryKey(nil, "s", ModeID, []byte("x"))
	clientKey := EntryKey(nil, "s", ModeClient, []byte("c"))
	// x: claimed at LSN 5 (taking over a claim made at LSN 3).
	idClaim := &Entry{InFlight: true, ClaimLSN: 5, ClaimFP: []byte("fp"), ClaimTime: 10, LeaseUntil: 20, LSN: 5}
	idCommitted := &Entry{Committed: true, CommitLSN: 9, ReplyKept: true, Reply: []byte("r"), LSN: 9}
	// c: seq 3 committed at LSN 4, seq 4 claimed at LSN 7.
	clientClaim := &Entry{Committed: true, Seq: 3, CommitLSN: 4, InFlight: true, ClaimLSN: 7, ClaimSeq: 4, LeaseUntil: 20, LSN: 7}
	state := func(m map[string]*Entry) func([]byte, byte) (*Entry, error) {
		return func(k []byte, _ byte) (*Entry, error) { return m[string(k)], nil }
	}
	idOp := func(typ byte, claim wal.LSN) *wal.Op {
		return &wal.Op{Type: typ, Scope: "s", ID: []byte("x"), ClaimLSN: claim, Time: 15, Reply: []byte("reply")}
	}
	clientOp := func(typ byte, claim wal.LSN) *wal.Op {
		return &wal.Op{Type: typ, Scope: "s", Client: "c", Seq: 4, ClaimLSN: claim, Time: 15, Reply: []byte("reply")}
	}
	for _, tc := range []struct {
		name string
		op   *wal.Op
		get  map[string]*Entry
	}{
		{"commit naming the taken-over claim", idOp(wal.OpCommit, 3), map[string]*Entry{string(idKey): idClaim}},
		{"abort naming the taken-over claim", idOp(wal.OpAbort, 3), map[string]*Entry{string(idKey): idClaim}},
		{"commit naming a later claim", idOp(wal.OpCommit, 6), map[string]*Entry{string(idKey): idClaim}},
		{"commit-advance naming a stale claim", func() *wal.Op {
			op := idOp(wal.OpCommitAdvance, 3)
			op.Advances = []wal.Advance{{Scope: "s", Client: "other", Seq: 1}}
			return op
		}(), map[string]*Entry{string(idKey): idClaim}},
		{"commit of an absent id", idOp(wal.OpCommit, 5), map[string]*Entry{}},
		{"abort of an absent id", idOp(wal.OpAbort, 5), map[string]*Entry{}},
		{"commit of a committed id", idOp(wal.OpCommit, 5), map[string]*Entry{string(idKey): idCommitted}},
		{"abort of a committed id", idOp(wal.OpAbort, 9), map[string]*Entry{string(idKey): idCommitted}},
		{"client commit naming a stale claim", clientOp(wal.OpCommit, 6), map[string]*Entry{string(clientKey): clientClaim}},
		{"client abort naming a stale claim", clientOp(wal.OpAbort, 6), map[string]*Entry{string(clientKey): clientClaim}},
		{"client commit naming the last commit", clientOp(wal.OpCommit, 4), map[string]*Entry{string(clientKey): clientClaim}},
	} {
		ts, err := Transitions(tc.op, 20, state(tc.get))
		if !errors.Is(err, ErrNoClaim) {
			t.Errorf("%s: got %v, %d transitions; want ErrNoClaim", tc.name, err, len(ts))
		} else if ts != nil {
			t.Errorf("%s: ErrNoClaim with %d transitions", tc.name, len(ts))
		}
	}

	// The current claim's own commit and abort go through.
	ids := state(map[string]*Entry{string(idKey): idClaim})
	ts, err := Transitions(idOp(wal.OpCommit, 5), 20, ids)
	if err != nil || len(ts) != 1 {
		t.Fatalf("commit of the current claim: %v, %d transitions", err, len(ts))
	}
	if n := ts[0].Next; n == nil || !n.Committed || n.InFlight || string(n.Reply) != "reply" || string(n.Fingerprint) != "fp" || n.CommitLSN != 20 || ts[0].Prev != idClaim {
		t.Fatalf("commit of the current claim: %+v", ts[0])
	}
	if ts, err = Transitions(idOp(wal.OpAbort, 5), 20, ids); err != nil || len(ts) != 1 || ts[0].Next != nil {
		t.Fatalf("abort of the current claim: %v %+v", err, ts)
	}
	clients := state(map[string]*Entry{string(clientKey): clientClaim})
	ts, err = Transitions(clientOp(wal.OpCommit, 7), 20, clients)
	if err != nil || len(ts) != 1 || ts[0].Next == nil || ts[0].Next.Seq != 4 || ts[0].Next.InFlight {
		t.Fatalf("client commit of the current claim: %v %+v", err, ts)
	}
	ts, err = Transitions(clientOp(wal.OpAbort, 7), 20, clients)
	if n := ts[0].Next; err != nil || n == nil || n.InFlight || n.Seq != 3 || !n.Committed {
		t.Fatalf("client abort of the current claim (seq 3 stays): %v %+v", err, ts)
	}
}

// TestAppendTransitions: AppendTransitions gives what Transitions gives,
// appended after what out holds, names the caller's key (no key of its
// own) and, with room in out, allocates only the new entry: a claim of a
// new id, then its commit, as the engine's single-request path makes them.
func TestAppendTransitions(t *testing.T) {
	key := EntryKey(nil, "s", ModeID, []byte("x"))
	claim := &wal.Op{Type: wal.OpClaim, Flags: wal.ClaimFlagNew, Scope: "s", ID: []byte("x"), Time: 10, LeaseUntil: 20}
	absent := func([]byte, byte) (*Entry, error) { return nil, nil }
	want, err := Transitions(claim, 7, absent)
	if err != nil {
		t.Fatal(err)
	}
	head := Transition{Key: []byte("before")}
	buf := make([]Transition, 1, 4)
	buf[0] = head
	got, err := AppendTransitions(buf, claim, 7, key, nil, absent)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Key == nil || string(got[0].Key) != "before" || &got[0] != &buf[0] {
		t.Fatalf("AppendTransitions did not append to out: %+v", got)
	}
	if g, w := got[1], want[0]; string(g.Key) != string(w.Key) || g.Mode != w.Mode || g.Prev != nil || !reflect.DeepEqual(g.Next, w.Next) {
		t.Fatalf("claim: got %+v (next %+v), want %+v (next %+v)", g, g.Next, w, w.Next)
	}
	if &got[1].Key[0] != &key[0] {
		t.Fatal("the transition does not name the caller's key")
	}
	claimed := got[1].Next
	// A claim fills the entry it is given (and allocates nothing then).
	var into Entry
	alloctest.CheckAllocs(t, "a claim with room in out, its key and its entry given", 0, 100, func() {
		ts, err := AppendTransitions(buf[:0], claim, 7, key, &into, absent)
		if err != nil || ts[0].Next != &into || !reflect.DeepEqual(&into, claimed) {
			t.Fatalf("claim into a given entry: %v %+v", err, ts)
		}
	})
	commit := &wal.Op{Type: wal.OpCommit, Scope: "s", ID: []byte("x"), ClaimLSN: 7, Time: 15, Reply: []byte("r")}
	current := func([]byte, byte) (*Entry, error) { return claimed, nil }
	alloctest.CheckAllocs(t, "a commit with room in out and its key given (its entry)", 1, 100, func() {
		if _, err := AppendTransitions(buf[:0], commit, 9, key, nil, current); err != nil {
			t.Fatal(err)
		}
	})
	// A record kind with no single key (a batch) goes through Transitions.
	batch := &wal.Op{Type: wal.OpBatch, Ops: []wal.Op{*claim}}
	got, err = AppendTransitions(buf[:1], batch, 11, nil, nil, absent)
	if err != nil || len(got) != 2 || string(got[1].Key) != string(key) || got[1].Next == nil || !got[1].Next.InFlight {
		t.Fatalf("batch: %v %+v", err, got)
	}
}

// TestEntrySize pins Entry's layout: one per key lives in a table slot and
// in a pending set, and with its three flags packed together it fits the
// 192-byte size class instead of 208.
func TestEntrySize(t *testing.T) {
	if got := unsafe.Sizeof(Entry{}); got > 184 {
		t.Fatalf("Entry is %d bytes, want at most 184 (its flags packed together, the 192-byte size class)", got)
	}
}
