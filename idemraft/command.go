package idemraft

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/idemdb/idem"
	"github.com/vmihailenco/msgpack/v5"
)

// commandMagic starts the data of every log entry written by Command or
// ForgetCommand. 0xC1 is the one byte msgpack never uses, and no JSON, text
// or common binary format starts with these eight bytes: an application's
// own entries pass through untouched unless they begin with exactly this.
const commandMagic = "\xc1idemraf"

// The kind byte after commandMagic. These values are frozen: a log holds
// entries written by every earlier version, and a reader refuses a kind it
// does not know (ErrInvalidCommand, the same on every replica) rather than
// guess at its body.
const (
	kindCommand byte = 1 // a request without a reply window: wireCommand
	kindForget  byte = 2 // the administrator's tombstone: Unix ns
	// kindWindowCommand is a request with a reply window
	// (Request.KeepReplies, KeepRepliesFor): wireWindowCommand. Command
	// writes it only when a window is given, so that entries without one
	// stay readable by an idemraft from before it.
	kindWindowCommand byte = 3
)

// MaxCommandSize bounds a log entry built by Command (64 MiB), far above
// what a raft entry should carry, so that a corrupt length can never make
// the decoder allocate without bound.
const MaxCommandSize = 64 << 20

var (
	// ErrInvalidCommand: a log entry starts like an idemraft command but
	// cannot be decoded (wrong version, truncated, malformed). The wrapped
	// FSM is not called; every replica returns the same error.
	ErrInvalidCommand = errors.New("idemraft: invalid command entry")
	// ErrReplyTooLarge: the wrapped FSM's reply exceeded the engine's reply
	// limit (idem.Options.MaxReplySize). The operation ran and counts as
	// done; its reply is not kept, and retries get this error.
	ErrReplyTooLarge = errors.New("idemraft: reply too large to keep")
	// ErrUnsupportedResult: the wrapped FSM's Apply returned something other
	// than []byte, string, nil or an error for a command. The operation ran
	// and counts as done; retries get this error.
	ErrUnsupportedResult = errors.New("idemraft: FSM.Apply returned an unsupported result type")
)

// wireCommand is the body of a command entry: a msgpack array, which the
// decoder (decodeRequest, which reads these fields in this order) accepts
// only with exactly these fields, so a field cannot simply be appended: a
// new form needs a new kind byte (see docs/design.md, "idemraft").
type wireCommand struct {
	_msgpack    struct{} `msgpack:",as_array"`
	Scope       string
	ID          []byte
	Client      string
	Seq         uint64
	Fingerprint []byte
	Acked       [][]byte
	TTL         int64 // nanoseconds
	Op          []byte
}

// wireWindowCommand is the body of a kindWindowCommand entry: the fields
// of wireCommand, then the reply window. As for wireCommand, the decoder
// takes exactly these fields.
type wireWindowCommand struct {
	_msgpack       struct{} `msgpack:",as_array"`
	Scope          string
	ID             []byte
	Client         string
	Seq            uint64
	Fingerprint    []byte
	Acked          [][]byte
	TTL            int64 // nanoseconds
	Op             []byte
	KeepReplies    int64
	KeepRepliesFor int64 // nanoseconds
}

// Command returns the data of a raft log entry that carries req (id or
// client and sequence number, scope, fingerprint, acked ids, TTL, and in
// sequence mode the reply window KeepReplies and KeepRepliesFor) and the
// application's operation op. Submit it with raft's Apply; the wrapped
// FSM's Apply receives op as Log.Data the first time the request is
// applied, and never again.
//
// It refuses requests the engine would refuse whatever its state (neither
// or both of ID and Client/Seq, a reply window out of range or with an
// ID), so a malformed request never costs a log append.
//
// A request with a reply window is written with a kind of entry of its own
// (docs/design.md, "idemraft"), which an idemraft from before it refuses
// (ErrInvalidCommand) rather than apply without the window: upgrade every
// node before clients send windows.
func Command(req idem.Request, op []byte) ([]byte, error) {
	if err := checkRequest(req); err != nil {
		return nil, err
	}
	window := req.KeepReplies != 0 || req.KeepRepliesFor != 0
	w := getEnvelopeWriter()
	defer putEnvelopeWriter(w)
	w.buf.Grow(len(commandMagic) + 1 + len(op) + len(req.ID) + len(req.Scope) + len(req.Client) + len(req.Fingerprint) + 64)
	w.buf.WriteString(commandMagic)
	if window {
		w.buf.WriteByte(kindWindowCommand)
	} else {
		w.buf.WriteByte(kindCommand)
	}
	writeCommand(w.enc, &req, op, window)
	if w.buf.Len() > MaxCommandSize {
		return nil, fmt.Errorf("%w: command of %d bytes exceeds %d", idem.ErrInvalidRequest, w.buf.Len(), MaxCommandSize)
	}
	return bytes.Clone(w.buf.Bytes()), nil
}

