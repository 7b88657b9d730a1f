package idemgrpc

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemgrpc/idemgrpcpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// Identity is who a call is, for exactly-once purposes: either a per-client
// sequence (Client and Seq) or an idempotency key (Key), within the service's
// scope fields. The actor is added by the server (Options.Actor), never taken
// from here.
type Identity struct {
	// Scope holds the service's scope fields, for example [namespace] or
	// [namespace, vault]. Each distinct tuple (with the actor) is a separate
	// sequence stream and key space.
	Scope []string
	// Client and Seq select per-client sequences: Seq must be the client's
	// last committed sequence + 1 to run (sequences start at 1).
	Client string
	Seq    uint64
	// Key is an idempotency key (for example from metadata, KeyFromMetadata).
	Key string
}

// IdentifyFunc extracts a call's identity from its request message or its
// metadata. An error that is a gRPC status is returned as is; any other
// error becomes InvalidArgument with reason INVALID_IDENTITY. Nothing runs.
type IdentifyFunc func(ctx context.Context, req proto.Message) (Identity, error)

// Options configure a Server. nil or a zero field means its default.
type Options struct {
	// Methods maps full method names ("/pkg.Service/Method") to the
	// function giving their identity. Only these methods are exactly-once;
	// every other method passes through the interceptor untouched. Each
	// must be a unary method of a service registered on the gRPC server:
	// Server.Check verifies it, and the interceptor serves nothing until
	// Check has passed.
	Methods map[string]IdentifyFunc
	// Actor gives the caller's actor from the authenticated context
	// (default ContextActor). The actor is part of every scope.
	Actor ActorFunc
	// ScopePrefix is the first field of every engine scope this server
	// builds (default "grpc"), so that other users of the same engine
	// (an HTTP middleware, another service) never share its ids.
	ScopePrefix string
	// Fingerprint returns the payload fingerprint of a request: a retry of
	// an identity with another fingerprint is IDEMPOTENCY_CONFLICT. Default:
	// SHA-256 of the full method name and the request's deterministic
	// protobuf encoding. Returning nil turns the check off for that call;
	// then nothing stops a retry of another method under the same identity
	// from getting this method's stored response (of another type), so keep
	// identities per method when fingerprints are off.
	Fingerprint func(fullMethod string, req proto.Message) ([]byte, error)
	// InFlightWait is how long a call whose identity is being run by
	// another call waits for it to finish (then it gets that call's reply)
	// before answering IN_FLIGHT (default 2s, always bounded by the call's
	// deadline). Negative: answer IN_FLIGHT at once.
	InFlightWait time.Duration
	// RetryDelay is the RetryInfo advice sent with IN_FLIGHT (default 100ms).
	RetryDelay time.Duration
	// MaxReplySize bounds a stored response (default 12 MiB, the engine's
	// default limit). A larger response (or one the engine refuses as
	// larger than its own Options.MaxReplySize) is returned to the call but
	// not stored: a marker is committed in its place, so the handler never
	// runs again for that identity, and retries get AlreadyExists
	// RESPONSE_NOT_STORED.
	MaxReplySize int
	// NoEffect reports whether a handler's error certifies that the call
	// had no effect. Then the claim is aborted: the identity is not
	// consumed, the error is not stored, and the same sequence or key runs
	// the handler again. Any other error (and a panic) leaves the outcome
	// unknown: the identity is consumed and the error stored, so that the
	// handler never runs twice for it; retries get it again with
	// FAILURE_REPLAYED. Default: DefaultNoEffect (the status codes that
	// refuse a request, such as InvalidArgument or FailedPrecondition).
	NoEffect func(err error) bool
	// TTL, when positive, is how long a stored response is kept for
	// retries (idem.Request.TTL: from the call's start; a retry does not
	// extend it), like a ledger's five-minute response cache. After it a
	// retry of the last sequence gets ALREADY_COMMITTED (the number is
	// never reused) and a retried idempotency key runs again. Zero: kept
	// until the client's next sequence, or for keys until acked, expired
	// by the engine's Retention, or forgotten.
	TTL time.Duration
	// KeepReplies and KeepRepliesFor are the per-client sequences' reply
	// cache (sequence-mode methods): a retry of any of a client's last
	// KeepReplies sequence numbers, committed less than KeepRepliesFor
	// ago, gets its stored response; an older one gets ALREADY_COMMITTED
	// with the client's last committed sequence. Defaults: 10,000 and 5
	// minutes, the ledger's. KeepReplies 1 keeps only the last one; the
	// engine logs the window with every claim, so recovery and replicas
	// keep the same replies (idem.Request.KeepReplies).
	KeepReplies    int
	KeepRepliesFor time.Duration
	// Logger receives warnings (aborts that failed, replies not stored).
	// Default: discard.
	Logger *slog.Logger
}

