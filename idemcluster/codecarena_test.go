package idemcluster

import (
	"bytes"
	"fmt"
	"slices"
	"testing"

	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/protobuf/proto"
)

// The bytes fields a batch's decoding fills in one allocation (the
// requests' ids, fingerprints and tokens; the replies, up to
// replyArenaLimit) hold what the generated decoder gives, also when a
// field occurs twice (merged: a longer second value), and each is capped
// at its own length: appending to one never writes into the next.
func TestBatchBytesArena(t *testing.T) {
	req := &clusterpb.BatchRequest{}
	res := &clusterpb.BatchResponse{}
	for i := range 300 {
		id := bytes.Repeat([]byte{byte('a' + i%26)}, i%40)
		if i%2 == 0 {
			req.Items = append(req.Items, &clusterpb.BatchItem{Call: &clusterpb.BatchItem_Begin{Begin: &clusterpb.BeginRequest{
				Request: &clusterpb.Request{Id: id, Fingerprint: []byte(fmt.Sprint(i))}, Owner: "o", Token: []byte(fmt.Sprintf("token-%d", i))}}})
		} else {
			req.Items = append(req.Items, &clusterpb.BatchItem{Call: &clusterpb.BatchItem_Lookup{Lookup: &clusterpb.LookupRequest{Request: &clusterpb.Request{Id: id}}}})
		}
		// Replies from empty to 3 KiB (above replyArenaLimit/64), 300 of
		// them: more than replyArenaLimit in all.
		res.Results = append(res.Results, &clusterpb.BatchResult{Result: &clusterpb.Result{Reply: bytes.Repeat([]byte{byte(i)}, i*37%3000)}})
	}
	for _, twice := range []bool{false, true} {
		b, err := proto.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		if twice {
			b = append(slices.Clip(b), b...)
		}
		want, got := &clusterpb.BatchRequest{}, &clusterpb.BatchRequest{}
		if err := want.UnmarshalVT(b); err != nil {
			t.Fatal(err)
		}
		if err := unmarshalBatchRequest(b, got); err != nil || !proto.Equal(want, got) {
			t.Fatalf("request (twice %v): %v\n%v\nwant\n%v", twice, err, got, want)
		}
		for i, it := range got.Items {
			var fields [][]byte
			if bg := it.GetBegin(); bg != nil {
				fields = [][]byte{bg.Request.Id, bg.Request.Fingerprint, bg.Token}
			} else {
				fields = [][]byte{it.GetLookup().Request.Id}
			}
			for _, f := range fields {
				_ = append(f, 0xff)
			}
			if !proto.Equal(want.Items[i], it) {
				t.Fatalf("request item %d changed when an earlier field was appended to: %v, want %v", i, it, want.Items[i])
			}
		}

		b, err = proto.Marshal(res)
		if err != nil {
			t.Fatal(err)
		}
		if twice {
			b = append(slices.Clip(b), b...)
		}
		wantRes, gotRes := &clusterpb.BatchResponse{}, &clusterpb.BatchResponse{}
		if err := wantRes.UnmarshalVT(b); err != nil {
			t.Fatal(err)
		}
		if err := unmarshalBatchResponse(b, gotRes); err != nil || !proto.Equal(wantRes, gotRes) {
			t.Fatalf("response (twice %v): %v", twice, err)
		}
		for i, r := range gotRes.Results {
			_ = append(r.Result.Reply, 0xff)
			if !proto.Equal(wantRes.Results[i], r) {
				t.Fatalf("result %d changed when an earlier reply was appended to", i)
			}
		}
	}
}
