package idemgrpc_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"sync/atomic"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/examples/ledger/ledgerpb"
	"github.com/idemdb/idem/idemgrpc"
	"github.com/idemdb/idem/idemgrpc/idemgrpcpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

// ledger is a service whose Write must run once per (client_id, sequence).
type ledger struct {
	ledgerpb.UnimplementedLedgerServer
	n atomic.Int64
}

func (l *ledger) Write(ctx context.Context, req *ledgerpb.WriteRequest) (*ledgerpb.WriteSuccess, error) {
	call, _ := idemgrpc.CallFromContext(ctx) // the actor comes from the auth context
	return &ledgerpb.WriteSuccess{TxId: fmt.Sprint("tx-", l.n.Add(1)), Sequence: req.GetSequence(), Actor: call.Actor}, nil
}

func Example() {
	dir, _ := os.MkdirTemp("", "idemgrpc-example")
	defer os.RemoveAll(dir)
	eng, err := idem.Open(dir, nil)
	if err != nil {
		panic(err)
	}
	defer eng.Close()

	// The exactly-once layer: Write's identity is its client_id and
	// sequence, in the namespace_id scope, under the caller's actor.
	srv, err := idemgrpc.NewServer(eng, &idemgrpc.Options{
		Methods: map[string]idemgrpc.IdentifyFunc{
			"/idem.examples.ledger.v1.Ledger/Write": idemgrpc.SequenceFromMessage(func(m proto.Message) []string {
				return []string{m.(*ledgerpb.WriteRequest).GetNamespaceId()}
			}),
		},
	})
	if err != nil {
		panic(err)
	}
	// An authentication interceptor runs first and sets the actor.
	auth := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		if md, _ := metadata.FromIncomingContext(ctx); len(md.Get("authorization")) == 1 && md.Get("authorization")[0] == "Bearer secret" {
			return h(idemgrpc.WithActor(ctx, "user:alice"), req)
		}
		return nil, fmt.Errorf("unauthenticated")
	}
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(auth, srv.UnaryServerInterceptor()))
	ledgerpb.RegisterLedgerServer(gs, &ledger{})
	idemgrpcpb.RegisterClientStateServer(gs, srv)
	if err := srv.Check(gs); err != nil { // every listed method is a registered unary method
		panic(err)
	}
	lis, _ := net.Listen("tcp", "127.0.0.1:0")
	go gs.Serve(lis)
	defer gs.Stop()

	// The retrying client: a timeout per attempt, a new connection after
	// a timeout, keepalive.
	dialOpts, err := idemgrpc.DialOptions(nil) // nil: the defaults
	if err != nil {
		panic(err)
	}
	cc, _ := grpc.NewClient(lis.Addr().String(), append(dialOpts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	defer cc.Close()
	c := ledgerpb.NewLedgerClient(cc)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer secret")

	req := &ledgerpb.WriteRequest{ClientId: "c1", Sequence: 1, NamespaceId: "acme", Operation: &ledgerpb.Operation{Account: "cash", Amount: 5}}
	r, _ := c.Write(ctx, req)
	fmt.Println(r.GetTxId(), r.GetActor())
	r, _ = c.Write(ctx, req) // a retry: the stored response
	fmt.Println(r.GetTxId(), r.GetActor())
	req.Sequence = 3 // skips 2
	_, err = c.Write(ctx, req)
	last, _ := idemgrpc.LastCommittedSequence(err)
	fmt.Println(idemgrpc.IsSequenceGap(err), last)
	// Output:
	// tx-1 user:alice
	// tx-1 user:alice
	// true 1
}
