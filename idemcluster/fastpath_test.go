package idemcluster

import (
	"context"
	"errors"
	"fmt"
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

// Calls that wait while a batch is on the wire go together in the next
// one, each answered as its own call.
func TestClientCoalescesCalls(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cb := &countBatches{}
	leader := tc.nodes[tc.leader(30*time.Second)]
	c, err := Dial(ctx, []string{leader.Addr()}, &Options{Owner: "app", DialOptions: []grpc.DialOption{grpc.WithUnaryInterceptor(cb.intercept)}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i := range 32 {
		if _, err := idem.Do(ctx, c, idem.Request{ID: []byte(fmt.Sprint("id-", i))}, func(context.Context) ([]byte, error) { return []byte(fmt.Sprint("r-", i)), nil }); err != nil {
			t.Fatal(err)
		}
	}
	cb.n.Store(0)
	cb.hold = make(chan struct{})
	p, err := c.peer(leader.Addr())
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
// round cannot reach a majority. The leader lease is long here (2 s), so
// that the reads arrive while it still thinks it leads: a node that
// skipped the round would answer them.
func TestIsolatedLeaderAnswersNoRead(t *testing.T) {
	cc := newChaosCluster(t, 3, func(o *NodeOptions) {
		o.HeartbeatTimeout, o.ElectionTimeout = 4*time.Second, 4*time.Second
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c := dial(t, cc.testCluster, "app")
	req := idem.Request{ID: []byte("x")}
	if _, err := idem.Do(ctx, c, req, func(context.Context) ([]byte, error) { return []byte("r"), nil }); err != nil {
		t.Fatal(err)
	}
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
	cb := &countBatches{}
	leader := tc.nodes[tc.leader(30*time.Second)]
	c, err := Dial(ctx, []string{leader.Addr()}, &Options{Owner: "app", DialOptions: []grpc.DialOption{grpc.WithUnaryInterceptor(cb.intercept)}})
	if err != nil {
		t.Fatal(err)
	}
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
	p, err := c.peer(leader.Addr())
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
