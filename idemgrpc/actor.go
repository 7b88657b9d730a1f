package idemgrpc

import (
	"context"
	"crypto/x509"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// ActorFunc gives the actor of a call from its authenticated context. It must
// never read anything the client chose freely (a request field, an
// unauthenticated header): the actor is part of every scope, so it decides
// whose sequences and replies a call can reach. An error that is a gRPC
// status is returned to the client as is; any other error becomes
// Unauthenticated.
type ActorFunc func(ctx context.Context) (string, error)

type actorKey struct{}

// WithActor returns ctx carrying actor. An authentication interceptor that
// runs before the idemgrpc interceptor calls it once it has verified the
// caller (a token, a session); ContextActor then reads it.
func WithActor(ctx context.Context, actor string) context.Context {
	return context.WithValue(ctx, actorKey{}, actor)
}

// ContextActor is the default ActorFunc: the actor stored by WithActor, or
// Unauthenticated when there is none.
func ContextActor(ctx context.Context) (string, error) {
	if a, ok := ctx.Value(actorKey{}).(string); ok && a != "" {
		return a, nil
	}
	return "", status.Error(codes.Unauthenticated, "idemgrpc: no authenticated actor in the call context (an authentication interceptor must run first and call idemgrpc.WithActor)")
}

// TLSActor is an ActorFunc for mutual TLS: "cert:" followed by the first URI
// SAN (for example a SPIFFE id) of the client's verified certificate, or its
// subject common name when it has no URI. Calls without a verified client
// certificate are Unauthenticated.
func TLSActor(ctx context.Context) (string, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return "", status.Error(codes.Unauthenticated, "idemgrpc: no peer in the call context")
	}
	ti, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		return "", status.Error(codes.Unauthenticated, "idemgrpc: the connection is not TLS")
	}
	var leaf *x509.Certificate
	if len(ti.State.VerifiedChains) > 0 && len(ti.State.VerifiedChains[0]) > 0 {
		leaf = ti.State.VerifiedChains[0][0]
	}
	if leaf == nil {
		return "", status.Error(codes.Unauthenticated, "idemgrpc: no verified client certificate (configure the server with tls.RequireAndVerifyClientCert)")
	}
	if len(leaf.URIs) > 0 {
		return "cert:" + leaf.URIs[0].String(), nil
	}
	if leaf.Subject.CommonName != "" {
		return "cert:" + leaf.Subject.CommonName, nil
	}
	return "", status.Error(codes.Unauthenticated, "idemgrpc: the client certificate has neither a URI SAN nor a common name")
}
