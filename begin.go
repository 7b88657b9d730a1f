package idem

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
)

// Begin looks the request up and, if it is new, claims it for the caller.
//
//   - Fresh: the caller owns the id; run the side effect, then
//     Result.Claim.Commit(reply) or Abort(). The claim is durable when Begin
//     returns (unless Options.RelaxedClaims).
//   - Done: Result.Reply is the committed reply; nothing must run.
//   - InFlight: someone else owns the id until Result.LeaseUntil.
//
// ctx is consulted before anything is written: a Begin whose ctx has ended
// claims nothing. Once the claim is appended, Begin waits for its fsync
// whatever ctx says, so that a Fresh claim is never handed out half made,
// nor left behind unowned.
//
// Errors: ErrConflict (fingerprint mismatch), *SequenceGapError,
// ErrAlreadyCommitted, ErrInvalidRequest, ErrClosed, ErrFailed.
func (e *Engine) Begin(ctx context.Context, req Request) (Result, error) {
	// The result is filled in place by beginEntered, before a Fresh
	// claim's durability wait: after the wait (an fsync, during which
	// hundreds of other callers run) this goroutine's stack is no longer
	// in the processor's cache, and a Result passed back by value through
	// each frame missed on every copy.
	var res Result
	err := e.begin(ctx, req, &res)
	return res, err
}

// verdict is what a request meets in the current entry: the one
// classification that Begin, Lookup and Wait share, so that a read names
// a request exactly as Begin does (its fingerprint included).
type verdict int

const (
	vClaim            verdict = iota // unknown (or expired, or its lease ran out): Begin claims it
	vDone                            // committed, fingerprint matches: the reply
	vInFlight                        // claimed by a live lease, fingerprint matches
	vConflict                        // fingerprint mismatch (committed or in flight)
	vAlreadyCommitted                // sequence at or below the last, reply not kept
	vGap                             // sequence beyond last+1
	vFailed                          // reading an older sequence's reply failed (err)
)

// classifyLocked classifies the request k (fingerprint fp) against cur, the
// key's current entry, at now. For vDone and vInFlight res is the result;
// for the errors err is the error; for vClaim, takeover says the entry is
// a claim whose lease ran out and expired an expired committed reply. ov,
// when not nil, is the batch being built (Batch.Run): an older sequence
// number's reply is read through it, as the batch's earlier items left it.
func (e *Engine) classifyLocked(cur *index.Entry, k reqKey, fp []byte, now time.Time, ov *index.Batch) (v verdict, res Result, err error, takeover, expired bool) {
	if k.mode == index.ModeID {
		switch {
		case cur != nil && cur.Committed && !e.expired(cur, now):
			if !fpMatch(cur.Fingerprint, fp) {
				return vConflict, Result{}, fmt.Errorf("%w: scope %q id %s", ErrConflict, k.scope, printable(k.ident)), false, false
			}
			return vDone, doneResult(cur), nil, false, false
		case cur != nil && cur.Committed:
			return vClaim, Result{}, nil, false, true // retention or TTL ran out: runs again as new
		case cur != nil && cur.InFlight:
			if !fpMatch(cur.ClaimFP, fp) {
				return vConflict, Result{}, fmt.Errorf("%w: scope %q id %s (in flight)", ErrConflict, k.scope, printable(k.ident)), false, false
			}
			if now.UnixNano() < cur.LeaseUntil {
				return vInFlight, Result{Status: InFlight, LeaseUntil: time.Unix(0, cur.LeaseUntil)}, nil, false, false
			}
			return vClaim, Result{}, nil, true, false
		}
		return vClaim, Result{}, nil, false, false
	}
	var last uint64
	if cur != nil && cur.Committed {
		last = cur.Seq
	}
	switch {
	case k.seq <= last:
		kept := cur // seq == last: the client's entry holds its reply
		if k.seq < last {
			// An older number: its reply, while inside the client's reply
			// window, is under its sequence key (same shard and lock as
			// the client's key).
			var err error
			if kept, err = e.olderReplyLocked(k, ov); err != nil {
				return vFailed, Result{}, err, false, false
			}
		}
		if kept != nil && kept.ReplyKept && !e.expired(kept, now) {
			if !fpMatch(kept.Fingerprint, fp) {
				return vConflict, Result{}, fmt.Errorf("%w: scope %q client %q seq %d", ErrConflict, k.scope, k.ident, k.seq), false, false
			}
			return vDone, doneResult(kept), nil, false, false
		}
		return vAlreadyCommitted, Result{Seq: k.seq}, &AlreadyCommittedError{Scope: k.scope, Client: string(k.ident), Seq: k.seq, Last: last}, false, false
	case k.seq == last+1:
		if cur != nil && cur.InFlight {
			if !fpMatch(cur.ClaimFP, fp) {
				return vConflict, Result{}, fmt.Errorf("%w: scope %q client %q seq %d (in flight)", ErrConflict, k.scope, k.ident, k.seq), false, false
			}
			if now.UnixNano() < cur.LeaseUntil {
				return vInFlight, Result{Status: InFlight, LeaseUntil: time.Unix(0, cur.LeaseUntil), Seq: k.seq}, nil, false, false
			}
			return vClaim, Result{}, nil, true, false
		}
		return vClaim, Result{}, nil, false, false
	default:
		return vGap, Result{}, &SequenceGapError{Scope: k.scope, Client: string(k.ident), Seq: k.seq, Last: last}, false, false
	}
}

