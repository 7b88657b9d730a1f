package idemhttp

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/idemdb/idem"
)

// Middleware returns the Idempotency-Key middleware: requests with a key
// (and a method in Options.Methods) are handled at most once per key, their
// response stored in store and replayed to retries (see the package
// documentation). opts may be nil (the defaults). A nil store or an option
// out of range is an error naming it.
//
// It has the shape net/http middleware has everywhere (chi's Use, alice,
// plain wrapping):
//
//	mw, err := idemhttp.Middleware(store, nil)
//	...
//	mux.Handle("/orders", mw(h))
func Middleware(store idem.Store, opts *Options) (func(http.Handler) http.Handler, error) {
	if store == nil {
		return nil, errors.New("idemhttp: Middleware needs a store (got nil)")
	}
	c, err := newConfig(opts)
	if err != nil {
		return nil, err
	}
	return func(next http.Handler) http.Handler {
		return &handler{s: store, c: c, next: next}
	}, nil
}

type handler struct {
	s    idem.Store
	c    *config
	next http.Handler
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if h.next == nil {
		h.c.log.LogAttrs(r.Context(), slog.LevelError, "idemhttp: the middleware wraps a nil handler",
			slog.String("method", r.Method), slog.String("path", r.URL.Path))
		writeError(w, http.StatusInternalServerError, CodeInternal, detailInternal, "", 0)
		return
	}
	if !h.c.methods[r.Method] {
		h.next.ServeHTTP(w, r)
		return
	}
	keys := r.Header.Values(HeaderKey)
	if len(keys) == 0 {
		if h.c.requireKey {
			writeError(w, http.StatusBadRequest, CodeMissingKey, detailMissingKey, "", 0)
			return
		}
		h.next.ServeHTTP(w, r)
		return
	}
	key := keys[0]
	if len(keys) > 1 {
		writeError(w, http.StatusBadRequest, CodeInvalidKey, detailDuplicate, strings.Join(keys, ", "), 0)
		return
	}
	if !ValidKey(key) {
		writeError(w, http.StatusBadRequest, CodeInvalidKey, invalidKeyDetail(key), key, 0)
		return
	}
	scope, ok := h.scope(w, r, key)
	if !ok {
		return
	}
	acked, ok := h.acked(w, r, key)
	if !ok {
		return
	}
	body, ok := h.readBody(w, r, key)
	if !ok {
		return
	}
	fp := h.c.fingerprint(r, body)
	h.serveKey(w, r, scope, key, fp, acked, body)
}

// scope returns the store scope of the request's key space; an actor that
// cannot be determined is a 401.
func (h *handler) scope(w http.ResponseWriter, r *http.Request, key string) (string, bool) {
	if h.c.actor == nil {
		return h.c.shared, true
	}
	a, err := h.c.actor(r)
	if err == nil && a == "" {
		err = errors.New("empty actor")
	}
	if err != nil {
		h.c.log.LogAttrs(r.Context(), slog.LevelInfo, "idemhttp: actor refused",
			slog.String("method", r.Method), slog.String("path", r.URL.Path), slog.String("key", key), slog.Any("error", err))
		writeError(w, http.StatusUnauthorized, CodeUnauthenticated, detailUnauth, key, 0)
		return "", false
	}
	return ScopeFor(h.c.prefix, a), true
}

// acked parses Idempotency-Acked-Keys. Acks are taken only with an Actor
// (without one anyone could free anyone's key): otherwise the header is
// ignored. The request's own key is dropped from the list.
func (h *handler) acked(w http.ResponseWriter, r *http.Request, key string) ([][]byte, bool) {
	if h.c.actor == nil || h.c.maxAcked < 0 {
		return nil, true
	}
	vals := r.Header.Values(HeaderAckedKeys)
	if len(vals) == 0 {
		return nil, true
	}
	var acked [][]byte
	seen := make(map[string]bool)
	for _, v := range vals {
		for k := range strings.SplitSeq(v, ",") {
			k = strings.TrimSpace(k)
			if k == "" { // empty list elements are allowed by HTTP list syntax
				continue
			}
			if !ValidKey(k) {
				writeError(w, http.StatusBadRequest, CodeInvalidAckedKeys,
					fmt.Sprintf("Invalid %s header: %q is not a valid idempotency key (1-255 characters of letters, numbers, hyphens and underscores)", HeaderAckedKeys, clipKey(k)), key, 0)
				return nil, false
			}
			if seen[k] {
				continue
			}
			seen[k] = true
			if len(seen) > h.c.maxAcked {
				writeError(w, http.StatusBadRequest, CodeInvalidAckedKeys,
					fmt.Sprintf("Invalid %s header: more than %d keys", HeaderAckedKeys, h.c.maxAcked), key, 0)
				return nil, false
			}
			if k != key {
				acked = append(acked, []byte(k))
			}
		}
	}
	return acked, true
}

