package idem

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
)

// Claim is the ownership of one id handed out by a Fresh Begin (or by
// InDoubt after a restart). Exactly one of Commit or Abort should be called.
type Claim struct {
	e          *Engine
	k          reqKey
	lsn        wal.LSN
	fp         []byte
	leaseUntil time.Time
	finished   atomic.Bool
}

// LeaseUntil is when the claim's lease runs out.
func (c *Claim) LeaseUntil() time.Time { return c.leaseUntil }

// Commit stores reply as the id's reply, durably (in SyncAlways mode) when it
// returns, and wakes callers waiting for it. If the lease ran out and another
// caller took the id over, it returns ErrLeaseLost and changes nothing.
func (c *Claim) Commit(ctx context.Context, reply []byte) error {
	if len(reply) > c.e.o.MaxReplySize {
		return invalid("reply of %d bytes exceeds %d", len(reply), c.e.o.MaxReplySize)
	}
	if reply == nil {
		reply = []byte{}
	}
	return c.finish(ctx, wal.OpCommit, reply, nil, nil)
}

// Abort releases the id: it is unknown again (a sequence number is not
// consumed). Use it when the side effect failed and did not happen.
func (c *Claim) Abort(ctx context.Context) error {
	return c.finish(ctx, wal.OpAbort, nil, nil, nil)
}

// Advance names a sequence-mode client (Scope, Client) whose last
// committed sequence number a commit raises to at least Seq, in the commit's
// own record (Claim.CommitAdvance). Numbers never go down: an advance to a
// number at or below the client's is a no-op. ClientState returns the
// number, which survives Forget, Ack, retention and TTL cleanup as every
// client's number does.
type Advance struct {
	Scope  string
	Client string
	Seq    uint64
}

// maxAdvances bounds the advances of one commit.
const maxAdvances = 1024

// CommitAdvance is Commit that also advances the sequence-mode clients adv
// in the same WAL record: after a crash either the reply and every advance
// are there, or none is. A stream consumer keeps its commit frontier this
// way (the client is the partition, Seq its offset): the offset is durable
// exactly when the event's effect is.
//
// Each advance needs a client name (1..MaxIDLen bytes), Seq >= 1, and a
// distinct client that is not the claim's own key. A client with a claim in
// flight cannot be advanced: CommitAdvance returns ErrInFlight, writes
// nothing and leaves the claim open (Commit, Abort or CommitAdvance it again).
// A raised client's kept reply is dropped, as a claim of a later number
// drops it.
func (c *Claim) CommitAdvance(ctx context.Context, reply []byte, adv ...Advance) error {
	if len(adv) == 0 {
		return c.Commit(ctx, reply)
	}
	if len(reply) > c.e.o.MaxReplySize {
		return invalid("reply of %d bytes exceeds %d", len(reply), c.e.o.MaxReplySize)
	}
	wadv, keys, err := c.e.checkAdvances(adv, c.k.key)
	if err != nil {
		return err
	}
	if reply == nil {
		reply = []byte{}
	}
	return c.finish(ctx, wal.OpCommitAdvance, reply, wadv, keys)
}

// checkAdvances validates adv and returns them for the WAL with the keys
// to lock: own (the committed key; nil for none) first, then one per
// advance.
func (e *Engine) checkAdvances(adv []Advance, own []byte) ([]wal.Advance, [][]byte, error) {
	if len(adv) > maxAdvances {
		return nil, nil, invalid("%d advances exceed %d", len(adv), maxAdvances)
	}
	keys := make([][]byte, 0, len(adv)+1)
	seen := make(map[string]bool, len(adv)+1)
	if own != nil {
		keys = append(keys, own)
		seen[string(own)] = true
	}
	wadv := make([]wal.Advance, len(adv))
	for i, a := range adv {
		if a.Client == "" || len(a.Client) > e.o.MaxIDLen || len(a.Scope) > e.o.MaxIDLen {
			return nil, nil, invalid("advance %d: client name must be 1..%d bytes and scope at most %d (client %d bytes, scope %d)", i, e.o.MaxIDLen, e.o.MaxIDLen, len(a.Client), len(a.Scope))
		}
		if a.Seq == 0 {
			return nil, nil, invalid("advance %d: client %q to sequence number 0 (numbers start at 1)", i, a.Client)
		}
		k := index.EntryKey(nil, a.Scope, index.ModeClient, []byte(a.Client))
		if seen[string(k)] {
			return nil, nil, invalid("advance %d: client %q in scope %q is named twice or is the committed key", i, a.Client, a.Scope)
		}
		seen[string(k)] = true
		keys = append(keys, k)
		wadv[i] = wal.Advance{Scope: a.Scope, Client: a.Client, Seq: a.Seq}
	}
	return wadv, keys, nil
}

// advancesInFlightLocked returns ErrInFlight if a client of adv (whose keys
// are locked) has a claim in flight.
func (e *Engine) advancesInFlightLocked(adv []wal.Advance, keys [][]byte) error {
	for i, a := range adv {
		sl, err := e.slotLocked(keys[i])
		if err != nil {
			return err
		}
		if en := e.current(sl, index.ModeClient); en != nil && en.InFlight {
			return fmt.Errorf("%w: cannot advance client %q in scope %q to %d: its sequence number %d is claimed", ErrInFlight, a.Client, a.Scope, a.Seq, en.ClaimSeq)
		}
	}
	return nil
}

