package wal

// The record vocabulary: what idem writes into WAL frames.
//
// Every operation that changes the dedup set is one WAL record. The frame
// type byte (see doc.go) is the operation kind; the payload is a msgpack array
// whose fields depend on the kind. The numbers and field orders below are
// frozen wire format: add new kinds or append fields, never reorder.
//
//	OpClaim  (1): [scope, id, client, seq, fingerprint, acked[], time, leaseUntil, flags, expiresAt,
//	               keepReplies, keepFor]
//	OpCommit (2): [scope, id, client, seq, claimLSN, time, replyCodec, reply]
//	OpAbort  (3): [scope, id, client, seq, claimLSN, time]
//	OpAck    (4): [scope, ids[], time]
//	OpForget (5): [before, time, reason]
//	OpExpire (6): [keys[], time]
//	OpCommitAdvance (7): [scope, id, client, seq, claimLSN, time, replyCodec, reply, advances[]]
//	                     advance = [scope, client, seq]
//	OpAdvance (8): [advances[], time]
//	OpBatch   (9): [time, ops[]]
//	                 op = [kind, fields[]]: kind is 1, 2, 3, 4, 7 or 8 and fields
//	                 that kind's array, exactly as its own record holds it
//
// A claim's expiresAt (appended in format 2; absent or 0 = never) is when
// the request's per-request TTL runs out. An expire record names the index
// entry keys (opaque to this package) whose TTL ran out: each loses its
// reply, as a forget would remove it.
//
// A sequence-mode claim's keepReplies and keepFor (appended in format 3;
// absent or 0 = the latest reply only) are the client's reply window:
// when the claim commits, the replies of the last keepReplies sequence
// numbers are kept, each older one while younger than keepFor ns (0 = no
// age bound). The index decides from them, in the commit's own
// transition, which older replies move to their own keys and which go, so
// replay and replicas keep exactly the replies the engine kept. A claim
// with a window writes expiresAt too (0 when it has no TTL).
//
// A commit-advance record is a commit that also raises, in the same record
// and so atomically with it, the last committed sequence number of each
// named sequence-mode client to at least its seq (a commit frontier kept
// with the effect). It has its own kind, not a field appended to commit,
// so that a version that does not know it refuses the log instead of
// skipping the advances. An advance record raises clients alone (a
// position whose effect was committed earlier, by another record).
//
// A batch record is many operations applied in order as one atomic step:
// one frame, one CRC, so after a crash a batch is there whole or not at
// all. Its operations are claims, commits, commit-advances, aborts, acks
// and advances (never a forget, an expire or another batch). Every claim
// of a batch takes the batch record's LSN as its claim LSN (claims of
// different keys may share it: fencing compares per key), and a commit,
// commit-advance or abort whose claimLSN is 0 finishes the claim made
// earlier in the same record: claim and commit of one request in one
// record, with no claim ever visible alone. It is a kind of its own, so a
// version that does not know it refuses the log instead of misreading it.
// Decoding bounds what a batch may allocate: BatchOpCost per operation plus
// its decompressed reply, at most MaxBatchCost per record (the engine
// splits a larger batch into several records, each whole).
//
// Times are Unix nanoseconds taken from the engine's clock when the record was
// appended, so that replay never consults the clock. An id-mode request has a
// non-empty id and empty client; a sequence-mode request has a client and a
// seq >= 1 and an empty id.
//
// Large replies are compressed with S2 (github.com/klauspost/compress/s2) and
// flagged with replyCodec = 1. S2 was chosen over zstd because it compresses
// and decompresses at several GB/s on one core, which keeps it off the
// critical path of Commit; see BenchmarkReplyCodec for the measurement.

