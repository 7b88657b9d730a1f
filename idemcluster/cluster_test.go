package idemcluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/idemdb/idem"
)

// testCluster is n nodes on loopback, with listeners bound by the test
// (a restarted node binds its old addresses again, as a real restart does).
type testCluster struct {
	t     testing.TB
	dir   string
	nodes map[string]*Node
	opts  map[string]*NodeOptions
	addrs []string
}

func listen(t testing.TB) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func newTestCluster(t testing.TB, n int) *testCluster {
	t.Helper()
	tc := &testCluster{t: t, dir: t.TempDir(), nodes: map[string]*Node{}, opts: map[string]*NodeOptions{}}
	peers := map[string]string{}
	rls, gls := map[string]net.Listener{}, map[string]net.Listener{}
	for i := range n {
		id := fmt.Sprintf("n%d", i+1)
		rls[id], gls[id] = listen(t), listen(t)
		peers[id] = rls[id].Addr().String()
		tc.addrs = append(tc.addrs, gls[id].Addr().String())
	}
	for id := range peers {
		o := &NodeOptions{ID: id, Dir: filepath.Join(tc.dir, id), RaftListener: rls[id], GRPCListener: gls[id], Peers: peers,
			HeartbeatTimeout: 200 * time.Millisecond, ElectionTimeout: 200 * time.Millisecond}
		tc.opts[id] = o
		nd, err := StartNode(o)
		if err != nil {
			t.Fatalf("start %s: %v", id, err)
		}
		tc.nodes[id] = nd
	}
	t.Cleanup(func() {
		for _, nd := range tc.nodes {
			nd.Close()
		}
	})
	tc.leader(30 * time.Second)
	tc.addressesKnown(30 * time.Second)
	return tc
}

// addressesKnown waits until every node's members table has every
// node's gRPC address (each node advertises its own once it sees a
// leader: an entry in the log, which a test counting entries must not
// meet halfway).
func (tc *testCluster) addressesKnown(within time.Duration) {
	tc.t.Helper()
	eventually(tc.t, within, "every node's members table has every node's gRPC address", func() bool {
		for _, nd := range tc.nodes {
			for id, m := range tc.nodes {
				if nd.fsm.member(id) != m.Addr() {
					return false
				}
			}
		}
		return true
	})
}

// stop stops node id abruptly (no leadership transfer), as a crash of
// its process would.
func (tc *testCluster) stop(id string) {
	tc.t.Helper()
	if err := tc.nodes[id].teardown(); err != nil {
		tc.t.Logf("stop %s: %v", id, err)
	}
	delete(tc.nodes, id)
}

// start starts node id again on its directory and addresses.
func (tc *testCluster) start(id string) {
	tc.t.Helper()
	o := *tc.opts[id]
	o.RaftListener, o.GRPCListener = nil, nil
	o.RaftAddr, o.GRPCAddr = o.Peers[id], tc.addrs[int(id[1]-'1')]
	nd, err := StartNode(&o)
	if err != nil {
		tc.t.Fatalf("restart %s: %v", id, err)
	}
	tc.nodes[id] = nd
}

