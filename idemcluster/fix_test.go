package idemcluster

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A linearizable read after a barrier (an entry raft never hands the
// state machine) answers: it waits for the last entry the state machine
// gets, not for the commit index itself.
func TestReadAfterBarrierAnswers(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c := dial(t, tc, "app")
	req := idem.Request{ID: []byte("k")}
	if _, err := idem.Do(ctx, c, req, func(context.Context) ([]byte, error) { return []byte("r"), nil }); err != nil {
		t.Fatal(err)
	}
	// The barrier on the node that leads now, again on the next leader
	// when leadership moves meanwhile (200 ms timeouts on a loaded
	// machine): a barrier refused as "not leader" is not what this pins.
	for {
		err := tc.nodes[tc.leader(30*time.Second)].Raft().Barrier(10 * time.Second).Error()
		if err == nil {
			break
		}
		if !errors.Is(err, raft.ErrNotLeader) && !errors.Is(err, raft.ErrLeadershipLost) || ctx.Err() != nil {
			t.Fatal(err)
		}
	}
	// The read that waited for the commit index never answered at all (no
	// entry follows the barrier): a generous bound tells that from an
	// answer delayed by an election on a loaded machine, which a 3 s
	// bound did not.
	rctx, rcancel := context.WithTimeout(ctx, 30*time.Second)
	defer rcancel()
	r, err := c.Lookup(rctx, req)
	if err != nil || r.Status != idem.Done || string(r.Reply) != "r" {
		t.Fatalf("linearizable Lookup after a barrier: %+v %v", r, err)
	}
}

// A claim's finish is written whatever its ctx says: with ctx already
// ended, Commit (Abort) returns an error matching ErrInDoubt at most, and
// the record still reaches the cluster; a retry of the same finish (the
// claim as InDoubt lists it) gets the recorded outcome.
func TestFinishWithEndedContextIsWritten(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c := dial(t, tc, "app")
	for _, abort := range []bool{false, true} {
		req := idem.Request{ID: []byte(fmt.Sprint("finish-abort-", abort))}
		bctx, bcancel := context.WithCancel(ctx)
		r, err := c.Begin(bctx, req)
		if err != nil || r.Status != idem.Fresh {
			t.Fatalf("begin: %+v %v", r, err)
		}
		ds, err := c.InDoubt(ctx, "")
		if err != nil || len(ds) != 1 {
			t.Fatalf("in doubt: %v %v", ds, err)
		}
		bcancel()
		want := idem.Done
		if abort {
			want = idem.Absent
			err = r.Claim.Abort(bctx)
		} else {
			err = r.Claim.Commit(bctx, []byte("reply"))
		}
		if err != nil && !errors.Is(err, idem.ErrInDoubt) {
			l, lerr := c.Lookup(ctx, req)
			t.Fatalf("abort %v with an ended ctx: %v, want nil or ErrInDoubt (lookup: %v %v)", abort, err, l.Status, lerr)
		}
		// Wait returns once the key is no longer in flight.
		wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
		w, err := c.Wait(wctx, req)
		wcancel()
		if err != nil || w.Status != want || (!abort && string(w.Reply) != "reply") {
			t.Fatalf("abort %v: after the finish with an ended ctx: %+v %v, want %v", abort, w, err, want)
		}
		if abort {
			err = ds[0].Claim.Abort(ctx)
		} else {
			err = ds[0].Claim.Commit(ctx, []byte("reply"))
		}
		if err != nil {
			t.Fatalf("abort %v: the same finish again: %v", abort, err)
		}
	}
}

// withhold lets the first Begin or Batch RPC that succeeds through to the
// cluster, then keeps its answer until release is closed or the RPC's ctx
// ends (an answer lost on the way back). An RPC that fails (NOT_LEADER
// after a leader change on a loaded machine) is answered as it is, and the
// next one is withheld instead.
type withhold struct {
	n       atomic.Int32
	reached chan struct{} // closed when the withheld RPC's answer came
	release chan struct{}
	addr    string // the node the withheld RPC went to (set before reached is closed)
}

func newWithhold() *withhold {
	return &withhold{reached: make(chan struct{}), release: make(chan struct{})}
}

func (w *withhold) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	if (method != clusterpb.Idem_Batch_FullMethodName && method != clusterpb.Idem_Begin_FullMethodName) || w.n.Add(1) != 1 {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	if err := invoker(ctx, method, req, reply, cc, opts...); err != nil {
		w.n.Add(-1)
		return err
	}
	w.addr = cc.Target()
	close(w.reached)
	select {
	case <-w.release:
		return status.Error(codes.Unavailable, "answer lost")
	case <-ctx.Done():
		return status.FromContextError(ctx.Err()).Err()
	}
}

// A Begin whose answer is lost when its ctx ends returns an error matching
// ErrInDoubt (the cluster holds its claim, which InDoubt lists), with
// batches and without.
func TestBeginWithLostAnswerIsInDoubt(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	leader := tc.nodes[tc.leader(30*time.Second)]
	for _, noBatching := range []bool{false, true} {
		w := newWithhold()
		owner := fmt.Sprint("lost-", noBatching)
		// The leader only: the withheld answer is its claim, not NOT_LEADER.
		c, err := Dial(ctx, []string{leader.Addr()}, &Options{Owner: owner, NoBatching: noBatching, AttemptTimeout: 30 * time.Second,
			DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(w.intercept)}})
		if err != nil {
			t.Fatal(err)
		}
		bctx, bcancel := context.WithCancel(ctx)
		errc := make(chan error, 1)
		go func() {
			_, err := c.Begin(bctx, idem.Request{ID: []byte(owner)})
			errc <- err
		}()
		select {
		case <-w.reached:
		case <-ctx.Done():
			t.Fatal("the Begin did not reach the cluster")
		}
		bcancel()
		err = <-errc
		close(w.release)
		if !errors.Is(err, idem.ErrInDoubt) {
			t.Fatalf("NoBatching %v: Begin whose answer was lost as its ctx ended: %v, want ErrInDoubt", noBatching, err)
		}
		ds, err := c.InDoubt(ctx, "")
		if err != nil || len(ds) != 1 || string(ds[0].ID) != owner {
			t.Fatalf("NoBatching %v: in doubt after the lost answer: %+v %v", noBatching, ds, err)
		}
		if err := ds[0].Claim.Abort(ctx); err != nil {
			t.Fatal(err)
		}
		c.Close()
	}
}

