package idemhttp

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"time"
)

// Header names.
const (
	// HeaderKey carries the client's idempotency key.
	HeaderKey = "Idempotency-Key"
	// HeaderReplayed is "true" on a response that is the replay of a
	// stored one (the handler did not run).
	HeaderReplayed = "Idempotent-Replayed"
	// HeaderAckedKeys carries keys (of the same actor) whose responses
	// the client has received and will never retry: a comma-separated list
	// of keys (HTTP list syntax; the header may also be repeated), at most
	// Options.MaxAckedKeys of them (64 by default) per request.
	HeaderAckedKeys = "Idempotency-Acked-Keys"
)

// The error_code values of the middleware's JSON error bodies.
const (
	// 400: the Idempotency-Key header is not 1-255 characters of
	// [A-Za-z0-9_-], or it was sent more than once.
	CodeInvalidKey = "INVALID_IDEMPOTENCY_KEY"
	// 400: Options.RequireKey is set and the request has no key.
	CodeMissingKey = "MISSING_IDEMPOTENCY_KEY"
	// 400: the Idempotency-Acked-Keys header holds an invalid key or more
	// keys than Options.MaxAckedKeys.
	CodeInvalidAckedKeys = "INVALID_IDEMPOTENCY_ACKED_KEYS"
	// 409 (or 422, Options.ConflictStatus): the key was used for another
	// request (other method, path, query or body).
	CodeConflict = "IDEMPOTENCY_KEY_CONFLICT"
	// 409 with Retry-After: the first request with this key is still being
	// handled (or was in flight when the server crashed; see the package
	// documentation).
	CodeProcessing = "IDEMPOTENCY_KEY_PROCESSING"
	// 409: the request with this key was handled, but its response was
	// larger than Options.MaxResponseBytes and only went to the first
	// client; it cannot be replayed.
	CodeResponseNotStored = "IDEMPOTENCY_RESPONSE_NOT_STORED"
	// 413: the request body is larger than Options.MaxRequestBytes.
	CodeRequestTooLarge = "REQUEST_BODY_TOO_LARGE"
	// 400: the request body could not be read (the client went away or
	// sent a malformed body).
	CodeBodyUnreadable = "REQUEST_BODY_UNREADABLE"
	// 401: Options.Actor returned an error (or an empty actor).
	CodeUnauthenticated = "UNAUTHENTICATED"
	// 503 with Retry-After: the store is closed, failed, or the request's
	// context ended before the key could be looked up.
	CodeStoreUnavailable = "IDEMPOTENCY_STORE_UNAVAILABLE"
	// 503 with Retry-After: the request ended (the client went away, a
	// timeout) and the handler returned without writing anything; the key
	// was released.
	CodeCanceled = "REQUEST_CANCELED"
	// 500: anything else that went wrong in the middleware (logged).
	CodeInternal = "IDEMPOTENCY_INTERNAL_ERROR"
)

// ErrorBody is the JSON body of every response the middleware makes itself
// (the Idempotency-Key service's error format):
//
//	{"detail": "...", "error_code": "IDEMPOTENCY_KEY_CONFLICT", "idempotency_key": "client-key-123"}
//
// idempotency_key echoes the request's key; one longer than MaxKeyLen (an
// invalid key) is cut to its first 64 bytes followed by "…(<n> bytes)".
type ErrorBody struct {
	Detail         string `json:"detail"`
	ErrorCode      string `json:"error_code"`
	IdempotencyKey string `json:"idempotency_key"`
}

// Details of the error bodies.
const (
	detailInvalidKey  = "Invalid idempotency key format. Key must be 1-255 characters long and contain only letters, numbers, hyphens, and underscores"
	detailDuplicate   = "Invalid idempotency key: the Idempotency-Key header was sent more than once"
	detailMissingKey  = "This endpoint requires an Idempotency-Key header"
	detailConflict    = "Idempotency key already used with different request body"
	detailProcessing  = "Request with this idempotency key is already being processed"
	detailNotStored   = "Request with this idempotency key was processed, but its response was too large to store and cannot be replayed"
	detailTooLarge    = "Request body is larger than the limit of %d bytes"
	detailUnreadable  = "Request body could not be read"
	detailUnauth      = "Authentication required: the request's actor could not be determined"
	detailUnavailable = "The idempotency store is unavailable; retry later"
	detailInternal    = "Internal error while handling the idempotency key"
	detailCanceled    = "The request ended before the handler produced a response; retry with the same key"
)

// echoKeyLen is how much of a key longer than MaxKeyLen an error body
// echoes (an invalid key can be as long as the server's header limit).
const echoKeyLen = 64

// clipKey returns k as error bodies echo it: whole when it is at most
// MaxKeyLen bytes, else its first echoKeyLen bytes and "…(<n> bytes)".
func clipKey(k string) string {
	if len(k) <= MaxKeyLen {
		return k
	}
	return fmt.Sprintf("%s…(%d bytes)", k[:echoKeyLen], len(k))
}

// invalidKeyDetail is the detail of a 400 INVALID_IDEMPOTENCY_KEY for k:
// the Idempotency-Key service's text, and for a key too long to echo, a
// sentence saying that idempotency_key shows only its start.
func invalidKeyDetail(k string) string {
	if len(k) <= MaxKeyLen {
		return detailInvalidKey
	}
	return fmt.Sprintf(detailInvalidKey+". The key sent is %d bytes long: idempotency_key shows its first %d", len(k), echoKeyLen)
}

func writeError(w http.ResponseWriter, status int, code, detail, key string, retryAfter time.Duration) {
	body, err := json.Marshal(ErrorBody{Detail: detail, ErrorCode: code, IdempotencyKey: clipKey(key)})
	if err != nil { // cannot happen: three strings
		body = []byte(`{"detail":"error","error_code":"` + code + `","idempotency_key":""}`)
	}
	body = append(body, '\n')
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	if retryAfter > 0 {
		h.Set("Retry-After", strconv.FormatInt(int64((retryAfter+time.Second-1)/time.Second), 10))
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
