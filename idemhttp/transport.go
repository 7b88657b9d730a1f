package idemhttp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemdb/idem"
)

// Transport is an http.RoundTripper for clients of an Idempotency-Key API:
// it gives each request (POST by default) an Idempotency-Key, unless the
// caller set one, and retries it with the same key until it gets an answer
// that is final.
//
// Retried, with exponential backoff and jitter (and at least the server's
// Retry-After): network errors, attempts that ran past AttemptTimeout, 5xx
// responses but 501 and 505, and 409 IDEMPOTENCY_KEY_PROCESSING. Never
// retried: every other response, among them 400, 409 IDEMPOTENCY_KEY_CONFLICT,
// 422 and 429 (a 4xx from the handler is stored by the server and would
// only be replayed). Retries stop at MaxAttempts, and when the request's
// context ends or would end before the next attempt: the last response (or
// error) is returned then.
//
// Bodies are replayed from Request.GetBody when it is set (http.NewRequest
// sets it for bytes, strings and bytes.Buffer bodies); other bodies are
// buffered up to MaxBufferBytes, and a larger body without GetBody is sent
// once, without retries.
//
// Acked keys: once the body of a final response to a key the transport made
// itself has been read to the end, the key is remembered and sent to the
// same server (scheme, host and Authorization header) in the
// Idempotency-Acked-Keys header of later requests, at most MaxAckedKeys per
// request, so that a middleware with a Actor frees it long before its
// TTL. This is best effort: keys not yet sent when the transport is
// dropped simply expire. Keys the caller set are never acked (the caller
// may send them again), and a request that already has an
// Idempotency-Acked-Keys header keeps it as it is.
//
// The zero Transport is ready to use; its fields must not change once it is
// in use. It is safe for concurrent use.
type Transport struct {
	// Base sends each attempt (default http.DefaultTransport).
	Base http.RoundTripper
	// Methods that get a key and retries (default POST). Other requests
	// go to Base untouched.
	Methods []string
	// MaxAttempts bounds the attempts per request, the first included
	// (default 5; 1 means no retries).
	MaxAttempts int
	// BaseDelay is the backoff before the first retry (default 100ms); it
	// doubles for each retry, up to MaxDelay (default 5s). Each wait is
	// drawn uniformly from [d/2, d].
	BaseDelay, MaxDelay time.Duration
	// AttemptTimeout bounds each attempt, until the response headers
	// arrive and while its body is read (zero or negative: the default,
	// DefaultAttemptTimeout). Every attempt has one, whatever the
	// request's context says: a connection whose peer vanished without a
	// reset (a "zombie" socket) never answers, and only a timeout ends the
	// attempt. After an attempt timed out the transport makes sure the
	// retry does not reuse a connection from the pool: the timed-out
	// connection is closed (net/http closes the connection of a request
	// whose context ended before its response was read) and so are Base's
	// idle connections (when Base has CloseIdleConnections, as
	// *http.Transport does), which may be just as dead; the retry dials a
	// new one.
	AttemptTimeout time.Duration
	// MaxBufferBytes bounds the buffering of a body without GetBody
	// (default 1 MiB).
	MaxBufferBytes int64
	// MaxAckedKeys bounds the keys sent per request in
	// Idempotency-Acked-Keys (default 32; negative: send none).
	MaxAckedKeys int
	// NewKey makes the key of a request without one (default
	// idem.NewRequestID().String(): 26 characters, sortable by time).
	NewKey func() string

	mu      sync.Mutex
	pending map[string][]string // destination -> keys to ack
}

// DefaultAttemptTimeout is Transport.AttemptTimeout's default.
const DefaultAttemptTimeout = 30 * time.Second

const (
	defaultAttempts   = 5
	defaultBaseDelay  = 100 * time.Millisecond
	defaultMaxDelay   = 5 * time.Second
	defaultBufferMax  = 1 << 20
	defaultAckPerReq  = 32
	pendingPerDest    = 1024
	maxDestinations   = 1024
	peekConflictBytes = 4 << 10
	drainBytes        = 64 << 10
)

func (t *Transport) base() http.RoundTripper {
	if t.Base != nil {
		return t.Base
	}
	return http.DefaultTransport
}

func (t *Transport) handles(method string) bool {
	if len(t.Methods) == 0 {
		return method == http.MethodPost
	}
	for _, m := range t.Methods {
		if m == method {
			return true
		}
	}
	return false
}

