package idemcluster

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"sync"
	"unsafe"

	"github.com/idemdb/idem"
	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// The entries' codec. A command is logged as the msgpack map that the
// library's reflection writes for the command struct (field names from the
// msgpack tags, in declaration order, omitempty fields left out, Op and the
// fixed-width integers as msgpack writes them without compact ints). The
// codec writes and reads that form with the msgpack library's low-level,
// reflection-free API (Encoder.EncodeMapLen, EncodeString, EncodeBytes,
// EncodeUint64, ...; Decoder.DecodeMapLen, DecodeArrayLen, DecodeBytesLen,
// DecodeUint64, PeekCode, ...), field by field, rather than with
// msgpack.Marshal and Unmarshal: reflection cost every node a few
// microseconds per command (three nodes decode every entry; a batch of 32
// Begins: encode 88 -> 12 µs, decode 73 -> 26 µs). The bytes are the same
// (TestEntryCodecMatchesReflection), so entries logged by older nodes and
// by newer ones read alike, and a cluster can be upgraded one node at a time.
//
// The decoder takes what the reflective one took (any key order, unknown
// keys skipped, nil for an absent value, strings and binaries alike). Where
// the library would allocate what a header claims, the codec reads the
// length itself and checks it against the bytes left in the entry first
// (entryReader.in.Len()): a string or binary is read with DecodeBytesLen,
// the check, then ReadFull into a slice of that length (DecodeBytes and
// DecodeString allocate the claimed length before they read); an array
// whose length is more than the bytes left is refused (an element takes
// one byte at least), and slices grow as elements come rather than by the
// claim; an unknown field's value is skipped by seeking past its strings,
// binaries and extensions, checked the same way, rather than with the
// library's Skip (which reads them into the decoder's buffer and grows it
// by a megabyte per claim). So a corrupt length cannot make a node
// allocate more than the entry's elements (TestEntryCodecBoundsAllocation,
// FuzzDecodeCommand).

// entryEncoder is a msgpack.Encoder over its own buffer, both reused from
// one entry to the next (encoders, sync.Pool): an entry costs one
// allocation, its copy out of the buffer, which raft keeps.
type entryEncoder struct {
	buf bytes.Buffer
	enc *msgpack.Encoder // writes to buf
}

var encoders = sync.Pool{New: func() any {
	e := &entryEncoder{}
	e.enc = msgpack.NewEncoder(&e.buf)
	return e
}}

// maxPooledBuffer is the largest buffer an entryEncoder keeps for the next
// entry: a rare large entry's buffer is left to the collector.
const maxPooledBuffer = 1 << 20

// encodeCommand is msgpack.Marshal(c), without reflection.
func encodeCommand(c *command) ([]byte, error) {
	e := encoders.Get().(*entryEncoder)
	e.buf.Reset()
	err := writeCommand(e.enc, c)
	var out []byte
	if err == nil {
		out = bytes.Clone(e.buf.Bytes())
	}
	if e.buf.Cap() <= maxPooledBuffer {
		encoders.Put(e)
	}
	return out, err
}

// errs keeps the first error of a sequence of writes.
type errs struct{ err error }

func (e *errs) do(err error) {
	if e.err == nil {
		e.err = err
	}
}

