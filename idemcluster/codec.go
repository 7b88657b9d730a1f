package idemcluster

import (
	"errors"
	"fmt"
	"slices"
	"unicode/utf8"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	_ "google.golang.org/grpc/encoding/proto" // registers the default codec, the fallback below
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/idemdb/idem/idemcluster/clusterpb"
)

// vtCodec is the gRPC codec of the client and the nodes: protobuf, the
// same bytes on the wire, but the Batch RPC's messages (BatchRequest,
// BatchResponse: every call a client batches) are encoded and decoded by
// their generated MarshalVT and UnmarshalVT (planetscale/vtprotobuf,
// cluster_vtproto.pb.go) instead of the protobuf runtime's reflection:
// per call, a Batch item's messages were decoded twice and sized twice
// that way, a fifth of a duplicate's CPU (BenchmarkClusterDuplicate).
// Every other message (the unary calls', gRPC reflection's) goes to gRPC's
// default proto codec. The generated code does not check that string
// fields hold UTF-8, as the runtime does (proto3), so vtCodec checks the
// Batch messages' strings itself (checkBatchRequest, checkBatchResponse):
// a message the default codec refuses, it refuses too. It is set per
// connection and per server (codecDialOption, codecServerOption), not
// registered globally, so nothing else in the process changes; it keeps
// the name "proto", the content-subtype a client in any language sends.
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
	var err error
	switch v := v.(type) {
	case *clusterpb.BatchRequest:
		err = checkBatchRequest(v)
	case *clusterpb.BatchResponse:
		err = checkBatchResponse(v)
	default:
		return protoCodec.Marshal(v)
	}
	if err != nil {
		return nil, fmt.Errorf("proto: failed to marshal: %w", err)
	}
	m := v.(vtMessage)
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
	var decode func(b []byte) error
	switch m := v.(type) {
	case *clusterpb.BatchRequest:
		decode = func(b []byte) error {
			if err := unmarshalBatchRequest(b, m); err != nil {
				return err
			}
			return checkBatchRequest(m)
		}
	case *clusterpb.BatchResponse:
		decode = func(b []byte) error {
			if err := unmarshalBatchResponse(b, m); err != nil {
				return err
			}
			return checkBatchResponse(m)
		}
	default:
		return protoCodec.Unmarshal(data, v)
	}
	buf := data.MaterializeToBuffer(mem.DefaultBufferPool())
	defer buf.Free()
	if err := decode(buf.ReadOnlyData()); err != nil {
		return fmt.Errorf("proto: failed to unmarshal: %w", err)
	}
	return nil
}

// errInvalidUTF8 is a string field that is not UTF-8 (the protobuf
// runtime's "string field contains invalid UTF-8").
var errInvalidUTF8 = errors.New("string field contains invalid UTF-8")

// utf8Strings is nil when every s is UTF-8.
func utf8Strings(s ...string) error {
	for _, s := range s {
		if !utf8.ValidString(s) {
			return fmt.Errorf("%w: %q", errInvalidUTF8, s)
		}
	}
	return nil
}