// readBody reads the whole request body (bounded), for the fingerprint and
// to hand it to the handler again.
func (h *handler) readBody(w http.ResponseWriter, r *http.Request, key string) ([]byte, bool) {
	max := h.c.maxRequest
	if r.ContentLength > max {
		writeError(w, http.StatusRequestEntityTooLarge, CodeRequestTooLarge, fmt.Sprintf(detailTooLarge, max), key, 0)
		return nil, false
	}
	if r.Body == nil || r.Body == http.NoBody {
		return nil, true
	}
	var buf bytes.Buffer
	if r.ContentLength > 0 {
		buf.Grow(int(r.ContentLength))
	}
	// MaxBytesReader also tells net/http to close the connection instead
	// of reading the rest of an oversized body.
	_, err := buf.ReadFrom(http.MaxBytesReader(w, r.Body, max))
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			writeError(w, http.StatusRequestEntityTooLarge, CodeRequestTooLarge, fmt.Sprintf(detailTooLarge, max), key, 0)
			return nil, false
		}
		h.c.log.LogAttrs(r.Context(), slog.LevelDebug, "idemhttp: reading the request body",
			slog.String("method", r.Method), slog.String("path", r.URL.Path), slog.String("key", key), slog.Any("error", err))
		writeError(w, http.StatusBadRequest, CodeBodyUnreadable, detailUnreadable, key, 0)
		return nil, false
	}
	return buf.Bytes(), true
}

// DefaultFingerprint is the default of Options.Fingerprint: the SHA-256 of
// the method, the escaped path, the raw query and the body, each preceded
// by its length (8 bytes, big-endian), after a version tag, so that no two
// different requests give the same input. A key reused with another
// method, path, query or body is a conflict, never the replay of another
// request's response. (Stored with every key: it never changes for a
// request, or retries of keys stored before the change would conflict.)
func DefaultFingerprint(r *http.Request, body []byte) []byte {
	s := sha256.New()
	s.Write([]byte("idemhttp fingerprint 1\x00"))
	field(s, []byte(r.Method))
	field(s, []byte(r.URL.EscapedPath()))
	field(s, []byte(r.URL.RawQuery))
	field(s, body)
	return s.Sum(nil)
}

func field(s hash.Hash, b []byte) {
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(b)))
	s.Write(n[:])
	s.Write(b)
}

func (h *handler) serveKey(w http.ResponseWriter, r *http.Request, scope, key string, fp []byte, acked [][]byte, body []byte) {
	ctx := r.Context()
	id := []byte(key)
	var waitUntil time.Time // the wait for an in-flight key is real time, not a decision about the key
	if h.c.waitInFlight > 0 {
		waitUntil = time.Now().Add(h.c.waitInFlight)
	}
	for {
		res, err := h.s.Begin(ctx, h.c.request(scope, id, fp, acked))
		if err != nil {
			if errors.Is(err, idem.ErrConflict) {
				h.ack(ctx, scope, acked)
			}
			h.beginError(w, r, key, err)
			return
		}
		switch res.Status {
		case idem.Fresh:
			h.run(w, r, key, body, res.Claim)
			return
		case idem.Done:
			h.ack(ctx, scope, acked)
			h.replay(w, r, key, res.Reply)
			return
		case idem.InFlight:
			if left := time.Until(waitUntil); left > 0 {
				wctx, cancel := context.WithTimeout(ctx, left)
				_, err := h.s.Wait(wctx, h.c.request(scope, id, fp, nil))
				cancel()
				if err == nil || errors.Is(err, idem.ErrConflict) {
					continue // finished (or its lease ran out): ask again
				}
			}
			h.ack(ctx, scope, acked)
			writeError(w, http.StatusConflict, CodeProcessing, detailProcessing, key, h.c.retryAfter)
			return
		default:
			h.c.log.LogAttrs(ctx, slog.LevelError, "idemhttp: unexpected store status",
				slog.String("key", key), slog.String("status", res.Status.String()))
			writeError(w, http.StatusInternalServerError, CodeInternal, detailInternal, key, 0)
			return
		}
	}
}