// olderReplyLocked returns the entry of the client's sequence key for
// k.seq (nil if none), through the batch ov when not nil. The client key's
// lock is held, which covers it.
func (e *Engine) olderReplyLocked(k reqKey, ov *index.Batch) (*index.Entry, error) {
	key := index.SeqKey(nil, k.scope, k.ident, k.seq)
	if ov != nil {
		return ov.Get(key, index.ModeSeq)
	}
	sl, err := e.slotLocked(key)
	if err != nil {
		return nil, err
	}
	return e.current(sl, index.ModeSeq), nil
}

// fingerprint is the request's fingerprint as stored: empty means unchecked.
func fingerprint(req *Request) []byte {
	if len(req.Fingerprint) == 0 {
		return nil
	}
	return req.Fingerprint
}

// begin is Begin, filling *res (left zero on most errors, as Begin's
// result).
func (e *Engine) begin(ctx context.Context, req Request, res *Result) error {
	k, err := e.validate(&req)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := e.enter(); err != nil {
		return err
	}
	// One deferred call, in a function of few returns, so that the
	// compiler open-codes it: beginEntered's many returns made its two
	// defers (leave, the payload buffer) go through the runtime's defer
	// records (deferreturn), which cost a fresh Begin at 512 callers more
	// than its shard's lock does.
	pb := payloadPool.Get().(*[]byte)
	defer func() {
		if pb != nil {
			putPayload(pb)
		}
		e.leave()
	}()
	return e.beginEntered(&req, k, &pb, res)
}