// checkBatchRequest checks the string fields of m's messages (every
// string field that a BatchRequest holds: TestCodecChecksEveryString).
func checkBatchRequest(m *clusterpb.BatchRequest) error {
	for _, it := range m.Items {
		var err error
		switch c := it.GetCall().(type) {
		case *clusterpb.BatchItem_Begin:
			err = errors.Join(checkRequest(c.Begin.GetRequest()), utf8Strings(c.Begin.GetOwner()))
		case *clusterpb.BatchItem_Commit:
			err = checkClaimRef(c.Commit.GetClaim())
			for _, a := range c.Commit.GetAdvances() {
				err = errors.Join(err, utf8Strings(a.GetScope(), a.GetClient()))
			}
		case *clusterpb.BatchItem_Abort:
			err = checkClaimRef(c.Abort.GetClaim())
		case *clusterpb.BatchItem_Lookup:
			err = checkRequest(c.Lookup.GetRequest())
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// checkBatchResponse is checkBatchRequest for a BatchResponse.
func checkBatchResponse(m *clusterpb.BatchResponse) error {
	for _, r := range m.Results {
		if err := checkClaimRef(r.GetResult().GetClaim()); err != nil {
			return err
		}
		st := r.GetStatus()
		if err := utf8Strings(st.GetMessage()); err != nil {
			return err
		}
		for _, d := range st.GetDetails() {
			if err := utf8Strings(d.GetTypeUrl()); err != nil {
				return err
			}
		}
	}
	return nil
}

func checkRequest(r *clusterpb.Request) error { return utf8Strings(r.GetScope(), r.GetClient()) }

func checkClaimRef(r *clusterpb.ClaimRef) error {
	return utf8Strings(r.GetScope(), r.GetClient(), r.GetOwner())
}

// codecDialOption makes a client connection use vtCodec.
func codecDialOption() grpc.DialOption {
	return grpc.WithDefaultCallOptions(grpc.ForceCodecV2(vtCodec{}))
}

// codecServerOption makes a node's gRPC server use vtCodec.
func codecServerOption() grpc.ServerOption {
	return grpc.ForceServerCodecV2(vtCodec{})
}

// A Batch's messages are decoded into slabs: its items (or results), by
// kind, in one allocation per kind and batch instead of four or five
// per item (the item, its oneof wrapper, its request, the nested request
// or claim; a result, its Result, its timestamps), which at 64 calls per
// batch were a third of a duplicate's allocations. The generated decoder
// fills a message that is already there (it merges, as protobuf does), so
// the slab's messages are put in place first, each only where the bytes
// hold that field: a field absent on the wire stays nil, as the generated
// decoder leaves it (FuzzBatchDecode compares the two). Anything else (a
// field the batch messages do not have, bytes that do not parse) goes to
// the generated decoder as a whole.

// fieldsPresent is the set of field numbers (below 64) that b, a
// message's bytes, holds as length-delimited fields; ok is false when b
// does not parse.
func fieldsPresent(b []byte) (set uint64, ok bool) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return 0, false
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			return 0, false
		}
		if typ == protowire.BytesType && num < 64 {
			set |= 1 << num
		}
		b = b[n+m:]
	}
	return set, true
}

// has reports whether set (fieldsPresent) holds field num.
func has(set uint64, num protowire.Number) bool { return set&(1<<num) != 0 }

// repeatedField calls f with the value of each occurrence of field 1, a
// repeated message, in b; ok is false when b holds anything else or does
// not parse.
func repeatedField(b []byte, f func(v []byte)) (ok bool) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 || num != 1 || typ != protowire.BytesType {
			return false
		}
		v, m := protowire.ConsumeBytes(b[n:])
		if m < 0 {
			return false
		}
		f(v)
		b = b[n+m:]
	}
	return true
}

// firstField is the number and value of b's first field when it is
// length-delimited (0 otherwise).
func firstField(b []byte) (protowire.Number, []byte) {
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 || typ != protowire.BytesType {
		return 0, nil
	}
	v, m := protowire.ConsumeBytes(b[n:])
	if m < 0 {
		return 0, nil
	}
	return num, v
}

// Slabs of a BatchRequest's items, one kind each.
type (
	beginSlab struct {
		item clusterpb.BatchItem
		call clusterpb.BatchItem_Begin
		in   clusterpb.BeginRequest
		req  clusterpb.Request
	}
	commitSlab struct {
		item  clusterpb.BatchItem
		call  clusterpb.BatchItem_Commit
		in    clusterpb.CommitRequest
		claim clusterpb.ClaimRef
	}
	abortSlab struct {
		item  clusterpb.BatchItem
		call  clusterpb.BatchItem_Abort
		in    clusterpb.AbortRequest
		claim clusterpb.ClaimRef
	}
	lookupSlab struct {
		item clusterpb.BatchItem
		call clusterpb.BatchItem_Lookup
		in   clusterpb.LookupRequest
		req  clusterpb.Request
	}
)

