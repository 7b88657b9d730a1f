package idemraft

import (
	"bytes"
	"errors"
	"fmt"
	"sync"

	"github.com/idemdb/idem"
	"github.com/vmihailenco/msgpack/v5"
)

// Response is what ApplyFuture.Response() returns (as *Response) for a
// Command entry, and what Client.Do returns.
//
//   - A new request: Reply is what the wrapped FSM's Apply returned
//     ([]byte, or a string as bytes); if it returned an error, Err is an
//     *AppError with its message.
//   - A request already applied: the same Reply and Err, with Duplicate set.
//     The wrapped FSM was not called.
//   - A request the engine refuses: Err is idem.ErrConflict (same id,
//     other fingerprint), *idem.SequenceGapError, *idem.AlreadyCommittedError
//     or idem.ErrInvalidRequest (match with errors.Is / errors.As); nothing
//     ran. Every replica reaches the same answer.
//
// For a ForgetCommand entry Err is nil once it is applied.
type Response struct {
	Reply     []byte
	Duplicate bool
	Err       error
}

// AppError is an error returned by the wrapped FSM's Apply. It is stored
// as the request's reply (the operation happened, and a deterministic FSM
// fails the same way on every replica), so a retry gets it again rather
// than running the operation a second time. Only the message survives a
// retry, a snapshot or the network; errors.Unwrap gives the original error
// on the node that applied the entry, in the Response of that Apply only.
type AppError struct {
	Message string
	err     error
}

func (e *AppError) Error() string { return e.Message }

// Unwrap returns the original error where it is still known (see AppError).
func (e *AppError) Unwrap() error { return e.err }

// Reply kinds kept in the envelope stored as the engine's reply.
const (
	replyBytes       = 0
	replyNil         = 1
	replyAppError    = 2
	replyTooLarge    = 3
	replyUnsupported = 4
)

// envelope is the engine reply of a command: the application's result.
// It is part of the persisted format: the dedup set, and so every raft
// snapshot, holds one per kept request (see docs/design.md, "idemraft").
// Envelopes written before idem's API v1 carry a fourth element, a copy of
// the request's fingerprint, which decodeEnvelope skips: the engine keeps
// the fingerprint itself, and its Lookup checks it as Begin does.
type envelope struct {
	_msgpack struct{} `msgpack:",as_array"`
	Kind     int
	Reply    []byte
	Msg      string
}

// envelopeFields is the number of elements of the envelope's array.
const envelopeFields = 3

// resultEnvelope turns what the wrapped FSM returned into the stored
// envelope and the Response of the first application.
func resultEnvelope(res any, maxReply int) (envelope, Response) {
	var env envelope
	var resp Response
	switch v := res.(type) {
	case nil:
		env.Kind = replyNil
	case []byte:
		env.Kind, env.Reply = replyBytes, v
		resp.Reply = v
	case string:
		env.Kind, env.Reply = replyBytes, []byte(v)
		resp.Reply = env.Reply
	case error:
		env.Kind, env.Msg = replyAppError, v.Error()
		resp.Err = &AppError{Message: env.Msg, err: v}
	default:
		env.Kind, env.Msg = replyUnsupported, fmt.Sprintf("%T", res)
		resp.Err = env.err()
	}
	// Leave room for the envelope's own fields.
	if len(env.Reply)+len(env.Msg)+64 > maxReply {
		env = envelope{Kind: replyTooLarge, Msg: fmt.Sprintf("%d bytes", len(env.Reply)+len(env.Msg))}
		resp = Response{Err: env.err()}
	}
	return env, resp
}

func (env *envelope) err() error {
	switch env.Kind {
	case replyAppError:
		return &AppError{Message: env.Msg}
	case replyTooLarge:
		return fmt.Errorf("%w (%s)", ErrReplyTooLarge, env.Msg)
	case replyUnsupported:
		return fmt.Errorf("%w (%s)", ErrUnsupportedResult, env.Msg)
	}
	return nil
}

