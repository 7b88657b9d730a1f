package idemcluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	"github.com/idemdb/idem/internal/testclock"
)

// leaderSince records, on the test's monotonic clock, when each node
// became leader: raft calls an observer's filter synchronously as it
// enters the state.
type leaderSince struct {
	mu sync.Mutex
	at map[string][]time.Time
}

func (ls *leaderSince) watch(t *testing.T, id string, r *raft.Raft) {
	o := raft.NewObserver(nil, false, func(o *raft.Observation) bool {
		if s, ok := o.Data.(raft.RaftState); ok && s == raft.Leader {
			now := time.Now()
			ls.mu.Lock()
			ls.at[id] = append(ls.at[id], now)
			ls.mu.Unlock()
		}
		return false
	})
	r.RegisterObserver(o)
	t.Cleanup(func() { r.DeregisterObserver(o) })
}

// A leader cut off from the others answers reads on its lease only until
// the lease ends, then NOT_LEADER; and no other node becomes leader
// before the lease has ended (the followers that accepted the heartbeat
// the lease counts refuse votes for HeartbeatTimeout). One monotonic
// clock: the nodes run in the test's process.
func TestLeaseReadsEndWithTheLease(t *testing.T) { untilLeaderStays(t, testLeaseReadsEndWithTheLease) }

