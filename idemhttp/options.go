package idemhttp

import (
	"fmt"
	"log/slog"
	"net/http"
	"time"
)

// Options configure the middleware. The zero value (or nil) gives the
// defaults of the Idempotency-Key service: POST only, a 1 hour TTL, one
// shared key space, the fingerprint of method, path, query and body.
type Options struct {
	// TTL is how long a completed key is replayed: it expires at
	// created_at + TTL (created_at is when the first request claimed it; a
	// retry does not extend it), and a request after that, when
	// expires_at < now by the store's clock, runs as new. Default 1 hour.
	// It is this middleware's own: middlewares with different TTLs can
	// share one store.
	TTL time.Duration

	// Methods the middleware handles (default POST only). Requests with
	// other methods pass through untouched.
	Methods []string

	// Actor returns the authenticated identity of the request's caller
	// (a user id, an API client id: taken from authentication, never from
	// anything the client chooses). When set, every actor has its own key
	// space: two users sending the same key never see each other's
	// responses, and keys listed in Idempotency-Acked-Keys are acked. An
	// error, or an empty actor, is a 401 (for requests with a key). When
	// nil, all clients share one key space (see the package documentation)
	// and acked keys are ignored.
	Actor func(*http.Request) (string, error)

	// ScopePrefix separates this middleware's keys from those of other
	// middlewares sharing the store (for example one per API version). At
	// most 512 bytes. Default empty.
	ScopePrefix string

	// Fingerprint computes what "the same request" means: a retry of a
	// key whose fingerprint differs from the first request's is a 409
	// IDEMPOTENCY_KEY_CONFLICT. It gets the request and its whole body
	// (read already, at most MaxRequestBytes) and must not keep either.
	// Default DefaultFingerprint (method, path, query and body). Replace it
	// when something between client and server changes retries, for
	// example a gateway that adds a query parameter of its own to every
	// attempt: hash what the client sent, without it. The result is
	// compared byte for byte and stored with the key: at most 1024 bytes
	// (the engine's bound; a hash is best). A nil result means "any
	// request": the key never conflicts.
	Fingerprint func(r *http.Request, body []byte) []byte

	// RequireKey makes the key mandatory: a request (with a method in
	// Methods) without it is a 400 MISSING_IDEMPOTENCY_KEY, as the IETF
	// Idempotency-Key draft specifies. Default: requests without a key
	// pass through untouched.
	RequireKey bool

	// ConflictStatus is the status of IDEMPOTENCY_KEY_CONFLICT: 409 (the
	// default, the Idempotency-Key service) or 422 (the IETF draft).
	ConflictStatus int

	// MaxRequestBytes bounds the request body read to fingerprint it
	// (default 4 MiB); a larger body is a 413 REQUEST_BODY_TOO_LARGE and
	// the key is not used.
	MaxRequestBytes int64

	// MaxResponseBytes bounds the stored response body (default 4 MiB; at
	// most 12 MiB minus 64 KiB, what the engine stores). A handler that
	// writes more streams its response to the first client and the key is
	// stored as "not stored": retries get 409 IDEMPOTENCY_RESPONSE_NOT_STORED.
	MaxResponseBytes int

	// RetryAfter is the Retry-After sent with IDEMPOTENCY_KEY_PROCESSING
	// and IDEMPOTENCY_STORE_UNAVAILABLE (whole seconds, rounded up;
	// default 1 second).
	RetryAfter time.Duration

	// WaitInFlight, when positive, makes a request whose key is being
	// handled by another request wait up to this long for it (and replay
	// its response) before answering IDEMPOTENCY_KEY_PROCESSING. Default 0:
	// answer at once, as the Idempotency-Key service does.
	WaitInFlight time.Duration

	// NoEffect reports whether a handler's 5xx response certifies that
	// the request had no effect. Then the key is released and a retry runs
	// the handler again: the Idempotency-Key service's rule (an error
	// deletes the record; clients retry a 5xx with the same key), which
	// the default, DefaultNoEffect, keeps for every 5xx. A handler whose
	// failure may come after its side effect (a 500 after the payment went
	// out) returns false for that status: the response is then stored and
	// replayed to retries like any other, so the handler never runs twice
	// for the key. A panic counts as a 500: when NoEffect(500) is false the
	// key is kept as handled and retries get IDEMPOTENCY_RESPONSE_NOT_STORED.
	NoEffect func(status int) bool

	// MaxAckedKeys bounds the keys accepted in one Idempotency-Acked-Keys
	// header (default 64, at most 4096; more keys in a request is a 400).
	// Negative: the header is ignored.
	MaxAckedKeys int

	// Logger receives the middleware's warnings and errors (a response that
	// could not be stored, store failures). Never the request body.
	// Default slog.Default().
	Logger *slog.Logger
}