import (
	"bytes"
	"errors"
	"fmt"
	"unsafe"

	"github.com/idemdb/idem/internal/msgp"
	"github.com/klauspost/compress/s2"
	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// Operation kinds, stored as the frame type byte. Frozen.
const (
	OpClaim  byte = 1
	OpCommit byte = 2
	OpAbort  byte = 3
	OpAck    byte = 4
	OpForget byte = 5
	OpExpire byte = 6
	// OpCommitAdvance is a commit that also advances sequence-mode clients.
	OpCommitAdvance byte = 7
	// OpAdvance raises sequence-mode clients without a commit.
	OpAdvance byte = 8
	// OpBatch is many claims, commits, commit-advances, aborts, acks and
	// advances applied in order as one atomic step.
	OpBatch byte = 9
)

// InBatch says whether an operation of kind t may be part of a batch
// record.
func InBatch(t byte) bool {
	switch t {
	case OpClaim, OpCommit, OpCommitAdvance, OpAbort, OpAck, OpAdvance:
		return true
	}
	return false
}

// Forget reasons. Frozen.
const (
	ForgetAdmin     byte = 0 // Engine.Forget
	ForgetRetention byte = 1 // Options.Retention expiry
	ForgetCapacity  byte = 2 // Options.MaxEntries eviction
)

// Claim flags. Frozen.
const (
	// ClaimFlagNew says that the claimed key held no entry (after applying
	// forget marks) when the claim was made, so replay need not look it up.
	ClaimFlagNew uint64 = 1 << 0
)

// Reply codecs. Frozen.
const (
	codecRaw = 0
	codecS2  = 1
)

// CompressThreshold is the reply size from which replies are compressed in
// the WAL (when compression actually saves space).
const CompressThreshold = 1024

// Limits enforced on decode so that no input makes the decoder allocate
// without bound. They are generous: the engine validates requests against
// much tighter limits (see the root package).
const (
	maxFieldLen   = 64 << 20 // any single byte string
	maxAckedIDs   = 1 << 16  // acked ids in one record
	maxAdvances   = 1 << 16  // advances in one record
	maxReplyBytes = 64 << 20 // decompressed reply
)

// ErrBadRecord is wrapped by every decode error.
var ErrBadRecord = errors.New("wal: bad record")

// Op is one decoded operation. Which fields are meaningful depends on Type.
type Op struct {
	Type        byte
	Scope       string
	ID          []byte
	Client      string
	Seq         uint64
	Fingerprint []byte    // claim: nil when the request carried none
	Acked       [][]byte  // claim, ack: ids removed from the dedup set
	Time        int64     // unix nanoseconds, from the engine clock
	LeaseUntil  int64     // claim: unix nanoseconds
	Flags       uint64    // claim: ClaimFlag*
	ClaimLSN    LSN       // commit, abort: the claim being finished
	Reply       []byte    // commit
	Before      int64     // forget: entries committed before this time go
	Reason      byte      // forget: ForgetAdmin, ForgetRetention or ForgetCapacity
	ExpiresAt   int64     // claim: unix nanoseconds when the entry's TTL runs out; 0 = never
	Keys        [][]byte  // expire: index entry keys whose TTL ran out
	Advances    []Advance // commit-advance: clients raised with the commit
	KeepReplies uint64    // claim (sequence mode): reply window, in sequence numbers; 0 and 1 = the latest only
	KeepFor     int64     // claim (sequence mode): age bound of the older replies, ns; 0 = none
	Ops         []Op      // batch: the operations, in order (see InBatch)
}

// BatchOpCost is what decoding one operation of a batch record may
// allocate besides its byte strings: the Op itself, rounded up.
const BatchOpCost = int(unsafe.Sizeof(Op{})) + 32

// MaxBatchCost bounds the decoded size of one batch record: BatchOpCost
// per operation plus the decompressed size of its replies. A writer keeps
// each batch record within it (see BatchCost); DecodeOp refuses a record
// beyond it, so a small payload full of compressed replies cannot make the
// decoder allocate without bound.
const MaxBatchCost = maxReplyBytes

// BatchCost is what op, as an operation of a batch record, counts against
// MaxBatchCost.
func BatchCost(op *Op) int { return BatchOpCost + len(op.Reply) }

// Advance raises a sequence-mode client's last committed number to at
// least Seq (it never lowers it).
type Advance struct {
	Scope  string
	Client string
	Seq    uint64
}

// OpName is the readable name of an operation kind.
func OpName(t byte) string {
	switch t {
	case OpClaim:
		return "claim"
	case OpCommit:
		return "commit"
	case OpAbort:
		return "abort"
	case OpAck:
		return "ack"
	case OpForget:
		return "forget"
	case OpExpire:
		return "expire"
	case OpCommitAdvance:
		return "commit-advance"
	case OpAdvance:
		return "advance"
	case OpBatch:
		return "batch"
	}
	return fmt.Sprintf("unknown(%d)", t)
}

// EncodeOp appends the payload of op to dst and returns it.
func EncodeOp(dst []byte, op *Op) ([]byte, error) {
	switch op.Type {
	case OpClaim:
		// expiresAt is written only when set (or a window follows), and the
		// window only when set, so claims without a TTL or a window keep
		// the 9-field form (byte for byte what format 1 wrote).
		n := 9
		window := op.KeepReplies != 0 || op.KeepFor != 0
		if window {
			n = 12
		} else if op.ExpiresAt != 0 {
			n = 10
		}
		dst = msgp.AppendArrayLen(dst, n)
		dst = appendKey(dst, op)
		dst = msgp.AppendBytes(dst, op.Fingerprint)
		dst = appendIDs(dst, op.Acked)
		dst = msgp.AppendInt(dst, op.Time)
		dst = msgp.AppendInt(dst, op.LeaseUntil)
		dst = msgp.AppendUint(dst, op.Flags)
		if n >= 10 {
			dst = msgp.AppendInt(dst, op.ExpiresAt)
		}
		if window {
			dst = msgp.AppendUint(dst, op.KeepReplies)
			dst = msgp.AppendInt(dst, op.KeepFor)
		}
	case OpCommit, OpCommitAdvance:
		n := 8
		if op.Type == OpCommitAdvance {
			n = 9
		}
		dst = msgp.AppendArrayLen(dst, n)
		dst = appendKey(dst, op)
		dst = msgp.AppendUint(dst, uint64(op.ClaimLSN))
		dst = msgp.AppendInt(dst, op.Time)
		reply, codec := compressReply(op.Reply)
		dst = msgp.AppendUint(dst, uint64(codec))
		dst = msgp.AppendBytes(dst, reply)
		if op.Type == OpCommitAdvance {
			dst = appendAdvances(dst, op.Advances)
		}
	case OpAdvance:
		dst = msgp.AppendArrayLen(dst, 2)
		dst = appendAdvances(dst, op.Advances)
		dst = msgp.AppendInt(dst, op.Time)
	case OpAbort:
		dst = msgp.AppendArrayLen(dst, 6)
		dst = appendKey(dst, op)
		dst = msgp.AppendUint(dst, uint64(op.ClaimLSN))
		dst = msgp.AppendInt(dst, op.Time)
	case OpAck:
		dst = msgp.AppendArrayLen(dst, 3)
		dst = msgp.AppendString(dst, op.Scope)
		dst = appendIDs(dst, op.Acked)
		dst = msgp.AppendInt(dst, op.Time)
	case OpForget:
		dst = msgp.AppendArrayLen(dst, 3)
		dst = msgp.AppendInt(dst, op.Before)
		dst = msgp.AppendInt(dst, op.Time)
		dst = msgp.AppendUint(dst, uint64(op.Reason))
	case OpExpire:
		dst = msgp.AppendArrayLen(dst, 2)
		dst = appendIDs(dst, op.Keys)
		dst = msgp.AppendInt(dst, op.Time)
	case OpBatch:
		dst = AppendBatchHeader(dst, op.Time, len(op.Ops))
		for i := range op.Ops {
			var err error
			if dst, err = AppendBatchOp(dst, &op.Ops[i]); err != nil {
				return dst, fmt.Errorf("batch operation %d: %w", i, err)
			}
		}
	default:
		return dst, fmt.Errorf("%w: cannot encode kind %d", ErrBadRecord, op.Type)
	}
	return dst, nil
}

// AppendBatchHeader appends the head of a batch record's payload: its
// time and the array header of its n operations, which AppendBatchOp
// appends after it. (A writer that learns n only at the end reserves
// MaxBatchHeader bytes and writes the head right-aligned in front of the
// operations.)
func AppendBatchHeader(dst []byte, time int64, n int) []byte {
	dst = msgp.AppendArrayLen(dst, 2)
	dst = msgp.AppendInt(dst, time)
	return msgp.AppendArrayLen(dst, n)
}

// MaxBatchHeader is the largest head AppendBatchHeader writes.
const MaxBatchHeader = 1 + 9 + 5

// AppendBatchOp appends op as one operation of a batch record:
// [kind, fields[]].
func AppendBatchOp(dst []byte, op *Op) ([]byte, error) {
	if !InBatch(op.Type) {
		return dst, fmt.Errorf("%w: a batch cannot hold a %s record", ErrBadRecord, OpName(op.Type))
	}
	dst = msgp.AppendArrayLen(dst, 2)
	dst = msgp.AppendUint(dst, uint64(op.Type))
	return EncodeOp(dst, op)
}

func appendKey(dst []byte, op *Op) []byte {
	dst = msgp.AppendString(dst, op.Scope)
	dst = msgp.AppendBytes(dst, op.ID)
	dst = msgp.AppendString(dst, op.Client)
	return msgp.AppendUint(dst, op.Seq)
}

func appendAdvances(dst []byte, adv []Advance) []byte {
	dst = msgp.AppendArrayLen(dst, len(adv))
	for _, a := range adv {
		dst = msgp.AppendArrayLen(dst, 3)
		dst = msgp.AppendString(dst, a.Scope)
		dst = msgp.AppendString(dst, a.Client)
		dst = msgp.AppendUint(dst, a.Seq)
	}
	return dst
}

func appendIDs(dst []byte, ids [][]byte) []byte {
	dst = msgp.AppendArrayLen(dst, len(ids))
	for _, id := range ids {
		dst = msgp.AppendBytes(dst, id)
	}
	return dst
}

// compressReply returns the bytes to store and their codec. Small or
// incompressible replies are stored raw.
func compressReply(r []byte) ([]byte, int) {
	if len(r) < CompressThreshold {
		return r, codecRaw
	}
	c := s2.Encode(nil, r)
	if len(c) >= len(r)-len(r)/8 {
		return r, codecRaw
	}
	return c, codecS2
}

// DecodeOp parses the payload of a frame of kind typ. It never panics and
// never allocates more than a small multiple of len(payload) plus
// maxReplyBytes (a compressed reply; for a batch record, MaxBatchCost for
// its operations and their replies together).
func DecodeOp(typ byte, payload []byte) (op *Op, err error) {
	if fieldsOf(typ) == 0 && typ != OpBatch {
		return nil, fmt.Errorf("%w: unknown kind %d", ErrBadRecord, typ)
	}
	d := msgpack.GetDecoder()
	defer msgpack.PutDecoder(d)
	br := bytes.NewReader(payload)
	d.Reset(br)
	op = &Op{}
	r := &reader{d: d, br: br, left: len(payload), budget: MaxBatchCost}
	if typ == OpBatch {
		r.batch(op)
	} else {
		r.op(op, typ)
	}
	if r.err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrBadRecord, OpName(typ), r.err)
	}
	return op, nil
}

