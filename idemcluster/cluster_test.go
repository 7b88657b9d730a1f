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
	t     *testing.T
	dir   string
	nodes map[string]*Node
	opts  map[string]*NodeOptions
	addrs []string
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func newTestCluster(t *testing.T, n int) *testCluster {
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
	return tc
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
		if err := tc.nodes[old].teardown(); err != nil {
			t.Logf("teardown %s: %v", old, err)
		}
		delete(tc.nodes, old)
		tc.leader(30 * time.Second)
		o := *tc.opts[old]
		o.RaftListener, o.GRPCListener = nil, nil
		o.RaftAddr, o.GRPCAddr = o.Peers[old], tc.addrs[int(old[1]-'1')]
		nd, err := StartNode(&o)
		if err != nil {
			t.Fatalf("restart %s: %v", old, err)
		}
		tc.nodes[old] = nd
	}
	for id, want := range committed {
		r, err := c.Begin(ctx, idem.Request{ID: []byte(id)})
		if err != nil || r.Status != idem.Done || string(r.Reply) != want {
			t.Fatalf("%s after failovers: %+v %v", id, r, err)
		}
	}
}
