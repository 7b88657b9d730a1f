// Package idemhttp is the Idempotency-Key middleware and client for
// net/http, built on an idem.Store (the embedded *idem.Engine, or any other
// Store): a POST with an Idempotency-Key header is handled at most once per
// key, its response is stored durably before it is sent, and retries get
// that response back, byte for byte, even after a restart or a crash of the
// server.
//
//	e, err := idem.Open("/var/lib/orders/idem", nil)
//	...
//	mw, err := idemhttp.Middleware(e, nil) // a bad option is an error naming it
//	...
//	mux.Handle("POST /orders", mw(ordersHandler))
//
// and on the client side
//
//	client := &http.Client{Transport: &idemhttp.Transport{}}
//
// Middleware has the usual shape func(http.Handler) http.Handler, so it works
// with net/http, chi (r.Use), alice and the like.
//
// # Server behaviour
//
// Requests whose method is not in Options.Methods (default POST only) and
// requests without an Idempotency-Key header pass through untouched (with
// Options.RequireKey a missing key is a 400 instead). For the others:
//
//	key not 1-255 characters of [A-Za-z0-9_-],   400 INVALID_IDEMPOTENCY_KEY
//	or the header sent twice
//	new key                                      the handler runs; its response is stored, then sent
//	same key, same request                       the stored response, with "Idempotent-Replayed: true";
//	                                             the handler does not run
//	same key, another request                    409 IDEMPOTENCY_KEY_CONFLICT (422 with Options.ConflictStatus)
//	same key while the first is being handled    409 IDEMPOTENCY_KEY_PROCESSING with Retry-After
//	                                             (Options.WaitInFlight: wait for the first instead)
//	request body over Options.MaxRequestBytes    413 REQUEST_BODY_TOO_LARGE (the key is not used)
//	Options.Actor fails                          401 UNAUTHENTICATED
//	store closed or failed                       503 IDEMPOTENCY_STORE_UNAVAILABLE with Retry-After
//
// Every response the middleware makes itself has a JSON body with detail,
// error_code and idempotency_key (ErrorBody; the codes are the Code*
// constants), for example
//
//	{"detail":"Idempotency key already used with different request body","error_code":"IDEMPOTENCY_KEY_CONFLICT","idempotency_key":"new-key-123"}
//
// A key longer than 255 bytes (an invalid one: it can be as long as the
// server's header limit) is not echoed whole: idempotency_key holds its
// first 64 bytes and its length, "xxxx…(300 bytes)", and the detail says
// so.
//
// "The same request" means the same fingerprint: by default
// (DefaultFingerprint) the SHA-256 of the method, the escaped path, the raw
// query and the body, each framed by its length, so a key reused on another
// endpoint (or with another query or body) is a conflict, never the replay
// of another request's response. Options.Fingerprint replaces it (for
// example to leave out a query parameter that a gateway adds to every
// attempt). Every decision is the store's (Store.Begin with that
// fingerprint), so the store's Stats count hits, misses, conflicts and
// processing collisions.
//
// # What is stored
//
// A response with a status below 500 is stored: the status, the header the
// handler had set when it wrote the status, the body and the trailers (the
// StoredResponse type, msgpack-encoded). It is committed (fsynced, with the
// engine's default durability) before the first byte goes to the client, so
// the first client and every retry get the same bytes; the middleware adds a
// Content-Length when the handler set none, to both. Headers that middleware
// outside this one sets on the ResponseWriter are not stored (they are that
// middleware's to set again). Informational responses (1xx) are not sent.
//
// # Where to mount it
//
// Put authentication, rate limiting and http.TimeoutHandler outside the
// middleware (they wrap it), and the handler that makes the side effect
// inside: every response below 500 that reaches the middleware is stored and
// replayed, so a 401 or a 429 made inside it would be replayed to the
// retries too. Options.Actor then reads the identity the authentication
// middleware put in the request's context.
//
// # Failures
//
//   - A 5xx from the handler releases the key (the store's claim is
//     aborted): the 5xx is sent, and a retry runs the handler again. That
//     is the Idempotency-Key service's rule, and Options.NoEffect's
//     default: a 5xx certifies that nothing happened. A handler whose
//     failure may follow its side effect says so with Options.NoEffect
//     (false for that status): the 5xx is then stored and replayed like
//     any response, and the handler never runs twice for the key.
//   - A panic in the handler counts as a 500: it releases the key (or,
//     when NoEffect(500) is false, keeps it as handled: retries get
//     IDEMPOTENCY_RESPONSE_NOT_STORED) and goes on to net/http (which
//     drops the connection; http.ErrAbortHandler included).
//   - The client goes away or the request's context ends: the handler keeps
//     running (as net/http handlers do); if it still writes a response, that
//     response is stored and retries get it. If it returns without writing
//     anything after its context ended, it is treated as failed: the key is
//     released (503 REQUEST_CANCELED, which nobody may read). Commit and
//     Abort get the request's context even when it has ended: once a claim
//     exists they write their record whatever it says (idem.Claim), and a
//     networked store may only stop waiting for the outcome (idem.ErrInDoubt,
//     logged).
//   - Timeouts: put http.TimeoutHandler outside the middleware, never inside
//     (inside, its 503 would release the key while the handler still runs).
//   - Storing fails (the store failed, its outcome is in doubt, or the
//     claim's lease ran out and another request took the key over): the
//     response is sent anyway and the failure is logged with the key; the
//     key stays as the store has it.
//
// # Sizes and streaming
//
// The request body is read (up to Options.MaxRequestBytes, default 4 MiB) to
// fingerprint it, then handed to the handler again. The stored body is
// bounded by Options.MaxResponseBytes (default 4 MiB): the response is
// buffered until the handler returns, and Flush (http.Flusher,
// http.ResponseController) does nothing meanwhile. A handler that writes more
// than the limit makes the middleware give up storing it: what is buffered is
// sent and the rest streams to the client as written (Flush then works); when
// the handler returns the key is committed as "not stored", and retries get
// 409 IDEMPOTENCY_RESPONSE_NOT_STORED (the request was handled; its response
// cannot be replayed). Never a silent truncation. Hijacking is not
// supported on requests with a key.
//
// # Expiry
//
// A completed key is replayed for Options.TTL (default 1 hour) after it was
// first claimed: expires_at = created_at + TTL, and a request when
// expires_at < now runs as new (the Idempotency-Key service's timing table:
// T+60m replays, T+61m runs again). Retries do not extend it. Times are the
// store's clock (idem.Options.Clock for the engine), never time.Now, so a
// test with a fake clock sees exactly that table. The engine removes expired
// keys by its periodic cleanup (idem.Options.CleanupInterval, default 10
// minutes; the count is logged, "idem: TTL cleanup removed expired
// entries", and counted in Stats.Cleanups, as are the keys an engine
// Retention forgets, "idem: retention cleanup removed expired entries").
// The TTL is the middleware's own: middlewares with different TTLs can
// share one engine opened with default options.
//
// # Key spaces and security
//
// With Options.Actor every actor (the authenticated caller, taken from
// authentication, never from anything the client chooses) has its own key
// space: two users sending the same key never see each other's responses
// or conflicts. Keys live in the store scope ScopeFor(Options.ScopePrefix,
// actor), an encoding in which no two (prefix, actor) pairs meet (see
// ScopeFor); middlewares with different Options.ScopePrefix never meet
// either.
//
// Without Actor all clients share one space: a client that sends another
// client's key with the same method, path, query and body gets that client's
// response, and a different body reveals (by the conflict) that the key is in
// use. That is fine when keys are unguessable (idem.NewRequestID has 64
// random bits) or all clients are one party; otherwise set Actor.
//
// The request body is never logged; logs carry the method, the path and the
// key.
//
// # Acked keys
//
// A client may list, in the Idempotency-Acked-Keys header, keys whose
// responses it has received and will never retry: a comma-separated list
// (the header may be repeated), at most Options.MaxAckedKeys (default 64)
// keys, each a valid key. With an Actor the middleware removes them from
// that actor's space at once (in the claim's own log record for a new key),
// long before their TTL; an invalid list is a 400
// INVALID_IDEMPOTENCY_ACKED_KEYS. Without an Actor the header is ignored
// (anyone could free anyone's key), as it is on requests without a key.
//
// # Crashes: keys in doubt
//
// If the server dies while a request is being handled, its key is in doubt
// after the restart: retries get 409 IDEMPOTENCY_KEY_PROCESSING until the
// claim's lease (idem.Options.Lease, default 1 hour) runs out, after which a
// retry runs the handler again. Resolve such keys at start-up, before
// serving, with ResolveInDoubt (the same Options as the middleware's): for
// each of the middleware's keys in doubt it asks the application, which
// should keep the key with the records its handler writes, whether the
// effect happened; if so the response it gives is committed (retries
// replay it), if not the key is released (a retry runs the handler). See
// ExampleResolveInDoubt and examples/httpapi. (By hand: Store.InDoubt lists
// the claims, ParseKey tells the key and actor, StoredResponse.Encode and
// Claim.Commit or Claim.Abort settle them.)
//
// # Metrics
//
// The store's Stats count the Idempotency-Key service's metrics: Hits
// (idempotency.hit), Misses (.miss), Conflicts (.conflict),
// InFlightCollisions (.processing_collision) and Cleanups (.cleanup.count);
// the hit rate is Hits / (Hits + Misses). Package idemprom exports them to
// Prometheus with the store's other counters and sizes.
//
// # Client
//
// Transport gives each POST an Idempotency-Key (idem.NewRequestID: 26
// characters, sortable by time) unless the caller set one, replays bodies,
// and retries network errors, attempt timeouts, 5xx (but 501 and 505) and
// IDEMPOTENCY_KEY_PROCESSING with the same key, with exponential backoff and
// jitter, honouring Retry-After, bounded by the request's context. Every
// attempt has a timeout (Transport.AttemptTimeout, default 30 seconds), and
// a retry after a timeout goes on a new connection. It never retries 400,
// 409 IDEMPOTENCY_KEY_CONFLICT, 422 or 429. It acks the keys
// whose responses it has read in Idempotency-Acked-Keys (see Transport).
package idemhttp
