package idemgrpc

import (
	"context"
	"fmt"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

// DefaultKeyHeader is the metadata key KeyFromMetadata reads.
const DefaultKeyHeader = "idempotency-key"

// MetadataKey returns the idempotency key of the incoming call from metadata
// header (DefaultKeyHeader if empty): exactly one value of 1-255 characters
// of [A-Za-z0-9_-], as for the HTTP Idempotency-Key header.
func MetadataKey(ctx context.Context, header string) (string, error) {
	if header == "" {
		header = DefaultKeyHeader
	}
	vals := metadata.ValueFromIncomingContext(ctx, header)
	switch len(vals) {
	case 0:
		return "", fmt.Errorf("missing %s metadata", header)
	case 1:
	default:
		return "", fmt.Errorf("%d values of %s metadata; send one", len(vals), header)
	}
	k := vals[0]
	if len(k) < 1 || len(k) > 255 {
		return "", fmt.Errorf("%s of %d characters; want 1-255", header, len(k))
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return "", fmt.Errorf("%s has %q at position %d; allowed: A-Z a-z 0-9 _ -", header, c, i)
		}
	}
	return k, nil
}

// KeyFromMetadata is an IdentifyFunc taking an idempotency key from metadata
// (see MetadataKey), with no scope fields (the actor still scopes it).
func KeyFromMetadata(header string) IdentifyFunc {
	return func(ctx context.Context, _ proto.Message) (Identity, error) {
		k, err := MetadataKey(ctx, header)
		if err != nil {
			return Identity{}, err
		}
		return Identity{Key: k}, nil
	}
}

// SequencedMessage is a request carrying per-client sequence fields
// (protobuf fields client_id and sequence generate these getters).
type SequencedMessage interface {
	GetClientId() string
	GetSequence() uint64
}

// SequenceFromMessage is an IdentifyFunc for requests implementing
// SequencedMessage; scope returns the request's scope fields (nil: none).
func SequenceFromMessage(scope func(req proto.Message) []string) IdentifyFunc {
	return func(_ context.Context, req proto.Message) (Identity, error) {
		sm, ok := req.(SequencedMessage)
		if !ok {
			return Identity{}, fmt.Errorf("%s has no client_id and sequence fields", req.ProtoReflect().Descriptor().FullName())
		}
		id := Identity{Client: sm.GetClientId(), Seq: sm.GetSequence()}
		if scope != nil {
			id.Scope = scope(req)
		}
		return id, nil
	}
}
