package idemgrpc_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/examples/ledger/ledgerpb"
	"github.com/idemdb/idem/examples/ledger/ledgersvc"
	"github.com/idemdb/idem/idemgrpc"
	"github.com/idemdb/idem/idemgrpc/idemgrpcpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"
)

func openEngine(t *testing.T) *idem.Engine {
	t.Helper()
	eng, err := idem.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	return eng
}

// TestOptionsErrors: configuration errors are returned, naming the field
// and the value.
func TestOptionsErrors(t *testing.T) {
	eng := openEngine(t)
	id := idemgrpc.KeyFromMetadata("")
	for _, tc := range []struct {
		store idem.Store
		o     *idemgrpc.Options
		want  string
	}{
		{nil, nil, "store is nil"},
		{eng, &idemgrpc.Options{Methods: map[string]idemgrpc.IdentifyFunc{"/pkg.Svc/Foo": nil}}, "Options.Methods: /pkg.Svc/Foo: nil IdentifyFunc"},
		{eng, &idemgrpc.Options{Methods: map[string]idemgrpc.IdentifyFunc{"pkg.Svc/Foo": id}}, "Options.Methods: pkg.Svc/Foo: not a full method name"},
		{eng, &idemgrpc.Options{Methods: map[string]idemgrpc.IdentifyFunc{"/pkg.Svc": id}}, "Options.Methods: /pkg.Svc: not a full method name"},
		{eng, &idemgrpc.Options{RetryDelay: -time.Second}, "Options.RetryDelay: -1s: negative"},
		{eng, &idemgrpc.Options{MaxReplySize: -1}, "Options.MaxReplySize: -1: negative"},
		{eng, &idemgrpc.Options{TTL: -time.Second}, "Options.TTL: -1s: negative"},
	} {
		if _, err := idemgrpc.NewServer(tc.store, tc.o); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewServer(%v): %v; want an error with %q", tc.o, err, tc.want)
		}
	}
	if _, err := idemgrpc.NewServer(eng, nil); err != nil {
		t.Fatalf("nil options: %v", err)
	}
	st := idemgrpc.ServiceState(nil)
	for _, tc := range []struct {
		client string
		store  idemgrpc.SequenceStore
		state  idemgrpc.StateFunc
		o      *idemgrpc.TrackerOptions
		want   string
	}{
		{"", idemgrpc.NewMemoryStore(), st, nil, "client id of 0 bytes"},
		{strings.Repeat("c", 1025), idemgrpc.NewMemoryStore(), st, nil, "client id of 1025 bytes"},
		{"c", nil, st, nil, "SequenceStore is nil"},
		{"c", idemgrpc.NewMemoryStore(), nil, nil, "StateFunc is nil"},
		{"c", idemgrpc.NewMemoryStore(), st, &idemgrpc.TrackerOptions{MaxResyncs: -1}, "TrackerOptions.MaxResyncs: -1"},
	} {
		if _, err := idemgrpc.NewTracker(tc.client, tc.store, tc.state, tc.o); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewTracker: %v; want an error with %q", err, tc.want)
		}
	}
}

