package idemgrpc_test

import (
	"context"
	"errors"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/examples/ledger/ledgerpb"
	"github.com/idemdb/idem/examples/ledger/ledgersvc"
	"github.com/idemdb/idem/idemgrpc"
	"github.com/idemdb/idem/idemgrpc/idemgrpcpb"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

var tokens = map[string]string{"tok-alice": "user:alice", "tok-bob": "user:bob"}

// ledgerEnv is a ledger server on a loopback TCP port, restartable on the
// same directory.
type ledgerEnv struct {
	t    *testing.T
	dir  string
	opts ledgersvc.Options
	mu   sync.Mutex
	srv  *ledgersvc.Server
	addr string
}

func startLedger(t *testing.T, opts ledgersvc.Options) *ledgerEnv {
	t.Helper()
	if opts.Tokens == nil {
		opts.Tokens = tokens
	}
	e := &ledgerEnv{t: t, dir: t.TempDir(), opts: opts}
	e.start()
	t.Cleanup(func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		if e.srv != nil {
			_ = e.srv.Kill()
			e.srv = nil
		}
	})
	return e
}

func (e *ledgerEnv) start() {
	e.t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		e.t.Fatal(err)
	}
	srv, err := ledgersvc.Start(e.dir, lis, &e.opts)
	if err != nil {
		lis.Close()
		e.t.Fatal(err)
	}
	e.mu.Lock()
	e.srv, e.addr = srv, lis.Addr().String()
	e.mu.Unlock()
}

func (e *ledgerEnv) server() *ledgersvc.Server {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.srv
}

// restart stops the server (gracefully, or killing it), closes the engine
// and the journal, and starts a new server on the same directory and a new
// port.
func (e *ledgerEnv) restart(kill bool) {
	e.t.Helper()
	e.mu.Lock()
	srv := e.srv
	e.srv = nil
	e.mu.Unlock()
	var err error
	if kill {
		err = srv.Kill()
	} else {
		err = srv.Stop()
	}
	if err != nil {
		e.t.Fatalf("stop: %v", err)
	}
	e.start()
}

func dial(t *testing.T, addr string, ints ...grpc.UnaryClientInterceptor) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithChainUnaryInterceptor(ints...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// as returns ctx authenticated with token (replacing any token it had).
func as(ctx context.Context, token string) context.Context {
	md, _ := metadata.FromOutgoingContext(ctx)
	md = md.Copy()
	md.Set("authorization", "Bearer "+token)
	return metadata.NewOutgoingContext(ctx, md)
}

func write(client, ns, vault string, seq uint64, account string, amount int64) *ledgerpb.WriteRequest {
	return &ledgerpb.WriteRequest{ClientId: client, Sequence: seq, NamespaceId: ns, VaultId: vault,
		Operation: &ledgerpb.Operation{Account: account, Amount: amount}}
}

// wantStatus checks err's code and idemgrpc reason ("" for none) and returns
// its ErrorInfo metadata.
func wantStatus(t *testing.T, err error, code codes.Code, reason string) map[string]string {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("got %v (code %v), want code %v", err, status.Code(err), code)
	}
	r, meta := idemgrpc.ErrorReason(err)
	if r != reason {
		t.Fatalf("got reason %q, want %q (%v)", r, reason, err)
	}
	return meta
}

func retryInfo(err error) *errdetails.RetryInfo {
	for _, d := range status.Convert(err).Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			return ri
		}
	}
	return nil
}

func sameReply(t *testing.T, a, b proto.Message) {
	t.Helper()
	if !proto.Equal(a, b) {
		t.Fatalf("replies differ:\n%v\n%v", a, b)
	}
	ab, _ := proto.MarshalOptions{Deterministic: true}.Marshal(a)
	bb, _ := proto.MarshalOptions{Deterministic: true}.Marshal(b)
	if string(ab) != string(bb) {
		t.Fatalf("reply bytes differ")
	}
}

// lossy is a client interceptor (placed inside the retry interceptor) that
// delivers the first n calls' requests but reports them lost: the server
// ran them, the client sees Unavailable.
func lossy(n int, seen *[]proto.Message) grpc.UnaryClientInterceptor {
	var mu sync.Mutex
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		mu.Lock()
		defer mu.Unlock()
		if n > 0 {
			n--
			if err == nil && seen != nil {
				*seen = append(*seen, proto.Clone(reply.(proto.Message)))
			}
			return status.Error(codes.Unavailable, "test: response lost on the way back")
		}
		return err
	}
}

