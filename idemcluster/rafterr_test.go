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
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Raft's errors, and the node stopping, as a handler meets them (a leader
// that removed itself: raft shuts down, ShutdownOnRemove) are answers the
// client retries on another node: NOT_LEADER when raft refused before
// appending, IN_DOUBT when the change may still commit. The Remove and
// Join handlers answered INTERNAL ("idemcluster: remove n1: raft is
// already shutdown"). And the client, retrying such a write until its ctx
// ends, reports it in doubt exactly when the change may have been
// applied.
func TestRaftErrorsAreRetriedElsewhere(t *testing.T) {
	tc := newTestCluster(t, 1)
	nd := tc.nodes["n1"]
	c := dial(t, tc, "admin")
	for _, tt := range []struct {
		err    error
		reason string
		doubt  bool
	}{
		{raft.ErrNotLeader, ReasonNotLeader, false},
		{raft.ErrLeadershipTransferInProgress, ReasonNotLeader, false},
		{raft.ErrLeadershipLost, ReasonInDoubt, true},
		{raft.ErrRaftShutdown, ReasonInDoubt, true},
		{errStopped, ReasonInDoubt, true},
	} {
		// As a handler wraps it (raftErr), and as it may reach toStatus
		// from any other path (wrapped, without the node's words).
		for _, err := range []error{nd.raftErr("remove n2", tt.err), fmt.Errorf("idemcluster: remove n2: %w", tt.err)} {
			st := toStatus(err)
			ei, _ := errorInfo(st)
			if status.Code(st) != codes.Unavailable || ei == nil || ei.Reason != tt.reason {
				t.Errorf("%v: %v (%v), want UNAVAILABLE %s", err, st, ei, tt.reason)
				continue
			}
			ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
			got := c.retry(ctx, nil, true, func(context.Context, *peer, time.Time) error { return st })
			cancel()
			if errors.Is(got, idem.ErrInDoubt) != tt.doubt || !errors.Is(got, context.DeadlineExceeded) {
				t.Errorf("%v: a write retried until its ctx ended: %v, want in doubt %v", err, got, tt.doubt)
			}
		}
	}
	if st := toStatus(fmt.Errorf("idemcluster: add voter n2: %w", raft.ErrEnqueueTimeout)); status.Code(st) != codes.DeadlineExceeded {
		t.Errorf("enqueue timeout: %v, want DEADLINE_EXCEEDED", st)
	}
}

// The leader removes itself while writes and a second Remove (of a
// follower) are in flight on it: every answer there, the writes', both
// removals' and the Joins' and Removes' sent after raft shut down, is one
// the client retries on another node, never INTERNAL; and the client
// completes both removals on the next leader.
func TestRemoveLeaderWithRemoveInFlight(t *testing.T) {
	untilLeaderStays(t, testRemoveLeaderWithRemoveInFlight)
}

func testRemoveLeaderWithRemoveInFlight(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	leader := tc.leader(30 * time.Second)
	follower := "n1"
	if follower == leader {
		follower = "n2"
	}
	addr := tc.nodes[leader].Addr()
	ic, cl := rawIdem(t, addr), rawCluster(t, addr)
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		answers []error
		writes  atomic.Int64
		writing atomic.Int64 // writers still writing
		stop    = make(chan struct{})
	)
	note := func(what string, err error) {
		if err != nil {
			mu.Lock()
			answers = append(answers, fmt.Errorf("%s: %w", what, err))
			mu.Unlock()
		}
	}
	for w := range 8 {
		wg.Add(1)
		writing.Add(1)
		go func() {
			defer wg.Done()
			defer writing.Add(-1)
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				id := fmt.Sprintf("w%d-%d", w, i)
				cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
				_, err := ic.Begin(cctx, &clusterpb.BeginRequest{Request: reqToPB(idem.Request{ID: []byte(id)}), Owner: "o", Token: []byte(id)})
				ccancel()
				if err != nil {
					note("begin "+id, err)
					return
				}
				writes.Add(1)
			}
		}()
	}
	eventually(t, 30*time.Second, "writes flowing", func() bool { return writes.Load() >= 50 || writing.Load() == 0 })
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, err := cl.Remove(ctx, &clusterpb.RemoveRequest{NodeId: follower})
		note("remove "+follower, err)
	}()
	_, err := cl.Remove(ctx, &clusterpb.RemoveRequest{NodeId: leader})
	note("remove "+leader, err)
	nd := tc.nodes[leader]
	var nl *errNotLeader
	if errors.As(fromStatus(err), &nl) && nd.Raft().State() != raft.Shutdown {
		close(stop)
		wg.Wait()
		t.Skipf("the leader changed before the removal (a loaded machine): nothing to check (%v)", err)
	}
	eventually(t, 30*time.Second, "raft shut down after the removal", func() bool { return nd.Raft().State() == raft.Shutdown })
	close(stop)
	wg.Wait()
	// On the removed node now: a Remove and a Join.
	_, err = cl.Remove(ctx, &clusterpb.RemoveRequest{NodeId: follower})
	note("remove after the shutdown", err)
	_, err = cl.Join(ctx, &clusterpb.JoinRequest{NodeId: "n9", RaftAddr: "127.0.0.1:1"})
	note("join after the shutdown", err)
	for _, err := range answers {
		e := fromStatus(errors.Unwrap(err))
		var nl *errNotLeader
		switch {
		case errors.As(e, &nl), errors.Is(e, idem.ErrInDoubt), errors.Is(e, idem.ErrClosed):
		case status.Code(errors.Unwrap(err)) == codes.Unavailable: // the connection went
		default:
			t.Errorf("%v: want an answer the client retries on another node (NOT_LEADER, IN_DOUBT, UNAVAILABLE)", err)
		}
	}
	t.Logf("%d writes; answers on the removed leader: %v", writes.Load(), answers)
	c := dial(t, tc, "admin")
	for _, id := range []string{leader, follower} {
		if err := c.Remove(ctx, id); err != nil {
			t.Fatalf("client remove of %s retried on the next leader: %v", id, err)
		}
	}
}
