package idemcluster

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// Reads that arrive while a leadership round runs share the next round;
// none is served by a round that started before it arrived.
func TestReadRoundsShareOneConfirmation(t *testing.T) {
	gate := make(chan struct{})
	started := make(chan uint64, 16)
	var rounds atomic.Uint64
	rr := &readRounds{confirm: func() (uint64, error) {
		n := rounds.Add(1)
		started <- n
		if n == 1 {
			<-gate
		}
		return n, nil
	}}
	first := rr.join()
	if n := <-started; n != 1 {
		t.Fatalf("first round %d", n)
	}
	var later []*readRound
	for range 10 {
		later = append(later, rr.join())
	}
	close(gate)
	wait(t, first)
	if first.index != 1 || first.err != nil {
		t.Fatalf("first read: round %d, %v", first.index, first.err)
	}
	for i, r := range later {
		wait(t, r)
		if r.index != 2 || r.err != nil {
			t.Fatalf("read %d, arrived during round 1: served by round %d (%v), want round 2", i, r.index, r.err)
		}
	}
	if n := rounds.Load(); n != 2 {
		t.Fatalf("%d rounds for 11 reads, want 2", n)
	}
}

// wait waits for r's round, bounded (a round that never runs fails the
// test instead of hanging it).
func wait(t *testing.T, r *readRound) {
	t.Helper()
	select {
	case <-r.done:
	case <-time.After(10 * time.Second):
		t.Fatal("a read's round never ran")
	}
}

// A Begin of a committed id is answered Done as a linearizable read: the
// log gets no entry for it.
func TestBeginOfCommittedIDAppendsNothing(t *testing.T) {
	tc := newTestCluster(t, 3)
	c := dial(t, tc, "app")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	req := idem.Request{ID: []byte("paid"), Fingerprint: []byte("fp")}
	if _, err := idem.Do(ctx, c, req, func(context.Context) ([]byte, error) { return []byte("receipt"), nil }); err != nil {
		t.Fatal(err)
	}
	leader := tc.nodes[tc.leader(30*time.Second)]
	last := leader.Raft().LastIndex()
	for i := range 3 {
		r, err := c.Begin(ctx, req)
		if err != nil || r.Status != idem.Done || string(r.Reply) != "receipt" {
			t.Fatalf("duplicate %d: %+v %v", i, r, err)
		}
	}
	if now := leader.Raft().LastIndex(); now != last {
		t.Fatalf("three duplicates appended %d log entries", now-last)
	}
	// What is not Done still goes through the log: a conflict, a new id.
	if _, err := c.Begin(ctx, idem.Request{ID: []byte("paid"), Fingerprint: []byte("other")}); !errors.Is(err, idem.ErrConflict) {
		t.Fatalf("another payload: %v", err)
	}
	if r, err := c.Begin(ctx, idem.Request{ID: []byte("new")}); err != nil || r.Status != idem.Fresh {
		t.Fatalf("a new id: %+v %v", r, err)
	}
}

// countBatches counts a client's Batch RPCs; hold, while set, stops the
// first one until it is closed.
type countBatches struct {
	n    atomic.Int32
	hold chan struct{}
	fail bool // answer every Batch with Unimplemented (a node without it)
	one  atomic.Int32
}