// DefaultNoEffect is Options.NoEffect's default: every 5xx releases its
// key (the Idempotency-Key service's rule).
func DefaultNoEffect(status int) bool { return status >= 500 }

const (
	defaultTTL          = time.Hour
	defaultMaxRequest   = 4 << 20
	defaultMaxResponse  = 4 << 20
	maxResponseLimit    = 12<<20 - 64<<10
	defaultRetryAfter   = time.Second
	defaultMaxAckedKeys = 64
	maxScopePrefix      = 512
	maxAckedLimit       = 4096
)

type config struct {
	ttl            time.Duration
	methods        map[string]bool
	actor          func(*http.Request) (string, error)
	prefix         string
	shared         string // scope of the shared space
	fingerprint    func(*http.Request, []byte) []byte
	noEffect       func(status int) bool
	requireKey     bool
	conflictStatus int
	maxRequest     int64
	maxResponse    int
	retryAfter     time.Duration
	waitInFlight   time.Duration
	maxAcked       int
	log            *slog.Logger
}

// newConfig applies the defaults and checks the options; a bad option is
// an error naming the field and its value, returned when the middleware is
// built, never at request time.
func newConfig(o *Options) (*config, error) {
	if o == nil {
		o = &Options{}
	}
	c := &config{
		ttl:            o.TTL,
		methods:        make(map[string]bool),
		actor:          o.Actor,
		prefix:         o.ScopePrefix,
		fingerprint:    o.Fingerprint,
		noEffect:       o.NoEffect,
		requireKey:     o.RequireKey,
		conflictStatus: o.ConflictStatus,
		maxRequest:     o.MaxRequestBytes,
		maxResponse:    o.MaxResponseBytes,
		retryAfter:     o.RetryAfter,
		waitInFlight:   o.WaitInFlight,
		maxAcked:       o.MaxAckedKeys,
		log:            o.Logger,
	}
	switch {
	case c.ttl < 0:
		return nil, fmt.Errorf("idemhttp: Options.TTL %v is negative", c.ttl)
	case c.ttl == 0:
		c.ttl = defaultTTL
	}
	if len(o.Methods) == 0 {
		c.methods[http.MethodPost] = true
	}
	for i, m := range o.Methods {
		if m == "" {
			return nil, fmt.Errorf("idemhttp: Options.Methods[%d] is empty", i)
		}
		c.methods[m] = true
	}
	if len(c.prefix) > maxScopePrefix {
		return nil, fmt.Errorf("idemhttp: Options.ScopePrefix of %d bytes exceeds %d", len(c.prefix), maxScopePrefix)
	}
	c.shared = ScopeFor(c.prefix, "")
	if c.fingerprint == nil {
		c.fingerprint = DefaultFingerprint
	}
	if c.noEffect == nil {
		c.noEffect = DefaultNoEffect
	}
	switch c.conflictStatus {
	case 0:
		c.conflictStatus = http.StatusConflict
	case http.StatusConflict, http.StatusUnprocessableEntity:
	default:
		return nil, fmt.Errorf("idemhttp: Options.ConflictStatus %d: want 409 or 422", c.conflictStatus)
	}
	switch {
	case c.maxRequest < 0:
		return nil, fmt.Errorf("idemhttp: Options.MaxRequestBytes %d is negative", c.maxRequest)
	case c.maxRequest == 0:
		c.maxRequest = defaultMaxRequest
	}
	switch {
	case c.maxResponse < 0 || c.maxResponse > maxResponseLimit:
		return nil, fmt.Errorf("idemhttp: Options.MaxResponseBytes %d: want 0..%d", c.maxResponse, maxResponseLimit)
	case c.maxResponse == 0:
		c.maxResponse = defaultMaxResponse
	}
	if c.retryAfter <= 0 {
		c.retryAfter = defaultRetryAfter
	}
	switch {
	case c.maxAcked == 0:
		c.maxAcked = defaultMaxAckedKeys
	case c.maxAcked > maxAckedLimit:
		return nil, fmt.Errorf("idemhttp: Options.MaxAckedKeys %d exceeds %d (the engine's bound)", c.maxAcked, maxAckedLimit)
	}
	if c.log == nil {
		c.log = slog.Default()
	}
	return c, nil
}
