package ledgersvc

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"path/filepath"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/examples/ledger/ledgerpb"
	"github.com/idemdb/idem/idemgrpc"
	"github.com/idemdb/idem/idemgrpc/idemgrpcpb"
	// errdetails registers google/rpc/error_details.proto, which
	// reflection serves so that clients decode idemgrpc's ErrorInfo and
	// RetryInfo details (idemgrpc links it too; this says it is needed).
	_ "google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
)

// Options configure Start (Tokens is required).
type Options struct {
	// Tokens maps bearer tokens to actors (required).
	Tokens map[string]string
	// Engine options (nil: defaults, fsync before acknowledging).
	Engine *idem.Options
	// TTL of stored responses (idemgrpc.Options.TTL; 0: kept until the
	// client's next sequence).
	TTL time.Duration
	// InFlightWait (idemgrpc.Options.InFlightWait; 0: its default).
	InFlightWait time.Duration
	// KeepReplies and KeepRepliesFor (idemgrpc.Options; 0: the ledger's
	// defaults, 10,000 replies for 5 minutes).
	KeepReplies    int
	KeepRepliesFor time.Duration
	Logger         *slog.Logger
	// AfterApply is copied to Ledger.AfterApply.
	AfterApply func(ctx context.Context)
	// BeforeApply is copied to Ledger.BeforeApply.
	BeforeApply func(ctx context.Context) error
}

// Server is a running ledger: engine, journal and gRPC server.
type Server struct {
	Engine *idem.Engine
	Idem   *idemgrpc.Server
	Ledger *Ledger
	GRPC   *grpc.Server
	done   chan error
}

// Start opens dir (dir/idem for the engine, dir/ledger for the journal),
// settles calls left in doubt, and serves the Ledger and ClientState
// services on lis behind the token check and the idemgrpc interceptor, with
// server reflection (v1 and v1alpha).
func Start(dir string, lis net.Listener, opts *Options) (*Server, error) {
	if opts == nil || len(opts.Tokens) == 0 {
		return nil, errors.New("ledger: Options.Tokens: none configured")
	}
	o := *opts
	eng, err := idem.Open(filepath.Join(dir, "idem"), o.Engine)
	if err != nil {
		return nil, err
	}
	isrv, err := idemgrpc.NewServer(eng, &idemgrpc.Options{
		Methods: Methods(), TTL: o.TTL, InFlightWait: o.InFlightWait, Logger: o.Logger,
		KeepReplies: o.KeepReplies, KeepRepliesFor: o.KeepRepliesFor,
	})
	if err != nil {
		eng.Close()
		return nil, err
	}
	l, err := Open(filepath.Join(dir, "ledger"), isrv, eng)
	if err != nil {
		eng.Close()
		return nil, err
	}
	l.BeforeApply, l.AfterApply = o.BeforeApply, o.AfterApply
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(TokenAuth(o.Tokens), isrv.UnaryServerInterceptor()),
		// idemgrpc.DialOptions' clients ping after 30s of silence (10s
		// is grpc-go's floor): allow it, or grpc-go's default policy
		// (5 minutes) closes their connections with GOAWAY too_many_pings.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second}))
	ledgerpb.RegisterLedgerServer(gs, l)
	idemgrpcpb.RegisterClientStateServer(gs, isrv)
	// Server reflection: grpcurl and other tools list the services and
	// fetch the descriptors of their messages and of the error details
	// (google.rpc.ErrorInfo, RetryInfo) without .proto files.
	reflection.Register(gs)
	if err := isrv.Check(gs); err != nil {
		l.Close()
		eng.Close()
		return nil, err
	}
	s := &Server{Engine: eng, Idem: isrv, Ledger: l, GRPC: gs, done: make(chan error, 1)}
	go func() { s.done <- gs.Serve(lis) }()
	return s, nil
}

// Stop stops serving (waiting for running calls), then closes the journal
// and the engine.
func (s *Server) Stop() error {
	s.GRPC.GracefulStop()
	err := <-s.done
	if errors.Is(err, grpc.ErrServerStopped) {
		err = nil
	}
	return errors.Join(err, s.Ledger.Close(), s.Engine.Close())
}

// Kill stops the gRPC server at once (running calls are cut) and closes
// the engine and the journal without waiting for handlers: what a crash
// leaves, minus the lost page cache.
func (s *Server) Kill() error {
	s.GRPC.Stop()
	<-s.done
	return errors.Join(s.Engine.Close(), s.Ledger.Close())
}
