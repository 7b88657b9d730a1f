package wal

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/idemdb/idem/internal/msgp"
	"github.com/klauspost/compress/s2"
)

// batchOps is one operation of every kind a batch may hold.
func batchOps() []Op {
	big := bytes.Repeat([]byte("compressible "), 200)
	return []Op{
		{Type: OpClaim, Scope: "s", ID: []byte("a"), Fingerprint: []byte("f"), Acked: [][]byte{[]byte("x")}, Time: 5, LeaseUntil: 9, Flags: ClaimFlagNew},
		{Type: OpCommit, Scope: "s", ID: []byte("a"), Time: 5, Reply: big}, // claimLSN 0: the claim above
		{Type: OpClaim, Scope: "s", Client: "c", Seq: 3, Time: 5, LeaseUntil: 9, ExpiresAt: 7, KeepReplies: 4, KeepFor: 2},
		{Type: OpCommitAdvance, Scope: "s", Client: "c", Seq: 3, Time: 5, Reply: []byte("r"), Advances: []Advance{{Scope: "s", Client: "k", Seq: 8}}},
		{Type: OpAbort, Scope: "s", ID: []byte("b"), ClaimLSN: 17, Time: 5},
		{Type: OpAck, Scope: "s", Acked: [][]byte{[]byte("x"), []byte("y")}, Time: 5},
		{Type: OpAdvance, Advances: []Advance{{Client: "k", Seq: 9}}, Time: 5},
	}
}

// A batch record round-trips every operation kind it may hold, each
// encoded as its own record would be, and EncodeOp and the incremental
// AppendBatchHeader/AppendBatchOp write the same bytes.
func TestBatchRecordRoundTrip(t *testing.T) {
	op := &Op{Type: OpBatch, Time: 5, Ops: batchOps()}
	p, err := EncodeOp(nil, op)
	if err != nil {
		t.Fatal(err)
	}
	d, err := DecodeOp(OpBatch, p)
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(*d) != fmt.Sprint(*op) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", *d, *op)
	}
	inc := AppendBatchHeader(nil, op.Time, len(op.Ops))
	for i := range op.Ops {
		if inc, err = AppendBatchOp(inc, &op.Ops[i]); err != nil {
			t.Fatal(err)
		}
		// Each operation is its own record's encoding after [kind.
		own, _ := EncodeOp(nil, &op.Ops[i])
		if !bytes.HasSuffix(inc, own) {
			t.Fatalf("operation %d is not encoded as its own record", i)
		}
	}
	if !bytes.Equal(inc, p) {
		t.Fatalf("incremental encoding differs from EncodeOp")
	}
	if len(AppendBatchHeader(nil, 1<<62, 1<<20)) > MaxBatchHeader {
		t.Fatalf("MaxBatchHeader %d is too small", MaxBatchHeader)
	}
	// An empty batch.
	p, _ = EncodeOp(nil, &Op{Type: OpBatch, Time: 1})
	if d, err := DecodeOp(OpBatch, p); err != nil || len(d.Ops) != 0 || d.Time != 1 {
		t.Fatalf("empty batch: %+v %v", d, err)
	}
}

// A batch never holds a forget, an expire or another batch: neither
// written nor read.
func TestBatchRefusesKinds(t *testing.T) {
	for _, typ := range []byte{OpForget, OpExpire, OpBatch, 0, 42} {
		if _, err := EncodeOp(nil, &Op{Type: OpBatch, Ops: []Op{{Type: typ}}}); !errors.Is(err, ErrBadRecord) {
			t.Errorf("encode a batch holding kind %d: %v", typ, err)
		}
		p := AppendBatchHeader(nil, 1, 1)
		p = msgp.AppendArrayLen(p, 2)
		p = msgp.AppendUint(p, uint64(typ))
		p = msgp.AppendArrayLen(p, 3)
		p = append(p, 1, 2, 3)
		if _, err := DecodeOp(OpBatch, p); !errors.Is(err, ErrBadRecord) || !strings.Contains(err.Error(), "cannot hold kind") {
			t.Errorf("decode a batch holding kind %d: %v", typ, err)
		}
	}
}

// Decoding a batch is bounded: the operations a header claims must fit
// in the payload and in MaxBatchCost, and the replies of all operations
// share MaxBatchCost, so many small compressed replies claiming 64 MiB
// each cannot make the decoder allocate without bound.
func TestBatchDecodeBounds(t *testing.T) {
	// 10,000 operations claimed, a few bytes present.
	p := AppendBatchHeader(nil, 1, 10000)
	if _, err := DecodeOp(OpBatch, p); !errors.Is(err, ErrBadRecord) {
		t.Fatalf("count beyond the payload: %v", err)
	}
	// Enough bytes, but beyond what MaxBatchCost allows.
	m := MaxBatchCost/BatchOpCost + 1
	p = AppendBatchHeader(nil, 1, m)
	p = append(p, make([]byte, m)...)
	if _, err := DecodeOp(OpBatch, p); err == nil || !strings.Contains(err.Error(), "exceed the limit") {
		t.Fatalf("count beyond MaxBatchCost: %v", err)
	}
	// Commits whose S2 replies claim 40 MiB each: the first fits, the
	// second exceeds what the batch has left.
	bomb := s2.Encode(nil, make([]byte, 40<<20))
	ops := []Op{{Type: OpCommit, ID: []byte("a"), Reply: make([]byte, 40<<20)}, {Type: OpCommit, ID: []byte("b"), Reply: make([]byte, 40<<20)}}
	p, err := EncodeOp(nil, &Op{Type: OpBatch, Ops: ops})
	if err != nil {
		t.Fatal(err)
	}
	if len(p) > 2*len(bomb)+100 {
		t.Fatalf("replies not compressed: %d bytes", len(p))
	}
	if _, err := DecodeOp(OpBatch, p); err == nil || !strings.Contains(err.Error(), "exceeds limit") {
		t.Fatalf("replies beyond MaxBatchCost: %v", err)
	}
	// One alone decodes.
	p, _ = EncodeOp(nil, &Op{Type: OpBatch, Ops: ops[:1]})
	if d, err := DecodeOp(OpBatch, p); err != nil || len(d.Ops[0].Reply) != 40<<20 {
		t.Fatalf("one 40 MiB reply: %v", err)
	}
	if BatchCost(&ops[0]) != BatchOpCost+40<<20 {
		t.Fatalf("BatchCost %d", BatchCost(&ops[0]))
	}
}
