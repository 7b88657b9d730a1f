package idemgrpc

import (
	"strconv"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
)

// ErrorDomain is the errdetails.ErrorInfo domain of every status the
// interceptor produces itself (handler errors pass through untouched).
const ErrorDomain = "idem"

// ErrorInfo reasons (see the status table in the package documentation).
const (
	// ReasonSequenceGap: FailedPrecondition; the sequence is beyond the
	// client's last committed one + 1. Nothing ran. Metadata:
	// last_committed_sequence, sequence, client_id.
	ReasonSequenceGap = "SEQUENCE_GAP"
	// ReasonAlreadyCommitted: AlreadyExists; the sequence is at or below the
	// last committed one and its reply is no longer kept: the request ran
	// before. Metadata: last_committed_sequence, sequence, client_id.
	ReasonAlreadyCommitted = "ALREADY_COMMITTED"
	// ReasonConflict: AlreadyExists; the identity was used by a request with
	// another payload (fingerprint mismatch). Nothing ran.
	ReasonConflict = "IDEMPOTENCY_CONFLICT"
	// ReasonInFlight: Aborted, with errdetails.RetryInfo; another call with
	// the same identity is running. Retrying with the same identity is safe.
	// Metadata: lease_until (RFC 3339) when known.
	ReasonInFlight = "IN_FLIGHT"
	// ReasonLeaseLost: Aborted; the handler ran longer than the engine's
	// lease and another call took the identity over, so this reply was not
	// stored. Retrying with the same identity returns the other call's reply.
	ReasonLeaseLost = "LEASE_LOST"
	// ReasonInvalidIdentity: InvalidArgument; the request's identity is
	// missing or malformed. Nothing ran.
	ReasonInvalidIdentity = "INVALID_IDENTITY"
	// ReasonUnavailable: Unavailable; the engine is closed or stopped after
	// a disk failure. Nothing ran; retry later (or on another server).
	ReasonUnavailable = "ENGINE_UNAVAILABLE"
	// ReasonInDoubt: Unavailable; the handler ran but its response could
	// not be stored (the engine closed or failed meanwhile). The call stays
	// in doubt until the server restarts and settles it
	// (Server.ResolveInDoubt); retrying with the same identity is safe.
	ReasonInDoubt = "IN_DOUBT"
	// ReasonResponseNotStored: the handler ran, but its response could not
	// be stored (larger than Options.MaxReplySize or the engine's limit, not
	// encodable, or not a protobuf message). The identity is consumed: a
	// marker was committed in place of the response, so the handler never
	// runs again for it. Retries get AlreadyExists with this reason
	// (metadata: sequence and client_id for per-client sequences); the call
	// itself gets its response when it is a message that is only too large
	// to store, else Internal with this reason.
	ReasonResponseNotStored = "RESPONSE_NOT_STORED"
	// ReasonFailureReplayed: the handler failed with an error that does not
	// certify it had no effect (Options.NoEffect), or panicked, so its side
	// effect may have happened: the identity is consumed and its failure
	// stored. Retries get that status again (its code, its message after a
	// prefix, its details) with this ErrorInfo first; they are final. A new
	// request needs a new sequence or key.
	ReasonFailureReplayed = "FAILURE_REPLAYED"
)

// ErrorInfo metadata keys.
const (
	MetaLastCommitted = "last_committed_sequence"
	MetaSequence      = "sequence"
	MetaClient        = "client_id"
	MetaLeaseUntil    = "lease_until"
)

func newStatus(c codes.Code, reason string, meta map[string]string, retry time.Duration, msg string) error {
	st := status.New(c, msg)
	details := []protoadapt.MessageV1{&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain, Metadata: meta}}
	if retry > 0 {
		details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(retry)})
	}
	if d, err := st.WithDetails(details...); err == nil {
		st = d
	}
	return st.Err()
}

// ErrorReason returns the ErrorInfo reason and metadata of a status produced
// by the idemgrpc server interceptor (domain ErrorDomain); "" if err carries
// none (for example a handler's own error).
func ErrorReason(err error) (reason string, meta map[string]string) {
	st, ok := status.FromError(err)
	if !ok || st == nil {
		return "", nil
	}
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetDomain() == ErrorDomain {
			return ei.GetReason(), ei.GetMetadata()
		}
	}
	return "", nil
}

// LastCommittedSequence returns the last_committed_sequence carried by a
// SEQUENCE_GAP or ALREADY_COMMITTED status.
func LastCommittedSequence(err error) (uint64, bool) {
	reason, meta := ErrorReason(err)
	if reason != ReasonSequenceGap && reason != ReasonAlreadyCommitted {
		return 0, false
	}
	v, perr := strconv.ParseUint(meta[MetaLastCommitted], 10, 64)
	return v, perr == nil
}

// IsSequenceGap reports whether err is a SEQUENCE_GAP status.
func IsSequenceGap(err error) bool { r, _ := ErrorReason(err); return r == ReasonSequenceGap }

// IsAlreadyCommitted reports whether err is an ALREADY_COMMITTED status: the
// request ran before and its reply is no longer kept.
func IsAlreadyCommitted(err error) bool {
	r, _ := ErrorReason(err)
	return r == ReasonAlreadyCommitted
}

// IsConflict reports whether err is an IDEMPOTENCY_CONFLICT status.
func IsConflict(err error) bool { r, _ := ErrorReason(err); return r == ReasonConflict }

// retryDelay returns the RetryInfo delay of a status, if any.
func retryDelay(err error) time.Duration {
	st, ok := status.FromError(err)
	if !ok || st == nil {
		return 0
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			return ri.GetRetryDelay().AsDuration()
		}
	}
	return 0
}

// replayedFailure is the status retries of a call whose handler failed get:
// the stored status, its message prefixed, FAILURE_REPLAYED's ErrorInfo
// first among its details.
func replayedFailure(sp *spb.Status) *status.Status {
	ei, err := anypb.New(&errdetails.ErrorInfo{Reason: ReasonFailureReplayed, Domain: ErrorDomain})
	if err != nil {
		return status.New(codes.Internal, "idemgrpc: "+err.Error())
	}
	return status.FromProto(&spb.Status{
		Code: sp.GetCode(),
		Message: "idemgrpc: replay of a failed call (its handler may have had effects, so it does not run again; " +
			"send a new request with a new identity): " + sp.GetMessage(),
		Details: append([]*anypb.Any{ei}, sp.GetDetails()...),
	})
}

// noEffectCodes are the codes DefaultNoEffect accepts.
var noEffectCodes = map[codes.Code]bool{
	codes.InvalidArgument: true, codes.NotFound: true, codes.AlreadyExists: true,
	codes.PermissionDenied: true, codes.Unauthenticated: true, codes.ResourceExhausted: true,
	codes.FailedPrecondition: true, codes.Aborted: true, codes.OutOfRange: true,
	codes.Unimplemented: true,
}

// DefaultNoEffect is the default Options.NoEffect: a handler error certifies
// that the call changed nothing when it is a gRPC status whose code says the
// request was refused: InvalidArgument, NotFound, AlreadyExists,
// PermissionDenied, Unauthenticated, ResourceExhausted, FailedPrecondition,
// Aborted, OutOfRange or Unimplemented. Handlers must return these only
// before any side effect (or after undoing it). Every other error (Unknown,
// including a plain Go error, Internal, DataLoss, Unavailable,
// DeadlineExceeded, Canceled) leaves the outcome unknown.
func DefaultNoEffect(err error) bool {
	st, ok := status.FromError(err)
	return ok && st != nil && noEffectCodes[st.Code()]
}