// The per-client sequences' reply cache defaults (Options.KeepReplies,
// Options.KeepRepliesFor).
const (
	DefaultKeepReplies    = 10000
	DefaultKeepRepliesFor = 5 * time.Minute
)

// Server is the exactly-once layer of a gRPC server: its
// UnaryServerInterceptor runs each identified call's handler once and
// replays the stored response to retries, and it implements the
// ClientState service (GetClientState). Safe for concurrent use.
type Server struct {
	idemgrpcpb.UnimplementedClientStateServer
	store   idem.Store
	o       Options
	checked atomic.Bool
}

// NewServer returns a Server storing its claims and responses in store
// (an *idem.Engine, or any idem.Store). Configuration errors name the
// field and the value. Register the services on the gRPC server, then call
// Check.
func NewServer(store idem.Store, opts *Options) (*Server, error) {
	if store == nil {
		return nil, errors.New("idemgrpc: NewServer: the store is nil")
	}
	var o Options
	if opts != nil {
		o = *opts
	}
	bad := func(field string, v any, why string) (*Server, error) {
		return nil, fmt.Errorf("idemgrpc: Options.%s: %v: %s", field, v, why)
	}
	switch {
	case o.RetryDelay < 0:
		return bad("RetryDelay", o.RetryDelay, "negative")
	case o.MaxReplySize < 0:
		return bad("MaxReplySize", o.MaxReplySize, "negative")
	case o.TTL < 0:
		return bad("TTL", o.TTL, "negative (0 keeps responses until the next sequence)")
	case o.KeepReplies < 0 || o.KeepReplies > idem.MaxKeepReplies:
		return bad("KeepReplies", o.KeepReplies, fmt.Sprintf("want 1..%d (0: the default %d)", idem.MaxKeepReplies, DefaultKeepReplies))
	case o.KeepRepliesFor < 0:
		return bad("KeepRepliesFor", o.KeepRepliesFor, "negative")
	}
	if o.KeepReplies == 0 {
		o.KeepReplies = DefaultKeepReplies
	}
	if o.KeepRepliesFor == 0 {
		o.KeepRepliesFor = DefaultKeepRepliesFor
	}
	if o.Actor == nil {
		o.Actor = ContextActor
	}
	if o.ScopePrefix == "" {
		o.ScopePrefix = "grpc"
	}
	if o.Fingerprint == nil {
		o.Fingerprint = DefaultFingerprint
	}
	if o.InFlightWait == 0 {
		o.InFlightWait = 2 * time.Second
	}
	if o.RetryDelay == 0 {
		o.RetryDelay = 100 * time.Millisecond
	}
	if o.NoEffect == nil {
		o.NoEffect = DefaultNoEffect
	}
	if o.MaxReplySize == 0 {
		o.MaxReplySize = 12 << 20
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	m := make(map[string]IdentifyFunc, len(o.Methods))
	for k, f := range o.Methods {
		if _, _, err := splitMethod(k); err != nil {
			return bad("Methods", k, err.Error())
		}
		if f == nil {
			return bad("Methods", k, "nil IdentifyFunc")
		}
		m[k] = f
	}
	o.Methods = m
	return &Server{store: store, o: o}, nil
}

// splitMethod splits "/pkg.Service/Method".
func splitMethod(full string) (service, method string, err error) {
	rest, ok := strings.CutPrefix(full, "/")
	if ok {
		service, method, ok = strings.Cut(rest, "/")
	}
	if !ok || service == "" || method == "" || strings.Contains(method, "/") {
		return "", "", errors.New(`not a full method name "/package.Service/Method"`)
	}
	return service, method, nil
}

// ServiceInfoProvider lists the services registered on a gRPC server:
// *grpc.Server implements it.
type ServiceInfoProvider interface {
	GetServiceInfo() map[string]grpc.ServiceInfo
}

// Check verifies every method of Options.Methods against the services
// registered on gs (a *grpc.Server, after its services were registered):
// an unknown method, or a streaming one (the interceptor is unary: it
// would run without exactly-once), is an error naming it. Until Check has
// passed, the interceptor answers every call Internal, so that no
// misconfigured method runs.
func (s *Server) Check(gs ServiceInfoProvider) error {
	if gs == nil {
		return errors.New("idemgrpc: Check: no gRPC server")
	}
	info := gs.GetServiceInfo()
	var errs []error
	for _, full := range slices.Sorted(maps.Keys(s.o.Methods)) {
		service, method, _ := splitMethod(full)
		si, ok := info[service]
		if !ok {
			errs = append(errs, fmt.Errorf("idemgrpc: Options.Methods: unknown method %s: service %s not registered", full, service))
			continue
		}
		i := slices.IndexFunc(si.Methods, func(m grpc.MethodInfo) bool { return m.Name == method })
		switch {
		case i < 0:
			errs = append(errs, fmt.Errorf("idemgrpc: Options.Methods: unknown method %s: service %s has no method %s", full, service, method))
		case si.Methods[i].IsClientStream || si.Methods[i].IsServerStream:
			errs = append(errs, fmt.Errorf("idemgrpc: Options.Methods: %s is a streaming method: only unary methods can be exactly-once", full))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	s.checked.Store(true)
	return nil
}

// DefaultFingerprint is SHA-256 over the full method name, a zero byte and
// the request's deterministic protobuf encoding. Deterministic encoding is
// stable for one binary; if clients in other languages retry through
// re-encoding proxies, supply a fingerprint over the fields that matter.
func DefaultFingerprint(fullMethod string, req proto.Message) ([]byte, error) {
	b, err := deterministic.Marshal(req)
	if err != nil {
		return nil, err
	}
	h := sha256.New()
	h.Write([]byte(fullMethod))
	h.Write([]byte{0})
	h.Write(b)
	return h.Sum(nil), nil
}

// Call describes the exactly-once call a handler is running; handlers read
// it with CallFromContext (for example to record the actor).
type Call struct {
	Method   string
	Actor    string
	Identity Identity
	// Scope is the engine scope (EncodeScope of ScopePrefix, Actor and
	// Identity.Scope).
	Scope string
}

type callKey struct{}

// CallFromContext returns the call the interceptor is running the handler
// for.
func CallFromContext(ctx context.Context) (*Call, bool) {
	c, ok := ctx.Value(callKey{}).(*Call)
	return c, ok
}

// ReplayHeader is the response header set to "true" when a response is a
// replay of a stored one.
const ReplayHeader = "idem-replay"

// actor runs the ActorFunc and turns its failures into statuses.
func (s *Server) actor(ctx context.Context) (string, error) {
	a, err := s.o.Actor(ctx)
	if err != nil {
		if _, ok := status.FromError(err); ok {
			return "", err
		}
		return "", status.Errorf(codes.Unauthenticated, "idemgrpc: no actor: %v", err)
	}
	if a == "" {
		return "", status.Error(codes.Unauthenticated, "idemgrpc: the actor function returned an empty actor")
	}
	return a, nil
}

func invalidIdentity(format string, args ...any) error {
	return newStatus(codes.InvalidArgument, ReasonInvalidIdentity, nil, 0, "idemgrpc: invalid identity: "+fmt.Sprintf(format, args...))
}

func checkIdentity(id Identity) error {
	switch {
	case id.Key != "" && (id.Client != "" || id.Seq != 0):
		return invalidIdentity("both an idempotency key and a client sequence were given")
	case id.Key != "":
		return nil
	case id.Client == "" && id.Seq == 0:
		return invalidIdentity("no client_id and sequence, and no idempotency key")
	case id.Client == "":
		return invalidIdentity("sequence %d without a client_id", id.Seq)
	case id.Seq == 0:
		return invalidIdentity("client_id %q without a sequence (sequences start at 1)", id.Client)
	}
	return nil
}

// UnaryServerInterceptor returns the interceptor. Chain it after the
// authentication interceptor (grpc.ChainUnaryInterceptor(auth,
// s.UnaryServerInterceptor())) so that the actor is known.
func (s *Server) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if !s.checked.Load() {
			s.o.Logger.Error("idemgrpc: a call before Server.Check passed; refused", "method", info.FullMethod)
			return nil, status.Errorf(codes.Internal, "idemgrpc: the server is not ready: Server.Check was not called after registering its services (call to %s refused)", info.FullMethod)
		}
		identify, ok := s.o.Methods[info.FullMethod]
		if !ok {
			return handler(ctx, req)
		}
		msg, ok := req.(proto.Message)
		if !ok {
			return nil, status.Errorf(codes.Internal, "idemgrpc: request of %s is %T, not a protobuf message", info.FullMethod, req)
		}
		actor, err := s.actor(ctx)
		if err != nil {
			return nil, err
		}
		id, err := identify(ctx, msg)
		if err != nil {
			if _, ok := status.FromError(err); ok {
				return nil, err
			}
			return nil, invalidIdentity("%v", err)
		}
		if err := checkIdentity(id); err != nil {
			return nil, err
		}
		call := &Call{Method: info.FullMethod, Actor: actor, Identity: id, Scope: EncodeScope(s.o.ScopePrefix, actor, id.Scope...)}
		fp, err := s.o.Fingerprint(info.FullMethod, msg)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "idemgrpc: fingerprint of %s: %v", info.FullMethod, err)
		}
		r := idem.Request{Scope: call.Scope, Client: id.Client, Seq: id.Seq, Fingerprint: fp, TTL: s.o.TTL}
		if id.Client != "" { // the reply cache of per-client sequences
			r.KeepReplies, r.KeepRepliesFor = s.o.KeepReplies, s.o.KeepRepliesFor
		}
		if id.Key != "" {
			r.ID = []byte(id.Key)
		}
		return s.serve(ctx, call, r, req, handler)
	}
}