// writeCommand encodes a command's body, wireCommand (or, with window,
// wireWindowCommand) holding req and op, with the msgpack library's
// low-level Encoder: the calls its reflection makes for those structs
// (EncodeUint64 and EncodeInt64 for the numbers, in 9 bytes, nil for a nil
// slice), so the bytes are msgpack.Marshal's (TestCommandEncoding), without
// reflection and with one allocation per command (the copy Command
// returns). enc writes to a bytes.Buffer, which cannot fail.
func writeCommand(enc *msgpack.Encoder, req *idem.Request, op []byte, window bool) {
	n := 8
	if window {
		n = 10
	}
	_ = enc.EncodeArrayLen(n)
	_ = enc.EncodeString(req.Scope)
	_ = enc.EncodeBytes(req.ID)
	_ = enc.EncodeString(req.Client)
	_ = enc.EncodeUint64(req.Seq)
	_ = enc.EncodeBytes(req.Fingerprint)
	if req.Acked == nil {
		_ = enc.EncodeNil()
	} else {
		_ = enc.EncodeArrayLen(len(req.Acked))
		for _, a := range req.Acked {
			_ = enc.EncodeBytes(a)
		}
	}
	_ = enc.EncodeInt64(int64(req.TTL))
	_ = enc.EncodeBytes(op)
	if window {
		_ = enc.EncodeInt64(int64(req.KeepReplies))
		_ = enc.EncodeInt64(int64(req.KeepRepliesFor))
	}
}

func checkRequest(req idem.Request) error {
	hasID := len(req.ID) > 0
	hasSeq := req.Client != "" || req.Seq != 0
	switch {
	case hasID && hasSeq:
		return fmt.Errorf("%w: give either ID or Client and Seq, not both", idem.ErrInvalidRequest)
	case !hasID && !hasSeq:
		return fmt.Errorf("%w: give ID, or Client and Seq", idem.ErrInvalidRequest)
	case hasSeq && (req.Client == "" || req.Seq == 0):
		return fmt.Errorf("%w: sequence mode needs both Client and Seq (>= 1)", idem.ErrInvalidRequest)
	case req.TTL < 0:
		return fmt.Errorf("%w: negative TTL", idem.ErrInvalidRequest)
	case (req.KeepReplies != 0 || req.KeepRepliesFor != 0) && !hasSeq:
		return fmt.Errorf("%w: KeepReplies and KeepRepliesFor apply to sequence mode (Client and Seq) only", idem.ErrInvalidRequest)
	case req.KeepReplies < 0 || req.KeepReplies > idem.MaxKeepReplies:
		return fmt.Errorf("%w: KeepReplies %d out of range 0..%d", idem.ErrInvalidRequest, req.KeepReplies, idem.MaxKeepReplies)
	case req.KeepRepliesFor < 0:
		return fmt.Errorf("%w: negative KeepRepliesFor", idem.ErrInvalidRequest)
	}
	return nil
}

// ForgetCommand returns the data of a log entry holding the
// administrator's tombstone "forget every reply committed before before"
// (idem.Engine.Forget). Every replica applies it at the same point of the
// log, so they all drop the same ids. The times compared are the log
// entries' AppendedAt, never a replica's clock.
func ForgetCommand(before time.Time) []byte {
	b := make([]byte, 0, len(commandMagic)+1+9)
	b = append(b, commandMagic...)
	b = append(b, kindForget)
	enc, _ := msgpack.Marshal(before.UnixNano()) // an int64 always encodes
	return append(b, enc...)
}

// IsCommand reports whether data is a log entry written by Command or
// ForgetCommand (its first bytes; it is not decoded).
func IsCommand(data []byte) bool {
	return len(data) > len(commandMagic) && string(data[:len(commandMagic)]) == commandMagic
}

