package idemcluster

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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
