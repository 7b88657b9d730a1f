package idemcluster

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemdb/idem"
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