// decoded is a command entry after decoding.
type decoded struct {
	kind   byte
	req    idem.Request
	op     []byte
	before time.Time
}

func decodeCommand(data []byte) (decoded, error) {
	if !IsCommand(data) {
		return decoded{}, fmt.Errorf("%w: missing the idemraft prefix", ErrInvalidCommand)
	}
	if len(data) > MaxCommandSize+1024 {
		return decoded{}, fmt.Errorf("%w: %d bytes", ErrInvalidCommand, len(data))
	}
	kind := data[len(commandMagic)]
	body := data[len(commandMagic)+1:]
	switch kind {
	case kindCommand, kindWindowCommand:
		req, op, err := decodeRequest(body, kind == kindWindowCommand)
		if err != nil {
			return decoded{}, fmt.Errorf("%w: %v", ErrInvalidCommand, err)
		}
		if err := checkRequest(req); err != nil {
			return decoded{}, fmt.Errorf("%w: %v", ErrInvalidCommand, err)
		}
		return decoded{kind: kind, req: req, op: op}, nil
	case kindForget:
		var ns int64
		if err := unmarshalStrict(body, &ns); err != nil {
			return decoded{}, fmt.Errorf("%w: forget: %v", ErrInvalidCommand, err)
		}
		return decoded{kind: kind, before: time.Unix(0, ns)}, nil
	default:
		return decoded{}, fmt.Errorf("%w: unknown kind %d (written by a newer idemraft?)", ErrInvalidCommand, kind)
	}
}

// decodeRequest reads the body of a request command: the array of
// wireCommand's fields, with window wireWindowCommand's, exactly that
// many, each with the msgpack library's Decoder method for its type, and
// nothing after (FuzzDecodeCommand compares it with msgpack.Unmarshal on
// every input). It runs once per command on raft's FSM goroutine, so it
// reads in place (see wireReader): the id, the acked ids and op are
// slices of body (as Apply hands the application raft's own Log.Data),
// and nothing the engine keeps after the entry is applied points into it:
// the scope and client are strings, and the engine keeps its own copy of
// the fingerprint, as of every byte slice of a Request
// (TestDedupSetKeepsNoLogBytes).
func decodeRequest(body []byte, window bool) (req idem.Request, op []byte, err error) {
	if req, op, ok := decodeCanonical(body, window); ok {
		return req, op, nil
	}
	return decodeGeneral(body, window)
}

// decodeGeneral is decodeRequest for any body: the library's Decoder
// reads each value.
func decodeGeneral(body []byte, window bool) (req idem.Request, op []byte, err error) {
	r := getWireReader(body)
	defer putWireReader(r)
	want := 8
	if window {
		want = 10
	}
	if n := r.arrayLen(); r.err == nil && n != want {
		r.fail("an array of %d fields, want %d", n, want)
	}
	req.Scope = r.str()
	req.ID = r.bytes()
	req.Client = r.str()
	req.Seq = r.uint64()
	req.Fingerprint = r.bytes()
	if k := r.arrayLen(); r.err == nil && k > r.r.Len() { // each id takes a byte at least
		r.fail("%d acked ids in %d bytes", k, r.r.Len())
	} else if k > 0 && r.err == nil {
		req.Acked = make([][]byte, k)
		for j := range req.Acked {
			req.Acked[j] = r.bytes()
		}
	}
	ttl := r.int64()
	op = r.bytes()
	var keep, keepFor int64
	if window {
		keep, keepFor = r.int64(), r.int64()
		if r.err == nil && (keep < 0 || keep > idem.MaxKeepReplies) {
			r.fail("KeepReplies %d out of range 0..%d", keep, idem.MaxKeepReplies)
		}
	}
	if r.err == nil && r.r.Len() != 0 {
		r.fail("%d trailing bytes", r.r.Len())
	}
	if r.err != nil {
		return idem.Request{}, nil, r.err
	}
	req.TTL = time.Duration(ttl)
	req.KeepReplies, req.KeepRepliesFor = int(keep), time.Duration(keepFor)
	return req, op, nil
}

