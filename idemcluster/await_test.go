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

// A leader that removes itself shuts its raft down (ShutdownOnRemove)
// without the node stopping; raft never answers a write its buffered
// apply channel took meanwhile. Writes in flight on it must still be
// answered, each with an error the client retries on another node
// (NOT_LEADER, in doubt, unavailable), not wait for their deadline.
func TestRemoveLeaderAnswersWritesInFlight(t *testing.T) {
	untilLeaderStays(t, testRemoveLeaderAnswersWritesInFlight)
}

func testRemoveLeaderAnswersWritesInFlight(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	leader := tc.leader(30 * time.Second)
	ic := rawIdem(t, tc.nodes[leader].Addr())
	const writers, callTimeout = 16, 10 * time.Second
	var (
		wg    sync.WaitGroup
		done  atomic.Int64
		mu    sync.Mutex
		ended []error // each writer's first error
	)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				cctx, ccancel := context.WithTimeout(ctx, callTimeout)
				id := fmt.Sprintf("w%d-%d", w, i)
				_, err := ic.Begin(cctx, &clusterpb.BeginRequest{Request: reqToPB(idem.Request{ID: []byte(id)}), Owner: "o", Token: []byte(id)})
				ccancel()
				if err != nil {
					mu.Lock()
					ended = append(ended, err)
					mu.Unlock()
					return
				}
				done.Add(1)
			}
		}()
	}
	allEnded := make(chan struct{})
	go func() { wg.Wait(); close(allEnded) }()
	eventually(t, 30*time.Second, "writes flowing", func() bool {
		select {
		case <-allEnded:
			return true
		default:
			return done.Load() >= 100
		}
	})
	select {
	case <-allEnded:
		if !tc.nodes[leader].IsLeader() {
			t.Skip("the leader changed before the removal (a loaded machine): nothing to check")
		}
		t.Fatalf("the writes ended before the removal: %v", ended)
	default:
	}
	if _, err := rawCluster(t, tc.nodes[leader].Addr()).Remove(ctx, &clusterpb.RemoveRequest{NodeId: leader}); err != nil {
		if status.Code(err) == codes.DeadlineExceeded {
			t.Fatalf("the removal of the leader %s with writes in flight waited for its deadline: %v", leader, err)
		}
		t.Logf("remove the leader %s: %v", leader, err)
	}
	wg.Wait()
	t.Logf("%d writes before the removal", done.Load())
	// Whether a write's future was caught in raft's apply channel above
	// depends on timing; a future raft never answers is caught for sure.
	nd := tc.nodes[leader]
	eventually(t, 30*time.Second, "raft shut down after the removal", func() bool { return nd.Raft().State() == raft.Shutdown })
	never := make(chan struct{})
	defer close(never)
	awaited := make(chan error, 1)
	go func() { awaited <- nd.await(unanswered(never)) }()
	select {
	case err := <-awaited:
		if !errors.Is(err, raft.ErrRaftShutdown) {
			t.Fatalf("await on a node whose raft shut down: %v, want %v", err, raft.ErrRaftShutdown)
		}
	case <-ctx.Done():
		t.Fatal("await of a future raft never answers did not end when raft shut itself down")
	}
	for _, err := range ended {
		e := fromStatus(err)
		var nl *errNotLeader
		switch {
		case errors.Is(e, context.DeadlineExceeded) || status.Code(err) == codes.DeadlineExceeded:
			t.Fatalf("a write on the leader that removed itself waited for its deadline: %v", err)
		case errors.As(e, &nl), errors.Is(e, idem.ErrInDoubt), status.Code(err) == codes.Unavailable:
		default:
			t.Fatalf("a write on the leader that removed itself: %v, want an error the client retries elsewhere", err)
		}
	}
}

// unanswered is a raft future that is never answered (until its channel
// closes: the test's end).
type unanswered chan struct{}

func (u unanswered) Error() error {
	<-u
	return errors.New("never answered")
}
