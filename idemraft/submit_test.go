package idemraft

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
)

// TestSubmitDuplicateAppendsNothing: a request the leader's local set holds
// as committed (same fingerprint, or none asked) is answered by Submit
// without a log append: raft's LastIndex does not move. A request the set
// cannot answer (another fingerprint) goes through the log. A single node,
// so that no election appends entries of its own meanwhile.
func TestSubmitDuplicateAppendsNothing(t *testing.T) {
	c := newCluster(t, 1, clusterOpts{wrap: true})
	r, f, app, _ := c.nodes[0].current()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	submit := func(req idem.Request, op counterOp) *Response {
		t.Helper()
		cmd, err := Command(req, encodeOp(op))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := Submit(ctx, r, f, cmd)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	byID := idem.Request{Scope: "s", ID: []byte("dup-1"), Fingerprint: []byte("fp")}
	bySeq := idem.Request{Scope: "s", Client: "c1", Seq: 1}
	if v := val(t, submit(byID, counterOp{ID: "dup-1", Key: "k", Delta: 3})); v != 3 {
		t.Fatalf("first by id: %d", v)
	}
	if v := val(t, submit(bySeq, counterOp{ID: "seq-1", Key: "k", Delta: 4})); v != 7 {
		t.Fatalf("first by sequence: %d", v)
	}
	before := r.LastIndex()
	st := f.Stats()
	unchecked := byID
	unchecked.Fingerprint = nil
	for _, req := range []idem.Request{byID, unchecked, bySeq, byID} {
		resp := submit(req, counterOp{ID: "never", Key: "k", Delta: 100})
		if !resp.Duplicate || resp.Err != nil {
			t.Fatalf("retry of %+v: %+v", req, resp)
		}
		if after := r.LastIndex(); after != before {
			t.Fatalf("a duplicate answered from the local set moved raft's LastIndex from %d to %d", before, after)
		}
	}
	if got := f.Stats(); got.LocalDuplicates != st.LocalDuplicates+4 || got.Duplicates != st.Duplicates {
		t.Fatalf("stats: local duplicates %d -> %d, log duplicates %d -> %d; want +4 and +0",
			st.LocalDuplicates, got.LocalDuplicates, st.Duplicates, got.Duplicates)
	}
	// Another fingerprint: the set cannot answer, the log decides (conflict).
	other := byID
	other.Fingerprint = []byte("other")
	if resp := submit(other, counterOp{ID: "never", Key: "k", Delta: 100}); !errors.Is(resp.Err, idem.ErrConflict) {
		t.Fatalf("other fingerprint: %+v", resp)
	}
	if after := r.LastIndex(); after != before+1 {
		t.Fatalf("the conflicting request: LastIndex %d -> %d, want one append", before, after)
	}
	if n := app.state().Applied["never"]; n != 0 {
		t.Fatalf("a duplicate reached the application %d times", n)
	}
}

// TestSubmitInDoubt: a Submit that stops waiting for its entry (ctx ended:
// the leader is cut off, nothing commits) reports the outcome unknown
// (idem.ErrInDoubt, and ctx's error); the same request sent again once the
// cluster heals is answered and runs once, whether the first append
// survived or not.
func TestSubmitInDoubt(t *testing.T) {
	// Long timeouts: the cut-off leader keeps believing it leads (and
	// appends) for over a second.
	c := newCluster(t, 3, clusterOpts{wrap: true, timeout: 2 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// Each try has an id of its own: a try given up on may have left an
	// append that commits later.
	var id string
	var cmd []byte
	for try := 1; ; try++ {
		id = fmt.Sprintf("doubt-%d", try)
		var err error
		if cmd, err = Command(idem.Request{Scope: "s", ID: []byte(id)}, encodeOp(counterOp{ID: id, Key: id, Delta: 1})); err != nil {
			t.Fatal(err)
		}
		l := c.waitLeader(30 * time.Second)
		r, f, _, _ := l.current()
		c.partition(l, true)
		wctx, wcancel := context.WithTimeout(ctx, 100*time.Millisecond)
		_, err = Submit(wctx, r, f, cmd)
		wcancel()
		c.partition(l, false)
		var nl *NotLeaderError
		if ctx.Err() == nil && (errors.As(err, &nl) || errors.Is(err, raft.ErrLeadershipLost)) {
			// It stepped down before the append, or before Submit saw its
			// ctx end (a stalled machine: the cut-off leader's lease ran
			// out first): again.
			t.Logf("try %d: %v", try, err)
			continue
		}
		if !errors.Is(err, idem.ErrInDoubt) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Submit that stopped waiting: %v, want idem.ErrInDoubt and context.DeadlineExceeded", err)
		}
		break
	}
	resp, err := c.client().DoCommand(ctx, cmd)
	if err != nil || resp.Err != nil {
		t.Fatal(err, resp)
	}
	// Duplicate or not: the healed leader may have committed the first
	// append after all (then the retry gets its stored reply), or a new
	// leader dropped it (then the retry runs it).
	if val(t, resp) != 1 {
		t.Fatalf("the retry: %+v", resp)
	}
	for _, st := range c.converge(t, ctx) {
		if n := st.Applied[id]; n != 1 {
			t.Fatalf("%s applied %d times", id, n)
		}
	}
}
