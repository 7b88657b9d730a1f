package wal

import (
	"fmt"
	"testing"
)

// A sequence-mode claim carries its reply window (keepReplies, keepFor);
// claims without one keep their earlier forms byte for byte.
func TestClaimWindowFields(t *testing.T) {
	for _, op := range []*Op{
		{Type: OpClaim, Scope: "s", Client: "c", Seq: 7, Time: 1, LeaseUntil: 2, KeepReplies: 10000, KeepFor: 300e9},
		{Type: OpClaim, Scope: "s", Client: "c", Seq: 7, Time: 1, LeaseUntil: 2, ExpiresAt: 9, KeepReplies: 2},
		{Type: OpClaim, Scope: "s", Client: "c", Seq: 7, Time: 1, LeaseUntil: 2, KeepFor: 5},
	} {
		p, err := EncodeOp(nil, op)
		if err != nil {
			t.Fatal(err)
		}
		if p[0] != 0x90|12 {
			t.Fatalf("claim with a window: header %#x, want 12 fields", p[0])
		}
		d, err := DecodeOp(OpClaim, p)
		if err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(*d) != fmt.Sprint(*op) {
			t.Fatalf("round trip:\n got %+v\nwant %+v", *d, *op)
		}
	}
	for _, c := range []struct {
		op     *Op
		fields byte
	}{
		{&Op{Type: OpClaim, Scope: "s", Client: "c", Seq: 7, Time: 1}, 9},
		{&Op{Type: OpClaim, Scope: "s", Client: "c", Seq: 7, Time: 1, ExpiresAt: 3}, 10},
	} {
		p, err := EncodeOp(nil, c.op)
		if err != nil {
			t.Fatal(err)
		}
		if p[0] != 0x90|c.fields {
			t.Fatalf("claim %+v: header %#x, want %d fields", *c.op, p[0], c.fields)
		}
	}
}