// fieldsOf is the number of fields the first version of kind typ wrote
// (0: not an operation kind; a batch is decoded by reader.batch).
func fieldsOf(typ byte) int {
	switch typ {
	case OpClaim, OpCommitAdvance:
		return 9
	case OpCommit:
		return 8
	case OpAbort:
		return 6
	case OpAck, OpForget:
		return 3
	case OpExpire, OpAdvance:
		return 2
	}
	return 0
}

// batch decodes a batch record's payload into op: [time, ops[]], each
// operation [kind, fields[]]. Its operations and their replies are
// charged against r.budget before they are allocated.
func (r *reader) batch(op *Op) {
	op.Type = OpBatch
	n := r.arrayLen()
	if r.err == nil && n < 2 {
		r.err = fmt.Errorf("batch has %d fields, want 2", n)
		return
	}
	op.Time = r.int()
	m := r.arrayLen()
	if r.err != nil {
		return
	}
	if m > r.budget/BatchOpCost {
		r.err = fmt.Errorf("%d operations exceed the limit of %d", m, MaxBatchCost/BatchOpCost)
		return
	}
	r.budget -= m * BatchOpCost
	if m > 0 {
		op.Ops = make([]Op, m)
	}
	for i := 0; i < m && r.err == nil; i++ {
		if k := r.arrayLen(); r.err == nil && k != 2 {
			r.err = fmt.Errorf("operation %d has %d elements, want 2 (kind, fields)", i, k)
			return
		}
		kind := r.uint()
		if r.err != nil {
			break
		}
		if kind > 0xff || !InBatch(byte(kind)) {
			r.err = fmt.Errorf("operation %d: a batch cannot hold kind %d", i, kind)
			return
		}
		r.op(&op.Ops[i], byte(kind))
		if r.err != nil {
			r.err = fmt.Errorf("operation %d (%s): %w", i, OpName(byte(kind)), r.err)
		}
	}
	// Fields appended by later versions are skipped.
	for i := 2; i < n && r.err == nil; i++ {
		r.err = SkipBounded(r.d, r.br, 0)
	}
}

