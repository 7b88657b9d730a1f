package idem

import (
	"context"
	"fmt"
	"time"

	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
)

// ---- the API ----

// Begin looks the request up and, if it is new, claims it for the caller.
//
//   - Fresh: the caller owns the id; run the side effect, then
//     Result.Claim.Commit(reply) or Abort(). The claim is durable when Begin
//     returns (unless Options.RelaxedClaims).
//   - Done: Result.Reply is the committed reply; nothing must run.
//   - InFlight: someone else owns the id until Result.LeaseUntil.
//
// Errors: ErrConflict (fingerprint mismatch), *SequenceGapError,
// ErrAlreadyCommitted, ErrInvalidRequest, ErrClosed, ErrFailed.
func (e *Engine) Begin(ctx context.Context, req Request) (Result, error) {
	res, _, err := e.begin(ctx, req)
	return res, err
}

func (e *Engine) begin(ctx context.Context, req Request) (Result, reqKey, error) {
	k, err := e.validate(&req)
	if err != nil {
		return Result{}, k, err
	}
	if err := ctx.Err(); err != nil {
		return Result{}, k, err
	}
	if err := e.enter(); err != nil {
		return Result{}, k, err
	}
	defer e.leave()
	fp := req.Fingerprint
	if len(fp) == 0 {
		fp = nil
	}
	now := e.o.Clock()
	var (
		unlock func()
		sl     *slot
	)
	if len(k.ackKey) == 0 {
		sl, unlock, err = e.lockSlot(k.key)
		if err != nil {
			return Result{}, k, err
		}
	} else {
		unlock = e.lockKeys(append([][]byte{k.key}, k.ackKey...)...)
		sl, err = e.slotLocked(k.key)
		if err != nil {
			unlock()
			return Result{}, k, err
		}
	}
	cur := e.current(sl, k.mode)
	takeover := false
	if k.mode == index.ModeID {
		switch {
		case cur != nil && cur.Committed && !e.expired(cur, now):
			if !fpMatch(cur.Fingerprint, fp) {
				unlock()
				e.st.conflicts.Add(1)
				return Result{}, k, fmt.Errorf("%w: scope %q id %s", ErrConflict, k.scope, printable(k.ident))
			}
			res := doneResult(cur)
			unlock()
			e.st.hits.Add(1)
			return res, k, e.waitDurable(cur.CommitLSN)
		case cur != nil && cur.Committed:
			e.st.expired.Add(1) // retention or TTL ran out: runs again as new (T+61m for a one-hour TTL)
		case cur != nil && cur.InFlight:
			if !fpMatch(cur.ClaimFP, fp) {
				unlock()
				e.st.conflicts.Add(1)
				return Result{}, k, fmt.Errorf("%w: scope %q id %s (in flight)", ErrConflict, k.scope, printable(k.ident))
			}
			if now.UnixNano() < cur.LeaseUntil {
				res := Result{Status: InFlight, LeaseUntil: time.Unix(0, cur.LeaseUntil)}
				unlock()
				e.st.collisions.Add(1)
				return res, k, nil
			}
			takeover = true
		}
	} else {
		var last uint64
		if cur != nil && cur.Committed {
			last = cur.Seq
		}
		switch {
		case k.seq <= last:
			if k.seq == last && cur.ReplyKept && !e.expired(cur, now) {
				if !fpMatch(cur.Fingerprint, fp) {
					unlock()
					e.st.conflicts.Add(1)
					return Result{}, k, fmt.Errorf("%w: scope %q client %q seq %d", ErrConflict, k.scope, k.ident, k.seq)
				}
				res := doneResult(cur)
				unlock()
				e.st.hits.Add(1)
				return res, k, e.waitDurable(cur.CommitLSN)
			}
			unlock()
			e.st.alreadyCommitted.Add(1)
			return Result{Seq: k.seq}, k, &AlreadyCommittedError{Scope: k.scope, Client: string(k.ident), Seq: k.seq, Last: last}
		case k.seq == last+1:
			if cur != nil && cur.InFlight {
				if !fpMatch(cur.ClaimFP, fp) {
					unlock()
					e.st.conflicts.Add(1)
					return Result{}, k, fmt.Errorf("%w: scope %q client %q seq %d (in flight)", ErrConflict, k.scope, k.ident, k.seq)
				}
				if now.UnixNano() < cur.LeaseUntil {
					res := Result{Status: InFlight, LeaseUntil: time.Unix(0, cur.LeaseUntil), Seq: k.seq}
					unlock()
					e.st.collisions.Add(1)
					return res, k, nil
				}
				takeover = true
			}
		default:
			unlock()
			e.st.gaps.Add(1)
			return Result{}, k, &SequenceGapError{Scope: k.scope, Client: string(k.ident), Seq: k.seq, Last: last}
		}
	}
	// Claim it.
	lease := now.Add(e.o.Lease)
	op := &wal.Op{
		Type: wal.OpClaim, Scope: k.scope, Fingerprint: fp, Acked: k.acked,
		Time: now.UnixNano(), LeaseUntil: lease.UnixNano(),
	}
	var expiresAt time.Time
	if req.TTL > 0 {
		expiresAt = now.Add(req.TTL)
		op.ExpiresAt = expiresAt.UnixNano()
	}
	if k.mode == index.ModeID {
		op.ID = k.ident
		if cur == nil {
			op.Flags |= wal.ClaimFlagNew
		}
	} else {
		op.Client, op.Seq = string(k.ident), k.seq
	}
	ts, err := index.Transitions(op, 0, e.getLocked)
	if err != nil {
		unlock()
		return Result{}, k, err
	}
	lsn, err := e.appendOp(op, ts)
	unlock()
	if err != nil {
		return Result{}, k, err
	}
	if takeover {
		e.st.takeovers.Add(1)
	}
	e.st.misses.Add(1)
	if !e.o.RelaxedClaims {
		if err := e.waitDurable(lsn); err != nil {
			return Result{}, k, err
		}
	}
	c := &Claim{e: e, k: k, lsn: lsn, fp: fp, leaseUntil: lease}
	return Result{Status: Fresh, Claim: c, LeaseUntil: lease, Seq: k.seq, ExpiresAt: expiresAt}, k, nil
}

func doneResult(en *index.Entry) Result {
	r := Result{Status: Done, Reply: en.Reply, CommittedAt: time.Unix(0, en.CommitTime), Seq: en.Seq}
	if en.ExpiresAt != 0 {
		r.ExpiresAt = time.Unix(0, en.ExpiresAt)
	}
	return r
}

// fpMatch: an unchecked request matches anything; a checked one needs the
// same fingerprint, and never matches an entry stored without one.
func fpMatch(stored, asked []byte) bool {
	if asked == nil {
		return true
	}
	return stored != nil && string(stored) == string(asked)
}