func writeCommand(enc *msgpack.Encoder, c *command) error {
	if c == nil {
		return enc.EncodeNil()
	}
	n := 2 // op, key
	for _, set := range [...]bool{c.Req != nil, c.Owner != "", len(c.Token) > 0, c.Seq != 0, len(c.Reply) > 0,
		len(c.Adv) > 0, len(c.IDs) > 0, c.Before != 0, c.Node != "", c.Addr != "", len(c.Cmds) > 0} {
		if set {
			n++
		}
	}
	var e errs
	e.do(enc.EncodeMapLen(n))
	e.do(enc.EncodeString("op"))
	e.do(enc.EncodeUint8(c.Op))
	if c.Req != nil {
		e.do(enc.EncodeString("req"))
		e.do(writeRequest(enc, c.Req))
	}
	if c.Owner != "" {
		e.do(enc.EncodeString("owner"))
		e.do(enc.EncodeString(c.Owner))
	}
	if len(c.Token) > 0 {
		e.do(enc.EncodeString("tok"))
		e.do(enc.EncodeBytes(c.Token))
	}
	e.do(enc.EncodeString("key"))
	e.do(writeKey(enc, &c.Key))
	if c.Seq != 0 {
		e.do(enc.EncodeString("seq"))
		e.do(enc.EncodeUint64(c.Seq))
	}
	if len(c.Reply) > 0 {
		e.do(enc.EncodeString("reply"))
		e.do(enc.EncodeBytes(c.Reply))
	}
	if len(c.Adv) > 0 {
		e.do(enc.EncodeString("adv"))
		e.do(enc.EncodeArrayLen(len(c.Adv)))
		for _, a := range c.Adv {
			// idem.Advance has no msgpack tags: its Go field names.
			e.do(enc.EncodeMapLen(3))
			e.do(enc.EncodeString("Scope"))
			e.do(enc.EncodeString(a.Scope))
			e.do(enc.EncodeString("Client"))
			e.do(enc.EncodeString(a.Client))
			e.do(enc.EncodeString("Seq"))
			e.do(enc.EncodeUint64(a.Seq))
		}
	}
	if len(c.IDs) > 0 {
		e.do(enc.EncodeString("ids"))
		e.do(writeByteSlices(enc, c.IDs))
	}
	if c.Before != 0 {
		e.do(enc.EncodeString("before"))
		e.do(enc.EncodeInt64(c.Before))
	}
	if c.Node != "" {
		e.do(enc.EncodeString("node"))
		e.do(enc.EncodeString(c.Node))
	}
	if c.Addr != "" {
		e.do(enc.EncodeString("addr"))
		e.do(enc.EncodeString(c.Addr))
	}
	if len(c.Cmds) > 0 {
		e.do(enc.EncodeString("cmds"))
		e.do(enc.EncodeArrayLen(len(c.Cmds)))
		for _, sub := range c.Cmds {
			e.do(writeCommand(enc, sub))
		}
	}
	return e.err
}

func writeByteSlices(enc *msgpack.Encoder, bs [][]byte) error {
	var e errs
	e.do(enc.EncodeArrayLen(len(bs)))
	for _, b := range bs {
		e.do(enc.EncodeBytes(b))
	}
	return e.err
}

func writeKey(enc *msgpack.Encoder, k *claimKey) error {
	n := 1
	if len(k.ID) > 0 {
		n++
	}
	if k.Client != "" {
		n++
	}
	var e errs
	e.do(enc.EncodeMapLen(n))
	e.do(enc.EncodeString("s"))
	e.do(enc.EncodeString(k.Scope))
	if len(k.ID) > 0 {
		e.do(enc.EncodeString("i"))
		e.do(enc.EncodeBytes(k.ID))
	}
	if k.Client != "" {
		e.do(enc.EncodeString("c"))
		e.do(enc.EncodeString(k.Client))
	}
	return e.err
}

