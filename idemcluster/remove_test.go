package idemcluster

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// TestRemoveRefusesMistakes: removing an id that is no member, or the
// last voter, is answered at once with the reason (raft itself accepts
// the first and changes nothing, and fails the second with an error that
// a client retries until its ctx ends).
func TestRemoveRefusesMistakes(t *testing.T) {
	tc := newTestCluster(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c := dial(t, tc, "admin")
	if err := c.Remove(ctx, "n9"); status.Code(err) != codes.NotFound {
		t.Fatalf("remove of a non-member: %v, want NotFound", err)
	}
	if err := c.Remove(ctx, "n1"); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("remove of the last voter: %v, want FailedPrecondition", err)
	}
	if ctx.Err() != nil {
		t.Fatal("the refusals waited for the deadline")
	}
}

// Removing the leader succeeds: it commits its own removal and steps
// down. The removal's answer used to be the NOT_LEADER of the member
// entry appended after it, and the client's retry on the new leader was
// told the node is no member (NOT_FOUND), though it was removed.
func TestRemoveLeader(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c := dial(t, tc, "admin")
	leader := tc.leader(30 * time.Second)
	if err := c.Remove(ctx, leader); err != nil {
		t.Fatalf("remove the leader %s: %v", leader, err)
	}
	tc.stop(leader)
	f := tc.nodes[tc.leader(30*time.Second)].Raft().GetConfiguration()
	if err := f.Error(); err != nil || len(f.Configuration().Servers) != 2 {
		t.Fatalf("configuration after removing %s: %+v %v", leader, f.Configuration(), err)
	}
}

// A Remove retried after its answer was lost (the leader changed, the
// connection dropped) is answered as done: the node it names was a
// member and was removed, which is what the caller asked for. The next
// attempt used to find no such member and answer NOT_FOUND. A node that
// never was a member is still NOT_FOUND: the members table remembers the
// removed ids (replicated, in snapshots), so the two differ.
func TestRemoveRetriedAfterLostAnswer(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c := dial(t, tc, "admin")
	victim := "n1"
	if tc.leader(30*time.Second) == victim {
		victim = "n2"
	}
	if err := c.Remove(ctx, victim); err != nil {
		t.Fatalf("remove %s: %v", victim, err)
	}
	// The retry: the same call again, as the client sends it when the
	// first answer did not arrive. The raw answer says it was removed
	// before.
	if err := c.Remove(ctx, victim); err != nil {
		t.Fatalf("remove %s again (a retry after a lost answer): %v, want success", victim, err)
	}
	_, resp, err := onLeader(t, tc, func(cl clusterpb.ClusterClient, _ string) (*clusterpb.RemoveResponse, error) {
		return cl.Remove(ctx, &clusterpb.RemoveRequest{NodeId: victim})
	})
	if err != nil || !resp.AlreadyRemoved {
		t.Fatalf("raw remove of %s again: %+v %v, want already_removed", victim, resp, err)
	}
	for _, m := range resp.Members {
		if m.NodeId == victim {
			t.Fatalf("%s is still listed: %+v", victim, resp.Members)
		}
	}
	if err := c.Remove(ctx, "n9"); status.Code(err) != codes.NotFound {
		t.Fatalf("remove of a node that never was a member: %v, want NotFound", err)
	}
}

// The leader removes itself and its answer is lost: the retry reaches
// the next leader, which must know the removal happened (the removed id
// is recorded in the log before raft's removal, so every later leader has
// applied it).
func TestRemoveLeaderRetriedOnNextLeader(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c := dial(t, tc, "admin")
	leader, _, err := onLeader(t, tc, func(cl clusterpb.ClusterClient, leader string) (*clusterpb.RemoveResponse, error) {
		return cl.Remove(ctx, &clusterpb.RemoveRequest{NodeId: leader})
	})
	if err != nil {
		t.Fatalf("remove the leader %s: %v", leader, err)
	}
	tc.stop(leader)
	next, resp, err := onLeader(t, tc, func(cl clusterpb.ClusterClient, _ string) (*clusterpb.RemoveResponse, error) {
		return cl.Remove(ctx, &clusterpb.RemoveRequest{NodeId: leader})
	})
	if err != nil || !resp.AlreadyRemoved {
		t.Fatalf("remove %s retried on the next leader %s: %+v %v, want already_removed", leader, next, resp, err)
	}
	if err := c.Remove(ctx, leader); err != nil {
		t.Fatalf("client remove of %s retried: %v", leader, err)
	}
}

// A Join retried after its answer was lost (the node joined) succeeds
// with the same answer, and appends no configuration change.
func TestJoinRetried(t *testing.T) {
	tc := newTestCluster(t, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rl, gl := listen(t), listen(t)
	o := &NodeOptions{ID: "n2", Dir: filepath.Join(tc.dir, "n2"), RaftListener: rl, GRPCListener: gl, Join: tc.addrs[0],
		HeartbeatTimeout: 200 * time.Millisecond, ElectionTimeout: 200 * time.Millisecond}
	nd, err := StartNode(o)
	if err != nil {
		t.Fatal(err)
	}
	tc.nodes["n2"] = nd
	tc.addressesKnown(30 * time.Second)
	before := tc.nodes[tc.leader(30*time.Second)].Raft().LastIndex()
	req := &clusterpb.JoinRequest{NodeId: "n2", RaftAddr: nd.RaftAddr(), GrpcAddr: nd.Addr()}
	join := func(cl clusterpb.ClusterClient, _ string) (*clusterpb.JoinResponse, error) { return cl.Join(ctx, req) }
	_, first, err := onLeader(t, tc, join)
	if err != nil {
		t.Fatalf("join retried: %v", err)
	}
	_, second, err := onLeader(t, tc, join)
	if err != nil {
		t.Fatalf("join retried twice: %v", err)
	}
	if !proto.Equal(first, second) || len(first.Members) != 2 {
		t.Fatalf("the retries' answers differ or miss a member:\n%v\n%v", first, second)
	}
	// No configuration entry was appended (raft appends one for an
	// AddVoter of a voter it has, changing nothing). Read on every node
	// whose log has the range: a leader change meanwhile appends entries
	// of other kinds only.
	for id, n := range tc.nodes {
		for i := before + 1; i <= n.Raft().LastIndex(); i++ {
			var l raft.Log
			if err := n.logc.GetLog(i, &l); err != nil {
				t.Fatalf("%s: entry %d: %v", id, i, err)
			}
			if l.Type == raft.LogConfiguration {
				t.Fatalf("a retried join appended a configuration change on %s at entry %d (joined before %d)", id, i, before)
			}
		}
	}
}

// onLeader makes call on the node leading now (its Cluster service and
// its id), and again on the next leader while the answer is NOT_LEADER:
// an election on a loaded machine moved leadership in between. It
// returns the node that answered.
func onLeader[T any](t *testing.T, tc *testCluster, call func(cl clusterpb.ClusterClient, id string) (T, error)) (string, T, error) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; {
		id := tc.leader(30 * time.Second)
		out, err := call(rawCluster(t, tc.nodes[id].Addr()), id)
		var nl *errNotLeader
		if errors.As(fromStatus(err), &nl) && time.Now().Before(deadline) {
			continue
		}
		return id, out, err
	}
}