// TestCheck: the methods of Options.Methods are checked against the
// registered services: an unknown method, a method of an unknown service
// and a streaming method are errors naming them; until Check passes the
// interceptor refuses every call (nothing runs without exactly-once).
func TestCheck(t *testing.T) {
	eng := openEngine(t)
	newServer := func(methods ...string) (*idemgrpc.Server, *grpc.Server, *fnLedger) {
		m := map[string]idemgrpc.IdentifyFunc{}
		for _, name := range methods {
			m[name] = ledgersvc.Identify
		}
		isrv, err := idemgrpc.NewServer(eng, &idemgrpc.Options{Methods: m})
		if err != nil {
			t.Fatal(err)
		}
		gs := grpc.NewServer(grpc.ChainUnaryInterceptor(ledgersvc.TokenAuth(tokens), isrv.UnaryServerInterceptor()))
		l := &fnLedger{}
		ledgerpb.RegisterLedgerServer(gs, l)
		idemgrpcpb.RegisterClientStateServer(gs, isrv)
		reflection.Register(gs) // a bidirectional streaming service
		return isrv, gs, l
	}
	for _, tc := range []struct {
		method, want string
	}{
		{"/idem.examples.ledger.v1.Ledger/Wirte", "unknown method /idem.examples.ledger.v1.Ledger/Wirte: service idem.examples.ledger.v1.Ledger has no method Wirte"},
		{"/ledger.v1.Ledger/Write", "unknown method /ledger.v1.Ledger/Write: service ledger.v1.Ledger not registered"},
		{"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo is a streaming method"},
	} {
		isrv, gs, _ := newServer(ledgersvc.MethodWrite, tc.method)
		if err := isrv.Check(gs); err == nil || !strings.Contains(err.Error(), "idemgrpc: Options.Methods: "+tc.want) {
			t.Errorf("Check with %s: %v; want %q", tc.method, err, tc.want)
		}
	}

	// Not checked: every call is refused, and the handler does not run.
	isrv, gs, l := newServer(ledgersvc.MethodWrite, ledgersvc.MethodBatchWrite)
	lis := listen(t)
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)
	ctx := as(testCtx(t), "tok-alice")
	c := ledgerpb.NewLedgerClient(dial(t, lis.Addr().String()))
	_, err := c.Write(ctx, write("c", "ns", "", 1, "a", 1))
	if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "Server.Check was not called") || l.runs.Load() != 0 {
		t.Fatalf("call before Check: %v, %d runs", err, l.runs.Load())
	}
	if err := isrv.Check(gs); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write(ctx, write("c", "ns", "", 1, "a", 1)); err != nil || l.runs.Load() != 1 {
		t.Fatalf("call after Check: %v, %d runs", err, l.runs.Load())
	}
}

// TestCancelledBeforeCommit: the client gives up while the handler runs;
// the handler finishes after its context was cancelled, and the interceptor
// commits with that cancelled context (a claim's Commit writes whatever ctx
// says): the identity ends Done, and the retry gets the response without
// running the handler again (not IN_FLIGHT until the lease ends).
func TestCancelledBeforeCommit(t *testing.T) {
	handlerCtx := make(chan context.Context, 1)
	finish := make(chan struct{})
	l := &fnLedger{}
	l.write = func(ctx context.Context, req *ledgerpb.WriteRequest) (*ledgerpb.WriteSuccess, error) {
		handlerCtx <- ctx
		<-ctx.Done() // the client is gone
		<-finish
		return &ledgerpb.WriteSuccess{TxId: "tx-1", Sequence: req.GetSequence()}, nil
	}
	srv := serveIdem(t, nil, idemgrpc.Options{}, l, nil, nil)
	ctx := as(testCtx(t), "tok-alice")
	c := ledgerpb.NewLedgerClient(srv.cc)
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { _, err := c.Write(cctx, write("c", "ns", "", 1, "a", 1)); done <- err }()
	hctx := <-handlerCtx
	cancel()
	if err := <-done; status.Code(err) != codes.Canceled {
		t.Fatalf("the cancelled call: %v", err)
	}
	<-hctx.Done()
	close(finish)
	// The commit happens after the handler returns; the retry waits for it
	// (InFlightWait), or is told IN_FLIGHT and sent again.
	var r *ledgerpb.WriteSuccess
	for {
		var err error
		r, err = c.Write(ctx, write("c", "ns", "", 1, "a", 1))
		if reason, _ := idemgrpc.ErrorReason(err); reason == idemgrpc.ReasonInFlight {
			continue
		}
		if err != nil {
			t.Fatalf("retry: %v", err)
		}
		break
	}
	if r.GetTxId() != "tx-1" || l.runs.Load() != 1 {
		t.Fatalf("retry got %v, %d runs; want the stored tx-1 and 1 run", r, l.runs.Load())
	}
	if last, err := idemgrpc.ServiceState(srv.cc)(ctx, "c", []string{"ns"}); err != nil || last != 1 {
		t.Fatalf("client state %d, %v", last, err)
	}
}
