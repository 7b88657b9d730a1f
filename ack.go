package idem

import (
	"context"
	"time"

	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
)

// Ack removes committed ids whose replies the client has received, by a
// logged record, so that replay removes them too. Unknown and
// in-flight ids are ignored. Durable when it returns (SyncAlways).
func (e *Engine) Ack(ctx context.Context, scope string, ids ...[]byte) error {
	if len(ids) == 0 {
		return nil
	}
	if len(scope) > e.o.MaxIDLen {
		return invalid("scope of %d bytes exceeds %d", len(scope), e.o.MaxIDLen)
	}
	keys := make([][]byte, 0, len(ids))
	for _, id := range ids {
		if len(id) == 0 || len(id) > e.o.MaxIDLen {
			return invalid("acked id of %d bytes (want 1..%d)", len(id), e.o.MaxIDLen)
		}
		keys = append(keys, index.EntryKey(nil, scope, index.ModeID, id))
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := e.enter(); err != nil {
		return err
	}
	defer e.leave()
	unlock := e.lockKeys(keys...)
	op := &wal.Op{Type: wal.OpAck, Scope: scope, Acked: ids, Time: e.o.Clock().UnixNano()}
	ts, err := index.Transitions(op, 0, e.getLocked)
	if err != nil || len(ts) == 0 {
		unlock()
		return err // nothing to remove: nothing to log
	}
	lsn, err := e.appendOp(op, ts)
	unlock()
	if err != nil {
		return err
	}
	return e.waitDurable(lsn)
}

// Forget appends the administrator's tombstone "forget every reply
// committed before before". Ids forgotten run again as new;
// sequence-mode clients keep their last sequence number (a retry at or
// below it is ErrAlreadyCommitted). In-flight claims whose lease ended
// before before are dropped too (abandoned claims). A forget never moves
// backwards: a before earlier than a previous one changes nothing. Durable
// when it returns (SyncAlways).
func (e *Engine) Forget(ctx context.Context, before time.Time) error {
	return e.forget(ctx, before.UnixNano(), wal.ForgetAdmin)
}

func (e *Engine) forget(ctx context.Context, before int64, reason byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := e.enter(); err != nil {
		return err
	}
	defer e.leave()
	unlock := e.lockAll()
	cur := *e.mark.Load()
	b := max(before, cur.Before)
	op := &wal.Op{Type: wal.OpForget, Before: b, Time: e.o.Clock().UnixNano(), Reason: reason}
	payload, err := wal.EncodeOp(nil, op)
	if err != nil {
		unlock()
		return err
	}
	lsn, err := e.w.AppendWith(wal.OpForget, payload, func(lsn wal.LSN) any {
		return &index.Update{LSN: lsn, Forget: &index.Mark{Before: b, LSN: lsn}, Reason: reason}
	})
	if err != nil {
		unlock()
		return e.failure(err)
	}
	e.mark.Store(&index.Mark{Before: b, LSN: lsn})
	unlock()
	return e.waitDurable(lsn)
}