func (s *Server) serve(ctx context.Context, call *Call, r idem.Request, req any, handler grpc.UnaryHandler) (any, error) {
	waitUntil := time.Now().Add(s.o.InFlightWait)
	for {
		res, err := s.store.Begin(ctx, r)
		if err != nil {
			return nil, s.storeStatus(err, r)
		}
		switch res.Status {
		case idem.Fresh:
			return s.run(ctx, call, res.Claim, req, handler)
		case idem.InFlight:
			if s.o.InFlightWait < 0 || !time.Now().Before(waitUntil) {
				return nil, s.inFlight(call, res.LeaseUntil)
			}
			wctx, cancel := context.WithDeadline(ctx, waitUntil)
			res, err = s.store.Wait(wctx, r)
			cancel()
			switch {
			case ctx.Err() != nil:
				return nil, status.FromContextError(ctx.Err()).Err()
			case errors.Is(err, context.DeadlineExceeded):
				continue // waited long enough: IN_FLIGHT
			case err != nil:
				return nil, s.storeStatus(err, r)
			case res.Status != idem.Done:
				continue // released, or the lease ran out: Begin claims it
			}
		}
		if res.Status != idem.Done {
			return nil, status.Errorf(codes.Internal, "idemgrpc: unexpected store status %v", res.Status)
		}
		m, mk, err := decodeStored(res.Reply)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "idemgrpc: %v", err)
		}
		_ = grpc.SetHeader(ctx, metadata.Pairs(ReplayHeader, "true"))
		if mk != nil {
			return nil, mk.err(call.Identity)
		}
		return m, nil
	}
}

