package idemgrpc

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"unicode"
	"unicode/utf8"

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

// IDFunc reads an authenticated identifier from a call's context: a
// verified token's subject, an API key's client id, a certificate's name
// (TLSName). Like an ActorFunc it must never read what the client chose
// freely.
type IDFunc func(ctx context.Context) (string, error)

// The kinds of actor the ledger's format knows: "user:<id>" (a person),
// "client:<id>" (an application or service account), "system:<name>" (the
// operator's own jobs).
const (
	KindUser   = "user"
	KindClient = "client"
	KindSystem = "system"
)

// maxActorID bounds the id part of an actor.
const maxActorID = 512

// kindActor forms kind + ":" + the id that id reads.
func kindActor(kind string, id IDFunc) ActorFunc {
	return func(ctx context.Context) (string, error) {
		if id == nil {
			return "", status.Errorf(codes.Unauthenticated, "idemgrpc: %s actor: no IDFunc", kind)
		}
		v, err := id(ctx)
		if err != nil {
			if _, ok := status.FromError(err); ok {
				return "", err
			}
			return "", status.Errorf(codes.Unauthenticated, "idemgrpc: %s actor: %v", kind, err)
		}
		if err := checkActorID(v); err != nil {
			return "", status.Errorf(codes.Unauthenticated, "idemgrpc: %s actor: %v", kind, err)
		}
		return kind + ":" + v, nil
	}
}

func checkActorID(v string) error {
	if v == "" {
		return errors.New("empty id")
	}
	if len(v) > maxActorID {
		return fmt.Errorf("id of %d bytes, more than %d", len(v), maxActorID)
	}
	if !utf8.ValidString(v) {
		return errors.New("id is not valid UTF-8")
	}
	for i, r := range v {
		if unicode.IsControl(r) || unicode.IsSpace(r) {
			return fmt.Errorf("id has %q at byte %d (no spaces or control characters)", r, i)
		}
	}
	return nil
}

// UserActor is an ActorFunc giving "user:<id>", id being the authenticated
// end user that userID reads (for example a verified token's subject).
// An empty or malformed id (spaces, control characters, more than 512
// bytes) is Unauthenticated, as is an error of userID that is not a status.
func UserActor(userID IDFunc) ActorFunc { return kindActor(KindUser, userID) }

// ClientActor is an ActorFunc giving "client:<id>", id being the
// authenticated application or service account that clientID reads (an API
// key's owner, a workload identity: ClientActor(TLSName) forms it from the
// verified client certificate).
func ClientActor(clientID IDFunc) ActorFunc { return kindActor(KindClient, clientID) }

// SystemActor is an ActorFunc giving "system:<name>", name being the
// operator's own job that systemName reads from the authenticated context
// (an internal credential, a dedicated certificate).
func SystemActor(systemName IDFunc) ActorFunc { return kindActor(KindSystem, systemName) }

// TLSName is an IDFunc for mutual TLS: the first URI SAN (for example a
// SPIFFE id) of the client's verified certificate, or its subject common
// name when it has no URI. Calls without a verified client certificate are
// Unauthenticated.
func TLSName(ctx context.Context) (string, error) {
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
		return leaf.URIs[0].String(), nil
	}
	if leaf.Subject.CommonName != "" {
		return leaf.Subject.CommonName, nil
	}
	return "", status.Error(codes.Unauthenticated, "idemgrpc: the client certificate has neither a URI SAN nor a common name")
}

// TLSActor is an ActorFunc for mutual TLS: "cert:" followed by TLSName (the
// verified client certificate's first URI SAN, or its common name). Calls
// without a verified client certificate are Unauthenticated.
// ClientActor(TLSName) gives "client:" and the same name.
func TLSActor(ctx context.Context) (string, error) {
	n, err := TLSName(ctx)
	if err != nil {
		return "", err
	}
	return "cert:" + n, nil
}
