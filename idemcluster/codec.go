package idemcluster

import (
	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the default codec, the fallback below
	"google.golang.org/grpc/mem"
)

// vtCodec is the gRPC codec of the client and the nodes: protobuf, the
// same bytes on the wire, but the idem messages (clusterpb) are encoded
// and decoded by their generated MarshalVT and UnmarshalVT
// (planetscale/vtprotobuf, cluster_vtproto.pb.go) instead of the protobuf
// runtime's reflection-driven tables: per call a Batch item's messages
// were decoded twice and sized twice that way, a fifth of a duplicate's
// CPU (BenchmarkClusterDuplicate). Any other message (gRPC reflection's,
// on the nodes' server) goes to gRPC's default proto codec. It is set
// per connection and per server (codecDialOption, codecServerOption), not
// registered globally, so nothing else in the process changes; it keeps
// the name "proto", which is the content-subtype a client in any language
// sends.
type vtCodec struct{}

// vtMessage is a message with vtprotobuf's generated methods.
type vtMessage interface {
	SizeVT() int
	MarshalToSizedBufferVT([]byte) (int, error)
	UnmarshalVT([]byte) error
}

// protoCodec is gRPC's default codec, for the messages without them.
var protoCodec = encoding.GetCodecV2("proto")

func (vtCodec) Name() string { return "proto" }

// Marshal is the default codec's Marshal (pooled buffers above gRPC's
// threshold) with the generated encoder.
func (vtCodec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(vtMessage)
	if !ok {
		return protoCodec.Marshal(v)
	}
	size := m.SizeVT()
	if mem.IsBelowBufferPoolingThreshold(size) {
		buf := make([]byte, size)
		if _, err := m.MarshalToSizedBufferVT(buf); err != nil {
			return nil, err
		}
		return mem.BufferSlice{mem.SliceBuffer(buf)}, nil
	}
	pool := mem.DefaultBufferPool()
	buf := pool.Get(size)
	if _, err := m.MarshalToSizedBufferVT((*buf)[:size]); err != nil {
		pool.Put(buf)
		return nil, err
	}
	return mem.BufferSlice{mem.NewBuffer(buf, pool)}, nil
}

// Unmarshal decodes with the generated decoder, which copies every bytes
// field out of data (vtprotobuf's default, not its unsafe mode), so the
// buffer goes back to its pool.
func (vtCodec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(vtMessage)
	if !ok {
		return protoCodec.Unmarshal(data, v)
	}
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	defer buf.Free()
	return m.UnmarshalVT(buf.ReadOnlyData())
}

// codecDialOption makes a client connection use vtCodec.
func codecDialOption() grpc.DialOption {
	return grpc.WithDefaultCallOptions(grpc.ForceCodecV2(vtCodec{}))
}

// codecServerOption makes a node's gRPC server use vtCodec.
func codecServerOption() grpc.ServerOption {
	return grpc.ForceServerCodecV2(vtCodec{})
}