func (cb *countBatches) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if method != clusterpb.Idem_Batch_FullMethodName {
		if method == clusterpb.Idem_Lookup_FullMethodName {
			cb.one.Add(1)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	if cb.fail {
		return status.Error(codes.Unimplemented, "unknown method Batch")
	}
	if cb.n.Add(1) == 1 && cb.hold != nil {
		select {
		case <-cb.hold:
		case <-ctx.Done(): // the batch's own timeout: a test that failed before releasing it
			return ctx.Err()
		}
	}
	return invoker(ctx, method, req, reply, cc, opts...)
}

// queuedCalls is how many calls wait in p's batcher.
func queuedCalls(p *peer) int {
	p.batch.mu.Lock()
	defer p.batch.mu.Unlock()
	return len(p.batch.queue)
}

// dialLeaderCounting dials tc's leader (at addr), counting the client's
// Batch RPCs. A held batch lasts as long as its calls' attempts: long
// enough that it is still on the wire when the others have queued on a
// loaded machine (with the default 5 s it ended first, and its successor
// took the queue).
func dialLeaderCounting(ctx context.Context, t *testing.T, tc *testCluster) (c *Client, cb *countBatches, addr string) {
	t.Helper()
	cb = &countBatches{}
	addr = tc.nodes[tc.leader(30*time.Second)].Addr()
	c, err := Dial(ctx, []string{addr}, &Options{Owner: "app", AttemptTimeout: 60 * time.Second,
		DialOptions: []grpc.DialOption{grpc.WithUnaryInterceptor(cb.intercept)}})
	if err != nil {
		t.Fatal(err)
	}
	return c, cb, addr
}

// Calls that wait while a batch is on the wire go together in the next
// one, each answered as its own call.
func TestClientCoalescesCalls(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, cb, leader := dialLeaderCounting(ctx, t, tc)
	defer c.Close()
	for i := range 32 {
		if _, err := idem.Do(ctx, c, idem.Request{ID: []byte(fmt.Sprint("id-", i))}, func(context.Context) ([]byte, error) { return []byte(fmt.Sprint("r-", i)), nil }); err != nil {
			t.Fatal(err)
		}
	}
	cb.n.Store(0)
	cb.hold = make(chan struct{})
	p, err := c.peer(leader)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 32)
	lookup := func(i int) {
		defer wg.Done()
		r, err := c.Lookup(ctx, idem.Request{ID: []byte(fmt.Sprint("id-", i))})
		if err == nil && (r.Status != idem.Done || string(r.Reply) != fmt.Sprint("r-", i)) {
			err = fmt.Errorf("lookup %d: %+v", i, r)
		}
		errs <- err
	}
	wg.Add(1)
	go lookup(0)
	eventually(t, 30*time.Second, "the first batch on the wire", func() bool { return cb.n.Load() > 0 })
	for i := 1; i < 32; i++ {
		wg.Add(1)
		go lookup(i)
	}
	eventually(t, 30*time.Second, "31 lookups queued", func() bool { return queuedCalls(p) == 31 })
	close(cb.hold)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if n := cb.n.Load(); n != 2 {
		t.Fatalf("32 lookups in %d Batch RPCs, want 2 (one alone, then 31 together)", n)
	}
	// Errors come back per item, with their fields.
	if _, err := c.Begin(ctx, idem.Request{ID: []byte("id-1"), Fingerprint: []byte("x")}); !errors.Is(err, idem.ErrConflict) {
		t.Fatalf("conflict through a batch: %v", err)
	}
	if _, err := c.Lookup(ctx, idem.Request{}); !errors.Is(err, idem.ErrInvalidRequest) {
		t.Fatalf("invalid request through a batch: %v", err)
	}
}

