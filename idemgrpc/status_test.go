package idemgrpc_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/examples/ledger/ledgerpb"
	"github.com/idemdb/idem/examples/ledger/ledgersvc"
	"github.com/idemdb/idem/idemgrpc"
	"github.com/idemdb/idem/internal/testclock"
	"google.golang.org/grpc/codes"
)

// TestLeaseLost: a handler that outlives the engine's lease loses its claim
// to a retry; its late response is not stored and it answers Aborted
// LEASE_LOST (retryable: the retry gets the other call's response). The
// engine's clock is manual: the lease runs out when the test says so.
func TestLeaseLost(t *testing.T) {
	clk := testclock.New()
	var calls atomic.Int64
	started, release := make(chan struct{}), make(chan struct{})
	env := startLedger(t, ledgersvc.Options{Engine: &idem.Options{Clock: clk.Now, Lease: time.Minute}, BeforeApply: func(context.Context) error {
		if calls.Add(1) == 1 {
			close(started)
			<-release
		}
		return nil
	}})
	ctx := as(testCtx(t), "tok-alice")
	c := ledgerpb.NewLedgerClient(dial(t, env.addr))
	first := make(chan error, 1)
	go func() { _, err := c.Write(ctx, write("c", "ns", "", 1, "a", 1)); first <- err }()
	<-started
	clk.Advance(time.Minute) // the first call's lease runs out
	// the retry takes the request over and runs it.
	second, err := c.Write(ctx, write("c", "ns", "", 1, "a", 1))
	if err != nil {
		t.Fatal(err)
	}
	close(release)
	err = <-first
	wantStatus(t, err, codes.Aborted, idemgrpc.ReasonLeaseLost)
	if !idemgrpc.Retryable(ctx, err) {
		t.Fatal("LEASE_LOST not retryable")
	}
	again, err := c.Write(ctx, write("c", "ns", "", 1, "a", 1))
	if err != nil {
		t.Fatal(err)
	}
	sameReply(t, second, again)
	if calls.Load() != 2 || env.server().Engine.Stats().Takeovers != 1 {
		t.Fatalf("%d handler calls, %d takeovers; want 2, 1", calls.Load(), env.server().Engine.Stats().Takeovers)
	}
}

// TestEngineClosed: a closed engine answers Unavailable ENGINE_UNAVAILABLE
// (retryable), and nothing runs.
func TestEngineClosed(t *testing.T) {
	env := startLedger(t, ledgersvc.Options{})
	ctx := as(testCtx(t), "tok-alice")
	c := ledgerpb.NewLedgerClient(dial(t, env.addr))
	if err := env.server().Engine.Close(); err != nil {
		t.Fatal(err)
	}
	_, err := c.Write(ctx, write("c", "ns", "", 1, "a", 1))
	wantStatus(t, err, codes.Unavailable, idemgrpc.ReasonUnavailable)
	if !idemgrpc.Retryable(ctx, err) || env.server().Ledger.ApplyCount() != 0 {
		t.Fatal("not retryable, or the handler ran")
	}
	_, err = idemgrpc.ServiceState(dial(t, env.addr))(ctx, "c", []string{"ns"})
	wantStatus(t, err, codes.Unavailable, idemgrpc.ReasonUnavailable)
}
