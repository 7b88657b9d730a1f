package idem

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

// doubtBackend answers its first finish with ErrInDoubt (the answer was
// lost), then with the outcome.
type doubtBackend struct{ commits, aborts int }

func (b *doubtBackend) Commit(context.Context, []byte, []Advance) error {
	b.commits++
	if b.commits == 1 {
		return fmt.Errorf("%w: the answer was lost", ErrInDoubt)
	}
	return nil
}

func (b *doubtBackend) Abort(context.Context) error {
	b.aborts++
	return nil
}

// TestClaimRetryAfterInDoubt: a finish whose outcome is unknown is retried
// through the same Claim (as store.go promises a backend), as the same
// finish only; once it succeeded the claim is finished.
func TestClaimRetryAfterInDoubt(t *testing.T) {
	b := &doubtBackend{}
	c := NewClaim(b, time.Now().Add(time.Hour))
	ctx := context.Background()
	if err := c.Commit(ctx, []byte("r")); !errors.Is(err, ErrInDoubt) {
		t.Fatalf("first commit: %v, want ErrInDoubt", err)
	}
	if err := c.Abort(ctx); !errors.Is(err, ErrInvalidRequest) || b.aborts != 0 {
		t.Fatalf("abort after an in-doubt commit: %v (%d aborts sent), want ErrInvalidRequest and none", err, b.aborts)
	}
	if err := c.Commit(ctx, []byte("r")); err != nil {
		t.Fatalf("commit retried after ErrInDoubt: %v", err)
	}
	if err := c.Commit(ctx, []byte("r")); !errors.Is(err, ErrLeaseLost) || b.commits != 2 {
		t.Fatalf("a third commit: %v (%d commits sent), want ErrLeaseLost and 2", err, b.commits)
	}
}