// op decodes the fields array of an operation of kind typ into op.
func (r *reader) op(op *Op, typ byte) {
	op.Type = typ
	want := fieldsOf(typ)
	n := r.arrayLen()
	if r.err == nil && n < want {
		r.err = fmt.Errorf("%s has %d fields, want %d", OpName(typ), n, want)
		return
	}
	switch typ {
	case OpClaim:
		r.key(op)
		op.Fingerprint = r.bytes()
		op.Acked = r.ids()
		op.Time = r.int()
		op.LeaseUntil = r.int()
		op.Flags = r.uint()
		if n >= 10 {
			op.ExpiresAt = r.int()
			want = 10
		}
		if n >= 12 {
			op.KeepReplies = r.uint()
			op.KeepFor = r.int()
			want = 12
		}
	case OpCommit, OpCommitAdvance:
		r.key(op)
		op.ClaimLSN = LSN(r.uint())
		op.Time = r.int()
		codec := r.uint()
		reply := r.bytes()
		if r.err == nil {
			op.Reply, r.err = r.decompressReply(reply, codec)
		}
		if typ == OpCommitAdvance {
			op.Advances = r.advances()
		}
	case OpAbort:
		r.key(op)
		op.ClaimLSN = LSN(r.uint())
		op.Time = r.int()
	case OpAck:
		op.Scope = r.string()
		op.Acked = r.ids()
		op.Time = r.int()
	case OpForget:
		op.Before = r.int()
		op.Time = r.int()
		op.Reason = byte(r.uint())
	case OpExpire:
		op.Keys = r.ids()
		op.Time = r.int()
	case OpAdvance:
		op.Advances = r.advances()
		op.Time = r.int()
	}
	// Fields appended by later versions are skipped.
	for i := want; i < n && r.err == nil; i++ {
		r.err = SkipBounded(r.d, r.br, 0)
	}
}