func (env *envelope) response(dup bool) *Response {
	r := &Response{Duplicate: dup, Err: env.err()}
	if env.Kind == replyBytes {
		r.Reply = env.Reply
		if r.Reply == nil {
			r.Reply = []byte{}
		}
	}
	return r
}

// envelopeWriter encodes envelopes with the msgpack library's low-level
// Encoder (EncodeArrayLen, EncodeInt, EncodeBytes, EncodeString: the
// calls its reflection makes for the envelope struct, so the bytes are
// msgpack.Marshal's, TestEnvelopeEncoding) into a buffer it keeps: it runs
// once per new request on raft's FSM goroutine, and a reused Encoder and
// buffer cost no allocation per envelope. The engine copies a reply it is
// given (idem.Claim.Commit, idem.Batch.Put), so the buffer is reused once
// the envelopes it holds are handed over.
type envelopeWriter struct {
	buf bytes.Buffer
	enc *msgpack.Encoder
}

func newEnvelopeWriter() *envelopeWriter {
	w := new(envelopeWriter)
	w.enc = msgpack.NewEncoder(&w.buf) // a bytes.Buffer is written directly, unbuffered
	return w
}

// write appends env's encoding to the buffer.
func (w *envelopeWriter) write(env envelope) {
	// Writes to a bytes.Buffer cannot fail (it panics when out of memory).
	_ = w.enc.EncodeArrayLen(envelopeFields)
	_ = w.enc.EncodeInt(int64(env.Kind))
	_ = w.enc.EncodeBytes(env.Reply)
	_ = w.enc.EncodeString(env.Msg)
}

// maxPooledEnvelope bounds the buffer a pooled envelopeWriter keeps.
const maxPooledEnvelope = 64 << 10

var envelopeWriters = sync.Pool{New: func() any { return newEnvelopeWriter() }}

// getEnvelopeWriter returns a pooled envelopeWriter with an empty buffer.
func getEnvelopeWriter() *envelopeWriter {
	w := envelopeWriters.Get().(*envelopeWriter)
	w.buf.Reset()
	return w
}

func putEnvelopeWriter(w *envelopeWriter) {
	if w.buf.Cap() <= maxPooledEnvelope {
		envelopeWriters.Put(w)
	}
}

// encodeEnvelope writes env as envelopeWriter does, into a new slice.
func encodeEnvelope(env envelope) []byte {
	w := getEnvelopeWriter()
	defer putEnvelopeWriter(w)
	w.write(env)
	return bytes.Clone(w.buf.Bytes())
}

// decodeEnvelope reads an envelope: the 3 elements written now, and any
// elements after them (the fingerprint copy of the envelopes written
// before API v1, or fields a later version appends) are skipped. It reads
// the 3 elements with wireReader, the library's DecodeInt, DecodeBytes
// and DecodeString with the length checked first (FuzzDecodeEnvelope
// compares it with the library's Decoder), and skips the rest with the
// library's Skip; it runs on every replica for every duplicate in the
// log. The reply is copied: b is the engine's stored reply, which its
// readers share (idem.Result.Reply), and Response.Reply is the caller's.
func decodeEnvelope(b []byte) (env envelope, err error) {
	defer func() {
		if r := recover(); r != nil { // the decoder must never take a replica down
			err = fmt.Errorf("decoder panic: %v", r)
		}
		if err != nil {
			env, err = envelope{}, fmt.Errorf("idemraft: stored reply is not an idemraft envelope: %w", err)
		}
	}()
	r := getWireReader(b)
	n := r.arrayLen()
	if r.err == nil && n < envelopeFields {
		r.fail("%d elements, want at least %d", n, envelopeFields)
	}
	env.Kind = int(r.int64())
	env.Reply = bytes.Clone(r.bytes())
	env.Msg = r.str()
	skipped := false
	for i := envelopeFields; i < n && r.err == nil; i++ {
		r.setErr(r.d.Skip())
		skipped = true
	}
	if r.err == nil && r.r.Len() != 0 {
		r.fail("%d trailing bytes", r.r.Len())
	}
	err = r.err
	if !skipped {
		// Skip reads a skipped string into the Decoder's buffer, which
		// then keeps its size: a reader that skipped is left to the GC.
		putWireReader(r)
	}
	if err != nil {
		return envelope{}, err
	}
	return env, nil
}