func (s *Server) inFlight(call *Call, leaseUntil time.Time) error {
	meta := map[string]string{}
	if !leaseUntil.IsZero() {
		meta[MetaLeaseUntil] = leaseUntil.UTC().Format(time.RFC3339Nano)
	}
	what := "idempotency key"
	if call.Identity.Client != "" {
		what = fmt.Sprintf("client %q sequence %d", call.Identity.Client, call.Identity.Seq)
		meta[MetaClient] = call.Identity.Client
		meta[MetaSequence] = strconv.FormatUint(call.Identity.Seq, 10)
	}
	return newStatus(codes.Aborted, ReasonInFlight, meta, s.o.RetryDelay,
		fmt.Sprintf("idemgrpc: %s is being processed by another call; retry with the same identity", what))
}

// run calls the handler for a fresh claim and commits its response. Once
// the handler has been called the identity is released (the claim aborted)
// only when its error certifies it had no effect (NoEffect); a panic, any
// other error, and a response that cannot be stored all commit a marker
// instead, so that a retry never runs the handler again.
func (s *Server) run(ctx context.Context, call *Call, c *idem.Claim, req any, handler grpc.UnaryHandler) (any, error) {
	returned := false
	defer func() {
		if returned {
			return
		}
		// The handler panicked (the panic goes on): whatever it did stays
		// done, so the identity is consumed with a failure.
		s.o.Logger.Error("idemgrpc: the handler panicked; its identity is consumed (retries get FAILURE_REPLAYED)",
			"method", call.Method, "client", call.Identity.Client, "seq", call.Identity.Seq)
		st := status.Newf(codes.Internal, "idemgrpc: the handler of %s panicked", call.Method)
		s.commitMarker(ctx, call, c, markerFailed, st)
	}()
	resp, err := handler(context.WithValue(ctx, callKey{}, call), req)
	returned = true
	if err != nil {
		if s.o.NoEffect(err) {
			if aerr := c.Abort(ctx); aerr != nil {
				s.o.Logger.Warn("idemgrpc: abort of a failed call failed; its identity stays claimed until the lease ends",
					"method", call.Method, "client", call.Identity.Client, "seq", call.Identity.Seq, "err", aerr)
			}
			return nil, err
		}
		s.commitMarker(ctx, call, c, markerFailed, status.Convert(err))
		return nil, err
	}
	m, ok := resp.(proto.Message)
	if !ok || m == nil {
		why := fmt.Sprintf("%s returned %T, not a protobuf message", call.Method, resp)
		s.notStored(ctx, call, c, why)
		return nil, newStatus(codes.Internal, ReasonResponseNotStored, nil, 0, "idemgrpc: "+why+"; the call ran and will not run again")
	}
	b, err := EncodeReply(m)
	if err != nil {
		s.notStored(ctx, call, c, err.Error())
		return nil, newStatus(codes.Internal, ReasonResponseNotStored, nil, 0, fmt.Sprintf("idemgrpc: %v; the call ran and will not run again", err))
	}
	if len(b) > s.o.MaxReplySize {
		s.notStored(ctx, call, c, fmt.Sprintf("%s of %d bytes, more than MaxReplySize %d", m.ProtoReflect().Descriptor().FullName(), len(b), s.o.MaxReplySize))
		return resp, nil
	}
	err = c.Commit(ctx, b)
	if errors.Is(err, idem.ErrInvalidRequest) {
		// Larger than the engine's own limit: the claim is still open.
		s.notStored(ctx, call, c, fmt.Sprintf("%s of %d bytes: %v", m.ProtoReflect().Descriptor().FullName(), len(b), err))
		return resp, nil
	}
	if err != nil {
		return nil, s.commitStatus(call, err)
	}
	return resp, nil
}

