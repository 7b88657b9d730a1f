package idemgrpc

import (
	"fmt"

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
// types).
func DecodeReply(b []byte) (proto.Message, error) {
	a := new(anypb.Any)
	if err := proto.Unmarshal(b, a); err != nil {
		return nil, fmt.Errorf("idemgrpc: stored reply is not a google.protobuf.Any: %w", err)
	}
	m, err := a.UnmarshalNew()
	if err != nil {
		return nil, fmt.Errorf("idemgrpc: stored reply of type %q: %w", a.GetTypeUrl(), err)
	}
	return m, nil
}