// ---- errors on the wire (HTTP) ----

// Error codes of wireResponse.
const (
	codeNone = iota
	codeApp
	codeConflict
	codeGap
	codeAlreadyCommitted
	codeInvalidRequest
	codeTooLarge
	codeUnsupported
	codeInvalidCommand
	codeOther
)

type wireResponse struct {
	_msgpack  struct{} `msgpack:",as_array"`
	Reply     []byte
	Duplicate bool
	Code      int
	Msg       string
	GapScope  string // GapScope..GapLast: a SequenceGapError's or an AlreadyCommittedError's fields
	GapClient string
	GapSeq    uint64
	GapLast   uint64
}

func toWire(r *Response) wireResponse {
	w := wireResponse{Reply: r.Reply, Duplicate: r.Duplicate}
	if r.Err == nil {
		return w
	}
	w.Msg = r.Err.Error()
	var app *AppError
	var gap *idem.SequenceGapError
	var done *idem.AlreadyCommittedError
	switch {
	case errors.As(r.Err, &app):
		w.Code, w.Msg = codeApp, app.Message
	case errors.As(r.Err, &gap):
		w.Code, w.GapScope, w.GapClient, w.GapSeq, w.GapLast = codeGap, gap.Scope, gap.Client, gap.Seq, gap.Last
	case errors.Is(r.Err, idem.ErrConflict):
		w.Code = codeConflict
	case errors.As(r.Err, &done):
		w.Code, w.GapScope, w.GapClient, w.GapSeq, w.GapLast = codeAlreadyCommitted, done.Scope, done.Client, done.Seq, done.Last
	case errors.Is(r.Err, idem.ErrAlreadyCommitted):
		w.Code = codeAlreadyCommitted
	case errors.Is(r.Err, idem.ErrInvalidRequest):
		w.Code = codeInvalidRequest
	case errors.Is(r.Err, ErrReplyTooLarge):
		w.Code = codeTooLarge
	case errors.Is(r.Err, ErrUnsupportedResult):
		w.Code = codeUnsupported
	case errors.Is(r.Err, ErrInvalidCommand):
		w.Code = codeInvalidCommand
	default:
		w.Code = codeOther
	}
	return w
}

func fromWire(w wireResponse) *Response {
	r := &Response{Reply: w.Reply, Duplicate: w.Duplicate}
	switch w.Code {
	case codeNone:
	case codeApp:
		r.Err = &AppError{Message: w.Msg}
	case codeGap:
		r.Err = &idem.SequenceGapError{Scope: w.GapScope, Client: w.GapClient, Seq: w.GapSeq, Last: w.GapLast}
	case codeConflict:
		r.Err = &remoteError{msg: w.Msg, is: idem.ErrConflict}
	case codeAlreadyCommitted:
		if w.GapClient == "" { // encoded without the client's numbers
			r.Err = &remoteError{msg: w.Msg, is: idem.ErrAlreadyCommitted}
			break
		}
		r.Err = &idem.AlreadyCommittedError{Scope: w.GapScope, Client: w.GapClient, Seq: w.GapSeq, Last: w.GapLast}
	case codeInvalidRequest:
		r.Err = &remoteError{msg: w.Msg, is: idem.ErrInvalidRequest}
	case codeTooLarge:
		r.Err = &remoteError{msg: w.Msg, is: ErrReplyTooLarge}
	case codeUnsupported:
		r.Err = &remoteError{msg: w.Msg, is: ErrUnsupportedResult}
	case codeInvalidCommand:
		r.Err = &remoteError{msg: w.Msg, is: ErrInvalidCommand}
	default:
		r.Err = errors.New(w.Msg)
	}
	return r
}

// remoteError is an engine error that crossed the network: its message,
// matching its sentinel with errors.Is.
type remoteError struct {
	msg string
	is  error
}

func (e *remoteError) Error() string        { return e.msg }
func (e *remoteError) Is(target error) bool { return target == e.is }