// commitStatus is the status of a call whose handler ran but whose commit
// failed.
func (s *Server) commitStatus(call *Call, err error) error {
	if errors.Is(err, idem.ErrLeaseLost) {
		return newStatus(codes.Aborted, ReasonLeaseLost, nil, s.o.RetryDelay,
			"idemgrpc: the handler outlasted the engine's lease and another call took the request over; retry with the same identity for its reply")
	}
	// The side effect happened but its reply is not durable: the claim
	// stays in doubt (Server.ResolveInDoubt after a restart).
	s.o.Logger.Error("idemgrpc: commit failed; the call stays in doubt until the server restarts and resolves it",
		"method", call.Method, "client", call.Identity.Client, "seq", call.Identity.Seq, "err", err)
	return newStatus(codes.Unavailable, ReasonInDoubt, nil, s.o.RetryDelay,
		fmt.Sprintf("idemgrpc: the call ran but its response could not be stored (%v); retry with the same identity", err))
}

// notStored commits the RESPONSE_NOT_STORED marker of a call whose handler
// succeeded but whose response cannot be stored (why says what it was).
func (s *Server) notStored(ctx context.Context, call *Call, c *idem.Claim, why string) {
	s.o.Logger.Warn("idemgrpc: response not stored; retries get RESPONSE_NOT_STORED", "method", call.Method,
		"client", call.Identity.Client, "seq", call.Identity.Seq, "why", why)
	s.commitMarker(ctx, call, c, markerNotStored, status.New(codes.AlreadyExists, why))
}

