package idem

import (
	"errors"
	"fmt"
)

// Errors returned by the engine; match them with errors.Is / errors.As.
var (
	// ErrConflict: the id is known with a different fingerprint, or it was
	// stored without a fingerprint and is asked for with one (an unchecked
	// entry never satisfies a checked request).
	ErrConflict = errors.New("idem: id already used with a different request (fingerprint mismatch)")
	// ErrSequenceGap is matched by *SequenceGapError.
	ErrSequenceGap = errors.New("idem: sequence gap")
	// ErrAlreadyCommitted: a sequence number at or below the client's last
	// committed one whose reply is no longer kept. The request ran; its
	// reply cannot be replayed. It is matched by *AlreadyCommittedError,
	// which carries the client's last committed number.
	ErrAlreadyCommitted = errors.New("idem: sequence number already committed and its reply is no longer kept")
	// ErrLeaseLost: the claim's lease ran out and another caller took the
	// id over, or the claim was finished already; the Commit changed nothing.
	ErrLeaseLost = errors.New("idem: claim lost (lease expired and taken over, or already finished)")
	// ErrInFlight: Claim.CommitAdvance named a client whose next sequence
	// number is claimed by a caller still running it; nothing was written.
	ErrInFlight = errors.New("idem: a claim is in flight")
	// ErrInvalidRequest: the request is malformed (see the message).
	ErrInvalidRequest = errors.New("idem: invalid request")
	// ErrClosed: the engine was closed.
	ErrClosed = errors.New("idem: engine closed")
	// ErrLocked: the directory is open by another engine, in this process
	// or another.
	ErrLocked = errors.New("idem: directory is locked by another engine")
	// ErrCorrupt: the WAL or the index holds data that cannot be trusted;
	// the message says where.
	ErrCorrupt = errors.New("idem: corrupt data")
	// ErrFailed: an earlier write or fsync failed; the engine stopped
	// accepting writes so that it never reports as durable what may not be.
	// Close it and open it again to recover from the WAL.
	ErrFailed = errors.New("idem: engine failed")
)

// SequenceGapError is returned when a client skips sequence numbers: Seq is
// beyond Last+1. The client should resume at Last+1 (see ClientState).
type SequenceGapError struct {
	Scope, Client string
	Seq           uint64 // the sequence number asked for
	Last          uint64 // the client's last committed sequence number
}

func (e *SequenceGapError) Error() string {
	return fmt.Sprintf("idem: sequence gap: scope %q client %q sent seq %d, last committed is %d (next expected %d)",
		e.Scope, e.Client, e.Seq, e.Last, e.Last+1)
}

// Is makes errors.Is(err, ErrSequenceGap) true.
func (e *SequenceGapError) Is(target error) bool { return target == ErrSequenceGap }

// AlreadyCommittedError is returned for a sequence number at or below the
// client's last committed one whose reply is no longer kept (acked,
// expired or forgotten). Last is the client's last committed number when
// the request was refused, read under the same lock as the refusal: a
// client that lost its place resumes at Last+1.
type AlreadyCommittedError struct {
	Scope, Client string
	Seq           uint64 // the sequence number asked for
	Last          uint64 // the client's last committed sequence number
}

func (e *AlreadyCommittedError) Error() string {
	return fmt.Sprintf("%v: scope %q client %q seq %d (last committed %d)", ErrAlreadyCommitted, e.Scope, e.Client, e.Seq, e.Last)
}

// Is makes errors.Is(err, ErrAlreadyCommitted) true.
func (e *AlreadyCommittedError) Is(target error) bool { return target == ErrAlreadyCommitted }

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidRequest, fmt.Sprintf(format, args...))
}

// ErrInDoubt: the operation was sent but its outcome is unknown: the
// caller stopped waiting (ctx ended) or the connection to the store broke
// before the answer came. It may or may not have taken effect. Retry the
// same call (Begin by the same owner, Commit and Abort of the same claim
// are idempotent) or resolve it through InDoubt. The embedded Engine never
// returns it: its Commit and Abort wait for their fsync.
var ErrInDoubt = errors.New("idem: outcome unknown (in doubt)")
