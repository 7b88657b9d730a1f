package idem

import (
	"context"
	"time"

	"github.com/idemdb/idem/index"
)

// Wait blocks until the id is no longer in flight (or its lease runs out, or
// ctx ends) and returns what Lookup then says.
func (e *Engine) Wait(ctx context.Context, scope string, id []byte) (Result, error) {
	k, err := e.validate(&Request{Scope: scope, ID: id})
	if err != nil {
		return Result{}, err
	}
	return e.waitKey(ctx, k)
}

// WaitSeq is Wait for sequence mode: it blocks while the client's request
// seq is in flight (until its claim is committed or aborted, its lease runs
// out, or ctx ends) and returns what LookupSeq then says.
func (e *Engine) WaitSeq(ctx context.Context, scope, client string, seq uint64) (Result, error) {
	k, err := e.validate(&Request{Scope: scope, Client: client, Seq: seq})
	if err != nil {
		return Result{}, err
	}
	return e.waitKey(ctx, k)
}

func (e *Engine) waitKey(ctx context.Context, k reqKey) (Result, error) {
	for {
		if err := ctx.Err(); err != nil {
			return Result{}, err
		}
		if err := e.enter(); err != nil {
			return Result{}, err
		}
		unlock := e.lockKeys(k.key)
		sl, err := e.slotLocked(k.key)
		if err != nil {
			unlock()
			e.leave()
			return Result{}, err
		}
		cur := e.current(sl, k.mode)
		now := e.o.Clock()
		if cur != nil && cur.InFlight && (k.mode == index.ModeID || cur.ClaimSeq == k.seq) && now.UnixNano() < cur.LeaseUntil {
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
		res := e.resultLocked(cur, k, now)
		unlock()
		e.leave()
		if res.Status == Done {
			if err := e.waitDurable(cur.CommitLSN); err != nil {
				return Result{}, err
			}
		}
		return res, nil
	}
}

func (e *Engine) resultLocked(cur *index.Entry, k reqKey, now time.Time) Result {
	if cur == nil {
		return Result{Status: Absent}
	}
	if k.mode == index.ModeClient {
		if cur.InFlight && (k.seq == 0 || k.seq == cur.ClaimSeq) {
			return Result{Status: InFlight, LeaseUntil: time.Unix(0, cur.LeaseUntil), Seq: cur.ClaimSeq}
		}
		if cur.Committed && cur.ReplyKept && !e.expired(cur, now) && (k.seq == 0 || k.seq == cur.Seq) {
			return doneResult(cur)
		}
		return Result{Status: Absent, Seq: k.seq}
	}
	if cur.InFlight {
		return Result{Status: InFlight, LeaseUntil: time.Unix(0, cur.LeaseUntil)}
	}
	if cur.Committed && !e.expired(cur, now) {
		return doneResult(cur)
	}
	return Result{Status: Absent}
}

// Lookup reports what the engine knows of an id without claiming it:
// Absent, Done (with the reply) or InFlight. It does not count as a hit or
// a miss.
func (e *Engine) Lookup(scope string, id []byte) (Result, error) {
	k, err := e.validate(&Request{Scope: scope, ID: id})
	if err != nil {
		return Result{}, err
	}
	return e.lookup(k)
}

// LookupSeq is Lookup for sequence mode: what the engine knows of a
// client's request seq.
func (e *Engine) LookupSeq(scope, client string, seq uint64) (Result, error) {
	k, err := e.validate(&Request{Scope: scope, Client: client, Seq: seq})
	if err != nil {
		return Result{}, err
	}
	return e.lookup(k)
}

func (e *Engine) lookup(k reqKey) (Result, error) {
	if err := e.enter(); err != nil {
		return Result{}, err
	}
	defer e.leave()
	sl, unlock, err := e.lockSlot(k.key)
	if err != nil {
		return Result{}, err
	}
	cur := e.current(sl, k.mode)
	res := e.resultLocked(cur, k, e.o.Clock())
	unlock()
	if res.Status == Done {
		if err := e.waitDurable(cur.CommitLSN); err != nil {
			return Result{}, err
		}
	}
	return res, nil
}

// ClientState returns the client's last committed sequence number in scope
// (0 for a client never seen). The client resumes at that number + 1.
func (e *Engine) ClientState(scope, client string) (uint64, error) {
	if client == "" || len(client) > e.o.MaxIDLen || len(scope) > e.o.MaxIDLen {
		return 0, invalid("client name must be 1..%d bytes", e.o.MaxIDLen)
	}
	if err := e.enter(); err != nil {
		return 0, err
	}
	defer e.leave()
	key := index.EntryKey(nil, scope, index.ModeClient, []byte(client))
	unlock := e.lockKeys(key)
	sl, err := e.slotLocked(key)
	if err != nil {
		unlock()
		return 0, err
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