// maxMarker bounds a marker's status; a larger one (a handler status with
// large details) keeps its code and the start of its message.
const maxMarker = 4 << 10

// commitMarker commits a marker in place of a response. If the engine
// refuses it as too large (its Options.MaxReplySize is tiny), a marker of
// the code alone is committed, and failing that an empty reply. A failure is logged: the claim then stays in
// flight (in doubt if the engine failed, taken over after its lease if it
// is lost).
func (s *Server) commitMarker(ctx context.Context, call *Call, c *idem.Claim, url string, st *status.Status) {
	b, err := encodeMarker(url, st)
	if err == nil && len(b) > maxMarker {
		b, err = encodeMarker(url, status.New(st.Code(), truncate(st.Message(), maxMarker/2)))
	}
	if err == nil {
		err = c.Commit(ctx, b)
		if errors.Is(err, idem.ErrInvalidRequest) {
			if b, err = encodeMarker(url, status.New(st.Code(), "")); err == nil {
				err = c.Commit(ctx, b)
			}
		}
		if errors.Is(err, idem.ErrInvalidRequest) {
			err = c.Commit(ctx, nil) // read as RESPONSE_NOT_STORED
		}
	}
	if err != nil {
		s.o.Logger.Error("idemgrpc: storing the marker of a call that ran failed", "method", call.Method,
			"client", call.Identity.Client, "seq", call.Identity.Seq, "marker", url, "err", err)
	}
}