// ack applies acks of a request that did not claim its key (a claim
// carries them in its own record).
func (h *handler) ack(ctx context.Context, scope string, acked [][]byte) {
	if len(acked) == 0 {
		return
	}
	if err := h.s.Ack(ctx, scope, acked...); err != nil && ctx.Err() == nil {
		h.c.log.LogAttrs(ctx, slog.LevelWarn, "idemhttp: acking keys", slog.Int("keys", len(acked)), slog.Any("error", err))
	}
}

func (h *handler) beginError(w http.ResponseWriter, r *http.Request, key string, err error) {
	ctx := r.Context()
	switch {
	case errors.Is(err, idem.ErrConflict):
		writeError(w, h.c.conflictStatus, CodeConflict, detailConflict, key, 0)
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		h.c.log.LogAttrs(ctx, slog.LevelDebug, "idemhttp: request ended before its key was looked up",
			slog.String("key", key), slog.Any("error", err))
		writeError(w, http.StatusServiceUnavailable, CodeStoreUnavailable, detailUnavailable, key, h.c.retryAfter)
	case errors.Is(err, idem.ErrClosed) || errors.Is(err, idem.ErrFailed):
		h.c.log.LogAttrs(ctx, slog.LevelError, "idemhttp: store unavailable",
			slog.String("method", r.Method), slog.String("path", r.URL.Path), slog.String("key", key), slog.Any("error", err))
		writeError(w, http.StatusServiceUnavailable, CodeStoreUnavailable, detailUnavailable, key, h.c.retryAfter)
	default:
		h.c.log.LogAttrs(ctx, slog.LevelError, "idemhttp: store refused the request",
			slog.String("method", r.Method), slog.String("path", r.URL.Path), slog.String("key", key), slog.Any("error", err))
		writeError(w, http.StatusInternalServerError, CodeInternal, detailInternal, key, 0)
	}
}

func (h *handler) replay(w http.ResponseWriter, r *http.Request, key string, reply []byte) {
	s, err := DecodeStoredResponse(reply)
	if err != nil {
		h.c.log.LogAttrs(r.Context(), slog.LevelError, "idemhttp: cannot replay the stored response",
			slog.String("method", r.Method), slog.String("path", r.URL.Path), slog.String("key", key), slog.Any("error", err))
		writeError(w, http.StatusInternalServerError, CodeInternal, detailInternal, key, 0)
		return
	}
	if s.NotStored {
		w.Header().Set(HeaderReplayed, "true")
		writeError(w, http.StatusConflict, CodeResponseNotStored,
			fmt.Sprintf("%s (status %d, more than %d bytes)", detailNotStored, s.Status, h.c.maxResponse), key, 0)
		return
	}
	_ = sendStored(w, s, true)
}

// run runs the handler for a claimed key and stores its response before
// sending it.
func (h *handler) run(w http.ResponseWriter, r *http.Request, key string, body []byte, claim *idem.Claim) {
	rec := newRecorder(w, h.c.maxResponse)
	r2 := new(http.Request)
	*r2 = *r
	r2.Body = io.NopCloser(bytes.NewReader(body))
	r2.ContentLength = int64(len(body))
	r2.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	// Storing and releasing happen even if the client has gone away: once
	// a claim exists, Commit and Abort write their record whatever the
	// context says (idem.Claim); the request's context only bounds how
	// long a networked store is waited for (its error is then
	// idem.ErrInDoubt, logged).
	ctx := r.Context()
	returned := false
	defer func() {
		if returned {
			return
		}
		// The handler panicked: a 500 for Options.NoEffect. Release the
		// key (a retry runs again), or keep it as handled when a 500 may
		// follow the side effect; the panic goes on to net/http.
		if !h.c.noEffect(http.StatusInternalServerError) {
			h.commitNotStored(r, key, claim, http.StatusInternalServerError)
			return
		}
		if err := claim.Abort(ctx); err != nil {
			h.logStore(r, key, "releasing the key of a handler that panicked", err)
		}
	}()
	h.next.ServeHTTP(rec, r2)
	returned = true
	h.finish(w, r, key, rec, claim)
}