// leader waits for a ready leader and returns its id.
func (tc *testCluster) leader(within time.Duration) string {
	tc.t.Helper()
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		for id, nd := range tc.nodes {
			if nd.IsLeader() {
				return id
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	tc.t.Fatalf("no leader within %v", within)
	return ""
}

// applyOnLeader applies c on the node that leads now, and again on the
// next leader when leadership moved before the entry committed (raft's
// "not leader", or leadership lost after the append: the same command is
// sent again, as a client retries). Applying on the node found leading a
// moment earlier fails by chance when an election (200 ms timeouts on a
// loaded machine) moves leadership in between.
func (tc *testCluster) applyOnLeader(ctx context.Context, c *command) (*applied, error) {
	tc.t.Helper()
	for {
		a, err := tc.nodes[tc.leader(30*time.Second)].apply(ctx, c)
		var nl *errNotLeader
		if (errors.As(err, &nl) || errors.Is(err, idem.ErrInDoubt)) && ctx.Err() == nil {
			continue
		}
		return a, err
	}
}

// withDone dials a client (owner "app") and commits request "x" with the
// reply "r" through it: the committed request the read tests look up. ctx
// ends after 60 s, or with the test.
func withDone(t *testing.T, tc *testCluster) (context.Context, *Client, idem.Request) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	c := dial(t, tc, "app")
	req := idem.Request{ID: []byte("x")}
	if _, err := idem.Do(ctx, c, req, func(context.Context) ([]byte, error) { return []byte("r"), nil }); err != nil {
		t.Fatal(err)
	}
	return ctx, c, req
}

func dial(t *testing.T, tc *testCluster, owner string) *Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := Dial(ctx, tc.addrs, &Options{Owner: owner, AttemptTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestClusterExactlyOnceAcrossClients(t *testing.T) {
	tc := newTestCluster(t, 3)
	a, b := dial(t, tc, "app-a"), dial(t, tc, "app-b")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req := idem.Request{Scope: "orders", ID: []byte("o-1"), Fingerprint: []byte("fp")}
	r, err := a.Begin(ctx, req)
	if err != nil || r.Status != idem.Fresh {
		t.Fatalf("begin: %+v %v", r, err)
	}
	// Another process sees the claim in flight, and a conflict for another payload.
	if r2, err := b.Begin(ctx, req); err != nil || r2.Status != idem.InFlight {
		t.Fatalf("begin from b while a runs: %+v %v", r2, err)
	}
	if _, err := b.Begin(ctx, idem.Request{Scope: "orders", ID: []byte("o-1"), Fingerprint: []byte("other")}); !errors.Is(err, idem.ErrConflict) {
		t.Fatalf("conflict across processes: %v", err)
	}
	if err := r.Claim.Commit(ctx, []byte("receipt-1")); err != nil {
		t.Fatal(err)
	}
	for _, c := range []*Client{a, b} {
		r, err := c.Begin(ctx, req)
		if err != nil || r.Status != idem.Done || string(r.Reply) != "receipt-1" {
			t.Fatalf("retry: %+v %v", r, err)
		}
		if l, err := c.Lookup(ctx, req); err != nil || l.Status != idem.Done {
			t.Fatalf("lookup: %+v %v", l, err)
		}
	}
	// Sequence mode: errors come back with their fields.
	rs, err := a.Begin(ctx, idem.Request{Scope: "ledger", Client: "c1", Seq: 1})
	if err != nil || rs.Status != idem.Fresh {
		t.Fatal(rs, err)
	}
	if err := rs.Claim.Commit(ctx, []byte("one")); err != nil {
		t.Fatal(err)
	}
	var gap *idem.SequenceGapError
	if _, err := b.Begin(ctx, idem.Request{Scope: "ledger", Client: "c1", Seq: 5}); !errors.As(err, &gap) || gap.Last != 1 {
		t.Fatalf("gap across the wire: %v", err)
	}
	if n, err := b.ClientState(ctx, "ledger", "c1"); err != nil || n != 1 {
		t.Fatalf("client state: %d %v", n, err)
	}
	// idem.Do works on the cluster as on an engine.
	runs := 0
	for range 3 {
		if _, err := idem.Do(ctx, b, idem.Request{ID: []byte("do")}, func(context.Context) ([]byte, error) { runs++; return []byte("x"), nil }); err != nil {
			t.Fatal(err)
		}
	}
	if runs != 1 {
		t.Fatalf("Do ran %d times", runs)
	}
}

func TestClusterFailover(t *testing.T) {
	tc := newTestCluster(t, 3)
	c := dial(t, tc, "app")
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	committed := map[string]string{}
	for round := range 3 {
		for i := range 20 {
			id := fmt.Sprintf("r%d-%d", round, i)
			reply, err := idem.Do(ctx, c, idem.Request{ID: []byte(id)}, func(context.Context) ([]byte, error) { return []byte("reply-" + id), nil })
			if err != nil {
				t.Fatalf("%s: %v", id, err)
			}
			committed[id] = string(reply)
		}
		// Stop the leader abruptly (no leadership transfer) and start it again.
		old := tc.leader(30 * time.Second)
		tc.stop(old)
		tc.leader(30 * time.Second)
		tc.start(old)
	}
	for id, want := range committed {
		r, err := c.Begin(ctx, idem.Request{ID: []byte(id)})
		if err != nil || r.Status != idem.Done || string(r.Reply) != want {
			t.Fatalf("%s after failovers: %+v %v", id, r, err)
		}
	}
}

// A Begin applied twice with one owner and token (its answer was lost and
// the client retried) returns the same claim, not InFlight against itself;
// a finish retried after its answer was lost gets the recorded outcome;
// a stale owner's commit after a takeover is ErrLeaseLost.
func TestClusterClaimsAcrossRetries(t *testing.T) {
	tc := newTestCluster(t, 3)
	c := dial(t, tc, "owner-1")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req := idem.Request{ID: []byte("x")}
	begin := &command{Op: cmdBegin, Req: toWire(req), Owner: "owner-1", Token: []byte("tok-1")}
	a1, err := tc.applyOnLeader(ctx, begin)
	if err != nil || a1.err != nil || a1.res.Status != idem.Fresh {
		t.Fatalf("first begin: %+v %v", a1, err)
	}
	a2, err := tc.applyOnLeader(ctx, begin) // the retry of the same Begin
	if err != nil || a2.err != nil || a2.res.Status != idem.Fresh || string(a2.token) != "tok-1" {
		t.Fatalf("retried begin: %+v %v", a2, err)
	}
	other := &command{Op: cmdBegin, Req: toWire(req), Owner: "owner-2", Token: []byte("tok-2")}
	if a, err := tc.applyOnLeader(ctx, other); err != nil || a.res.Status != idem.InFlight {
		t.Fatalf("another owner's begin: %+v %v", a, err)
	}
	commit := &command{Op: cmdCommit, Key: keyOf(&req), Owner: "owner-1", Token: []byte("tok-1"), Reply: []byte("r")}
	for i := range 2 { // the second is a retry after a lost answer
		if a, err := tc.applyOnLeader(ctx, commit); err != nil || a.err != nil {
			t.Fatalf("commit %d: %+v %v", i, a, err)
		}
	}
	abort := &command{Op: cmdAbort, Key: keyOf(&req), Owner: "owner-1", Token: []byte("tok-1")}
	if a, err := tc.applyOnLeader(ctx, abort); err != nil || !errors.Is(a.err, idem.ErrLeaseLost) {
		t.Fatalf("abort of a committed claim: %+v %v", a, err)
	}
	if r, err := c.Lookup(ctx, req); err != nil || r.Status != idem.Done || string(r.Reply) != "r" {
		t.Fatalf("lookup: %+v %v", r, err)
	}
	stale := &command{Op: cmdCommit, Key: keyOf(&req), Owner: "owner-2", Token: []byte("tok-2"), Reply: []byte("s")}
	if a, err := tc.applyOnLeader(ctx, stale); err != nil || !errors.Is(a.err, idem.ErrLeaseLost) {
		t.Fatalf("a commit by a token that never held the claim: %+v %v", a, err)
	}
}

// A claim left by a process that died is listed for its owner after a
// snapshot and a restart of every node, and the restarted process commits
// it with the claim InDoubt hands back.
func TestClusterInDoubtAcrossSnapshotAndRestart(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	c := dial(t, tc, "orders@host-1")
	r, err := c.Begin(ctx, idem.Request{Scope: "orders/", ID: []byte("o-9"), Fingerprint: []byte("fp")})
	if err != nil || r.Status != idem.Fresh {
		t.Fatal(r, err)
	}
	c.Close() // the process dies between its side effect and its Commit
	for _, nd := range tc.nodes {
		if err := nd.Raft().Snapshot().Error(); err != nil {
			t.Fatalf("snapshot: %v", err)
		}
	}
	ids := []string{"n1", "n2", "n3"}
	for _, id := range ids {
		tc.stop(id)
	}
	for _, id := range ids {
		tc.start(id)
	}
	tc.leader(30 * time.Second)
	again := dial(t, tc, "orders@host-1") // the process restarted
	if other, err := dial(t, tc, "someone-else").InDoubt(ctx, ""); err != nil || len(other) != 0 {
		t.Fatalf("another owner's in-doubt claims: %+v %v", other, err)
	}
	ds, err := again.InDoubt(ctx, "orders/")
	if err != nil || len(ds) != 1 || string(ds[0].ID) != "o-9" || string(ds[0].Fingerprint) != "fp" {
		t.Fatalf("in doubt after restart: %+v %v", ds, err)
	}
	if err := ds[0].Claim.Commit(ctx, []byte("shipped")); err != nil {
		t.Fatal(err)
	}
	if r, err := again.Begin(ctx, idem.Request{Scope: "orders/", ID: []byte("o-9"), Fingerprint: []byte("fp")}); err != nil || r.Status != idem.Done || string(r.Reply) != "shipped" {
		t.Fatalf("after resolving: %+v %v", r, err)
	}
}

// A node that joins a running cluster whose log was compacted becomes a
// voter, catches up and answers from what it got.
func TestClusterJoin(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	c := dial(t, tc, "app")
	for i := range 50 {
		if _, err := idem.Do(ctx, c, idem.Request{ID: []byte(fmt.Sprintf("j%d", i))}, func(context.Context) ([]byte, error) { return []byte("v"), nil }); err != nil {
			t.Fatal(err)
		}
	}
	leader := tc.nodes[tc.leader(30*time.Second)]
	rc := leader.Raft().ReloadableConfig()
	rc.TrailingLogs = 5 // compact the log behind the snapshot
	if err := leader.Raft().ReloadConfig(rc); err != nil {
		t.Fatal(err)
	}
	if err := leader.Raft().Snapshot().Error(); err != nil {
		t.Fatal(err)
	}
	if first, _ := leader.logs.FirstIndex(); first <= 1 {
		t.Fatalf("the leader's log was not compacted (first index %d)", first)
	}
	rl, gl := listen(t), listen(t)
	n4, err := StartNode(&NodeOptions{ID: "n4", Dir: filepath.Join(tc.dir, "n4"), RaftListener: rl, GRPCListener: gl, Join: c.addrs[0],
		HeartbeatTimeout: 200 * time.Millisecond, ElectionTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatalf("join: %v", err)
	}
	tc.nodes["n4"] = n4
	// Asked of the node that leads now: the join is committed, so any
	// leader has it, while the node that led before may have lost
	// leadership since and not have it yet.
	f := tc.nodes[tc.leader(30*time.Second)].Raft().GetConfiguration()
	if err := f.Error(); err != nil || len(f.Configuration().Servers) != 4 {
		t.Fatalf("configuration after the join: %+v %v", f.Configuration(), err)
	}
	c4, err := Dial(ctx, []string{gl.Addr().String()}, &Options{FollowerReads: true, AttemptTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c4.Close()
	for {
		r, err := c4.Lookup(ctx, idem.Request{ID: []byte("j0")})
		if err == nil && r.Status == idem.Done {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("n4 never caught up: %+v %v", r, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// raft-wal v0.4.0 still serves entries below its first index while
	// they are in its tail segment, so the leader may send them instead of
	// its snapshot: say which way n4 caught up.
	t.Logf("n4 caught up; last_snapshot_index %s", n4.Raft().Stats()["last_snapshot_index"])
}

// The per-client reply window travels with the request: a pipelining
// client that lost the reply of an older number gets it back.
func TestClusterSequenceReplyWindow(t *testing.T) {
	tc := newTestCluster(t, 3)
	c := dial(t, tc, "ledger")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for seq := uint64(1); seq <= 3; seq++ {
		req := idem.Request{Scope: "l", Client: "p", Seq: seq, KeepReplies: 10, KeepRepliesFor: time.Hour}
		if _, err := idem.Do(ctx, c, req, func(context.Context) ([]byte, error) { return []byte(fmt.Sprint("reply-", seq)), nil }); err != nil {
			t.Fatal(err)
		}
	}
	r, err := c.Begin(ctx, idem.Request{Scope: "l", Client: "p", Seq: 1, KeepReplies: 10, KeepRepliesFor: time.Hour})
	if err != nil || r.Status != idem.Done || string(r.Reply) != "reply-1" {
		t.Fatalf("retry of seq 1 within the window: %+v %v", r, err)
	}
}

// A node removed from the cluster leaves the configuration, and the two
// left go on; a client with FollowerReads reads from the node it asks.
func TestClusterRemoveAndFollowerReads(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c := dial(t, tc, "app")
	if _, err := idem.Do(ctx, c, idem.Request{ID: []byte("before")}, func(context.Context) ([]byte, error) { return []byte("b"), nil }); err != nil {
		t.Fatal(err)
	}
	// A follower read from each node eventually sees the commit.
	for i, addr := range tc.addrs {
		fc, err := Dial(ctx, []string{addr}, &Options{FollowerReads: true, AttemptTimeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		for {
			r, err := fc.Lookup(ctx, idem.Request{ID: []byte("before")})
			if err == nil && r.Status == idem.Done {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("node %d never answered the follower read: %+v %v", i+1, r, err)
			}
			time.Sleep(10 * time.Millisecond)
		}
		fc.Close()
	}
	leader := tc.leader(30 * time.Second)
	victim := "n1"
	if victim == leader {
		victim = "n2"
	}
	if err := c.Remove(ctx, victim); err != nil {
		t.Fatalf("remove %s: %v", victim, err)
	}
	// Asked of the node that leads now (the removal is committed, so any
	// leader has it; the one that led before may have lost leadership
	// since and not have it yet).
	f := tc.nodes[tc.leader(30*time.Second)].Raft().GetConfiguration()
	if err := f.Error(); err != nil || len(f.Configuration().Servers) != 2 {
		t.Fatalf("configuration after removing %s: %+v %v", victim, f.Configuration(), err)
	}
	tc.stop(victim)
	if _, err := idem.Do(ctx, c, idem.Request{ID: []byte("after")}, func(context.Context) ([]byte, error) { return []byte("a"), nil }); err != nil {
		t.Fatalf("a write with two nodes left: %v", err)
	}
}
