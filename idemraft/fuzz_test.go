package idemraft

import (
	"errors"
	"reflect"
	"testing"
	"time"

	"github.com/idemdb/idem"
)

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