// unmarshalBatchRequest is m.UnmarshalVT(b) into slabs (m is new).
func unmarshalBatchRequest(b []byte, m *clusterpb.BatchRequest) error {
	var n [5]int // items by the number of their first field (0: other)
	if !repeatedField(b, func(v []byte) {
		if k, _ := firstField(v); k >= 1 && k <= 4 {
			n[k]++
		} else {
			n[0]++
		}
	}) {
		return m.UnmarshalVT(b)
	}
	var (
		begins  = make([]beginSlab, n[1])
		commits = make([]commitSlab, n[2])
		aborts  = make([]abortSlab, n[3])
		lookups = make([]lookupSlab, n[4])
		err     error
	)
	m.Items = slices.Grow(m.Items, n[0]+n[1]+n[2]+n[3]+n[4])
	repeatedField(b, func(v []byte) {
		if err != nil {
			return
		}
		var it *clusterpb.BatchItem
		k, call := firstField(v)
		set, _ := fieldsPresent(call) // !ok: the item's decoding reports it
		switch k {
		case 1:
			s := &begins[0]
			begins = begins[1:]
			if has(set, 1) {
				s.in.Request = &s.req
			}
			s.call.Begin, s.item.Call, it = &s.in, &s.call, &s.item
		case 2:
			s := &commits[0]
			commits = commits[1:]
			if has(set, 1) {
				s.in.Claim = &s.claim
			}
			s.call.Commit, s.item.Call, it = &s.in, &s.call, &s.item
		case 3:
			s := &aborts[0]
			aborts = aborts[1:]
			if has(set, 1) {
				s.in.Claim = &s.claim
			}
			s.call.Abort, s.item.Call, it = &s.in, &s.call, &s.item
		case 4:
			s := &lookups[0]
			lookups = lookups[1:]
			if has(set, 1) {
				s.in.Request = &s.req
			}
			s.call.Lookup, s.item.Call, it = &s.in, &s.call, &s.item
		default:
			it = &clusterpb.BatchItem{}
		}
		err = it.UnmarshalVT(v)
		m.Items = append(m.Items, it)
	})
	return err
}

// resultSlab is a BatchResponse's result with its messages (not its
// claim, which only a Fresh Begin's has: a slab of 64 with one each was
// half again as large, all of it zeroed).
type resultSlab struct {
	out   clusterpb.BatchResult
	res   clusterpb.Result
	times [3]timestamppb.Timestamp // lease_until, committed_at, expires_at
}

// fieldValue is the value of the first occurrence of field num in b, a
// message's bytes, when it is length-delimited (nil otherwise).
func fieldValue(b []byte, num protowire.Number) []byte {
	for len(b) > 0 {
		k, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil
		}
		if k == num && typ == protowire.BytesType {
			v, _ := protowire.ConsumeBytes(b[n:])
			return v
		}
		m := protowire.ConsumeFieldValue(k, typ, b[n:])
		if m < 0 {
			return nil
		}
		b = b[n+m:]
	}
	return nil
}

// unmarshalBatchResponse is m.UnmarshalVT(b) into slabs (m is new).
func unmarshalBatchResponse(b []byte, m *clusterpb.BatchResponse) error {
	n := 0
	if !repeatedField(b, func([]byte) { n++ }) {
		return m.UnmarshalVT(b)
	}
	slabs := make([]resultSlab, n)
	m.Results = slices.Grow(m.Results, n)
	var err error
	repeatedField(b, func(v []byte) {
		if err != nil {
			return
		}
		s := &slabs[0]
		slabs = slabs[1:]
		if set, _ := fieldsPresent(v); has(set, 2) {
			s.out.Result = &s.res
			// The first occurrence's fields (a repeat merges into them).
			rset, _ := fieldsPresent(fieldValue(v, 2))
			if has(rset, 4) {
				s.res.LeaseUntil = &s.times[0]
			}
			if has(rset, 5) {
				s.res.CommittedAt = &s.times[1]
			}
			if has(rset, 7) {
				s.res.ExpiresAt = &s.times[2]
			}
		}
		err = s.out.UnmarshalVT(v)
		m.Results = append(m.Results, &s.out)
	})
	return err
}