// A node without the Batch RPC (an older node) gets the calls one by one,
// and so does every node with Options.NoBatching.
func TestClientWithoutBatchRPC(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cb := &countBatches{fail: true}
	c, err := Dial(ctx, tc.addrs, &Options{Owner: "app", DialOptions: []grpc.DialOption{grpc.WithUnaryInterceptor(cb.intercept)}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := idem.Do(ctx, c, idem.Request{ID: []byte("a")}, func(context.Context) ([]byte, error) { return []byte("r"), nil }); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if r, err := c.Lookup(ctx, idem.Request{ID: []byte("a")}); err != nil || r.Status != idem.Done {
			t.Fatalf("lookup: %+v %v", r, err)
		}
	}
	if n := cb.one.Load(); n != 2 {
		t.Fatalf("%d Lookup RPCs, want 2", n)
	}
	// Options.NoBatching: one RPC per call, no Batch at all.
	nb := &countBatches{}
	c2, err := Dial(ctx, tc.addrs, &Options{Owner: "app", NoBatching: true, DialOptions: []grpc.DialOption{grpc.WithUnaryInterceptor(nb.intercept)}})
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if r, err := c2.Lookup(ctx, idem.Request{ID: []byte("a")}); err != nil || r.Status != idem.Done {
		t.Fatalf("lookup without batching: %+v %v", r, err)
	}
	if b, one := nb.n.Load(), nb.one.Load(); b != 0 || one != 1 {
		t.Fatalf("NoBatching: %d Batch and %d Lookup RPCs, want 0 and 1", b, one)
	}
}

// The Batch RPC answers every item as its own call would, errors with
// their ErrorInfo included.
func TestBatchRPCItems(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c := dial(t, tc, "app")
	if _, err := idem.Do(ctx, c, idem.Request{ID: []byte("done")}, func(context.Context) ([]byte, error) { return []byte("r"), nil }); err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(tc.nodes[tc.leader(30*time.Second)].Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	out, err := clusterpb.NewIdemClient(cc).Batch(ctx, &clusterpb.BatchRequest{Items: []*clusterpb.BatchItem{
		{Call: &clusterpb.BatchItem_Begin{Begin: &clusterpb.BeginRequest{Request: &clusterpb.Request{Id: []byte("new")}, Owner: "o", Token: []byte("t")}}},
		{Call: &clusterpb.BatchItem_Lookup{Lookup: &clusterpb.LookupRequest{Request: &clusterpb.Request{Id: []byte("done")}}}},
		{Call: &clusterpb.BatchItem_Commit{Commit: &clusterpb.CommitRequest{Claim: &clusterpb.ClaimRef{Id: []byte("other"), Token: []byte("nobody's")}}}},
		{},
	}})
	if err != nil || len(out.Results) != 4 {
		t.Fatalf("batch: %v %v", out, err)
	}
	itemErr := func(i int) error {
		st := out.Results[i].Status
		if st == nil {
			return nil
		}
		return fromStatus(status.ErrorProto(toProto(st)))
	}
	if r := out.Results[0]; itemErr(0) != nil || r.Result.GetStatus() != clusterpb.Status_STATUS_FRESH || r.Result.GetClaim() == nil {
		t.Fatalf("begin: %v %v", r, itemErr(0))
	}
	if r := out.Results[1]; itemErr(1) != nil || r.Result.GetStatus() != clusterpb.Status_STATUS_DONE || string(r.Result.GetReply()) != "r" {
		t.Fatalf("lookup: %v %v", r, itemErr(1))
	}
	if err := itemErr(2); !errors.Is(err, idem.ErrLeaseLost) {
		t.Fatalf("commit of a claim never held: %v", err)
	}
	if err := itemErr(3); !errors.Is(err, idem.ErrInvalidRequest) {
		t.Fatalf("an empty item: %v", err)
	}
}

// A leader cut off from the others answers no linearizable read (a
// Lookup, a Begin of a committed id) from its own state: its leadership
// round cannot reach a majority. Raft's leader lease is long here (2 s),
// so that the reads arrive while it still thinks it leads: a node that
// skipped the round would answer them. Leases for reads are off: this is
// the round's test (TestLeaseReadsEndWithTheLease is the lease's).
func TestIsolatedLeaderAnswersNoRead(t *testing.T) {
	untilLeaderStays(t, testIsolatedLeaderAnswersNoRead)
}

func testIsolatedLeaderAnswersNoRead(t *testing.T) {
	cc := newChaosCluster(t, 3, func(o *NodeOptions) {
		o.HeartbeatTimeout, o.ElectionTimeout = 4*time.Second, 4*time.Second
		o.NoLeaseReads = true
	})
	ctx, _, req := withDone(t, cc.testCluster)
	old := cc.leader(30 * time.Second)
	oc := rawIdem(t, cc.addr(old))
	if out, err := oc.Lookup(ctx, &clusterpb.LookupRequest{Request: reqToPB(req)}); err != nil || out.Result.Status != clusterpb.Status_STATUS_DONE {
		t.Fatalf("lookup before the cut: %v %v", out, err)
	}
	// Cut it off, and wait until a heartbeat to each follower has failed:
	// no answer sent before the cut is on its way any more.
	obs := make(chan raft.Observation, 16)
	o := raft.NewObserver(obs, false, func(o *raft.Observation) bool {
		_, ok := o.Data.(raft.FailedHeartbeatObservation)
		return ok
	})
	r := cc.nodes[old].Raft()
	r.RegisterObserver(o)
	defer r.DeregisterObserver(o)
	cc.isolate(old)
	failed := map[raft.ServerID]bool{}
	for len(failed) < 2 {
		select {
		case ob := <-obs:
			failed[ob.Data.(raft.FailedHeartbeatObservation).PeerID] = true
		case <-ctx.Done():
			t.Fatalf("no failed heartbeats after the cut: %v", failed)
		}
	}
	if !cc.nodes[old].IsLeader() {
		t.Skip("the old leader stepped down before the reads (a loaded machine): nothing to check")
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		if out, err := oc.Lookup(ctx, &clusterpb.LookupRequest{Request: reqToPB(req)}); err == nil {
			t.Errorf("the cut-off leader answered a lookup: %v", out.Result.Status)
		}
	}()
	go func() {
		defer wg.Done()
		if out, err := oc.Begin(ctx, &clusterpb.BeginRequest{Request: reqToPB(req), Owner: "o", Token: []byte("t")}); err == nil {
			t.Errorf("the cut-off leader answered a Begin: %v", out.Result.Status)
		}
	}()
	wg.Wait()
}

// Calls with large replies that queue together still go in batches under
// gRPC's 4 MiB message limit (each call alone is under it).
func TestClientBatchesOfLargeReplies(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, cb, leader := dialLeaderCounting(ctx, t, tc)
	defer c.Close()
	const n = 6
	var claims []*idem.Claim
	for i := range n {
		r, err := c.Begin(ctx, idem.Request{ID: []byte(fmt.Sprint("big-", i))})
		if err != nil || r.Status != idem.Fresh {
			t.Fatalf("begin %d: %+v %v", i, r, err)
		}
		claims = append(claims, r.Claim)
	}
	p, err := c.peer(leader)
	if err != nil {
		t.Fatal(err)
	}
	cb.n.Store(0)
	cb.hold = make(chan struct{})
	reply := make([]byte, 900<<10)
	var wg sync.WaitGroup
	errs := make(chan error, n+1)
	wg.Add(1)
	go func() { // the first batch, held on the wire
		defer wg.Done()
		_, err := c.Lookup(ctx, idem.Request{ID: []byte("big-0")})
		errs <- err
	}()
	eventually(t, 30*time.Second, "the first batch on the wire", func() bool { return cb.n.Load() > 0 })
	for i, cl := range claims {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := cl.Commit(ctx, reply); err != nil {
				errs <- fmt.Errorf("commit %d: %w", i, err)
			}
		}()
	}
	eventually(t, 30*time.Second, "the commits queued", func() bool { return queuedCalls(p) == n })
	close(cb.hold)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	for i := range n {
		if r, err := c.Lookup(ctx, idem.Request{ID: []byte(fmt.Sprint("big-", i))}); err != nil || r.Status != idem.Done || len(r.Reply) != len(reply) {
			t.Fatalf("big-%d: %v %d bytes %v", i, r.Status, len(r.Reply), err)
		}
	}
}

// heldTransport is an in-memory raft transport whose successful
// heartbeats can be held back: the follower has handled the heartbeat,
// and its answer reaches the sender only once release is closed.
// newHeldCluster starts a 3-node cluster whose transports are
// heldTransports; held returns a node's.
func newHeldCluster(t testing.TB, tune func(o *NodeOptions)) (cc *chaosCluster, held func(id string) *heldTransport) {
	hts := map[string]*heldTransport{}
	var mu sync.Mutex
	cc = newChaosClusterWrapped(t, 3, tune, func(id string, tr *raft.InmemTransport) raft.Transport {
		mu.Lock()
		defer mu.Unlock()
		hts[id] = &heldTransport{InmemTransport: tr}
		return hts[id]
	})
	return cc, func(id string) *heldTransport {
		mu.Lock()
		defer mu.Unlock()
		return hts[id]
	}
}

type heldTransport struct {
	*raft.InmemTransport
	mu      sync.Mutex         // guards release, held, stuck and unstick
	release chan struct{}      // non-nil: hold the answers until it is closed
	held    chan raft.ServerID // told the follower of each answer held
	// stuck, when set, is a follower that heartbeats to reach only once
	// unstick is closed (a stopped process: sent, never answered);
	// beats and most count them on their way.
	stuck       raft.ServerID
	unstick     chan struct{}
	beats, most atomic.Int32
}

func (h *heldTransport) AppendEntries(id raft.ServerID, target raft.ServerAddress, req *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) error {
	h.mu.Lock()
	stuck, unstick := h.stuck, h.unstick
	h.mu.Unlock()
	if stuck == id && len(req.Entries) == 0 && req.PrevLogEntry == 0 {
		n := h.beats.Add(1)
		for m := h.most.Load(); n > m && !h.most.CompareAndSwap(m, n); m = h.most.Load() {
		}
		<-unstick
		h.beats.Add(-1)
	}
	err := h.InmemTransport.AppendEntries(id, target, req, resp)
	h.mu.Lock()
	release, held := h.release, h.held
	h.mu.Unlock()
	if err == nil && release != nil && resp.Success && len(req.Entries) == 0 && req.PrevLogEntry == 0 {
		held <- id
		<-release
	}
	return err
}

// A read round counts only the answers to heartbeats it sent after the
// read arrived. Here both followers have accepted a heartbeat from the
// leader, the answers are held back, the leader is cut off, and a read
// arrives; then the answers are let through. They say nothing about the
// time after the read arrived (a majority may have elected another leader
// meanwhile, which may have committed writes the read would miss), so the
// read must not be answered. raft's VerifyLeader counted them: each
// replication goroutine gives the next answer it receives to every
// verification registered meanwhile, also the answer to a heartbeat sent
// before. Leases for reads are off: this is the round's test.
func TestReadRoundCountsOnlyItsOwnHeartbeats(t *testing.T) {
	untilLeaderStays(t, testReadRoundCountsOnlyItsOwnHeartbeats)
}

func testReadRoundCountsOnlyItsOwnHeartbeats(t *testing.T) {
	cc, heldOf := newHeldCluster(t, func(o *NodeOptions) {
		// Long enough that the leader keeps raft's lease while its answers
		// are held (about HeartbeatTimeout/2), and that no election runs.
		o.HeartbeatTimeout, o.ElectionTimeout = 4*time.Second, 4*time.Second
		o.NoLeaseReads = true
	})
	ctx, _, req := withDone(t, cc.testCluster)
	old := cc.leader(30 * time.Second)
	nd := cc.nodes[old]
	oc := rawIdem(t, cc.addr(old))
	if out, err := oc.Lookup(ctx, &clusterpb.LookupRequest{Request: reqToPB(req)}); err != nil || out.Result.Status != clusterpb.Status_STATUS_DONE {
		t.Fatalf("lookup before the cut: %v %v", out, err)
	}
	// Hold the answers to the leader's next heartbeat to each follower.
	ht := heldOf(old)
	release := make(chan struct{})
	released := false
	defer func() {
		if !released {
			close(release)
		}
	}()
	ht.mu.Lock()
	ht.release, ht.held = release, make(chan raft.ServerID, 8)
	ht.mu.Unlock()
	held := map[raft.ServerID]bool{}
	for len(held) < 2 {
		select {
		case id := <-ht.held:
			held[id] = true
		case <-ctx.Done():
			t.Fatalf("no heartbeat answers held: %v", held)
		}
	}
	cc.isolate(old)
	ht.mu.Lock()
	ht.release = nil // the read round's own heartbeats (which fail: cut) are not held
	ht.mu.Unlock()
	if !nd.IsLeader() {
		t.Skip("the old leader stepped down before the read (a loaded machine): nothing to check")
	}
	// The read (a Batch of lookups, the client's path), and its round:
	// started after the cut.
	started := make(chan struct{})
	var once sync.Once
	confirm := nd.reads.confirm
	nd.reads.confirm = func() (uint64, error) {
		once.Do(func() { close(started) })
		return confirm()
	}
	answer := make(chan error, 1)
	go func() {
		lookup := func(id string) *clusterpb.BatchItem {
			return &clusterpb.BatchItem{Call: &clusterpb.BatchItem_Lookup{Lookup: &clusterpb.LookupRequest{Request: reqToPB(idem.Request{ID: []byte(id)})}}}
		}
		out, err := oc.Batch(ctx, &clusterpb.BatchRequest{Items: []*clusterpb.BatchItem{lookup("x"), lookup("y")}})
		if err == nil {
			for _, r := range out.Results {
				if r.Status == nil {
					t.Logf("a lookup was answered %v", r.Result.Status)
					answer <- nil
					return
				}
				err = status.ErrorProto(toProto(r.Status))
			}
		}
		answer <- err
	}()
	select {
	case <-started:
	case <-ctx.Done():
		t.Fatal("the reads' round never started")
	}
	roundWaits(t)
	released = true
	close(release)
	select {
	case err := <-answer:
		if err == nil {
			t.Fatal("the cut-off leader answered a read, confirmed by heartbeat answers given before the read arrived")
		}
		t.Logf("the read: %v", err)
	case <-ctx.Done():
		t.Fatal("the read never ended")
	}
}

// A follower that stopped answering holds one heartbeat of the read
// rounds, not one per round: a round sends none to a voter an earlier
// round's heartbeat is still on its way to (and does not count it). Each
// would hold a connection of raft's TCP transport (its pool is empty
// while they wait) until the transport's timeout. A run whose leader
// stepped down on its own during the reads (a loaded machine) checks
// nothing and runs again on a new cluster (untilLeaderStays).
func TestReadRoundsKeepOneHeartbeatPerVoter(t *testing.T) {
	untilLeaderStays(t, testReadRoundsKeepOneHeartbeatPerVoter)
}

func testReadRoundsKeepOneHeartbeatPerVoter(t *testing.T) {
	cc, heldOf := newHeldCluster(t, func(o *NodeOptions) { o.NoLeaseReads = true }) // every read a round
	ctx, _, req := withDone(t, cc.testCluster)
	leader := cc.leader(30 * time.Second)
	ht := heldOf(leader)
	unstick := make(chan struct{})
	defer close(unstick)
	ht.mu.Lock()
	ht.stuck, ht.unstick = raft.ServerID(cc.others(leader)[0]), unstick
	ht.mu.Unlock()
	oc := rawIdem(t, cc.addr(leader))
	const reads = 20
	for i := range reads {
		out, err := oc.Lookup(ctx, &clusterpb.LookupRequest{Request: reqToPB(req)})
		if err != nil && !cc.nodes[leader].IsLeader() {
			t.Skipf("the leader stepped down during the reads (a loaded machine): nothing to check (read %d: %v)", i, err)
		}
		if err != nil || out.Result.Status != clusterpb.Status_STATUS_DONE {
			t.Fatalf("read %d with a follower stuck: %v %v", i, out, err)
		}
	}
	// raft's own heartbeat goroutine holds one too.
	if n := ht.most.Load(); n > 2 {
		t.Fatalf("%d heartbeats on their way to the stuck follower at once after %d reads, want at most 2 (one of raft's, one of the read rounds)", n, reads)
	}
}

// roundWaits waits, bounded, until the running read round has ended or
// waits for answers with raft's main loop idle (a round on raft's
// VerifyLeader has registered with the replication goroutines by then).
func roundWaits(t *testing.T) {
	t.Helper()
	buf := make([]byte, 16<<20)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		round, busy := "", false
		for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
			head, _, _ := strings.Cut(g, "\n")
			switch {
			case strings.Contains(g, ".confirmLeadership("):
				round = head
			case strings.Contains(g, ".leaderLoop(") && !strings.Contains(head, "[select"):
				busy = true
			}
		}
		if round == "" || (!busy && (strings.Contains(round, "[select") || strings.Contains(round, "[chan receive"))) {
			return
		}
		runtime.Gosched()
	}
	t.Fatal("the read round neither ended nor waited")
}
