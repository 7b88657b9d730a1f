package idemcluster

import (
	"bytes"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
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

// TestCodecChecksEveryString: every string field a Batch message holds,
// set to bytes that are not UTF-8, is refused by vtCodec as by the
// protobuf runtime, both when it encodes and when it decodes (the
// generated code does not check them; a string field added to the
// protocol fails here until checkBatchRequest or checkBatchResponse
// checks it).
func TestCodecChecksEveryString(t *testing.T) {
	for _, root := range []proto.Message{&clusterpb.BatchRequest{}, &clusterpb.BatchResponse{}} {
		for _, path := range stringFields(root.ProtoReflect().Descriptor(), nil, map[protoreflect.FullName]bool{}) {
			m := root.ProtoReflect().New()
			setPath(m, path, "\xffbad")
			name := fmt.Sprintf("%s.%s", root.ProtoReflect().Descriptor().Name(), pathName(path))
			if _, err := proto.Marshal(m.Interface()); err == nil {
				t.Fatalf("%s: the protobuf runtime encodes it (the test's premise)", name)
			}
			if _, err := (vtCodec{}).Marshal(m.Interface()); err == nil {
				t.Errorf("%s: vtCodec encodes a string that is not UTF-8; the default codec refuses it", name)
			}
			wire, err := m.Interface().(vtMessage).(interface{ MarshalVT() ([]byte, error) }).MarshalVT()
			if err != nil {
				t.Fatal(err)
			}
			if err := proto.Unmarshal(wire, root.ProtoReflect().New().Interface()); err == nil {
				t.Fatalf("%s: the protobuf runtime decodes it (the test's premise)", name)
			}
			if err := (vtCodec{}).Unmarshal(mem.BufferSlice{mem.SliceBuffer(wire)}, root.ProtoReflect().New().Interface()); err == nil {
				t.Errorf("%s: vtCodec decodes a string that is not UTF-8; the default codec refuses it", name)
			}
		}
	}
}

// stringFields are the paths to every string field under md.
func stringFields(md protoreflect.MessageDescriptor, path []protoreflect.FieldDescriptor, seen map[protoreflect.FullName]bool) [][]protoreflect.FieldDescriptor {
	if seen[md.FullName()] {
		return nil
	}
	seen[md.FullName()] = true
	defer delete(seen, md.FullName())
	var out [][]protoreflect.FieldDescriptor
	fs := md.Fields()
	for i := range fs.Len() {
		f := fs.Get(i)
		p := append(slices.Clip(path), f)
		switch f.Kind() {
		case protoreflect.StringKind:
			out = append(out, p)
		case protoreflect.MessageKind:
			out = append(out, stringFields(f.Message(), p, seen)...)
		}
	}
	return out
}

// setPath sets the string at path under m (one element of each list).
func setPath(m protoreflect.Message, path []protoreflect.FieldDescriptor, s string) {
	f := path[0]
	if len(path) == 1 {
		if f.IsList() {
			m.Mutable(f).List().Append(protoreflect.ValueOfString(s))
		} else {
			m.Set(f, protoreflect.ValueOfString(s))
		}
		return
	}
	if f.IsList() {
		l := m.Mutable(f).List()
		e := l.NewElement()
		setPath(e.Message(), path[1:], s)
		l.Append(e)
		return
	}
	setPath(m.Mutable(f).Message(), path[1:], s)
}

func pathName(path []protoreflect.FieldDescriptor) string {
	var names []string
	for _, f := range path {
		names = append(names, string(f.Name()))
	}
	return strings.Join(names, ".")
}

// FuzzBatchDecode: the slab decoders of the Batch messages
// (unmarshalBatchRequest, unmarshalBatchResponse) give what the generated
// decoder gives, on any bytes: the same message (fields absent on the
// wire stay nil) or an error in both. The seeds run in every go test;
// go test -fuzz FuzzBatchDecode ./idemcluster/ searches further.
func FuzzBatchDecode(f *testing.F) {
	for _, m := range codecCases() {
		if b, err := proto.Marshal(m); err == nil {
			f.Add(b)
			f.Add(append(slices.Clip(b), b...)) // every field twice: merged
			if len(b) > 3 {
				f.Add(b[:len(b)-3]) // torn
			}
		}
	}
	f.Add([]byte{0x0a, 0x02, 0x22, 0x00})                   // a Lookup without its request
	f.Add([]byte{0x0a, 0x04, 0x22, 0x02, 0x10, 0x01})       // a Lookup with follower_read only
	f.Add([]byte{0x0a, 0x02, 0x12, 0x00, 0x12, 0x01, 0x00}) // a Commit without its claim; field 2 of BatchRequest
	f.Add([]byte{0x0a, 0x06, 0x12, 0x02, 0x2a, 0x00, 0x1a, 0x00})
	f.Fuzz(func(t *testing.T, b []byte) {
		wantReq, gotReq := &clusterpb.BatchRequest{}, &clusterpb.BatchRequest{}
		werr, gerr := wantReq.UnmarshalVT(b), unmarshalBatchRequest(b, gotReq)
		if (werr == nil) != (gerr == nil) {
			t.Fatalf("BatchRequest % x: generated decoder: %v; slab decoder: %v", b, werr, gerr)
		}
		if werr == nil && !proto.Equal(wantReq, gotReq) {
			t.Fatalf("BatchRequest % x: generated decoder:\n%v\nslab decoder:\n%v", b, wantReq, gotReq)
		}
		wantRes, gotRes := &clusterpb.BatchResponse{}, &clusterpb.BatchResponse{}
		werr, gerr = wantRes.UnmarshalVT(b), unmarshalBatchResponse(b, gotRes)
		if (werr == nil) != (gerr == nil) {
			t.Fatalf("BatchResponse % x: generated decoder: %v; slab decoder: %v", b, werr, gerr)
		}
		if werr == nil && !proto.Equal(wantRes, gotRes) {
			t.Fatalf("BatchResponse % x: generated decoder:\n%v\nslab decoder:\n%v", b, wantRes, gotRes)
		}
	})
}