func (h *handler) finish(w http.ResponseWriter, r *http.Request, key string, rec *recorder, claim *idem.Claim) {
	ctx := r.Context()
	status := rec.finalStatus()
	switch {
	case !rec.wroteAny && r.Context().Err() != nil:
		// The request ended (client gone, a timeout) and the handler gave
		// up without a response: a failure, the key is released.
		if err := claim.Abort(ctx); err != nil {
			h.logStore(r, key, "releasing the key of a canceled request", err)
		}
		writeError(w, http.StatusServiceUnavailable, CodeCanceled, detailCanceled, key, h.c.retryAfter)
	case status >= 500 && h.c.noEffect(status):
		// A failed request that had no effect releases its key: the retry
		// runs again. (One that may have had effects is stored below.)
		if err := claim.Abort(ctx); err != nil {
			h.logStore(r, key, "releasing the key of a failed request", err)
		}
		if rec.streaming {
			copyHeader(w.Header(), trailers(rec.snapshot, rec.header))
		} else {
			_ = sendStored(w, rec.stored(), false)
		}
	case rec.streaming:
		h.commitNotStored(r, key, claim, status)
		copyHeader(w.Header(), trailers(rec.snapshot, rec.header))
	default:
		s := rec.stored()
		reply, err := s.Encode()
		if err == nil {
			err = claim.Commit(ctx, reply)
		}
		if errors.Is(err, idem.ErrInvalidRequest) {
			// Larger than the engine stores (its MaxReplySize): the key
			// is kept as handled, its response not replayable.
			h.c.log.LogAttrs(r.Context(), slog.LevelWarn, "idemhttp: response too large for the engine; stored as not replayable",
				slog.String("method", r.Method), slog.String("path", r.URL.Path), slog.String("key", key), slog.Int("bytes", len(reply)), slog.Any("error", err))
			h.commitNotStored(r, key, claim, status)
		} else if err != nil {
			h.logStore(r, key, "storing the response (sent anyway)", err)
		}
		_ = sendStored(w, s, false)
	}
}

// commitNotStored commits the marker of a response too large to store: its
// status only (a retry gets IDEMPOTENCY_RESPONSE_NOT_STORED, never the
// handler's header), so the marker itself is always small.
func (h *handler) commitNotStored(r *http.Request, key string, claim *idem.Claim, status int) {
	ctx := r.Context()
	m := &StoredResponse{Status: status, NotStored: true}
	reply, err := m.Encode()
	if err == nil {
		err = claim.Commit(ctx, reply)
	}
	if err != nil {
		h.logStore(r, key, "storing the not-replayable marker", err)
	}
}

// logStore logs a failure to store or release a key: the store failed or
// stopped waiting for the outcome (idem.ErrInDoubt: the claim may stay in
// doubt until its lease runs out, see the package documentation), or the
// claim's lease ran out and another request took the key over.
func (h *handler) logStore(r *http.Request, key, what string, err error) {
	h.c.log.LogAttrs(r.Context(), slog.LevelError, "idemhttp: "+what,
		slog.String("method", r.Method), slog.String("path", r.URL.Path), slog.String("key", key), slog.Any("error", err))
}

// request builds the store request for a key. The TTL is this
// middleware's: the store decides expiry by its own clock (Store.Now;
// idem.Options.Clock for the engine), so every time decision about a key
// is the store's.
func (c *config) request(scope string, id, fp []byte, acked [][]byte) idem.Request {
	return idem.Request{Scope: scope, ID: id, Fingerprint: fp, Acked: acked, TTL: c.ttl}
}