func writeRequest(enc *msgpack.Encoder, r *wireRequest) error {
	n := 1
	for _, set := range [...]bool{len(r.ID) > 0, r.Client != "", r.Seq != 0, len(r.Fingerprint) > 0, len(r.Acked) > 0,
		r.TTL != 0, r.KeepReplies != 0, r.KeepFor != 0} {
		if set {
			n++
		}
	}
	var e errs
	e.do(enc.EncodeMapLen(n))
	e.do(enc.EncodeString("s"))
	e.do(enc.EncodeString(r.Scope))
	if len(r.ID) > 0 {
		e.do(enc.EncodeString("i"))
		e.do(enc.EncodeBytes(r.ID))
	}
	if r.Client != "" {
		e.do(enc.EncodeString("c"))
		e.do(enc.EncodeString(r.Client))
	}
	if r.Seq != 0 {
		e.do(enc.EncodeString("q"))
		e.do(enc.EncodeUint64(r.Seq))
	}
	if len(r.Fingerprint) > 0 {
		e.do(enc.EncodeString("f"))
		e.do(enc.EncodeBytes(r.Fingerprint))
	}
	if len(r.Acked) > 0 {
		e.do(enc.EncodeString("a"))
		e.do(writeByteSlices(enc, r.Acked))
	}
	if r.TTL != 0 {
		e.do(enc.EncodeString("t"))
		e.do(enc.EncodeInt64(r.TTL))
	}
	if r.KeepReplies != 0 {
		e.do(enc.EncodeString("kr"))
		e.do(enc.EncodeInt(int64(r.KeepReplies)))
	}
	if r.KeepFor != 0 {
		e.do(enc.EncodeString("kf"))
		e.do(enc.EncodeInt64(r.KeepFor))
	}
	return e.err
}

// decodeCommand reads an entry's command (msgpack.Unmarshal into a
// command, without reflection). The command shares no memory with data:
// its strings and byte slices are copies, so that what the FSM keeps
// (claims, tokens, replies) does not hold on to raft's log buffers.
func decodeCommand(data []byte) (*command, error) {
	r := readers.Get().(*entryReader)
	r.in.Reset(data)
	r.dec.Reset(&r.in)
	c := &command{}
	err := r.command(c, 0)
	r.in.Reset(nil)
	readers.Put(r)
	if err != nil {
		return nil, err
	}
	return c, nil
}

// entryReader reads one entry with a msgpack.Decoder over a bytes.Reader,
// both reused from one entry to the next (readers, sync.Pool). The decoder
// reads a bytes.Reader as it is (an io.ByteScanner: no bufio in between),
// so in.Len() is exactly what is left of the entry: every length a header
// claims is checked against it before anything is read or allocated.
type entryReader struct {
	in    bytes.Reader
	dec   *msgpack.Decoder // reads in
	key   [8]byte          // the map key being read
	chunk []byte           // what is left of the block short strings are cut from (alloc)
}

// A command's short strings and binaries (ids, scopes, owners, tokens,
// fingerprints: a Begin has five, a Commit four, and three nodes decode
// every entry) are cut from blocks of bytesChunk bytes instead of being
// allocated one by one; a longer one (a reply) is allocated alone. Each is
// still a copy, with its capacity cut at its length (an append copies it
// rather than writing into the next one), and what the FSM keeps of a
// command (a claim's key, owner, token and fingerprint) holds at most its
// blocks, bytesChunk bytes each, not the entry.
const (
	bytesChunk = 256
	maxChunked = 64
)

// alloc is a new slice of n bytes (alone when n > maxChunked).
func (r *entryReader) alloc(n int) []byte {
	if n == 0 || n > maxChunked {
		return make([]byte, n)
	}
	if len(r.chunk) < n {
		r.chunk = make([]byte, bytesChunk)
	}
	b := r.chunk[:n:n]
	r.chunk = r.chunk[n:]
	return b
}

var readers = sync.Pool{New: func() any {
	r := &entryReader{}
	r.dec = msgpack.NewDecoder(&r.in)
	return r
}}

// fields calls field for every key of the map that comes next (nil: no
// key); field reads the key's value, or returns false to have it skipped.
func (r *entryReader) fields(field func(key []byte) (bool, error)) error {
	n, err := r.dec.DecodeMapLen()
	if err != nil {
		return err
	}
	for range max(n, 0) {
		kn, err := r.dec.DecodeBytesLen()
		if err != nil {
			return fmt.Errorf("map key: %w", err)
		}
		var key []byte // compared in switches on string(key): no allocation
		if kn >= 0 && kn <= len(r.key) {
			key = r.key[:kn]
			if err := r.dec.ReadFull(key); err != nil {
				return err
			}
		} else if kn > len(r.key) { // no field has so long a name
			if err := r.skipN(kn); err != nil {
				return err
			}
		}
		read, err := field(key)
		if err != nil {
			return fmt.Errorf("field %q: %w", key, err)
		}
		if !read {
			if err := r.skip(0); err != nil {
				return fmt.Errorf("field %q: %w", key, err)
			}
		}
	}
	return nil
}

