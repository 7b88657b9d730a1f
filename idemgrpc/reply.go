package idemgrpc

import (
	"fmt"

	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

var deterministic = proto.MarshalOptions{Deterministic: true}

// EncodeReply is how the server interceptor stores a response: a
// google.protobuf.Any holding the message's full type name and its
// deterministic encoding, itself marshaled deterministically. Use it to
// commit a reply yourself (Server.ResolveInDoubt does).
func EncodeReply(m proto.Message) ([]byte, error) {
	if m == nil {
		return nil, fmt.Errorf("idemgrpc: nil response message")
	}
	a := new(anypb.Any)
	if err := anypb.MarshalFrom(a, m, deterministic); err != nil {
		return nil, fmt.Errorf("idemgrpc: marshal response %s: %w", m.ProtoReflect().Descriptor().FullName(), err)
	}
	b, err := deterministic.Marshal(a)
	if err != nil {
		return nil, fmt.Errorf("idemgrpc: marshal response envelope: %w", err)
	}
	return b, nil
}

// DecodeReply turns a stored reply back into a message of the type that was
// stored (it must be linked into the binary: generated code registers its
// types). A marker (a call that ran but whose response was not stored, or
// whose handler failed after it may have had effects) is an error carrying
// the status its retries get.
func DecodeReply(b []byte) (proto.Message, error) {
	m, mk, err := decodeStored(b)
	if err != nil {
		return nil, err
	}
	if mk != nil {
		return nil, fmt.Errorf("idemgrpc: the stored reply is not a response: %w", mk.err(Identity{}))
	}
	return m, nil
}

// Markers stored in place of a response. A stored reply is a
// google.protobuf.Any: a response under its own type URL
// ("type.googleapis.com/" + the message's full name), or one of these
// markers, whose value is a google.rpc.Status. Their URLs name no protobuf
// type, so no response can be mistaken for one. An empty reply (what is
// left when the engine refuses even a marker as too large) reads as
// markerNotStored.
const (
	// markerNotStored: the handler ran and succeeded, but its response
	// could not be stored (not a protobuf message, not encodable, or larger
	// than MaxReplySize). The value's message says why; retries get
	// AlreadyExists RESPONSE_NOT_STORED with it.
	markerNotStored = "idemdb.dev/idemgrpc/response-not-stored"
	// markerFailed: the handler failed in a way that does not certify it
	// had no effect (see Options.NoEffect) or panicked. The value is its
	// status; retries get it again with FAILURE_REPLAYED.
	markerFailed = "idemdb.dev/idemgrpc/handler-failed"
)

// encodeMarker stores st under a marker URL.
func encodeMarker(url string, st *status.Status) ([]byte, error) {
	v, err := deterministic.Marshal(st.Proto())
	if err != nil {
		return nil, fmt.Errorf("idemgrpc: marshal %s marker: %w", url, err)
	}
	return deterministic.Marshal(&anypb.Any{TypeUrl: url, Value: v})
}

// marker is a stored marker: its URL and status.
type marker struct {
	url string
	st  *spb.Status
}

// err is the status a retry of the call with identity id gets.
func (m *marker) err(id Identity) error {
	if m.url == markerFailed {
		return replayedFailure(m.st).Err()
	}
	return notStoredStatus(id, m.st.GetMessage())
}

// decodeStored decodes a stored reply: a response, or a marker.
func decodeStored(b []byte) (proto.Message, *marker, error) {
	if len(b) == 0 {
		// The last-resort marker of an engine too small for any other.
		return nil, &marker{url: markerNotStored, st: &spb.Status{}}, nil
	}
	a := new(anypb.Any)
	if err := proto.Unmarshal(b, a); err != nil {
		return nil, nil, fmt.Errorf("idemgrpc: stored reply is not a google.protobuf.Any: %w", err)
	}
	switch a.GetTypeUrl() {
	case markerNotStored, markerFailed:
		sp := new(spb.Status)
		if err := proto.Unmarshal(a.GetValue(), sp); err != nil {
			return nil, nil, fmt.Errorf("idemgrpc: stored %s marker: %w", a.GetTypeUrl(), err)
		}
		return nil, &marker{url: a.GetTypeUrl(), st: sp}, nil
	}
	m, err := a.UnmarshalNew()
	if err != nil {
		return nil, nil, fmt.Errorf("idemgrpc: stored reply of type %q: %w", a.GetTypeUrl(), err)
	}
	return m, nil, nil
}