// beginEntered is begin once the request is valid and the engine entered.
// *pbp is a pooled buffer for the claim's record; it sets *pbp to nil once
// it gave the buffer back (the caller gives back any other). It fills
// *out, which is zero on entry, with Begin's result.
func (e *Engine) beginEntered(req *Request, k reqKey, pbp **[]byte, out *Result) error {
	fp := fingerprint(req)
	now := e.o.Clock()
	// The claim's record, made and encoded before the shard's lock is
	// taken (at hundreds of callers that lock is the engine's most
	// contended): it depends on the key's entry only through
	// wal.ClaimFlagNew, set here as for a key without one (a new id: nearly
	// every claim), and encoded again under the lock when the key turns
	// out to hold an entry. Its time was read before the lock already.
	// A request that claims nothing (Done, InFlight, an error) wasted the
	// encoding, which costs far less than the lock's hold time it saves.
	op := &wal.Op{}
	lease, expiresAt := e.claimOp(op, k, req, fp, nil, now)
	pb := *pbp
	payload, err := wal.EncodeOp((*pb)[:0], op)
	*pb = payload
	if err != nil {
		return err
	}
	// The claim handed out, allocated with the updates that its record
	// and its finish go through (claimUpdates) and with its entry: taken
	// before the shard's lock too (an allocation of several hundred bytes
	// under it was part of its hold), from a pool that gets it back when
	// the request claims nothing.
	fc := freshClaimPool.Get().(*freshClaim)
	var (
		unlock func()
		sl     *slot
	)
	if len(k.ackKey) == 0 {
		sl, unlock, err = e.lockSlot(k.key)
		if err != nil {
			freshClaimPool.Put(fc)
			return err
		}
	} else {
		unlock = e.lockKeys(append([][]byte{k.key}, k.ackKey...)...)
		sl, err = e.slotLocked(k.key)
		if err != nil {
			unlock()
			freshClaimPool.Put(fc)
			return err
		}
	}
	cur := e.current(sl, k.mode)
	v, res, verr, takeover, expired := e.classifyLocked(cur, k, fp, now, nil)
	if v != vClaim {
		freshClaimPool.Put(fc) // untouched: nothing below uses it
	}
	switch v {
	case vDone:
		unlock()
		e.st.hits.Add(1)
		*out = res
		return e.waitDurable(cur.CommitLSN)
	case vInFlight:
		unlock()
		e.st.collisions.Add(1)
		*out = res
		return nil
	case vConflict:
		unlock()
		e.st.conflicts.Add(1)
		return verr
	case vAlreadyCommitted:
		unlock()
		e.st.alreadyCommitted.Add(1)
		*out = res
		return verr
	case vGap:
		unlock()
		e.st.gaps.Add(1)
		return verr
	case vFailed:
		unlock()
		return verr
	}
	if expired {
		e.st.expired.Add(1) // retention or TTL ran out: runs again as new (T+61m for a one-hour TTL)
	}
	// Claim it.
	if cur != nil && op.Flags&wal.ClaimFlagNew != 0 {
		// Not a new id after all (expired, or taken over): the record
		// made above, without wal.ClaimFlagNew, is encoded below.
		e.claimOp(op, k, req, fp, cur, now)
		payload = nil
	}
	// The entry keeps the fingerprint: its own copy, not the caller's
	// buffer, which the caller may reuse once Begin returns (the record's
	// payload, encoded above, holds its own bytes already).
	op.Fingerprint = bytes.Clone(op.Fingerprint)
	ts, err := e.slotShard(sl).transitionsHinted(fc.ups.claimTs[:0], op, k.key, sl, &fc.entry)
	if err != nil {
		unlock()
		*fc = freshClaim{} // nothing refers to it: the record was not appended
		freshClaimPool.Put(fc)
		return err
	}
	var lsn wal.LSN
	if payload != nil {
		if lsn, err = e.appendRecordSlot(op.Type, payload, ts, k.key, sl, &fc.ups.claim); err == nil {
			e.countRemovals(removals(op.Type, ts))
		}
	} else {
		lsn, err = e.appendOpSlot(op, ts, k.key, sl, &fc.ups.claim)
	}
	unlock()
	putPayload(pb) // the WAL copied it
	*pbp = nil
	if err != nil {
		return err
	}
	if takeover {
		e.st.takeovers.Add(1)
	}
	e.st.misses.Add(1)
	// The claim is filled in before the durability wait, not after: fc
	// was allocated and written a moment ago and is in this processor's
	// cache now, while after the wait (an fsync, during which hundreds of
	// other callers run) its lines are gone and each store would miss.
	// Nobody sees the claim before Begin returns it: the WAL and the
	// applier read only fc.ups and fc.entry.
	// The result too, for the same reason (see Begin).
	c := &fc.Claim
	c.ec = engineClaim{e: e, k: k, lsn: lsn, sl: sl, ups: &fc.ups}
	c.leaseUntil = lease
	*out = Result{Status: Fresh, Claim: c, LeaseUntil: lease, Seq: k.seq, ExpiresAt: expiresAt}
	if !e.o.RelaxedClaims {
		if err := e.waitDurable(lsn); err != nil {
			*out = Result{}
			return err
		}
	}
	return nil
}

// freshClaimPool holds zero freshClaims for Begin, which takes one before
// the shard's lock and puts it back when the request claims nothing. A
// claim handed out is never put back: the caller, the WAL and the table
// keep it.
var freshClaimPool = sync.Pool{New: func() any { return new(freshClaim) }}

// claimOp fills op with the claim record of the request req (key k,
// fingerprint fp) whose key holds cur, made at now, and returns the
// claim's lease and TTL deadline (zero: none).
func (e *Engine) claimOp(op *wal.Op, k reqKey, req *Request, fp []byte, cur *index.Entry, now time.Time) (lease, expiresAt time.Time) {
	lease = now.Add(e.o.Lease)
	*op = wal.Op{
		Type: wal.OpClaim, Scope: k.scope, Fingerprint: fp, Acked: k.acked,
		Time: now.UnixNano(), LeaseUntil: lease.UnixNano(),
	}
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
		op.KeepReplies, op.KeepFor = uint64(req.KeepReplies), int64(req.KeepRepliesFor)
	}
	return lease, expiresAt
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