// withheldPeer is the client's connection to the node whose answer w
// withholds, once it does: the queue to watch is that one's, whichever
// node the client ended up sending to.
func withheldPeer(t *testing.T, ctx context.Context, c *Client, w *withhold) *peer {
	t.Helper()
	select {
	case <-w.reached:
	case <-ctx.Done():
		t.Fatal("the first Begin did not reach the cluster")
	}
	p, err := c.peer(w.addr)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// awaitQueued waits until a call waits in p's batch queue, within ctx
// (the loops it replaces had no bound: a call that never queued there
// hung the test until go test's -timeout).
func awaitQueued(t *testing.T, ctx context.Context, p *peer) {
	t.Helper()
	for {
		p.batch.mu.Lock()
		n := len(p.batch.queue)
		p.batch.mu.Unlock()
		if n > 0 {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("no call waits behind the withheld batch to %s: %v", p.addr, ctx.Err())
		}
		time.Sleep(time.Millisecond) // polling the client's queue
	}
}

// firstBatchWithheld starts a 3-node cluster and a client (owner) to its
// leader whose Begin of "first" is on the wire with its answer withheld
// (released by closing w.release; first receives that Begin's error).
func firstBatchWithheld(t *testing.T, owner string) (ctx context.Context, c *Client, w *withhold, p *peer, first chan error) {
	t.Helper()
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	w = newWithhold()
	leader := tc.nodes[tc.leader(30*time.Second)]
	c, err := Dial(ctx, []string{leader.Addr()}, &Options{Owner: owner, AttemptTimeout: 30 * time.Second,
		DialOptions: []grpc.DialOption{grpc.WithChainUnaryInterceptor(w.intercept)}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	first = make(chan error, 1)
	go func() {
		_, err := c.Begin(ctx, idem.Request{ID: []byte("first")})
		first <- err
	}()
	return ctx, c, w, withheldPeer(t, ctx, c, w), first
}

// A Begin still queued behind a batch on the wire when its ctx ends is
// never sent: it returns ctx's error (not ErrInDoubt) and claims nothing.
func TestQueuedBeginWithEndedContextIsNotSent(t *testing.T) {
	ctx, c, w, p, first := firstBatchWithheld(t, "queued")
	bctx, bcancel := context.WithCancel(ctx)
	queued := make(chan error, 1)
	go func() {
		_, err := c.Begin(bctx, idem.Request{ID: []byte("queued")})
		queued <- err
	}()
	awaitQueued(t, ctx, p) // the second Begin waits for the next batch
	bcancel()
	if err := <-queued; !errors.Is(err, context.Canceled) || errors.Is(err, idem.ErrInDoubt) {
		t.Fatalf("a Begin cancelled while queued: %v, want context.Canceled", err)
	}
	close(w.release)
	if err := <-first; err != nil {
		t.Fatalf("the first Begin, retried after its lost answer: %v", err)
	}
	r, err := c.Lookup(ctx, idem.Request{ID: []byte("queued")})
	if err != nil || r.Status != idem.Absent {
		t.Fatalf("the Begin cancelled while queued was sent: lookup %v %v", r.Status, err)
	}
}

// A call still queued behind a batch on the wire when its attempt ends is
// never sent (the batcher keeps no timer per call: the batch that would
// carry it drops it), and says so: errNotSent, DeadlineExceeded.
func TestQueuedCallWithEndedAttemptIsNotSent(t *testing.T) {
	ctx, c, w, p, first := firstBatchWithheld(t, "attempt")
	late := &clusterpb.BatchItem{Call: &clusterpb.BatchItem_Begin{Begin: &clusterpb.BeginRequest{
		Request: &clusterpb.Request{Id: []byte("late")}, Owner: "attempt", Token: []byte("late-token")}}}
	queued := make(chan error, 1)
	go func() {
		_, err := p.batch.do(ctx, nil, time.Now(), late, nil) // an attempt that has ended already
		queued <- err
	}()
	awaitQueued(t, ctx, p) // it waits for the next batch
	close(w.release)
	if err := <-queued; !errors.Is(err, errNotSent) || !strings.Contains(fmt.Sprint(err), "code = DeadlineExceeded") {
		t.Fatalf("a call whose attempt ended while queued: %v, want errNotSent with DeadlineExceeded", err)
	}
	if err := <-first; err != nil {
		t.Fatalf("the first Begin, retried after its lost answer: %v", err)
	}
	r, err := c.Lookup(ctx, idem.Request{ID: []byte("late")})
	if err != nil || r.Status != idem.Absent {
		t.Fatalf("the call whose attempt ended while queued was sent: lookup %v %v", r.Status, err)
	}
}