func (r *entryReader) skipN(n int) error {
	if n > r.in.Len() {
		return fmt.Errorf("a length of %d with %d bytes left", n, r.in.Len())
	}
	_, err := r.in.Seek(int64(n), io.SeekCurrent)
	return err
}

// arrayLen reads an array's length (-1: nil), bounded by the bytes left.
func (r *entryReader) arrayLen() (int, error) {
	n, err := r.dec.DecodeArrayLen()
	if err == nil && n > r.in.Len() {
		err = fmt.Errorf("an array of %d elements with %d bytes left", n, r.in.Len())
	}
	return n, err
}

// initialCap is the capacity a slice of n decoded elements starts with:
// appends grow it as the elements come.
func initialCap(n int) int { return min(n, 64) }

func (r *entryReader) byteSlices() ([][]byte, error) {
	n, err := r.arrayLen()
	if err != nil || n < 0 {
		return nil, err
	}
	out := make([][]byte, 0, initialCap(n))
	for range n {
		b, err := r.bytes()
		if err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return out, nil
}

// bytes reads a string or a binary (nil: nil), refusing a length over the
// bytes left.
func (r *entryReader) bytes() ([]byte, error) {
	n, err := r.dec.DecodeBytesLen()
	if err != nil || n < 0 {
		return nil, err
	}
	if n > r.in.Len() {
		return nil, fmt.Errorf("a string of %d bytes with %d left", n, r.in.Len())
	}
	b := r.alloc(n)
	if err := r.dec.ReadFull(b); err != nil {
		return nil, err
	}
	return b, nil
}

// str is bytes as a string.
func (r *entryReader) str() (string, error) {
	b, err := r.bytes()
	if err != nil || len(b) == 0 {
		return "", err
	}
	return unsafe.String(&b[0], len(b)), nil // b (its length: alloc) is the string's alone and never written again
}

// maxSkipDepth bounds the nesting of an unknown field's value.
const maxSkipDepth = 32

// skip reads past the value that comes next (an unknown field's): its
// strings, binaries and extensions by seeking past them, checked against
// the bytes left, rather than with the library's Skip, which reads them
// into the pooled decoder's buffer and grows it by a megabyte for every
// length a header claims.
func (r *entryReader) skip(depth int) error {
	if depth > maxSkipDepth {
		return errors.New("a value nested too deep")
	}
	c, err := r.dec.PeekCode()
	if err != nil {
		return err
	}
	switch {
	case msgpcode.IsString(c) || msgpcode.IsBin(c):
		n, err := r.dec.DecodeBytesLen()
		if err != nil || n <= 0 {
			return err
		}
		return r.skipN(n)
	case msgpcode.IsExt(c):
		_, n, err := r.dec.DecodeExtHeader()
		if err != nil {
			return err
		}
		return r.skipN(n)
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		n, err := r.arrayLen()
		if err != nil {
			return err
		}
		for range max(n, 0) {
			if err := r.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		n, err := r.dec.DecodeMapLen()
		if err != nil {
			return err
		}
		if n > r.in.Len() {
			return fmt.Errorf("a map of %d entries with %d bytes left", n, r.in.Len())
		}
		for range 2 * max(n, 0) {
			if err := r.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	}
	return r.dec.Skip() // a number, a bool or nil: a few bytes
}

// isNil reads a nil if one comes next.
func (r *entryReader) isNil() (bool, error) {
	c, err := r.dec.PeekCode()
	if err != nil || c != msgpcode.Nil {
		return false, err
	}
	return true, r.dec.DecodeNil()
}

// maxBatchDepth bounds the nesting of batch commands: the FSM refuses a
// batch inside a batch; the reader only stops a corrupt entry from
// recursing without end.
const maxBatchDepth = 2

func (r *entryReader) command(c *command, depth int) error {
	return r.fields(func(key []byte) (read bool, err error) {
		d := r.dec
		switch string(key) {
		case "op":
			c.Op, err = d.DecodeUint8()
		case "req":
			if isNil, err := r.isNil(); err != nil || isNil {
				return true, err
			}
			c.Req = &wireRequest{}
			err = r.request(c.Req)
		case "owner":
			c.Owner, err = r.str()
		case "tok":
			c.Token, err = r.bytes()
		case "key":
			err = r.claimKey(&c.Key)
		case "seq":
			c.Seq, err = d.DecodeUint64()
		case "reply":
			c.Reply, err = r.bytes()
		case "adv":
			var n int
			if n, err = r.arrayLen(); err != nil || n < 0 {
				return true, err
			}
			c.Adv = make([]idem.Advance, 0, initialCap(n))
			for range n {
				var a idem.Advance
				if err := r.advance(&a); err != nil {
					return true, err
				}
				c.Adv = append(c.Adv, a)
			}
		case "ids":
			c.IDs, err = r.byteSlices()
		case "before":
			c.Before, err = d.DecodeInt64()
		case "node":
			c.Node, err = r.str()
		case "addr":
			c.Addr, err = r.str()
		case "cmds":
			if depth >= maxBatchDepth {
				return true, errors.New("batches nested too deep")
			}
			var n int
			if n, err = r.arrayLen(); err != nil || n < 0 {
				return true, err
			}
			c.Cmds = make([]*command, 0, initialCap(n))
			var subs []command // the commands, allocated a run at a time
			for i := range n {
				if isNil, err := r.isNil(); err != nil || isNil {
					if err != nil {
						return true, err
					}
					c.Cmds = append(c.Cmds, nil)
					continue
				}
				if len(subs) == cap(subs) {
					subs = make([]command, 0, initialCap(n-i))
				}
				subs = append(subs, command{})
				sub := &subs[len(subs)-1]
				if err := r.command(sub, depth+1); err != nil {
					return true, fmt.Errorf("command %d: %w", i, err)
				}
				c.Cmds = append(c.Cmds, sub)
			}
		default:
			return false, nil
		}
		return true, err
	})
}

func (r *entryReader) claimKey(k *claimKey) error {
	return r.fields(func(key []byte) (read bool, err error) {
		switch string(key) {
		case "s":
			k.Scope, err = r.str()
		case "i":
			k.ID, err = r.bytes()
		case "c":
			k.Client, err = r.str()
		default:
			return false, nil
		}
		return true, err
	})
}

func (r *entryReader) advance(a *idem.Advance) error {
	return r.fields(func(key []byte) (read bool, err error) {
		switch string(key) {
		case "Scope":
			a.Scope, err = r.str()
		case "Client":
			a.Client, err = r.str()
		case "Seq":
			a.Seq, err = r.dec.DecodeUint64()
		default:
			return false, nil
		}
		return true, err
	})
}

func (r *entryReader) request(w *wireRequest) error {
	return r.fields(func(key []byte) (read bool, err error) {
		d := r.dec
		switch string(key) {
		case "s":
			w.Scope, err = r.str()
		case "i":
			w.ID, err = r.bytes()
		case "c":
			w.Client, err = r.str()
		case "q":
			w.Seq, err = d.DecodeUint64()
		case "f":
			w.Fingerprint, err = r.bytes()
		case "a":
			w.Acked, err = r.byteSlices()
		case "t":
			w.TTL, err = d.DecodeInt64()
		case "kr":
			w.KeepReplies, err = d.DecodeInt()
		case "kf":
			w.KeepFor, err = d.DecodeInt64()
		default:
			return false, nil
		}
		return true, err
	})
}
