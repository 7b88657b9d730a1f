package idemgrpc_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/examples/ledger/ledgerpb"
	"github.com/idemdb/idem/examples/ledger/ledgersvc"
	"github.com/idemdb/idem/idemgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestResponseNotStored: a handler that ran never runs again for its
// identity when its response cannot be stored (larger than MaxReplySize,
// larger than the engine's limit, not a protobuf message): a marker is
// committed, the sequence is consumed, retries get AlreadyExists
// RESPONSE_NOT_STORED.
func TestResponseNotStored(t *testing.T) {
	notMessage := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		resp, err := h(ctx, req)
		if err != nil || info.FullMethod != ledgersvc.MethodWrite {
			return resp, err
		}
		return fmt.Sprint(resp), nil // what a broken middleware might return
	}
	for _, tc := range []struct {
		name      string
		eopts     *idem.Options
		cfg       idemgrpc.Options
		inner     []grpc.UnaryServerInterceptor
		firstCode codes.Code // OK: the first call gets its response
	}{
		{name: "MaxReplySize", cfg: idemgrpc.Options{MaxReplySize: 16}},
		{name: "EngineLimit", eopts: &idem.Options{MaxReplySize: 64}},
		{name: "TinyEngineLimit", eopts: &idem.Options{MaxReplySize: 1}}, // not even a marker fits: an empty reply
		{name: "NotAMessage", inner: []grpc.UnaryServerInterceptor{notMessage}, firstCode: codes.Internal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := &fnLedger{}
			l.write = func(_ context.Context, req *ledgerpb.WriteRequest) (*ledgerpb.WriteSuccess, error) {
				return &ledgerpb.WriteSuccess{TxId: fmt.Sprintf("tx-%d-%0100d", l.runs.Load(), 0), Sequence: req.GetSequence()}, nil
			}
			srv := serveIdem(t, tc.eopts, tc.cfg, l, nil, tc.inner)
			ctx := as(testCtx(t), "tok-alice")
			c := ledgerpb.NewLedgerClient(srv.cc)
			r, err := c.Write(ctx, write("c", "ns", "", 1, "a", 1))
			if tc.firstCode == codes.OK {
				if err != nil || !strings.HasPrefix(r.GetTxId(), "tx-1-") {
					t.Fatalf("first call: %v, %v; want its response", r, err)
				}
			} else {
				wantStatus(t, err, tc.firstCode, idemgrpc.ReasonResponseNotStored)
			}
			for range 2 {
				_, err = c.Write(ctx, write("c", "ns", "", 1, "a", 1))
				meta := wantStatus(t, err, codes.AlreadyExists, idemgrpc.ReasonResponseNotStored)
				if meta[idemgrpc.MetaClient] != "c" || meta[idemgrpc.MetaSequence] != "1" {
					t.Fatalf("metadata %v", meta)
				}
				if idemgrpc.Retryable(ctx, err) {
					t.Fatalf("RESPONSE_NOT_STORED is retryable: %v", err)
				}
			}
			if n := l.runs.Load(); n != 1 {
				t.Fatalf("the handler ran %d times, want 1", n)
			}
			if last, err := idemgrpc.ServiceState(srv.cc)(ctx, "c", []string{"ns"}); err != nil || last != 1 {
				t.Fatalf("client state %d, %v; want 1 (the sequence is consumed)", last, err)
			}
			// the next sequence runs.
			if _, err := c.Write(ctx, write("c", "ns", "", 2, "a", 1)); tc.firstCode == codes.OK && err != nil {
				t.Fatal(err)
			}
			if n := l.runs.Load(); n != 2 {
				t.Fatalf("the handler ran %d times, want 2", n)
			}
		})
	}
}

// TestHandlerFailureConsumed: once a handler ran, a failure that does not
// certify "no effect" (Internal, a plain error, Unavailable, a panic)
// consumes the identity: retries get the failure again with
// FAILURE_REPLAYED, and the handler does not run again. A NoEffect that
// certifies the error releases the identity.
func TestHandlerFailureConsumed(t *testing.T) {
	for _, tc := range []struct {
		name     string
		fail     func() error // nil: panic
		code     codes.Code
		noEffect func(error) bool
		runs     int64 // after the call and its retries
	}{
		{name: "Internal", fail: func() error { return status.Error(codes.Internal, "disk on fire") }, code: codes.Internal, runs: 1},
		{name: "PlainError", fail: func() error { return errors.New("half done") }, code: codes.Unknown, runs: 1},
		{name: "Unavailable", fail: func() error { return status.Error(codes.Unavailable, "downstream gone") }, code: codes.Unavailable, runs: 1},
		{name: "Panic", code: codes.Internal, runs: 1},
		{name: "CertifiedNoEffect", fail: func() error { return status.Error(codes.Internal, "rolled back") }, code: codes.Internal,
			noEffect: func(err error) bool { return strings.Contains(err.Error(), "rolled back") }, runs: 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := &fnLedger{}
			l.write = func(context.Context, *ledgerpb.WriteRequest) (*ledgerpb.WriteSuccess, error) {
				if tc.fail == nil {
					panic("test: handler panic")
				}
				return nil, tc.fail()
			}
			// recovery as a server would install it, outside everything.
			recovery := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (resp any, err error) {
				defer func() {
					if p := recover(); p != nil {
						err = status.Errorf(codes.Internal, "recovered: %v", p)
					}
				}()
				return h(ctx, req)
			}
			srv := serveIdem(t, nil, idemgrpc.Options{NoEffect: tc.noEffect}, l, []grpc.UnaryServerInterceptor{recovery}, nil)
			ctx := as(testCtx(t), "tok-alice")
			var retries atomic.Int64
			c := ledgerpb.NewLedgerClient(srv.cc)
			_, err := c.Write(ctx, write("c", "ns", "", 1, "a", 1))
			wantStatus(t, err, tc.code, "")
			for range 2 {
				_, err = c.Write(ctx, write("c", "ns", "", 1, "a", 1))
				if tc.noEffect != nil {
					wantStatus(t, err, tc.code, "")
					continue
				}
				wantStatus(t, err, tc.code, idemgrpc.ReasonFailureReplayed)
				if !strings.Contains(status.Convert(err).Message(), "replay") {
					t.Fatalf("message %q", status.Convert(err).Message())
				}
			}
			if n := l.runs.Load(); n != tc.runs {
				t.Fatalf("the handler ran %d times, want %d", n, tc.runs)
			}
			// the retrying client: a replayed failure is final, even
			// Unavailable.
			rc := ledgerpb.NewLedgerClient(dial(t, srv.cc.Target(), mustRetry(t, &idemgrpc.RetryOptions{
				InitialBackoff: time.Millisecond,
				OnRetry:        func(string, int, error, time.Duration) { retries.Add(1) },
			})))
			_, err = rc.Write(ctx, write("c", "ns", "", 2, "a", 1))
			if tc.noEffect == nil {
				want, reason := int64(0), ""
				if tc.code == codes.Unavailable {
					// the handler's own Unavailable is retried once; the
					// replay is final.
					want, reason = 1, idemgrpc.ReasonFailureReplayed
				}
				wantStatus(t, err, tc.code, reason)
				if retries.Load() != want || l.runs.Load() != tc.runs+1 {
					t.Fatalf("%d retries, %d runs; want %d, %d", retries.Load(), l.runs.Load(), want, tc.runs+1)
				}
			}
		})
	}
}
