package idemcluster

import (
	"bytes"
	"testing"
	"time"

	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// codecCases are messages of every kind a Batch carries, every field set
// (and each oneof case), plus the unary calls' and a message without
// vtprotobuf's methods (the fallback).
func codecCases() []proto.Message {
	at := timestamppb.New(time.Unix(1_700_000_000, 123456789))
	req := &clusterpb.Request{Scope: "s", Id: []byte("id-1"), Client: "c", Seq: 7, Fingerprint: []byte{1, 2, 3},
		Acked: [][]byte{[]byte("a"), {}}, Ttl: durationpb.New(3 * time.Second), KeepReplies: 4, KeepRepliesFor: durationpb.New(time.Minute)}
	claim := &clusterpb.ClaimRef{Scope: "s", Id: []byte("id-1"), Client: "c", Seq: 7, Owner: "o", Token: bytes.Repeat([]byte{9}, 16)}
	detail, _ := anypb.New(&clusterpb.Advance{Scope: "x", Client: "y", Seq: 1})
	big := bytes.Repeat([]byte("r"), 64<<10) // above gRPC's pooling threshold
	return []proto.Message{
		&clusterpb.BatchRequest{Items: []*clusterpb.BatchItem{
			{Call: &clusterpb.BatchItem_Begin{Begin: &clusterpb.BeginRequest{Request: req, Owner: "o", Token: []byte("t")}}},
			{Call: &clusterpb.BatchItem_Commit{Commit: &clusterpb.CommitRequest{Claim: claim, Reply: []byte("ok"),
				Advances: []*clusterpb.Advance{{Scope: "s", Client: "c", Seq: 3}}}}},
			{Call: &clusterpb.BatchItem_Abort{Abort: &clusterpb.AbortRequest{Claim: claim}}},
			{Call: &clusterpb.BatchItem_Lookup{Lookup: &clusterpb.LookupRequest{Request: req, FollowerRead: true}}},
			{Call: &clusterpb.BatchItem_Commit{Commit: &clusterpb.CommitRequest{Claim: claim, Reply: []byte{}}}},
			{},
		}},
		&clusterpb.BatchResponse{Results: []*clusterpb.BatchResult{
			{Result: &clusterpb.Result{Status: clusterpb.Status_STATUS_FRESH, Claim: claim, LeaseUntil: at, Seq: 7}},
			{Result: &clusterpb.Result{Status: clusterpb.Status_STATUS_DONE, Reply: []byte("ok"), CommittedAt: at, ExpiresAt: at}},
			{Status: &clusterpb.ItemStatus{Code: 9, Message: "m", Details: []*anypb.Any{detail}}},
			{},
		}},
		&clusterpb.BatchRequest{Items: []*clusterpb.BatchItem{{Call: &clusterpb.BatchItem_Commit{Commit: &clusterpb.CommitRequest{Claim: claim, Reply: big}}}}},
		&clusterpb.LookupResponse{Result: &clusterpb.Result{Status: clusterpb.Status_STATUS_DONE, Reply: big, CommittedAt: at}},
		&clusterpb.StatusResponse{NodeId: "n1", State: "Leader", Members: []*clusterpb.Member{{NodeId: "n1", Voter: true, Leader: true}}, Term: 2},
		&clusterpb.InDoubtResponse{Claims: []*clusterpb.InDoubtClaim{{Claim: claim, Fingerprint: []byte{1}, ClaimedAt: at, LeaseUntil: at}}},
		&clusterpb.BatchRequest{},
		&emptypb.Empty{},
	}
}

// TestCodecMatchesProto: vtCodec's bytes are what the protobuf runtime
// (gRPC's default codec, and so a client in another language) reads back
// as the same message, and it reads the runtime's bytes as the same
// message: the generated encoder changes the CPU, not the wire.
func TestCodecMatchesProto(t *testing.T) {
	for _, m := range codecCases() {
		name := string(m.ProtoReflect().Descriptor().FullName())
		data, err := vtCodec{}.Marshal(m)
		if err != nil {
			t.Fatalf("%s: vtCodec.Marshal: %v", name, err)
		}
		wire := data.Materialize()
		data.Free()
		back := m.ProtoReflect().New().Interface()
		if err := proto.Unmarshal(wire, back); err != nil {
			t.Fatalf("%s: proto.Unmarshal of vtCodec's bytes: %v", name, err)
		}
		if !proto.Equal(m, back) {
			t.Errorf("%s: vtCodec wrote bytes the protobuf runtime reads as\n%v\nwant\n%v", name, back, m)
		}
		if want, _ := (proto.MarshalOptions{Deterministic: true}).Marshal(m); !bytes.Equal(wire, want) {
			t.Errorf("%s: vtCodec's bytes differ from the protobuf runtime's:\n%x\n%x", name, wire, want)
		}

		in, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		got := m.ProtoReflect().New().Interface()
		if err := (vtCodec{}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(in)}, got); err != nil {
			t.Fatalf("%s: vtCodec.Unmarshal: %v", name, err)
		}
		if !proto.Equal(m, got) {
			t.Errorf("%s: vtCodec read the protobuf runtime's bytes as\n%v\nwant\n%v", name, got, m)
		}
		for i := range in { // the decoded message must not share the (pooled) buffer
			in[i] = 0xff
		}
		if !proto.Equal(m, got) {
			t.Errorf("%s: the message vtCodec decoded changed with the buffer it was read from", name)
		}
	}
}