// notStoredStatus is what retries of a call whose response was not stored
// get (why: what the response was, "" if unknown).
func notStoredStatus(id Identity, why string) error {
	var meta map[string]string
	what := "the call under this idempotency key"
	if id.Client != "" {
		meta = map[string]string{MetaClient: id.Client, MetaSequence: strconv.FormatUint(id.Seq, 10)}
		what = fmt.Sprintf("client %q sequence %d", id.Client, id.Seq)
	}
	if why != "" {
		why = " (" + why + ")"
	}
	return newStatus(codes.AlreadyExists, ReasonResponseNotStored, meta, 0,
		fmt.Sprintf("idemgrpc: %s ran, but its response was not stored%s, so it cannot be replayed; the call does not run again", what, why))
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// storeStatus maps a store error to a status (the table in doc.go).
func (s *Server) storeStatus(err error, r idem.Request) error {
	var (
		gap  *idem.SequenceGapError
		done *idem.AlreadyCommittedError
	)
	switch {
	case errors.As(err, &gap):
		return newStatus(codes.FailedPrecondition, ReasonSequenceGap, map[string]string{
			MetaLastCommitted: strconv.FormatUint(gap.Last, 10),
			MetaSequence:      strconv.FormatUint(gap.Seq, 10),
			MetaClient:        gap.Client,
		}, 0, fmt.Sprintf("idemgrpc: sequence gap: client %q sent sequence %d but its last committed sequence is %d; resume at %d (GetClientState)",
			gap.Client, gap.Seq, gap.Last, gap.Last+1))
	case errors.As(err, &done):
		// Last is the client's number as the engine refused the request
		// (the same lock), not a later reading.
		meta := map[string]string{MetaSequence: strconv.FormatUint(r.Seq, 10), MetaClient: r.Client,
			MetaLastCommitted: strconv.FormatUint(done.Last, 10)}
		return newStatus(codes.AlreadyExists, ReasonAlreadyCommitted, meta, 0,
			fmt.Sprintf("idemgrpc: client %q sequence %d was already committed and its response is no longer kept", r.Client, r.Seq))
	case errors.Is(err, idem.ErrConflict):
		what := "the idempotency key"
		if r.Client != "" {
			what = fmt.Sprintf("client %q sequence %d", r.Client, r.Seq)
		}
		return newStatus(codes.AlreadyExists, ReasonConflict, nil, 0,
			fmt.Sprintf("idemgrpc: %s was already used by a request with a different payload", what))
	case errors.Is(err, idem.ErrInvalidRequest):
		return newStatus(codes.InvalidArgument, ReasonInvalidIdentity, nil, 0, err.Error())
	case errors.Is(err, idem.ErrClosed), errors.Is(err, idem.ErrFailed), errors.Is(err, idem.ErrLocked):
		return newStatus(codes.Unavailable, ReasonUnavailable, nil, 0, err.Error())
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return status.FromContextError(err).Err()
	}
	return status.Errorf(codes.Internal, "idemgrpc: %v", err)
}

// ClientState returns the caller's last committed sequence of client in the
// scope fields (the actor comes from ctx through Options.Actor). Errors are
// gRPC statuses. Services with their own GetClientState message (per
// namespace, per vault) call it.
func (s *Server) ClientState(ctx context.Context, client string, scope ...string) (uint64, error) {
	actor, err := s.actor(ctx)
	if err != nil {
		return 0, err
	}
	if client == "" {
		return 0, invalidIdentity("empty client_id")
	}
	last, err := s.store.ClientState(ctx, EncodeScope(s.o.ScopePrefix, actor, scope...), client)
	if err != nil {
		return 0, s.storeStatus(err, idem.Request{})
	}
	return last, nil
}

// GetClientState implements the ClientState service
// (idemgrpcpb.RegisterClientStateServer(grpcServer, s)).
func (s *Server) GetClientState(ctx context.Context, req *idemgrpcpb.GetClientStateRequest) (*idemgrpcpb.GetClientStateResponse, error) {
	last, err := s.ClientState(ctx, req.GetClientId(), req.GetScope()...)
	if err != nil {
		return nil, err
	}
	return &idemgrpcpb.GetClientStateResponse{LastCommittedSequence: last}, nil
}

// InDoubt is a call whose claim a crash (or Close) left in flight: the
// handler may or may not have made its side effect.
type InDoubt struct {
	Actor string
	Scope []string
	// Client and Seq, or Key: the call's identity.
	Client string
	Seq    uint64
	Key    string
	// ClaimedAt is when the call began.
	ClaimedAt time.Time
	// EngineScope is the engine scope (Call.Scope when the call ran).
	EngineScope string
}

// ResolveInDoubt settles this server's claims left in doubt by a crash
// (claims of other scope prefixes are left alone). decide looks in the
// service's own state: if the call's effect happened it returns its
// response and true (the claim is committed with it, so retries get it;
// with a nil response, retries get RESPONSE_NOT_STORED); if not, nil and
// false (the claim is aborted and a retry runs the call). Call it after
// Open, before serving. An error from decide stops it.
func (s *Server) ResolveInDoubt(ctx context.Context, decide func(InDoubt) (proto.Message, bool, error)) (committed, aborted int, err error) {
	// EncodeScope's output starts with the length-prefixed ScopePrefix.
	claims, err := s.store.InDoubt(ctx, string(appendField(nil, s.o.ScopePrefix)))
	if err != nil {
		return 0, 0, err
	}
	for _, c := range claims {
		prefix, actor, fields, derr := DecodeScope(c.Scope)
		if derr != nil || prefix != s.o.ScopePrefix {
			continue
		}
		d := InDoubt{Actor: actor, Scope: fields, Client: c.Client, Seq: c.Seq, Key: string(c.ID), ClaimedAt: c.ClaimedAt, EngineScope: c.Scope}
		reply, ran, err := decide(d)
		if err != nil {
			return committed, aborted, err
		}
		if !ran && reply != nil {
			return committed, aborted, fmt.Errorf("idemgrpc: ResolveInDoubt: decide returned a reply for %s claim it says did not run", d.what())
		}
		if !ran {
			if err := c.Claim.Abort(ctx); err != nil {
				return committed, aborted, err
			}
			aborted++
			continue
		}
		var b []byte
		if reply == nil {
			// It ran; its response is not known: retries get
			// RESPONSE_NOT_STORED.
			b, err = encodeMarker(markerNotStored, status.New(codes.AlreadyExists, "it ran before a restart and its response was not recovered"))
		} else {
			b, err = EncodeReply(reply)
		}
		if err != nil {
			return committed, aborted, err
		}
		if err := c.Claim.Commit(ctx, b); err != nil {
			return committed, aborted, err
		}
		committed++
	}
	return committed, aborted, nil
}

func (d InDoubt) what() string {
	if d.Client != "" {
		return fmt.Sprintf("client %q sequence %d", d.Client, d.Seq)
	}
	return fmt.Sprintf("idempotency key %q", d.Key)
}