// decodeCanonical is decodeRequest's fast path for a body exactly as
// Command writes it (writeCommand: a fixarray, strings and byte strings as
// str or bin or nil, numbers as uint64 and int64 in 9 bytes, the acked ids
// as nil or an array): nearly every entry. Those encodings have one
// meaning to the library's Decoder, so it reads what decodeRequest's
// general path reads from them, in a single pass over body without the
// Decoder's per-byte reads. Anything else (another encoding the library
// accepts, a value out of range, a short or long body) gives ok false,
// and the general path reads it or says what is wrong
// (TestDecodeCanonical; FuzzDecodeCommand compares both with
// msgpack.Unmarshal).
func decodeCanonical(body []byte, window bool) (req idem.Request, op []byte, ok bool) {
	c := canonReader{b: body, ok: true}
	want := byte(0x98) // fixarray of 8
	if window {
		want = 0x9a
	}
	if len(body) == 0 || body[0] != want {
		return req, nil, false
	}
	c.off = 1
	req.Scope = string(c.bytes())
	req.ID = c.bytes()
	req.Client = string(c.bytes())
	req.Seq = c.uint64()
	req.Fingerprint = c.bytes()
	if k := c.arrayLen(); k > len(body)-c.off { // each id takes a byte at least
		return req, nil, false
	} else if k > 0 {
		req.Acked = make([][]byte, k)
		for j := range req.Acked {
			req.Acked[j] = c.bytes()
		}
	}
	req.TTL = time.Duration(c.uint64())
	op = c.bytes()
	if window {
		keep := int64(c.uint64())
		req.KeepRepliesFor = time.Duration(c.uint64())
		if keep < 0 || keep > idem.MaxKeepReplies {
			return req, nil, false
		}
		req.KeepReplies = int(keep)
	}
	if !c.ok || c.off != len(body) {
		return req, nil, false
	}
	return req, op, true
}

// canonReader reads the encodings decodeCanonical takes; ok turns false
// at the first other byte or at the end of b.
type canonReader struct {
	b   []byte
	off int
	ok  bool
}

// n reads an unsigned big-endian number of size bytes.
func (c *canonReader) n(size int) int {
	if !c.ok || len(c.b)-c.off < size {
		c.ok = false
		return 0
	}
	v := 0
	for _, x := range c.b[c.off : c.off+size] {
		v = v<<8 | int(x)
	}
	c.off += size
	return v
}

// bytes reads a str, bin or nil (nil) as a slice of b capped at its length.
func (c *canonReader) bytes() []byte {
	if !c.ok || c.off >= len(c.b) {
		c.ok = false
		return nil
	}
	code := c.b[c.off]
	c.off++
	var n int
	switch {
	case code == 0xc0: // nil
		return nil
	case code >= 0xa0 && code <= 0xbf: // fixstr
		n = int(code & 0x1f)
	case code == 0xd9 || code == 0xc4: // str8, bin8
		n = c.n(1)
	case code == 0xda || code == 0xc5: // str16, bin16
		n = c.n(2)
	case code == 0xdb || code == 0xc6: // str32, bin32
		n = c.n(4)
	default:
		c.ok = false
		return nil
	}
	if !c.ok || n > len(c.b)-c.off {
		c.ok = false
		return nil
	}
	v := c.b[c.off : c.off+n : c.off+n]
	c.off += n
	return v
}

// uint64 reads a uint64 or an int64 in 9 bytes (0xcf, 0xd3) as its 64 bits:
// the caller converts an int64's.
func (c *canonReader) uint64() uint64 {
	if !c.ok || len(c.b)-c.off < 9 {
		c.ok = false
		return 0
	}
	code := c.b[c.off]
	if code != 0xcf && code != 0xd3 {
		c.ok = false
		return 0
	}
	v := binary.BigEndian.Uint64(c.b[c.off+1:])
	c.off += 9
	return v
}

// arrayLen reads nil (-1) or an array header.
func (c *canonReader) arrayLen() int {
	if !c.ok || c.off >= len(c.b) {
		c.ok = false
		return 0
	}
	code := c.b[c.off]
	c.off++
	switch {
	case code == 0xc0:
		return -1
	case code >= 0x90 && code <= 0x9f:
		return int(code & 0x0f)
	case code == 0xdc:
		return c.n(2)
	case code == 0xdd:
		return c.n(4)
	}
	c.ok = false
	return 0
}