func clientState(t *testing.T, ctx context.Context, c ledgerpb.LedgerClient, token, client, ns, vault string) uint64 {
	t.Helper()
	r, err := c.GetClientState(as(ctx, token), &ledgerpb.GetClientStateRequest{NamespaceId: ns, VaultId: vault, ClientId: client})
	if err != nil {
		t.Fatalf("GetClientState: %v", err)
	}
	return r.GetLastCommittedSequence()
}

func balance(t *testing.T, ctx context.Context, c ledgerpb.LedgerClient, ns, vault, account string) int64 {
	t.Helper()
	r, err := c.GetBalance(as(ctx, "tok-alice"), &ledgerpb.GetBalanceRequest{NamespaceId: ns, VaultId: vault, Account: account})
	if err != nil {
		t.Fatalf("GetBalance: %v", err)
	}
	return r.GetBalance()
}

var errInjected = errors.New("injected")

func listen(t *testing.T) net.Listener {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return lis
}

func dialB(b *testing.B, addr string) *grpc.ClientConn {
	b.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cc.Close() })
	return cc
}

// fnLedger is a Ledger whose Write runs write and counts its runs.
type fnLedger struct {
	ledgerpb.UnimplementedLedgerServer
	runs  atomic.Int64
	write func(ctx context.Context, req *ledgerpb.WriteRequest) (*ledgerpb.WriteSuccess, error)
}

func (l *fnLedger) Write(ctx context.Context, req *ledgerpb.WriteRequest) (*ledgerpb.WriteSuccess, error) {
	n := l.runs.Add(1)
	if l.write != nil {
		return l.write(ctx, req)
	}
	call, _ := idemgrpc.CallFromContext(ctx)
	return &ledgerpb.WriteSuccess{TxId: "tx-" + strconv.FormatInt(n, 10), Actor: call.Actor, Sequence: req.GetSequence()}, nil
}

// idemServer is an engine in a temporary directory and a gRPC server on
// 127.0.0.1 serving impl behind the token check and an idemgrpc
// interceptor configured by cfg (Engine and Methods filled in when unset);
// inner interceptors run between idemgrpc and the handler, outer ones
// before the token check.
type idemServer struct {
	idem *idemgrpc.Server
	cc   *grpc.ClientConn
}

func serveIdem(t *testing.T, eopts *idem.Options, opts idemgrpc.Options, impl ledgerpb.LedgerServer, outer, inner []grpc.UnaryServerInterceptor) *idemServer {
	t.Helper()
	eng, err := idem.Open(t.TempDir(), eopts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	if opts.Methods == nil {
		opts.Methods = ledgersvc.Methods()
	}
	isrv, err := idemgrpc.NewServer(eng, &opts)
	if err != nil {
		t.Fatal(err)
	}
	chain := append(append(append([]grpc.UnaryServerInterceptor{}, outer...), ledgersvc.TokenAuth(tokens), isrv.UnaryServerInterceptor()), inner...)
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(chain...))
	ledgerpb.RegisterLedgerServer(gs, impl)
	idemgrpcpb.RegisterClientStateServer(gs, isrv)
	return &idemServer{idem: isrv, cc: dial(t, serve(t, isrv, gs))}
}

// serve checks isrv (if any) against gs's services and serves gs on 127.0.0.1
// until the test ends; it returns the address.
func serve(t testing.TB, isrv *idemgrpc.Server, gs *grpc.Server) string {
	t.Helper()
	if isrv != nil {
		if err := isrv.Check(gs); err != nil {
			t.Fatal(err)
		}
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)
	return lis.Addr().String()
}

// mustRetry is the retry interceptor with opts.
func mustRetry(t testing.TB, opts *idemgrpc.RetryOptions) grpc.UnaryClientInterceptor {
	t.Helper()
	ic, err := idemgrpc.UnaryClientInterceptor(opts)
	if err != nil {
		t.Fatal(err)
	}
	return ic
}