// Advance raises the sequence-mode clients adv, without a commit, in one
// WAL record, durable when it returns (SyncAlways): a position whose
// effect was committed earlier by another record (a stream consumer that
// replays a redelivered event found at a new offset). Same rules as
// Claim.CommitAdvance: ErrInvalidRequest, or ErrInFlight (nothing written)
// for a client with a claim in flight; an advance to a number at or below
// the client's changes nothing, and when every one is such, no record is
// written.
func (e *Engine) Advance(ctx context.Context, adv ...Advance) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if len(adv) == 0 {
		return nil
	}
	wadv, keys, err := e.checkAdvances(adv, nil)
	if err != nil {
		return err
	}
	if err := e.enter(); err != nil {
		return err
	}
	defer e.leave()
	unlock := e.lockKeys(keys...)
	if err := e.advancesInFlightLocked(wadv, keys); err != nil {
		unlock()
		return err
	}
	op := &wal.Op{Type: wal.OpAdvance, Time: e.o.Clock().UnixNano(), Advances: wadv}
	ts, err := index.Transitions(op, 0, e.getLocked)
	if err != nil {
		unlock()
		return err
	}
	var lsn wal.LSN
	if len(ts) == 0 {
		// Nothing to raise: wait for the records that raised them.
		for _, k := range keys {
			if sl, err := e.slotLocked(k); err == nil && sl.e != nil && sl.e.CommitLSN > lsn {
				lsn = sl.e.CommitLSN
			}
		}
		unlock()
		if lsn == 0 {
			return nil
		}
		return e.waitDurable(lsn)
	}
	lsn, err = e.appendOp(op, ts)
	unlock()
	if err != nil {
		return err
	}
	return e.waitDurable(lsn)
}

func (c *Claim) finish(ctx context.Context, typ byte, reply []byte, adv []wal.Advance, keys [][]byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	e := c.e
	if err := e.enter(); err != nil {
		return err
	}
	defer e.leave()
	if c.finished.Swap(true) {
		return fmt.Errorf("%w: claim on %s was already finished", ErrLeaseLost, printable(c.k.ident))
	}
	k := c.k
	var unlock func()
	if keys == nil { // Commit, Abort: the claim's key alone (no slice to build)
		unlock = e.lockKeys(k.key)
	} else {
		unlock = e.lockKeys(keys...)
	}
	sl, err := e.slotLocked(k.key)
	if err != nil {
		unlock()
		return err
	}
	cur := e.current(sl, k.mode)
	if cur == nil || !cur.InFlight || cur.ClaimLSN != c.lsn {
		unlock()
		e.st.leaseLost.Add(1)
		return fmt.Errorf("%w: scope %q %s", ErrLeaseLost, k.scope, printable(k.ident))
	}
	if len(adv) > 0 {
		if err := e.advancesInFlightLocked(adv, keys[1:]); err != nil {
			unlock()
			c.finished.Store(false)
			return err
		}
	}
	op := &wal.Op{Type: typ, Scope: k.scope, ClaimLSN: c.lsn, Time: e.o.Clock().UnixNano(), Reply: reply, Advances: adv}
	if k.mode == index.ModeID {
		op.ID = k.ident
	} else {
		op.Client, op.Seq = string(k.ident), k.seq
	}
	ts, err := index.Transitions(op, 0, e.getLocked)
	if err != nil {
		unlock()
		return err
	}
	lsn, err := e.appendOp(op, ts)
	var waiters chan struct{}
	if err == nil {
		waiters, sl.waiters = sl.waiters, nil
	}
	unlock()
	if err != nil {
		return err
	}
	err = e.waitDurable(lsn)
	if waiters != nil {
		close(waiters)
	}
	return err
}

// Do runs fn exactly once for the request: a new id runs fn and commits its
// reply (or aborts on its error, so that a retry runs again); a committed id
// returns the stored reply; while another caller runs the id, Do waits for
// it (bounded by ctx). If fn panics the claim is aborted and the panic goes on.
func (e *Engine) Do(ctx context.Context, req Request, fn func(context.Context) ([]byte, error)) ([]byte, error) {
	for {
		res, k, err := e.begin(ctx, req)
		if err != nil {
			return nil, err
		}
		switch res.Status {
		case Done:
			return res.Reply, nil
		case Fresh:
			return e.run(ctx, res.Claim, fn)
		case InFlight:
			if _, err := e.waitKey(ctx, k); err != nil {
				return nil, err
			}
		}
	}
}

func (e *Engine) run(ctx context.Context, c *Claim, fn func(context.Context) ([]byte, error)) (reply []byte, err error) {
	done := false
	defer func() {
		if !done {
			_ = c.Abort(context.WithoutCancel(ctx))
		}
	}()
	reply, err = fn(ctx)
	if err != nil {
		done = true
		if aerr := c.Abort(context.WithoutCancel(ctx)); aerr != nil {
			return nil, errors.Join(err, aerr)
		}
		return nil, err
	}
	done = true
	if err := c.Commit(context.WithoutCancel(ctx), reply); err != nil {
		return nil, err
	}
	return reply, nil
}
