package idemraft

import (
	"errors"
	"fmt"

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

// envelope is the engine reply of a command: the application's result and
// the fingerprint of the request that produced it (so that a leader can
// answer a retry from its local set with the same fingerprint check Begin
// makes; idem.Engine.Lookup does not return the stored fingerprint).
type envelope struct {
	_msgpack    struct{} `msgpack:",as_array"`
	Kind        int
	Reply       []byte
	Msg         string
	Fingerprint []byte
}

// resultEnvelope turns what the wrapped FSM returned into the stored
// envelope and the Response of the first application.
func resultEnvelope(res any, fp []byte, maxReply int) (envelope, *Response) {
	env := envelope{Fingerprint: fp}
	resp := &Response{}
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
	if len(env.Reply)+len(env.Msg)+len(fp)+64 > maxReply {
		env = envelope{Kind: replyTooLarge, Msg: fmt.Sprintf("%d bytes", len(env.Reply)+len(env.Msg)), Fingerprint: fp}
		resp = &Response{Err: env.err()}
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

func encodeEnvelope(env envelope) ([]byte, error) {
	return msgpack.Marshal(&env)
}

func decodeEnvelope(b []byte) (envelope, error) {
	var env envelope
	if err := unmarshalStrict(b, &env); err != nil {
		return envelope{}, fmt.Errorf("idemraft: stored reply is not an idemraft envelope: %w", err)
	}
	return env, nil
}

// fpMatch is the engine's fingerprint rule: an unchecked request matches
// anything; a checked one needs the same fingerprint and never matches an
// entry stored without one.
func fpMatch(stored, asked []byte) bool {
	if len(asked) == 0 {
		return true
	}
	return len(stored) > 0 && string(stored) == string(asked)
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