func testLeaseReadsEndWithTheLease(t *testing.T) {
	const hb = time.Second
	cc := newChaosCluster(t, 3, func(o *NodeOptions) { o.HeartbeatTimeout, o.ElectionTimeout = hb, hb })
	ctx, c, req := withDone(t, cc.testCluster)
	old := cc.leader(30 * time.Second)
	nd := cc.nodes[old]
	ls := &leaderSince{at: map[string][]time.Time{}}
	for _, id := range cc.others(old) {
		ls.watch(t, id, cc.nodes[id].Raft())
	}
	oc := rawIdem(t, cc.addr(old))
	lookup := func() error {
		out, err := oc.Lookup(ctx, &clusterpb.LookupRequest{Request: reqToPB(req)})
		if err == nil && (out.Result.Status != clusterpb.Status_STATUS_DONE || string(out.Result.Reply) != "r") {
			t.Fatalf("lookup: %v", out.Result)
		}
		return err
	}
	// A round, then reads on the lease it took.
	eventually(t, 30*time.Second, "a read served on the lease", func() bool {
		if err := lookup(); err != nil {
			if !nd.IsLeader() {
				t.Skip("the leader changed before the cut (a loaded machine): nothing to check")
			}
			t.Fatalf("lookup before the cut: %v", err)
		}
		return nd.lease.served.Load() > 0
	})
	term := nd.ready.Load()
	cc.isolate(old)
	cut := time.Now()
	// Reads until one is refused; each answered one was sent before the
	// lease's end (taken at the end: a round on its way at the cut may
	// have renewed it).
	type read struct {
		sent time.Time
		err  error
	}
	var reads []read
	for {
		r := read{sent: time.Now()}
		r.err = lookup()
		reads = append(reads, r)
		if r.err != nil {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	var nl *errNotLeader
	if err := fromStatus(reads[len(reads)-1].err); !errors.As(err, &nl) {
		t.Fatalf("the cut-off leader's read after its lease: %v, want NOT_LEADER", err)
	}
	g := nd.lease.grant.Load()
	if g == nil || g.term != term {
		t.Skip("the leader changed before the cut (a loaded machine): nothing to check")
	}
	for i, r := range reads[:len(reads)-1] {
		if !r.sent.Before(g.until) {
			t.Fatalf("read %d, sent %v after the lease's end, was answered", i, r.sent.Sub(g.until))
		}
	}
	t.Logf("%d reads answered on the lease after the cut (lease ended %v after the cut), then: %v", len(reads)-1, g.until.Sub(cut), fromStatus(reads[len(reads)-1].err))
	// A new leader, and a write through it.
	nl2 := cc.leaderAmong(cc.others(old), 30*time.Second)
	if _, err := idem.Do(ctx, c, idem.Request{ID: []byte("after")}, func(context.Context) ([]byte, error) { return []byte("r2"), nil }); err != nil {
		t.Fatal(err)
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if len(ls.at[nl2]) == 0 {
		t.Fatalf("no observation of %s becoming leader", nl2)
	}
	for id, at := range ls.at {
		for _, a := range at {
			if a.After(cut) && a.Before(g.until) {
				t.Fatalf("%s became leader %v before the cut-off leader's lease ended", id, g.until.Sub(a))
			}
		}
	}
	t.Logf("%s became leader %v after the lease ended", nl2, ls.at[nl2][0].Sub(g.until))
}

// Reads that flow keep the lease: a read served with less than half of
// it left starts one round in the background, so a steady stream of reads
// takes a round now and then, not one per read, and is answered on the
// lease.
func TestLeaseRenewedWhileReadsFlow(t *testing.T) {
	untilLeaderStays(t, testLeaseRenewedWhileReadsFlow)
}

func testLeaseRenewedWhileReadsFlow(t *testing.T) {
	const hb = time.Second // a lease of 900 ms: longer than a round on a loaded machine
	cc := newChaosCluster(t, 3, func(o *NodeOptions) { o.HeartbeatTimeout, o.ElectionTimeout = hb, hb })
	ctx, _, req := withDone(t, cc.testCluster)
	id := cc.leader(30 * time.Second)
	nd := cc.nodes[id]
	oc := rawIdem(t, cc.addr(id))
	before := nd.lease.served.Load()
	// Reads over several lease lengths.
	deadline := time.Now().Add(3 * hb)
	n := 0
	for ; time.Now().Before(deadline); n++ {
		if out, err := oc.Lookup(ctx, &clusterpb.LookupRequest{Request: reqToPB(req)}); err != nil || out.Result.Status != clusterpb.Status_STATUS_DONE {
			if !nd.IsLeader() {
				t.Skip("the leader changed (a loaded machine): nothing to check")
			}
			t.Fatalf("read %d: %v %v", n, out, err)
		}
	}
	served := nd.lease.served.Load() - before
	t.Logf("%d reads in %v, %d on the lease", n, 3*hb, served)
	if served == 0 {
		t.Fatal("no read served on the lease")
	}
}

// With NodeOptions.NoLeaseReads every read takes a round.
func TestNoLeaseReads(t *testing.T) {
	cc := newChaosCluster(t, 3, func(o *NodeOptions) { o.NoLeaseReads = true })
	ctx, _, req := withDone(t, cc.testCluster)
	id := cc.leader(30 * time.Second)
	oc := rawIdem(t, cc.addr(id))
	for range 20 {
		if _, err := oc.Lookup(ctx, &clusterpb.LookupRequest{Request: reqToPB(req)}); err != nil {
			t.Fatal(err)
		}
	}
	if s := cc.nodes[id].lease.served.Load(); s != 0 {
		t.Fatalf("%d reads served on a lease with NoLeaseReads", s)
	}
}

// voteProbe sends raft RPCs to node id of cc from a transport of the
// test's own, as another node would.
func voteProbe(cc *chaosCluster, id string) *raft.InmemTransport {
	_, probe := raft.NewInmemTransportWithTimeout("probe", 30*time.Second)
	cc.mu.Lock()
	probe.Connect(raft.ServerAddress(id), cc.trans[id])
	cc.mu.Unlock()
	return probe
}

// A restarted node knows no leader, and raft would grant a vote at once;
// the leader's lease may count a heartbeat the node accepted just before
// it stopped. So for HeartbeatTimeout after it starts it grants no vote
// and no pre-vote; then it does.
func TestRestartedNodeSitsOutElections(t *testing.T) {
	clock := testclock.New()
	cc := newChaosCluster(t, 3, func(o *NodeOptions) { o.leaseClock = clock.Now })
	leader := cc.leader(30 * time.Second)
	others := cc.others(leader)
	f, candidate := others[0], others[1]
	// Cut off, so that the restarted node hears from no leader.
	cc.isolate(f)
	cc.stop(f)
	cc.start(f)
	probe := voteProbe(cc, f)
	hdr := raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte(candidate), Addr: []byte(candidate)}
	vote := func() (*raft.RequestVoteResponse, *raft.RequestPreVoteResponse) {
		t.Helper()
		term := cc.nodes[f].Raft().CurrentTerm() + 100 // above any election the node runs itself meanwhile
		var pre raft.RequestPreVoteResponse
		if err := probe.RequestPreVote(raft.ServerID(f), raft.ServerAddress(f), &raft.RequestPreVoteRequest{RPCHeader: hdr, Term: term, LastLogIndex: math.MaxUint32, LastLogTerm: term}, &pre); err != nil {
			t.Fatal(err)
		}
		var resp raft.RequestVoteResponse
		if err := probe.RequestVote(raft.ServerID(f), raft.ServerAddress(f), &raft.RequestVoteRequest{RPCHeader: hdr, Term: term, LastLogIndex: math.MaxUint32, LastLogTerm: term}, &resp); err != nil {
			t.Fatal(err)
		}
		return &resp, &pre
	}
	if v, p := vote(); v.Granted || p.Granted {
		t.Fatalf("a node restarted within HeartbeatTimeout granted a vote %v, a pre-vote %v", v.Granted, p.Granted)
	}
	clock.Advance(cc.opts[f].HeartbeatTimeout)
	if v, p := vote(); !v.Granted || !p.Granted {
		t.Fatalf("HeartbeatTimeout after its start, a node knowing no leader refused a vote (%v) or pre-vote (%v)", v.Granted, p.Granted)
	}
}

// holdTimeouts is an in-memory transport whose TimeoutNows wait for
// release before they leave; sent is told of each.
type holdTimeouts struct {
	*raft.InmemTransport
	sent    chan struct{}
	release chan struct{}
}

func (h *holdTimeouts) TimeoutNow(id raft.ServerID, target raft.ServerAddress, args *raft.TimeoutNowRequest, resp *raft.TimeoutNowResponse) error {
	h.sent <- struct{}{}
	<-h.release
	return h.InmemTransport.TimeoutNow(id, target, args, resp)
}

// A leader that starts a leadership transfer answers no read on its
// lease once the TimeoutNow has left: the target's vote requests carry
// LeadershipTransfer, which the followers grant despite their leader.
// Here the TimeoutNow is held on its way; the leader still leads, and a
// read takes a round.
func TestLeadershipTransferVoidsLease(t *testing.T) {
	var mu sync.Mutex
	holds := map[string]*holdTimeouts{}
	release := make(chan struct{})
	var once sync.Once
	defer once.Do(func() { close(release) })
	cc := newChaosClusterWrapped(t, 3, func(o *NodeOptions) {
		// No election while the transfer is held.
		o.HeartbeatTimeout, o.ElectionTimeout = 4*time.Second, 4*time.Second
	}, func(id string, tr *raft.InmemTransport) raft.Transport {
		mu.Lock()
		defer mu.Unlock()
		holds[id] = &holdTimeouts{InmemTransport: tr, sent: make(chan struct{}, 4), release: release}
		return holds[id]
	})
	ctx, _, req := withDone(t, cc.testCluster)
	id := cc.leader(30 * time.Second)
	nd := cc.nodes[id]
	oc := rawIdem(t, cc.addr(id))
	lookup := func() {
		t.Helper()
		if out, err := oc.Lookup(ctx, &clusterpb.LookupRequest{Request: reqToPB(req)}); err != nil || out.Result.Status != clusterpb.Status_STATUS_DONE {
			t.Fatalf("lookup: %v %v", out, err)
		}
	}
	eventually(t, 30*time.Second, "a read served on the lease", func() bool {
		lookup()
		return nd.lease.served.Load() > 0
	})
	transfer := make(chan error, 1)
	go func() { transfer <- nd.Raft().LeadershipTransfer().Error() }()
	mu.Lock()
	h := holds[id]
	mu.Unlock()
	select {
	case <-h.sent:
	case <-ctx.Done():
		t.Fatal("no TimeoutNow sent")
	}
	if !nd.IsLeader() {
		t.Fatal("the leader stepped down with its TimeoutNow held")
	}
	served := nd.lease.served.Load()
	lookup() // a round: the followers still follow it
	if s := nd.lease.served.Load(); s != served {
		t.Fatalf("a read served on the lease after the leader's TimeoutNow left (%d -> %d)", served, s)
	}
	once.Do(func() { close(release) })
	if err := <-transfer; err != nil {
		t.Logf("transfer: %v", err)
	}
}

// A TimeoutNow makes its receiver forget its leader and stand with
// LeadershipTransfer set, which the others grant despite their leader. So
// the receiver takes one only when it carries the sender's term (raft
// v1.8 sends none; the node stamps it) and that term is not below its
// own: a delayed one from an earlier leader is dropped. A run in which the
// follower's term moved on its own (an election: a loaded machine) checks
// nothing after that and is run again on a new cluster (untilLeaderStays);
// a stale TimeoutNow taken fails before that check.
func TestStaleTimeoutNowDropped(t *testing.T) {
	untilLeaderStays(t, testStaleTimeoutNowDropped)
}

func testStaleTimeoutNowDropped(t *testing.T) {
	cc := newChaosCluster(t, 3, func(o *NodeOptions) {
		o.HeartbeatTimeout, o.ElectionTimeout = 2*time.Second, 2*time.Second
	})
	leader := cc.leader(30 * time.Second)
	f := cc.others(leader)[0]
	r := cc.nodes[f].Raft()
	term := r.CurrentTerm()
	probe := voteProbe(cc, f)
	hdr := raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte(leader), Addr: []byte(leader)}
	send := func(id []byte) error {
		h := hdr
		h.ID = id
		return probe.TimeoutNow(raft.ServerID(f), raft.ServerAddress(f), &raft.TimeoutNowRequest{RPCHeader: h}, &raft.TimeoutNowResponse{})
	}
	for _, tc := range []struct {
		name string
		id   []byte
	}{
		{"no term (raft's own)", []byte(leader)},
		{fmt.Sprintf("term %d, the node's is %d", term-1, term), stampTerm([]byte(leader), term-1)},
	} {
		if err := send(tc.id); err == nil {
			t.Fatalf("a TimeoutNow with %s was taken", tc.name)
		} else {
			t.Logf("%s: %v", tc.name, err)
		}
		termMoved(t, r, term)
		if s := r.State(); s != raft.Follower {
			t.Fatalf("after a TimeoutNow with %s the follower is %v", tc.name, s)
		}
		if _, lid := r.LeaderWithID(); string(lid) != leader {
			t.Fatalf("after a TimeoutNow with %s the follower follows %q, want %s", tc.name, lid, leader)
		}
	}
	// The current term's is taken: the node stands.
	if err := send(stampTerm([]byte(leader), term)); err != nil {
		termMoved(t, r, term)
		t.Fatalf("a TimeoutNow of the current term: %v", err)
	}
	eventually(t, 30*time.Second, "the node to stand", func() bool { return r.CurrentTerm() > term })
}

// BenchmarkConsumerHop is what leaseTransport's filter adds to an RPC a
// node receives (every AppendEntries a follower gets goes through it):
// one AppendEntries over raft's in-memory transport, answered at once by
// a stand-in for raft, without and with the filter between.
func BenchmarkConsumerHop(b *testing.B) {
	for _, filtered := range []bool{false, true} {
		b.Run(fmt.Sprint("filter=", filtered), func(b *testing.B) {
			_, from := raft.NewInmemTransport("a")
			_, to := raft.NewInmemTransport("b")
			from.Connect("b", to)
			var tr raft.Transport = to
			if filtered {
				tr = newLeaseTransport(to, "b", &leaderLease{}, time.Second, false, nil)
				defer tr.(io.Closer).Close()
			}
			done := make(chan struct{})
			defer close(done)
			go func() {
				for {
					select {
					case rpc := <-tr.Consumer():
						rpc.Respond(&raft.AppendEntriesResponse{Success: true}, nil)
					case <-done:
						return
					}
				}
			}()
			req := raft.AppendEntriesRequest{RPCHeader: raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax}, Term: 1,
				Entries: []*raft.Log{{Index: 1, Term: 1, Data: []byte("x")}}}
			var resp raft.AppendEntriesResponse
			for b.Loop() {
				if err := from.AppendEntries("b", "b", &req, &resp); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// termMoved skips the test when r's term is no longer term: an election
// happened on its own (a goroutine starved past the election timeout), and
// what the test checks next depends on the term it started in.
func termMoved(t *testing.T, r *raft.Raft, term uint64) {
	t.Helper()
	if now := r.CurrentTerm(); now != term {
		t.Skipf("the follower's term moved on its own from %d to %d: nothing to check in this run", term, now)
	}
}
