package idemcluster

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// finishGate holds every RPC that carries a claim's commit (a Batch with
// a commit item, or a Commit of its own) until the test answers it on
// held: true sends it on, false drops it unsent (UNAVAILABLE). An RPC
// whose ctx ends while held returns ctx's error, unsent.
type finishGate struct {
	held chan chan bool
}

func (g *finishGate) intercept(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	commit := method == clusterpb.Idem_Commit_FullMethodName
	if b, ok := req.(*clusterpb.BatchRequest); ok {
		for _, it := range b.Items {
			commit = commit || it.GetCommit() != nil
		}
	}
	if !commit {
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	answer := make(chan bool, 1) // the test may answer after ctx ended
	select {
	case g.held <- answer:
	case <-ctx.Done():
		return status.FromContextError(ctx.Err()).Err()
	}
	select {
	case pass := <-answer:
		if pass {
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		return status.Error(codes.Unavailable, "finishGate: dropped unsent")
	case <-ctx.Done():
		return status.FromContextError(ctx.Err()).Err()
	}
}

// next is the next commit RPC held, within ctx.
func (g *finishGate) next(t *testing.T, ctx context.Context, what string) chan bool {
	t.Helper()
	select {
	case a := <-g.held:
		return a
	case <-ctx.Done():
		t.Fatalf("no %s: %v", what, ctx.Err())
		return nil
	}
}

// gatedClient dials a one-node cluster through a finishGate and begins a
// claim on id.
func gatedClient(t *testing.T, ctx context.Context, o Options, id string) (*testCluster, *Client, *finishGate, *idem.Claim) {
	t.Helper()
	tc := newTestCluster(t, 1)
	g := &finishGate{held: make(chan chan bool)}
	o.DialOptions = []grpc.DialOption{grpc.WithChainUnaryInterceptor(g.intercept)}
	c, err := Dial(ctx, tc.addrs, &o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	r, err := c.Begin(ctx, idem.Request{Scope: "s", ID: []byte(id)})
	if err != nil || r.Status != idem.Fresh {
		t.Fatalf("begin %s: %+v %v", id, r, err)
	}
	return tc, c, g, r.Claim
}

// A Commit runs on its caller's goroutine while the caller waits; when
// the caller's ctx ends first, the caller gets ErrInDoubt and the finish
// goes on, on a goroutine of its own: its first send failed unsent, the
// goroutine sends it again, and Close waits for it (Close began before
// the resend was let through) and returns nil, the claim committed. With
// batches (the caller leaves while its batch is on the wire) and without
// (the caller's ctx cancels its RPC).
func TestAbandonedFinishGoesOnAndCloseWaitsForIt(t *testing.T) {
	for _, noBatching := range []bool{false, true} {
		t.Run(fmt.Sprint("NoBatching=", noBatching), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			tc, c, g, claim := gatedClient(t, ctx, Options{Owner: "app", AttemptTimeout: 10 * time.Second, CloseTimeout: time.Minute, NoBatching: noBatching}, "left")
			cctx, leave := context.WithCancel(ctx)
			committed := make(chan error, 1)
			go func() { committed <- claim.Commit(cctx, []byte("reply")) }()
			first := g.next(t, ctx, "commit sent by its caller")
			leave()
			if err := <-committed; !errors.Is(err, idem.ErrInDoubt) || !errors.Is(err, context.Canceled) {
				t.Fatalf("commit whose caller left: %v, want ErrInDoubt and context.Canceled", err)
			}
			first <- false // the first send fails unsent
			resent := g.next(t, ctx, "commit sent again after its caller left")
			closed := make(chan error, 1)
			go func() { closed <- c.Close() }()
			for c.finishes.Load()&finishesClosing == 0 { // Close began waiting
				if ctx.Err() != nil {
					t.Fatalf("Close did not begin: %v", ctx.Err())
				}
				time.Sleep(time.Millisecond) // polling the client's state
			}
			resent <- true
			select {
			case err := <-closed:
				if err != nil {
					t.Fatalf("Close with the finish completed: %v, want nil", err)
				}
			case <-ctx.Done():
				t.Fatal("Close did not return")
			}
			c2, err := Dial(ctx, tc.addrs, &Options{Owner: "check"})
			if err != nil {
				t.Fatal(err)
			}
			defer c2.Close()
			r, err := c2.Lookup(ctx, idem.Request{Scope: "s", ID: []byte("left")})
			if err != nil || r.Status != idem.Done || string(r.Reply) != "reply" {
				t.Fatalf("the abandoned commit: lookup %v %q %v, want Done %q", r.Status, r.Reply, err, "reply")
			}
		})
	}
}

// A Commit whose caller still waits when Close gives up ends at once: its
// caller gets an error, and Close's error names the claim. The attempt's
// own bound (AttemptTimeout) is longer than the test's: only Close's stop
// ends the wait.
func TestCloseStopsFinishWhoseCallerWaits(t *testing.T) {
	for _, noBatching := range []bool{false, true} {
		t.Run(fmt.Sprint("NoBatching=", noBatching), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_, c, g, claim := gatedClient(t, ctx, Options{Owner: "app", AttemptTimeout: time.Hour, CloseTimeout: 50 * time.Millisecond, NoBatching: noBatching}, "waiting")
			cctx, leave := context.WithCancel(ctx) // a ctx that can end, which it does not
			defer leave()
			committed := make(chan error, 1)
			go func() { committed <- claim.Commit(cctx, []byte("reply")) }()
			held := g.next(t, ctx, "commit sent by its caller")
			defer func() { held <- false }()
			closed := make(chan error, 1)
			go func() { closed <- c.Close() }()
			var err error
			select {
			case err = <-closed:
			case <-ctx.Done():
				t.Fatal("Close did not return while a finish waits for its answer")
			}
			if !errors.Is(err, idem.ErrInDoubt) || !strings.Contains(err.Error(), `commit of scope "s" id "waiting" (still being sent when Close gave up)`) {
				t.Fatalf("Close: %v, want ErrInDoubt naming the commit Close gave up on", err)
			}
			if err := <-committed; !errors.Is(err, idem.ErrClosed) {
				t.Fatalf("the commit Close stopped: %v, want ErrClosed", err)
			}
			t.Logf("Close: %v", err)
		})
	}
}
