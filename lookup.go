package idem

import (
	"context"
	"time"

	"github.com/idemdb/idem/index"
)

// Lookup answers what Begin would answer for req, without claiming and
// without counting a hit or a miss: Absent where Begin would hand out a
// Fresh claim (Result.Seq names the number for sequence mode), Done with
// the reply, InFlight with the owner's lease (also once the lease ran out,
// until another caller takes the id over: LeaseUntil is then in the
// past), and the same errors
// (ErrConflict when the fingerprint differs, exactly as Begin checks it;
// *SequenceGapError; *AlreadyCommittedError). Acked ids in req are
// ignored: a read removes nothing. ctx is consulted before the read.
func (e *Engine) Lookup(ctx context.Context, req Request) (Result, error) {
	return e.lookup(ctx, req, nil)
}

// lookup is Lookup, and with h LookupHint: it then installs the key's slot
// when absent (as Begin does) and fills h.
func (e *Engine) lookup(ctx context.Context, req Request, h *PutHint) (Result, error) {
	k, err := e.validate(&req)
	if err != nil {
		return Result{}, err
	}
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	if err := e.enter(); err != nil {
		return Result{}, err
	}
	defer e.leave()
	use := slotRead
	if h != nil {
		use = slotHint
	}
	sl, unlock, err := e.lockSlotFor(k.key, use)
	if err != nil {
		return Result{}, err
	}
	if sl == nil { // absent, and no slot installed for it (lockSlotRead)
		_, res, verr := e.readLocked(nil, k, nil, e.o.Clock())
		return res, verr
	}
	cur := e.current(sl, k.mode)
	fp := fingerprint(&req)
	v, res, verr := e.readLocked(cur, k, fp, e.o.Clock())
	unlock()
	if h != nil {
		*h = PutHint{e: e, req: req, k: k, fp: fp, sl: sl}
	}
	if v == vDone {
		if err := e.waitDurable(cur.CommitLSN); err != nil {
			return Result{}, err
		}
	}
	return res, verr
}

// readLocked is classifyLocked for the reads: a request Begin would claim
// is Absent, except a claim whose lease ran out and that nobody took over
// yet: it is still InFlight (its owner may still commit it), with its
// LeaseUntil in the past, and Wait does not wait for it.
func (e *Engine) readLocked(cur *index.Entry, k reqKey, fp []byte, now time.Time) (verdict, Result, error) {
	v, res, err, takeover, _ := e.classifyLocked(cur, k, fp, now, nil)
	switch {
	case v == vClaim && takeover:
		res = Result{Status: InFlight, LeaseUntil: time.Unix(0, cur.LeaseUntil), Seq: k.seq}
	case v == vClaim:
		res = Result{Status: Absent, Seq: k.seq}
	}
	return v, res, err
}

// Wait blocks while req is in flight (until its claim is committed or
// aborted, its lease runs out, or ctx ends) and returns what Lookup then
// says, with the same fingerprint check: a request whose fingerprint
// differs from the claim's is ErrConflict at once, not a wait.
func (e *Engine) Wait(ctx context.Context, req Request) (Result, error) {
	k, err := e.validate(&req)
	if err != nil {
		return Result{}, err
	}
	return e.waitKey(ctx, k, fingerprint(&req))
}

func (e *Engine) waitKey(ctx context.Context, k reqKey, fp []byte) (Result, error) {
	for {
		if err := ctx.Err(); err != nil {
			return Result{}, err
		}
		if err := e.enter(); err != nil {
			return Result{}, err
		}
		sl, unlock, err := e.lockSlotRead(k.key)
		if err != nil {
			e.leave()
			return Result{}, err
		}
		now := e.o.Clock()
		if sl == nil { // absent: nothing to wait for, no slot installed
			e.leave()
			_, res, verr := e.readLocked(nil, k, nil, now)
			return res, verr
		}
		cur := e.current(sl, k.mode)
		v, res, verr := e.readLocked(cur, k, fp, now)
		if v == vInFlight {
			if sl.waiters == nil {
				sl.waiters = make(chan struct{})
			}
			ch := sl.waiters
			left := time.Duration(cur.LeaseUntil - now.UnixNano())
			unlock()
			e.leave()
			t := time.NewTimer(left)
			select {
			case <-ch:
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return Result{}, ctx.Err()
			}
			t.Stop()
			continue
		}
		unlock()
		e.leave()
		if v == vDone {
			if err := e.waitDurable(cur.CommitLSN); err != nil {
				return Result{}, err
			}
		}
		return res, verr
	}
}

// ClientState returns the client's last committed sequence number in scope
// (0 for a client never seen). The client resumes at that number + 1.
func (e *Engine) ClientState(ctx context.Context, scope, client string) (uint64, error) {
	if client == "" || len(client) > e.o.MaxIDLen || len(scope) > e.o.MaxIDLen {
		return 0, invalid("client name must be 1..%d bytes", e.o.MaxIDLen)
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	if err := e.enter(); err != nil {
		return 0, err
	}
	defer e.leave()
	key := index.EntryKey(nil, scope, index.ModeClient, []byte(client))
	sl, unlock, err := e.lockSlotRead(key)
	if err != nil {
		return 0, err
	}
	if sl == nil { // a client never seen, and no slot installed for it
		return 0, nil
	}
	if sl.e == nil || !sl.e.Committed {
		unlock()
		return 0, nil
	}
	seq, lsn := sl.e.Seq, sl.e.CommitLSN
	// Wait for the number's record without the key's lock, as every other
	// read does: the applier takes the shard's lock to unpin what it
	// applied, and the WAL's sync goroutine waits for the applier once
	// the records waiting for it reach their bound.
	unlock()
	if err := e.waitDurable(lsn); err != nil {
		return 0, err
	}
	return seq, nil
}
