package idem

import (
	"fmt"
	"time"
)

// Status of a Result.
type Status int

const (
	// Absent: the id is unknown (Lookup only).
	Absent Status = iota
	// Fresh: the caller owns the id now and must Commit or Abort its Claim.
	Fresh
	// Done: the id was committed; Result.Reply is its reply. Nothing runs.
	Done
	// InFlight: another caller owns the id until Result.LeaseUntil.
	InFlight
)

func (s Status) String() string {
	switch s {
	case Absent:
		return "absent"
	case Fresh:
		return "fresh"
	case Done:
		return "done"
	case InFlight:
		return "in-flight"
	}
	return fmt.Sprintf("status(%d)", int(s))
}

// Request identifies one request. Give either ID, or Client and Seq
// (sequence mode: per-client sequences), never both.
// The engine keeps copies of what it stores (the id, the fingerprint, the
// acked ids): the caller's buffers are free again once the call returns.
type Request struct {
	// Scope separates independent id spaces (tenants, endpoints). May be empty.
	Scope string
	// ID is the request id (for example a UUID, or time + random nonce).
	ID []byte
	// Acked lists ids (in Scope) whose replies the client has received and
	// will never retry; they are removed from the set (acked ids).
	Acked [][]byte
	// Fingerprint of the payload (for example its SHA-256). A retry with a
	// different fingerprint is ErrConflict. Empty means unchecked.
	Fingerprint []byte
	// Client and Seq select sequence mode: Seq must be the client's last
	// committed sequence number + 1 to run.
	Client string
	Seq    uint64
	// TTL, when positive, makes the entry expire at claim time + TTL
	// (expires_at = created_at + TTL; a retry does not extend it). A Begin
	// at a time when that moment has passed (expiresAt < now) treats the
	// committed reply as gone: the id runs again as new, and a
	// sequence-mode client keeps its number (ErrAlreadyCommitted for
	// seq <= last). Expired entries are removed by a logged expire record
	// every Options.CleanupInterval (CleanupExpired does it now), counted
	// in Stats.Cleanups. Zero: no per-request expiry (Options.Retention
	// still applies). Requests with different TTLs share one engine.
	TTL time.Duration
	// KeepReplies and KeepRepliesFor are the client's reply window
	// (sequence mode only; ErrInvalidRequest with an ID). When this
	// request commits, the replies of the client's last KeepReplies
	// sequence numbers stay answerable (this one included), each older
	// one while younger than KeepRepliesFor after its commit (0: no age
	// bound): a retry of such a number (seq < last) gets its own reply
	// (Done), or ErrConflict if its fingerprint differs; a number outside
	// the window is *AlreadyCommittedError. The latest reply lives as
	// before (Retention, TTL, Forget), whatever KeepRepliesFor says.
	//
	// Zero (and 1) keeps the latest reply only, the engine's behaviour
	// before windows existed, so existing callers see no change; the
	// defaults of the per-client sequences service (10,000 replies, 5
	// minutes) are idemgrpc's options, which set them per request. The
	// window travels in the claim's record and every eviction is a logged
	// transition (the commit drops what falls out of the count; the TTL
	// cleanup's expire records drop what aged out), so replay, snapshots
	// and replicas keep exactly the same replies. The client's number is
	// never forgotten; Forget, Retention, MaxEntries and Advance drop older
	// replies as they drop others. At most MaxKeepReplies.
	KeepReplies    int
	KeepRepliesFor time.Duration
}

// MaxKeepReplies bounds Request.KeepReplies: a commit that narrows the
// window drops what falls out of it in its own record.
const MaxKeepReplies = 100_000

// Result is the outcome of Begin, Wait and Lookup.
type Result struct {
	Status Status
	// Reply is the stored reply when Status is Done. It is the engine's
	// own copy, shared with every caller that gets it: read it, do not
	// modify it (copy it first). The reply given to Commit is copied, so
	// the caller's buffer is free again once Commit returns.
	Reply []byte
	// Claim is set when Status is Fresh: commit or abort it.
	Claim *Claim
	// LeaseUntil is when the owner's claim expires (InFlight, Fresh).
	LeaseUntil time.Time
	// CommittedAt is when the reply was committed (Done).
	CommittedAt time.Time
	// Seq is the sequence number the result is about (sequence mode).
	Seq uint64
	// ExpiresAt is when the entry's TTL runs out (Done, Fresh); zero if it
	// has none.
	ExpiresAt time.Time
}