// decompressReply decodes a reply stored with codec. What it allocates
// is charged against r.budget (maxReplyBytes for one record; a batch
// record's replies share MaxBatchCost).
func (r *reader) decompressReply(b []byte, codec uint64) ([]byte, error) {
	switch codec {
	case codecRaw:
		return b, nil
	case codecS2:
		n, err := s2.DecodedLen(b)
		if err != nil {
			return nil, err
		}
		if n > maxReplyBytes || n > r.budget {
			return nil, fmt.Errorf("reply of %d bytes exceeds limit", n)
		}
		r.budget -= n
		return s2.Decode(make([]byte, n), b)
	}
	return nil, fmt.Errorf("unknown reply codec %d", codec)
}

// reader wraps a msgpack decoder, keeps the first error, and bounds every
// length by the bytes left in the payload before anything is allocated.
type reader struct {
	d    *msgpack.Decoder
	br   *bytes.Reader // what d reads from
	left int
	// budget is what decompressed replies (and a batch's operations) may
	// still allocate.
	budget int
	err    error
}

func (r *reader) arrayLen() int {
	if r.err != nil {
		return 0
	}
	n, err := r.d.DecodeArrayLen()
	if err != nil {
		r.err = err
		return 0
	}
	if n < 0 || n > r.left {
		r.err = fmt.Errorf("array length %d out of range", n)
		return 0
	}
	return n
}

