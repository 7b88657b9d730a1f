package idemcluster

import (
	"context"
	"errors"
	"fmt"
	"strings"
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

// Close returns even when no node can be reached while claim finishes
// are still being sent (their callers' ctx ended), and its error names
// those claims. It used to wait for each finish's own bound (30 s, or the
// caller's ctx deadline when later) and return nil.
func TestCloseWithUnreachableNodesNamesInDoubtClaims(t *testing.T) {
	tc := newTestCluster(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := Dial(ctx, tc.addrs, &Options{Owner: "app", AttemptTimeout: time.Second, CloseTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	var claims []*idem.Claim
	for _, id := range []string{"commit-me", "abort-me"} {
		r, err := c.Begin(ctx, idem.Request{Scope: "s", ID: []byte(id)})
		if err != nil || r.Status != idem.Fresh {
			t.Fatalf("begin %s: %+v %v", id, r, err)
		}
		claims = append(claims, r.Claim)
	}
	tc.stop("n1")
	// The callers stop waiting at once: the finishes go on, and no node
	// answers them.
	ended, end := context.WithCancel(ctx)
	end()
	if err := claims[0].Commit(ended, []byte("reply")); !errors.Is(err, idem.ErrInDoubt) {
		t.Fatalf("commit with an ended ctx: %v, want ErrInDoubt", err)
	}
	if err := claims[1].Abort(ended); !errors.Is(err, idem.ErrInDoubt) {
		t.Fatalf("abort with an ended ctx: %v, want ErrInDoubt", err)
	}
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	select {
	case err = <-closed:
	case <-ctx.Done():
		t.Fatal("Close did not return while no node answers")
	}
	if !errors.Is(err, idem.ErrInDoubt) {
		t.Fatalf("Close: %v, want an error matching ErrInDoubt", err)
	}
	for _, want := range []string{`commit of scope "s" id "commit-me"`, `abort of scope "s" id "abort-me"`} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Close's error does not name the %s: %v", want, err)
		}
	}
	t.Logf("Close: %v", err)
}

// stallTransport delivers a leader's heartbeats but, while stalled, no
// entries: the leader keeps leading and the entries it appends never
// commit, so a write's handler waits in apply for as long as the test
// wants. Pipelining is off so that every AppendEntries comes through here.
type stallTransport struct {
	*raft.InmemTransport
	stalled atomic.Bool
}

func (s *stallTransport) AppendEntries(id raft.ServerID, target raft.ServerAddress, req *raft.AppendEntriesRequest, resp *raft.AppendEntriesResponse) error {
	if s.stalled.Load() && len(req.Entries) > 0 {
		return errors.New("stallTransport: entries held back")
	}
	return s.InmemTransport.AppendEntries(id, target, req, resp)
}

func (s *stallTransport) AppendEntriesPipeline(raft.ServerID, raft.ServerAddress) (raft.AppendPipeline, error) {
	return nil, raft.ErrPipelineReplicationNotSupported
}

// A node closed while a gRPC handler waits for its entry to commit
// (mid-apply) is not held up by it: grpc-go's Server.Stop (the node uses
// Stop, not GracefulStop, and no WaitForHandlers) closes the connections
// without waiting for handlers, and the handler's wait ends when the node
// stops (Node.await), so it answers ErrInDoubt (the entry may still
// commit elsewhere) or its connection is already gone (Unavailable): the
// client retries the same request on another node either way.
func TestCloseWithHandlerMidApply(t *testing.T) {
	trans := map[string]*stallTransport{}
	var mu sync.Mutex
	// Longer timeouts than the chaos tests': fewer elections on a loaded
	// machine between finding the leader and the Begin reaching it.
	tune := func(o *NodeOptions) { o.HeartbeatTimeout, o.ElectionTimeout = time.Second, time.Second }
	cc := newChaosClusterWrapped(t, 3, tune, func(id string, tr *raft.InmemTransport) raft.Transport {
		mu.Lock()
		defer mu.Unlock()
		trans[id] = &stallTransport{InmemTransport: tr}
		return trans[id]
	})
	cc.addressesKnown(30 * time.Second) // no more entries of the nodes' own
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var (
		leader string
		nd     *Node
		answer chan error
	)
	for attempt := 1; ; attempt++ {
		leader = cc.leader(30 * time.Second)
		nd = cc.nodes[leader]
		mu.Lock()
		st := trans[leader]
		mu.Unlock()
		st.stalled.Store(true)
		commit := nd.Raft().CommitIndex()
		answer = make(chan error, 1)
		go func() {
			_, err := rawIdem(t, cc.addr(leader)).Begin(ctx, &clusterpb.BeginRequest{
				Request: &clusterpb.Request{Scope: "s", Id: fmt.Appendf(nil, "mid-apply-%d", attempt)}, Owner: "app", Token: fmt.Appendf(nil, "token-%d", attempt)})
			answer <- err
		}()
		// The handler is in apply once its entry is in the leader's log,
		// uncommitted. An election meanwhile (NOT_LEADER): again on the
		// next leader.
		var err error
		appended := false
		for !appended && err == nil {
			select {
			case err = <-answer:
			case <-ctx.Done():
				t.Fatal("the Begin's entry was never appended on the leader")
			case <-time.After(10 * time.Millisecond):
				appended = nd.Raft().LastIndex() > commit
			}
		}
		if appended {
			break
		}
		var nl *errNotLeader
		if !errors.As(fromStatus(err), &nl) {
			t.Fatalf("the Begin was answered while its entry cannot commit: %v", err)
		}
		st.stalled.Store(false)
		t.Logf("attempt %d: %s no longer leads (%v): again", attempt, leader, err)
	}
	closed := make(chan error, 1)
	go func() { closed <- nd.Close() }()
	select {
	case err := <-closed:
		t.Logf("Close: %v", err)
	case <-ctx.Done():
		t.Fatal("Close did not return while a handler waited in apply")
	}
	delete(cc.nodes, leader) // closed: the cleanup must not stop it again
	select {
	case err := <-answer:
		if !errors.Is(fromStatus(err), idem.ErrInDoubt) && status.Code(err) != codes.Unavailable {
			t.Fatalf("the Begin caught mid-apply: %v, want ErrInDoubt or Unavailable", err)
		}
		t.Logf("the Begin caught mid-apply: %v", err)
	case <-ctx.Done():
		t.Fatal("the Begin caught mid-apply was not answered after Close")
	}
}
