package idemcluster

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// ErrorDomain is the google.rpc.ErrorInfo domain of the cluster's errors.
const ErrorDomain = "idem.cluster"

// The ErrorInfo reasons of the cluster's errors.
const (
	ReasonConflict         = "CONFLICT"
	ReasonSequenceGap      = "SEQUENCE_GAP"
	ReasonAlreadyCommitted = "ALREADY_COMMITTED"
	ReasonLeaseLost        = "LEASE_LOST"
	ReasonInFlight         = "IN_FLIGHT"
	ReasonInvalid          = "INVALID"
	ReasonNotLeader        = "NOT_LEADER"
	ReasonClosed           = "CLOSED"
	ReasonInDoubt          = "IN_DOUBT"
)

// errNotLeader is a node's answer when it is not the leader; leader is the
// leader's gRPC address when the node knows it.
type errNotLeader struct{ leader string }

func (e *errNotLeader) Error() string {
	if e.leader == "" {
		return "idemcluster: not the leader, and no leader is known"
	}
	return "idemcluster: not the leader; the leader is at " + e.leader
}

// toStatus turns an engine or node error into a gRPC status carrying an
// ErrorInfo, so that the client (in any language) gets the error back with
// its fields.
//
// Raft's own errors, and the node stopping, are answers a client retries
// on another node, never INTERNAL (a leader that removed itself met them:
// raft shuts down after the removal, ShutdownOnRemove):
//
//	raft.ErrNotLeader, raft.ErrLeadershipTransferInProgress   UNAVAILABLE, NOT_LEADER (nothing was appended)
//	raft.ErrLeadershipLost, raft.ErrRaftShutdown, errStopped  UNAVAILABLE, IN_DOUBT (the change may commit through another leader)
//
// A handler that knows the leader's address wraps them first (raftErr), so
// that NOT_LEADER carries it.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	var (
		code   codes.Code
		reason string
		meta   = map[string]string{}
		gap    *idem.SequenceGapError
		ac     *idem.AlreadyCommittedError
		nl     *errNotLeader
	)
	switch {
	case errors.As(err, &nl):
		code, reason = codes.Unavailable, ReasonNotLeader
		if nl.leader != "" {
			meta["leader"] = nl.leader
		}
	case errors.As(err, &gap):
		code, reason = codes.FailedPrecondition, ReasonSequenceGap
		meta["scope"], meta["client"] = gap.Scope, gap.Client
		meta["seq"], meta["last"] = strconv.FormatUint(gap.Seq, 10), strconv.FormatUint(gap.Last, 10)
	case errors.As(err, &ac):
		code, reason = codes.AlreadyExists, ReasonAlreadyCommitted
		meta["scope"], meta["client"] = ac.Scope, ac.Client
		meta["seq"], meta["last"] = strconv.FormatUint(ac.Seq, 10), strconv.FormatUint(ac.Last, 10)
	case errors.Is(err, idem.ErrConflict):
		code, reason = codes.Aborted, ReasonConflict
	case errors.Is(err, idem.ErrLeaseLost):
		code, reason = codes.Aborted, ReasonLeaseLost
	case errors.Is(err, idem.ErrInFlight):
		code, reason = codes.Aborted, ReasonInFlight
	case errors.Is(err, idem.ErrInvalidRequest):
		code, reason = codes.InvalidArgument, ReasonInvalid
	case errors.Is(err, idem.ErrClosed):
		code, reason = codes.Unavailable, ReasonClosed
	case errors.Is(err, idem.ErrInDoubt):
		code, reason = codes.Unavailable, ReasonInDoubt
	case errors.Is(err, raft.ErrNotLeader), errors.Is(err, raft.ErrLeadershipTransferInProgress):
		code, reason = codes.Unavailable, ReasonNotLeader
	case errors.Is(err, raft.ErrLeadershipLost), errors.Is(err, raft.ErrRaftShutdown), errors.Is(err, errStopped):
		code, reason = codes.Unavailable, ReasonInDoubt
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, raft.ErrEnqueueTimeout):
		return status.Error(codes.DeadlineExceeded, err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	default:
		return status.Error(codes.Internal, err.Error())
	}
	st := status.New(code, err.Error())
	if d, derr := st.WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: ErrorDomain, Metadata: meta}); derr == nil {
		st = d
	}
	return st.Err()
}

// errorInfo returns the ErrorInfo of a status error of the cluster.
func errorInfo(err error) (*errdetails.ErrorInfo, *status.Status) {
	st, ok := status.FromError(err)
	if !ok {
		return nil, nil
	}
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.Domain == ErrorDomain {
			return ei, st
		}
	}
	return nil, st
}

// fromStatus turns a status error of the cluster back into the engine's
// error (matched by errors.Is / errors.As as the embedded engine's are).
func fromStatus(err error) error {
	ei, st := errorInfo(err)
	if ei == nil {
		return err
	}
	u := func(k string) uint64 { n, _ := strconv.ParseUint(ei.Metadata[k], 10, 64); return n }
	msg := st.Message()
	switch ei.Reason {
	case ReasonSequenceGap:
		return &idem.SequenceGapError{Scope: ei.Metadata["scope"], Client: ei.Metadata["client"], Seq: u("seq"), Last: u("last")}
	case ReasonAlreadyCommitted:
		return &idem.AlreadyCommittedError{Scope: ei.Metadata["scope"], Client: ei.Metadata["client"], Seq: u("seq"), Last: u("last")}
	case ReasonConflict:
		return remote(idem.ErrConflict, msg)
	case ReasonLeaseLost:
		return remote(idem.ErrLeaseLost, msg)
	case ReasonInFlight:
		return remote(idem.ErrInFlight, msg)
	case ReasonInvalid:
		return remote(idem.ErrInvalidRequest, msg)
	case ReasonClosed:
		return remote(idem.ErrClosed, msg)
	case ReasonInDoubt:
		return remote(idem.ErrInDoubt, msg)
	case ReasonNotLeader:
		return &errNotLeader{leader: ei.Metadata["leader"]}
	}
	return err
}

// remote wraps sentinel with the server's message (which already names it).
func remote(sentinel error, msg string) error {
	return fmt.Errorf("%w (from the cluster: %s)", sentinel, msg)
}
