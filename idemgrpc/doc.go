// Package idemgrpc makes gRPC unary methods exactly-once on an idem engine:
// per-client sequences (client_id and sequence in the request, per scope,
// as a ledger's writes carry them) or idempotency keys (metadata), a server
// interceptor that runs each identity's handler once and replays its stored
// response to retries, a ClientState service answering a client's last
// committed sequence, and on the client side a retry interceptor and a
// sequence tracker.
//
// # Server
//
//	srv, err := idemgrpc.NewServer(store, &idemgrpc.Options{ // store: an *idem.Engine or any idem.Store
//		Methods: map[string]idemgrpc.IdentifyFunc{
//			"/ledger.v1.Ledger/Write": identify, // client_id, sequence, scope fields from the message
//		},
//		Actor: idemgrpc.ContextActor, // the default: set by your auth interceptor with WithActor
//	})
//	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(auth, srv.UnaryServerInterceptor()))
//	ledgerpb.RegisterLedgerServer(gs, ledger)
//	idemgrpcpb.RegisterClientStateServer(gs, srv) // GetClientState
//	err = srv.Check(gs) // every listed method is a registered unary method
//
// Configuration errors are returned (NewServer: the options; Check: a
// listed method that is not registered, or is streaming, which the unary
// interceptor would let run without exactly-once). The interceptor refuses
// every call until Check has passed.
//
// For each listed method the interceptor takes the call's identity
// (IdentifyFunc: from the message, SequenceFromMessage; or from metadata,
// KeyFromMetadata) and asks the engine:
//
//   - sequence == last committed + 1 (or a new key): the handler runs; its
//     response is stored (EncodeReply: a google.protobuf.Any with the
//     message's full type name and deterministic encoding) durably before
//     it is returned.
//   - sequence == last committed, response still kept: the stored response
//     is returned (same type, same content; on the wire gRPC's codec encodes
//     it, which for messages without map fields gives the same bytes) with
//     the header idem-replay: true; nothing runs.
//   - a call with the same identity is running: the call waits for it
//     (Options.InFlightWait, default 2s, bounded by its deadline) and gets
//     its response; past the wait it is answered IN_FLIGHT.
//   - a handler error that certifies the call had no effect
//     (Options.NoEffect; by default the codes that refuse a request:
//     InvalidArgument, FailedPrecondition, ResourceExhausted, ...)
//     consumes no sequence and is not stored: the claim is aborted, the
//     client gets the handler's status unchanged, and the same sequence (or
//     key) runs again when sent again. A batch handler that applies all of
//     its writes or none therefore consumes one sequence on success and
//     none on a refusal.
//   - once the handler ran, its identity is never released otherwise: any
//     other error (Unknown, Internal, Unavailable, DeadlineExceeded, ...:
//     the side effect may have happened) and a panic are stored, and
//     retries get them again with FAILURE_REPLAYED; a response that cannot
//     be stored (larger than MaxReplySize or the engine's limit, or not a
//     protobuf message) commits a marker, and retries get
//     RESPONSE_NOT_STORED. The handler does not run again for that
//     identity.
//
// The engine keeps a client's latest response only: a retry of an older
// sequence is ALREADY_COMMITTED. Options.TTL bounds how long the latest one
// is kept (a ledger's five-minute response cache); after it, it too is
// ALREADY_COMMITTED. The sequence number itself is never forgotten.
//
// # Scope and actor
//
// The engine scope of a call is EncodeScope(Options.ScopePrefix, actor,
// Identity.Scope...): each element length-prefixed, so no two distinct
// (prefix, actor, fields) tuples share a scope. Namespace-level writes
// ([namespace]) and vault-level writes ([namespace, vault]) are separate
// sequence streams. The actor comes only from Options.Actor, a function of
// the authenticated context (ContextActor reads what an auth interceptor
// stored with WithActor; TLSActor reads the verified client certificate);
// an actor field or header sent by the client is never read. Since the
// actor is part of the scope, one actor can neither read (GetClientState)
// nor advance another's sequences, nor see its stored responses.
// UserActor, ClientActor and SystemActor form the ledger's actor format,
// "user:<id>", "client:<id>" and "system:<name>", from an IDFunc reading
// the authenticated context (ClientActor(TLSName) from a verified client
// certificate).
//
// # Status mapping
//
// Statuses the interceptor produces carry an errdetails.ErrorInfo with
// domain "idem" and the reason below; handler errors pass through
// untouched (their replays carry FAILURE_REPLAYED first).
//
//	case                             code                reason                details
//	sequence > last + 1              FailedPrecondition  SEQUENCE_GAP          last_committed_sequence, sequence, client_id
//	sequence <= last, reply gone     AlreadyExists       ALREADY_COMMITTED     last_committed_sequence, sequence, client_id
//	same identity, other payload     AlreadyExists       IDEMPOTENCY_CONFLICT
//	same identity running            Aborted             IN_FLIGHT             lease_until, RetryInfo
//	handler outlived the lease       Aborted             LEASE_LOST            RetryInfo
//	identity missing or malformed    InvalidArgument     INVALID_IDENTITY
//	no actor (auth failed)           Unauthenticated     (the ActorFunc's status)
//	engine closed or failed          Unavailable         ENGINE_UNAVAILABLE
//	ran, response not stored         Unavailable         IN_DOUBT              RetryInfo
//	retry, response was not storable AlreadyExists       RESPONSE_NOT_STORED   sequence, client_id
//	retry, handler failed (effect?)  the handler's code  FAILURE_REPLAYED      the handler's details
//
// Why these codes, following the gRPC status code guide:
//
//   - SEQUENCE_GAP is FailedPrecondition: "the system is not in a state
//     required for the operation; do not retry until the state is fixed".
//     Nothing ran; the client must resynchronize (GetClientState) and
//     resend at last_committed_sequence + 1.
//   - ALREADY_COMMITTED is AlreadyExists: the write the client tries to
//     create exists (it ran); retrying cannot change that.
//   - IDEMPOTENCY_CONFLICT is AlreadyExists too: the identity exists, bound
//     to another request; a retry would fail the same way (the client must
//     use a new sequence or key). The reason tells it from ALREADY_COMMITTED.
//   - IN_FLIGHT is Aborted ("a concurrency conflict; retry at a higher
//     level"), not Unavailable: the server is healthy, so load balancers'
//     health and outlier detection must not count it, and generic retry
//     policies keyed on Unavailable do not retry it blindly. RetryInfo says
//     when to retry; retrying with the same identity is safe.
//   - INVALID_IDENTITY is InvalidArgument: wrong whatever the server's state.
//   - ENGINE_UNAVAILABLE and IN_DOUBT are Unavailable: transient from the
//     client's view (a restart or failover settles them), and a retry with
//     the same identity is safe, so the standard retryable code fits.
//   - RESPONSE_NOT_STORED is AlreadyExists, as ALREADY_COMMITTED: the call
//     ran and a retry cannot bring its response back. (The call itself gets
//     its response when only its size stopped it from being stored;
//     Internal RESPONSE_NOT_STORED when it was not a storable message.)
//   - FAILURE_REPLAYED keeps the handler's own code, so that the retry
//     reads as the first call did; the reason makes it final (the retry
//     interceptor never retries it, even with code Unavailable).
//
// UnaryClientInterceptor retries exactly the safe set: Unavailable,
// DeadlineExceeded (while the call's own context lives), and Aborted with
// reason IN_FLIGHT or LEASE_LOST. It never retries FailedPrecondition,
// AlreadyExists, InvalidArgument, or any other handler error: these are
// final for that identity, and resending a failed call would run it again
// (a handler's own Unavailable or DeadlineExceeded is retried and runs
// again, since that failure consumed nothing: the code asks for it).
//
// # Client
//
// DialOptions gives a ClientConn the retry interceptor, which resends the
// same request message (so the same client_id and sequence; an idempotency
// key in outgoing metadata stays in the context) with exponential backoff
// and jitter, up to MaxAttempts, never sleeping past the call's deadline,
// honouring RetryInfo advice. Each attempt has a timeout
// (RetryOptions.PerAttemptTimeout, default 10s). A connection whose peer
// vanished without closing it (a zombie connection) swallows requests
// silently, so after an attempt that timed out the interceptor closes the
// ClientConn's connections that received nothing since the attempt began
// and has it reconnect at once: the retry goes out on a new connection.
// Keepalive pings (RetryOptions.Keepalive, default every 30s of silence
// while calls are outstanding, 10s to answer) find such connections
// between attempts; the server must permit them
// (grpc.KeepaliveEnforcementPolicy, MinTime at most the client's Time).
// UnaryClientInterceptor alone retries on the same ClientConn without
// closing connections.
//
// A Tracker numbers a client's requests per scope: Call saves last used + 1
// in a SequenceStore before sending (FileStore: fsynced file per scope;
// MemoryStore), handles SEQUENCE_GAP and a lost or corrupt saved state by
// asking GetClientState and resuming at last committed + 1, gives back the
// number of a request the server certifies consumed nothing (a handler
// error), and keeps it when the outcome is unknown (the next request then
// meets a gap and recovers). Per-client sequences allow one outstanding
// request per scope; Call serializes them.
//
// # Stored responses
//
// The reply stored for a call (idem.Request's reply bytes) is a
// google.protobuf.Any, marshaled deterministically: the response under
// "type.googleapis.com/" and its full type name (EncodeReply), or a marker
// under a URL naming no protobuf type, whose value is a google.rpc.Status:
// "idemdb.dev/idemgrpc/response-not-stored" (the handler ran, its response
// was not stored; the status message says why) or
// "idemdb.dev/idemgrpc/handler-failed" (the handler's failure, replayed
// with FAILURE_REPLAYED). An empty reply reads as response-not-stored. A
// stored reply outlives the binary that wrote it, so these URLs and this
// encoding do not change.
//
// # Restarts
//
// Stored responses are in the engine's log, so a retry after a server
// restart gets the response of a write that ran before it. A crash while a
// handler runs leaves its claim in doubt; after reopening, ResolveInDoubt
// lets the service settle each one from its own state (commit with the
// response if the effect happened, abort if not) before serving. The
// ledger example (examples/ledger) does it from its journal.
package idemgrpc