func orDefault[T int | int64 | time.Duration](v, d T) T {
	if v <= 0 {
		return d
	}
	return v
}

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if !t.handles(req.Method) {
		return t.base().RoundTrip(req)
	}
	ctx := req.Context()
	key := req.Header.Get(HeaderKey)
	own := key == ""
	if own {
		if t.NewKey != nil {
			key = t.NewKey()
		} else {
			key = idem.NewRequestID().String()
		}
	}
	body, err := t.replayable(req)
	if err != nil {
		return nil, err
	}
	dest := destination(req)
	var acks []string
	if req.Header.Get(HeaderAckedKeys) == "" { // the caller's own list wins
		acks = t.takeAcks(dest, key)
	}
	attempts := orDefault(t.MaxAttempts, defaultAttempts)
	if !body.replay {
		attempts = 1
	}
	for attempt := 1; ; attempt++ {
		out := req.Clone(ctx)
		out.Header.Set(HeaderKey, key)
		if len(acks) > 0 {
			out.Header.Set(HeaderAckedKeys, strings.Join(acks, ","))
		}
		if err := body.set(out, attempt); err != nil {
			t.putAcks(dest, acks)
			return nil, err
		}
		// The attempt's deadline is the transport's own: when it passes
		// (and the caller's context has not ended) the attempt timed out.
		actx, cancel := context.WithTimeout(ctx, orDefault(t.AttemptTimeout, DefaultAttemptTimeout))
		out = out.WithContext(actx)
		resp, err := t.base().RoundTrip(out)
		retry, wait := false, time.Duration(0)
		if err != nil {
			timedOut := errors.Is(actx.Err(), context.DeadlineExceeded)
			cancel()
			if ctx.Err() != nil {
				t.putAcks(dest, acks)
				return nil, err // the caller's context ended: not ours to retry
			}
			if timedOut {
				t.discardPool()
			}
			retry = true
		} else {
			retry, wait = retryable(resp)
		}
		if retry && attempt < attempts {
			if d := t.backoff(attempt); d > wait {
				wait = d
			}
			if dl, ok := ctx.Deadline(); !ok || time.Now().Add(wait).Before(dl) {
				if resp != nil {
					drain(resp.Body)
				}
				cancel()
				if err := sleep(ctx, wait); err != nil {
					t.putAcks(dest, acks)
					return nil, fmt.Errorf("idemhttp: waiting to retry %s %s (key %s, attempt %d): %w", req.Method, req.URL.Redacted(), key, attempt, err)
				}
				continue
			}
		}
		if err != nil {
			cancel()
			t.putAcks(dest, acks)
			return nil, err
		}
		resp.Body = &respBody{ReadCloser: resp.Body, cancel: cancel, onEOF: func() {
			if own && !retry {
				t.putAcks(dest, []string{key})
			}
		}, onTimeout: func() {
			if ctx.Err() == nil && errors.Is(actx.Err(), context.DeadlineExceeded) {
				t.discardPool() // the body read timed out: the next request dials
			}
		}}
		return resp, nil
	}
}

// retryable tells whether a response asks for a retry, and the wait its
// Retry-After asks for.
func retryable(resp *http.Response) (bool, time.Duration) {
	switch {
	case resp.StatusCode == http.StatusConflict:
		if !isProcessing(resp) {
			return false, 0
		}
	case resp.StatusCode >= 500 && resp.StatusCode != http.StatusNotImplemented && resp.StatusCode != http.StatusHTTPVersionNotSupported:
	default:
		return false, 0
	}
	return true, retryAfter(resp.Header.Get("Retry-After"))
}

// isProcessing reads the start of a 409's body to find the error_code, and
// puts what it read back in front of the body.
func isProcessing(resp *http.Response) bool {
	peek, err := io.ReadAll(io.LimitReader(resp.Body, peekConflictBytes))
	resp.Body = readCloser{io.MultiReader(bytes.NewReader(peek), errReader{err}, resp.Body), resp.Body}
	var eb ErrorBody
	return err == nil && json.Unmarshal(peek, &eb) == nil && eb.ErrorCode == CodeProcessing
}

type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) {
	if r.err != nil {
		return 0, r.err
	}
	return 0, io.EOF
}

type readCloser struct {
	io.Reader
	io.Closer
}

// retryAfter parses Retry-After: delay-seconds or an HTTP date.
func retryAfter(v string) time.Duration {
	if v == "" {
		return 0
	}
	if s, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil {
		if s < 0 {
			return 0
		}
		return time.Duration(min(s, int64(24*time.Hour/time.Second))) * time.Second
	}
	if when, err := http.ParseTime(v); err == nil {
		return max(time.Until(when), 0)
	}
	return 0
}