// wireReader reads the msgpack values of a command or an envelope with
// the msgpack library's low-level Decoder (DecodeArrayLen, DecodeUint64,
// DecodeInt64, DecodeBytesLen), so every value is read as the library
// reads its type, without reflection, and writes the library's own
// structs (wireCommand, envelope) read back the same. Two things it does
// itself, because the library's value methods cannot:
//
//   - it bounds every length before using it: a byte string or an array
//     of ids whose header claims more than the bytes left is refused
//     (DecodeBytes would allocate whatever the header claims: a 16-byte
//     command claiming 3.75 GiB allocated it; TestDecodersBoundAllocation),
//   - it takes a byte string as a slice of the input (the Decoder reads
//     from a bytes.Reader on data: its offset is len(data) - r.Len(), and
//     the reader is then moved past it), so a command's id and operation
//     cost no copy; a caller copies what outlives data.
//
// The first error stops every later read, which then returns zero values.
// Readers are pooled (getWireReader): one Decoder and bytes.Reader serve
// every entry, and a decode allocates only what it copies.
type wireReader struct {
	data []byte
	r    bytes.Reader // on data
	d    *msgpack.Decoder
	err  error
}

var wireReaders = sync.Pool{New: func() any {
	w := new(wireReader)
	w.d = msgpack.NewDecoder(&w.r) // a bytes.Reader is read directly, unbuffered
	return w
}}

func getWireReader(data []byte) *wireReader {
	w := wireReaders.Get().(*wireReader)
	w.data, w.err = data, nil
	w.r.Reset(data)
	return w
}

// putWireReader returns w to the pool, keeping no reference to its input.
func putWireReader(w *wireReader) {
	w.data, w.err = nil, nil
	w.r.Reset(nil)
	wireReaders.Put(w)
}

func (w *wireReader) fail(format string, args ...any) {
	if w.err == nil {
		w.err = fmt.Errorf(format, args...)
	}
}

func (w *wireReader) setErr(err error) {
	if w.err == nil && err != nil {
		w.err = err
	}
}

// arrayLen reads an array header (DecodeArrayLen): its length, or -1 for
// nil. The caller bounds the length by what it reads per element.
func (w *wireReader) arrayLen() int {
	if w.err != nil {
		return 0
	}
	n, err := w.d.DecodeArrayLen()
	w.setErr(err)
	return n
}

func (w *wireReader) uint64() uint64 {
	if w.err != nil {
		return 0
	}
	v, err := w.d.DecodeUint64()
	w.setErr(err)
	return v
}

func (w *wireReader) int64() int64 {
	if w.err != nil {
		return 0
	}
	v, err := w.d.DecodeInt64()
	w.setErr(err)
	return v
}

// bytes reads a byte string (str or bin, as DecodeBytes reads it: nil
// gives nil, an empty one a non-nil empty slice) as a slice of the input,
// capped at its length.
func (w *wireReader) bytes() []byte {
	if w.err != nil {
		return nil
	}
	n, err := w.d.DecodeBytesLen()
	switch left := w.r.Len(); {
	case err != nil:
		w.setErr(err)
		return nil
	case n < 0:
		return nil
	case n > left:
		w.fail("a string of %d bytes with %d left: %w", n, left, io.ErrUnexpectedEOF)
		return nil
	}
	off := len(w.data) - w.r.Len()
	w.r.Seek(int64(n), io.SeekCurrent) // within data: cannot fail
	return w.data[off : off+n : off+n]
}

// str reads a string as DecodeString does ("" for nil or empty), copied.
func (w *wireReader) str() string {
	return string(w.bytes())
}

// unmarshalStrict decodes exactly one msgpack value filling all of b.
func unmarshalStrict(b []byte, v any) (err error) {
	defer func() {
		if r := recover(); r != nil { // the decoder must never take a replica down
			err = fmt.Errorf("decoder panic: %v", r)
		}
	}()
	// Walk the value first: msgpack v5 sizes a slice by the length its
	// header claims (its allocation limit does not apply to slices of
	// slices), so a few bytes claiming 3.5 billion acked ids would take
	// the process down; a walk fails at the end of b instead, and then no
	// length exceeds what b holds (FuzzDecodeCommand found it).
	if err := msgpack.NewDecoder(bytes.NewReader(b)).Skip(); err != nil {
		return err
	}
	r := bytes.NewReader(b)
	d := msgpack.NewDecoder(r)
	if err := d.Decode(v); err != nil {
		return err
	}
	if r.Len() != 0 {
		return fmt.Errorf("%d trailing bytes", r.Len())
	}
	return nil
}
