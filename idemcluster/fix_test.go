package idemcluster

import (
	"context"
	"testing"
	"time"

	"github.com/idemdb/idem"
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
	leader := tc.nodes[tc.leader(30*time.Second)]
	if err := leader.Raft().Barrier(10 * time.Second).Error(); err != nil {
		t.Fatal(err)
	}
	rctx, rcancel := context.WithTimeout(ctx, 3*time.Second)
	defer rcancel()
	r, err := c.Lookup(rctx, req)
	if err != nil || r.Status != idem.Done || string(r.Reply) != "r" {
		t.Fatalf("linearizable Lookup after a barrier: %+v %v", r, err)
	}
}