func (t *Transport) backoff(attempt int) time.Duration {
	d := orDefault(t.BaseDelay, defaultBaseDelay)
	maxd := orDefault(t.MaxDelay, defaultMaxDelay)
	for i := 1; i < attempt && d < maxd; i++ {
		d *= 2
	}
	d = min(d, maxd)
	return d/2 + rand.N(d/2+1)
}

// discardPool closes Base's idle connections after an attempt timed out,
// so that the retry dials a new connection instead of taking from the pool
// one that may be as dead as the one that timed out (the timed-out one is
// closed by net/http itself: it closes the connection of a request whose
// context ended before its response was read).
func (t *Transport) discardPool() {
	if c, ok := t.base().(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func drain(b io.ReadCloser) {
	_, _ = io.Copy(io.Discard, io.LimitReader(b, drainBytes))
	_ = b.Close()
}

// respBody calls onEOF when the body has been read to its end (onTimeout
// when reading it failed), and ends the attempt's context when it is
// closed.
type respBody struct {
	io.ReadCloser
	cancel    context.CancelFunc
	onEOF     func()
	onTimeout func()
	once      sync.Once
}

func (b *respBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.once.Do(b.onEOF)
	} else if err != nil {
		b.once.Do(b.onTimeout)
	}
	return n, err
}

func (b *respBody) Close() error {
	err := b.ReadCloser.Close()
	b.cancel()
	return err
}

// body makes a request body replayable.
type body struct {
	first   io.ReadCloser
	get     func() (io.ReadCloser, error)
	replay  bool
	hasBody bool
}

func (t *Transport) replayable(req *http.Request) (*body, error) {
	switch {
	case req.Body == nil || req.Body == http.NoBody:
		return &body{replay: true}, nil
	case req.GetBody != nil:
		return &body{first: req.Body, get: req.GetBody, replay: true, hasBody: true}, nil
	}
	limit := orDefault(t.MaxBufferBytes, defaultBufferMax)
	buf, err := io.ReadAll(io.LimitReader(req.Body, limit+1))
	if err != nil {
		_ = req.Body.Close()
		return nil, fmt.Errorf("idemhttp: reading the body of %s %s to make it replayable: %w", req.Method, req.URL.Redacted(), err)
	}
	if int64(len(buf)) > limit {
		// Too large to buffer: sent once, as it comes.
		return &body{first: readCloser{io.MultiReader(bytes.NewReader(buf), req.Body), req.Body}, hasBody: true}, nil
	}
	_ = req.Body.Close()
	get := func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(buf)), nil }
	first, _ := get()
	return &body{first: first, get: get, replay: true, hasBody: true}, nil
}

func (b *body) set(out *http.Request, attempt int) error {
	if !b.hasBody {
		out.Body, out.GetBody = nil, nil
		return nil
	}
	if attempt == 1 {
		out.Body = b.first
	} else {
		rc, err := b.get()
		if err != nil {
			return fmt.Errorf("idemhttp: GetBody for retry %d: %w", attempt-1, err)
		}
		out.Body = rc
	}
	out.GetBody = b.get
	return nil
}

// destination names the server and credentials acks go back to.
func destination(req *http.Request) string {
	d := req.URL.Scheme + "://" + req.URL.Host
	if a := req.Header.Get("Authorization"); a != "" {
		sum := sha256.Sum256([]byte(a))
		d += " " + hex.EncodeToString(sum[:8])
	}
	return d
}

func (t *Transport) takeAcks(dest, key string) []string {
	n := orDefault(t.MaxAckedKeys, defaultAckPerReq)
	if t.MaxAckedKeys < 0 {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.pending[dest]
	var out []string
	rest := p[:0]
	for _, k := range p {
		if len(out) < n && k != key {
			out = append(out, k)
		} else {
			rest = append(rest, k)
		}
	}
	if len(rest) == 0 {
		delete(t.pending, dest)
	} else {
		t.pending[dest] = rest
	}
	return out
}

// putAcks queues keys to ack (again, for keys taken by a request that got
// no answer).
func (t *Transport) putAcks(dest string, keys []string) {
	if len(keys) == 0 || t.MaxAckedKeys < 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.pending == nil {
		t.pending = make(map[string][]string)
	}
	if _, ok := t.pending[dest]; !ok && len(t.pending) >= maxDestinations {
		for d := range t.pending { // forget one destination's acks: they expire by TTL
			delete(t.pending, d)
			break
		}
	}
	p := append(t.pending[dest], keys...)
	if len(p) > pendingPerDest {
		p = append([]string(nil), p[len(p)-pendingPerDest:]...)
	}
	t.pending[dest] = p
}

// pendingAcks returns how many keys wait to be acked to any server.
func (t *Transport) pendingAcks() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, p := range t.pending {
		n += len(p)
	}
	return n
}