func (r *reader) bytes() []byte {
	if r.err != nil {
		return nil
	}
	b, err := DecodeBin(r.d, r.br)
	if err != nil {
		r.err = err
		return nil
	}
	if len(b) > maxFieldLen {
		r.err = fmt.Errorf("field of %d bytes exceeds limit", len(b))
		return nil
	}
	return b
}

func (r *reader) string() string {
	return string(r.bytes())
}

// SkipBounded skips one msgpack value of d (reading from br) without
// allocating what its headers claim: strings and bins are bounded by the
// bytes left, arrays and maps are walked (at most 8 levels deep), ext
// values are refused.
func SkipBounded(d *msgpack.Decoder, br *bytes.Reader, depth int) error {
	c, err := d.PeekCode()
	if err != nil {
		return err
	}
	switch {
	case msgpcode.IsString(c) || msgpcode.IsBin(c):
		_, err := DecodeBin(d, br)
		return err
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32,
		msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		if depth >= 8 {
			return fmt.Errorf("values nested deeper than 8")
		}
		var n int
		if msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32 {
			n, err = d.DecodeMapLen()
			n *= 2
		} else {
			n, err = d.DecodeArrayLen()
		}
		if err != nil {
			return err
		}
		if n < 0 || n > br.Len() {
			return fmt.Errorf("%d elements exceed the %d bytes left", n, br.Len())
		}
		for i := 0; i < n; i++ {
			if err := SkipBounded(d, br, depth+1); err != nil {
				return err
			}
		}
		return nil
	case msgpcode.IsExt(c):
		return fmt.Errorf("unexpected ext value")
	}
	return d.Skip() // fixed-size values
}

// DecodeBin reads a msgpack bin or str (or nil) from d, which must read
// from br, and returns its bytes. Unlike msgpack's own DecodeBytes, it
// checks the length the header claims against the bytes left in br before
// allocating, so a 5-byte header cannot make it allocate gigabytes.
func DecodeBin(d *msgpack.Decoder, br *bytes.Reader) ([]byte, error) {
	n, err := d.DecodeBytesLen()
	if err != nil {
		return nil, err
	}
	if n == -1 {
		return nil, nil
	}
	if n < 0 || n > br.Len() {
		return nil, fmt.Errorf("length %d exceeds the %d bytes left", n, br.Len())
	}
	b := make([]byte, n)
	if err := d.ReadFull(b); err != nil {
		return nil, err
	}
	return b, nil
}

func (r *reader) uint() uint64 {
	if r.err != nil {
		return 0
	}
	v, err := r.d.DecodeUint64()
	if err != nil {
		r.err = err
	}
	return v
}

func (r *reader) int() int64 {
	if r.err != nil {
		return 0
	}
	v, err := r.d.DecodeInt64()
	if err != nil {
		r.err = err
	}
	return v
}

func (r *reader) key(op *Op) {
	op.Scope = r.string()
	op.ID = r.bytes()
	op.Client = r.string()
	op.Seq = r.uint()
}

func (r *reader) ids() [][]byte {
	n := r.arrayLen()
	if r.err != nil {
		return nil
	}
	if n > maxAckedIDs {
		r.err = fmt.Errorf("%d ids exceed limit", n)
		return nil
	}
	if n == 0 {
		return nil
	}
	ids := make([][]byte, 0, n)
	for i := 0; i < n && r.err == nil; i++ {
		ids = append(ids, r.bytes())
	}
	return ids
}

func (r *reader) advances() []Advance {
	n := r.arrayLen()
	if r.err != nil || n == 0 {
		return nil
	}
	if n > maxAdvances {
		r.err = fmt.Errorf("%d advances exceed limit", n)
		return nil
	}
	out := make([]Advance, 0, n)
	for i := 0; i < n && r.err == nil; i++ {
		if m := r.arrayLen(); r.err == nil && m != 3 {
			r.err = fmt.Errorf("advance has %d fields, want 3", m)
			return nil
		}
		out = append(out, Advance{Scope: r.string(), Client: r.string(), Seq: r.uint()})
	}
	return out
}
