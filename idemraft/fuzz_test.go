package idemraft

import (
	"bytes"
	"errors"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/internal/alloctest"
	"github.com/vmihailenco/msgpack/v5"
)

// decodeAllocLimit bounds what decoding b may allocate: a small multiple
// of b plus 4 MiB (msgpack's Skip, which the envelope decoder uses past
// its third element, reads a claimed length into buffers of 1 then 2 MiB
// before it finds the input short), whatever lengths b claims
// (alloctest.Check).
func decodeAllocLimit(b []byte) uint64 { return uint64(8*len(b)) + 4<<20 }

// TestDecodersBoundAllocation: a command or a stored envelope whose byte
// strings claim gigabytes in a few bytes is refused without allocating
// them (the library's DecodeBytes sizes its buffer by the claimed length).
func TestDecodersBoundAllocation(t *testing.T) {
	huge := []byte{0xc6, 0xf0, 0, 0, 0} // bin32 of 3.75 GiB
	cmd := append(append([]byte(commandMagic), kindCommand, 0x98, 0xa0), huge...)
	env := append([]byte{0x93, 0}, huge...)
	alloctest.Check(t, "decodeCommand", decodeAllocLimit(cmd), func() {
		if _, err := decodeCommand(cmd); !errors.Is(err, ErrInvalidCommand) {
			t.Errorf("decodeCommand: %v, want ErrInvalidCommand", err)
		}
	})
	alloctest.Check(t, "decodeEnvelope", decodeAllocLimit(env), func() {
		if _, err := decodeEnvelope(env); err == nil {
			t.Error("decodeEnvelope accepted an envelope claiming 3.75 GiB")
		}
	})
}

// FuzzDecodeCommand: no input makes the decoders panic, and a command that
// decodes re-encodes to one that decodes to the same request and operation
// (what every replica relies on: a log entry means one thing), reply
// window included.
func FuzzDecodeCommand(f *testing.F) {
	c1, _ := Command(idem.Request{Scope: "s", ID: []byte("a"), Fingerprint: []byte("f"), Acked: [][]byte{[]byte("z")}, TTL: time.Second}, []byte("op"))
	c2, _ := Command(idem.Request{Client: "c", Seq: 7}, nil)
	// A request with a reply window (its own kind), and one with only the age.
	c3, _ := Command(idem.Request{Scope: "s", Client: "c", Seq: 9, Fingerprint: []byte("f"), Acked: [][]byte{[]byte("z")}, TTL: time.Second, KeepReplies: 5, KeepRepliesFor: time.Minute}, []byte("op"))
	c4, _ := Command(idem.Request{Client: "c", Seq: 1, KeepRepliesFor: time.Second}, nil)
	for _, s := range [][]byte{c1, c2, c3, c4, ForgetCommand(time.Unix(100, 0)), []byte(commandMagic), {}} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		decodeEnvelope(b)
		var w wireResponse
		unmarshalStrict(b, &w)
		alloctest.Check(t, "decodeCommand", decodeAllocLimit(b), func() { decodeCommand(b) })
		d, err := decodeCommand(b)
		sameAsUnmarshal(t, b, d, err)
		if err != nil || d.kind == kindForget {
			return
		}
		again, err := Command(d.req, d.op)
		if err != nil {
			t.Fatalf("decoded request %+v does not encode: %v", d.req, err)
		}
		d2, err := decodeCommand(again)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(norm(d.req), norm(d2.req)) || string(d.op) != string(d2.op) {
			t.Fatalf("%+v became %+v", d.req, d2.req)
		}
	})
}

// sameAsUnmarshal checks that decodeCommand reads a request command
// exactly as msgpack.Unmarshal reads its struct (how idemraft decoded
// commands before decodeRequest, and how it encodes them): the same
// request from the same bytes, and the same bytes refused.
func sameAsUnmarshal(t *testing.T, b []byte, d decoded, derr error) {
	t.Helper()
	if !IsCommand(b) || len(b) > MaxCommandSize {
		return
	}
	kind, body := b[len(commandMagic)], b[len(commandMagic)+1:]
	var req idem.Request
	var op []byte
	var uerr error
	switch kind {
	case kindCommand:
		var c wireCommand
		uerr = unmarshalStrict(body, &c)
		req = idem.Request{Scope: c.Scope, ID: c.ID, Client: c.Client, Seq: c.Seq, Fingerprint: c.Fingerprint, Acked: c.Acked, TTL: time.Duration(c.TTL)}
		op = c.Op
	case kindWindowCommand:
		var c wireWindowCommand
		uerr = unmarshalStrict(body, &c)
		req = idem.Request{Scope: c.Scope, ID: c.ID, Client: c.Client, Seq: c.Seq, Fingerprint: c.Fingerprint, Acked: c.Acked, TTL: time.Duration(c.TTL),
			KeepReplies: int(c.KeepReplies), KeepRepliesFor: time.Duration(c.KeepRepliesFor)}
		op = c.Op
		if uerr == nil && (c.KeepReplies < 0 || c.KeepReplies > idem.MaxKeepReplies) {
			uerr = errors.New("KeepReplies out of range")
		}
	default:
		return
	}
	if uerr == nil {
		uerr = checkRequest(req)
	}
	switch {
	case (uerr == nil) != (derr == nil):
		t.Fatalf("decodeCommand: %v; Unmarshal: %v", derr, uerr)
	case uerr == nil && (!reflect.DeepEqual(norm(req), norm(d.req)) || string(op) != string(d.op)):
		t.Fatalf("decodeCommand read %+v %q; Unmarshal %+v %q", d.req, d.op, req, op)
	}
}

// norm makes empty and nil slices compare equal.
func norm(r idem.Request) idem.Request {
	if len(r.ID) == 0 {
		r.ID = nil
	}
	if len(r.Fingerprint) == 0 {
		r.Fingerprint = nil
	}
	if len(r.Acked) == 0 {
		r.Acked = nil
	}
	for i, a := range r.Acked {
		if len(a) == 0 {
			r.Acked[i] = nil
		}
	}
	return r
}

// FuzzDecodeEnvelope: decodeEnvelope reads every input exactly as
// msgpack's Decoder does with its value methods (DecodeInt, DecodeBytes,
// DecodeString, kept here as the reference; decodeEnvelope checks each
// length before it reads): the same envelope from the same bytes, and the
// same bytes refused. Envelopes are in every raft snapshot.
func FuzzDecodeEnvelope(f *testing.F) {
	old, _ := msgpack.Marshal([]any{replyBytes, []byte("r"), "", []byte("fingerprint")}) // before API v1
	for _, env := range []envelope{{Kind: replyBytes, Reply: []byte("reply")}, {Kind: replyNil}, {Kind: replyAppError, Msg: "refused"}, {Kind: replyBytes, Reply: []byte{}}} {
		f.Add(encodeEnvelope(env))
	}
	f.Add(old)
	f.Add([]byte{0x94, 0, 0xc4, 0, 0xa0, 0x92, 0xc0, 0x91, 0xc3})
	f.Fuzz(func(t *testing.T, b []byte) {
		alloctest.Check(t, "decodeEnvelope", decodeAllocLimit(b), func() { decodeEnvelope(b) })
		got, gerr := decodeEnvelope(b)
		if msgpack.NewDecoder(bytes.NewReader(b)).Skip() != nil {
			// Not one whole msgpack value: the library's decoder, which reads
			// every element, fails too (and may first allocate what a byte
			// string claims, so it is not run).
			if gerr == nil {
				t.Fatalf("decodeEnvelope accepted %x, which is not one msgpack value", b)
			}
			return
		}
		want, werr := decodeEnvelopeLibrary(b)
		switch {
		case (gerr == nil) != (werr == nil):
			t.Fatalf("decodeEnvelope: %v; the library: %v", gerr, werr)
		case gerr == nil && !reflect.DeepEqual(got, want):
			t.Fatalf("decodeEnvelope read %#v; the library %#v", got, want)
		}
	})
}

// decodeEnvelopeLibrary is decodeEnvelope as msgpack's Decoder reads it.
func decodeEnvelopeLibrary(b []byte) (env envelope, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("decoder panic: %v", r)
		}
	}()
	r := bytes.NewReader(b)
	d := msgpack.NewDecoder(r)
	n, err := d.DecodeArrayLen()
	if err != nil {
		return envelope{}, err
	}
	if n < envelopeFields {
		return envelope{}, fmt.Errorf("%d elements", n)
	}
	if env.Kind, err = d.DecodeInt(); err != nil {
		return envelope{}, err
	}
	if env.Reply, err = d.DecodeBytes(); err != nil {
		return envelope{}, err
	}
	if env.Msg, err = d.DecodeString(); err != nil {
		return envelope{}, err
	}
	for i := envelopeFields; i < n; i++ {
		if err := d.Skip(); err != nil {
			return envelope{}, err
		}
	}
	if r.Len() != 0 {
		return envelope{}, fmt.Errorf("%d trailing bytes", r.Len())
	}
	return env, nil
}
