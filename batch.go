package idem

import (
	"context"
	"fmt"
)

// Batcher is implemented by a Store that can run many requests at once
// (one record and one pass over its state per batch). It is not part of
// Store: an integration checks for it and batches when the store has it,
// one request at a time otherwise:
//
//	if bs, ok := store.(idem.Batcher); ok {
//		b := bs.NewBatch()
//		...
//	}
type Batcher interface {
	NewBatch() Batch
}

// Batch collects requests that a Store runs together with Run. Each call
// adds one item; Run returns one BatchResult per item, in the order the
// items were added, with exactly the result and error the single call
// would have given. Items of one batch that name the same key see each
// other in order (a second Begin of an id claimed earlier in the batch is
// InFlight). A Batch is used by one goroutine and run once.
type Batch interface {
	// Begin is Store.Begin as an item of the batch.
	Begin(req Request)
	// Put claims req and commits reply (with the advances adv) in one
	// step: for a request whose side effect another log holds (a raft
	// entry, a stream checkpoint) no claim is ever visible alone. Its
	// result is what Begin would say, except that a new request gives
	// Status Fresh with no Claim (it is committed already): Done with the
	// stored reply, InFlight, ErrConflict, *SequenceGapError,
	// *AlreadyCommittedError as Begin.
	Put(req Request, reply []byte, adv ...Advance)
	// Commit is c.Commit (c.CommitAdvance with adv) as an item.
	Commit(c *Claim, reply []byte, adv ...Advance)
	// Abort is c.Abort as an item.
	Abort(c *Claim)
	// Ack is Store.Ack as an item.
	Ack(scope string, ids ...[]byte)
	// Advance is Store.Advance as an item.
	Advance(adv ...Advance)
	// Len is the number of items added.
	Len() int
	// Run runs the items and waits for them to be durable. err is for the
	// batch as a whole (ErrClosed, ErrFailed, ctx ended before anything
	// was written, the batch was run before): then nothing of it was
	// written. Otherwise each item has its own result and error.
	Run(ctx context.Context) ([]BatchResult, error)
}

// BatchResult is the outcome of one item of a Batch: Result as the single
// call returns it (Begin, Put), and its error.
type BatchResult struct {
	Result Result
	Err    error
}

var _ Batcher = (*Engine)(nil)

// batchKind is what an item of an engine batch does.
type batchKind uint8

const (
	bBegin batchKind = iota
	bPut
	bCommit
	bAbort
	bAck
	bAdvance
)

type batchItem struct {
	kind  batchKind
	req   Request
	claim *Claim
	reply []byte
	adv   []Advance
	scope string
	ids   [][]byte
}

// engineBatch is the Engine's Batch.
type engineBatch struct {
	e     *Engine
	items []batchItem
	ran   bool
}

// NewBatch returns an empty batch of the engine (see Batch).
func (e *Engine) NewBatch() Batch { return &engineBatch{e: e} }

func (b *engineBatch) Begin(req Request) {
	b.items = append(b.items, batchItem{kind: bBegin, req: req})
}
func (b *engineBatch) Put(req Request, reply []byte, adv ...Advance) {
	b.items = append(b.items, batchItem{kind: bPut, req: req, reply: reply, adv: adv})
}
func (b *engineBatch) Commit(c *Claim, reply []byte, adv ...Advance) {
	b.items = append(b.items, batchItem{kind: bCommit, claim: c, reply: reply, adv: adv})
}
func (b *engineBatch) Abort(c *Claim) { b.items = append(b.items, batchItem{kind: bAbort, claim: c}) }
func (b *engineBatch) Ack(scope string, ids ...[]byte) {
	b.items = append(b.items, batchItem{kind: bAck, scope: scope, ids: ids})
}
func (b *engineBatch) Advance(adv ...Advance) {
	b.items = append(b.items, batchItem{kind: bAdvance, adv: adv})
}
func (b *engineBatch) Len() int { return len(b.items) }

// Run runs the items. This first version runs them one at a time through
// the single calls (same results, one record each); the one-record batch
// (docs/design.md, "The batch path") replaces it.
func (b *engineBatch) Run(ctx context.Context) ([]BatchResult, error) {
	if b.ran {
		return nil, fmt.Errorf("%w: the batch was run already", ErrInvalidRequest)
	}
	b.ran = true
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	e := b.e
	if err := e.enter(); err != nil {
		return nil, err
	}
	e.leave()
	out := make([]BatchResult, len(b.items))
	for i := range b.items {
		it := &b.items[i]
		r := &out[i]
		switch it.kind {
		case bBegin:
			r.Result, r.Err = e.Begin(context.WithoutCancel(ctx), it.req)
		case bPut:
			r.Result, r.Err = e.Begin(context.WithoutCancel(ctx), it.req)
			if r.Err == nil && r.Result.Status == Fresh {
				c := r.Result.Claim
				r.Result.Claim = nil
				if len(it.adv) > 0 {
					r.Err = c.CommitAdvance(ctx, it.reply, it.adv...)
				} else {
					r.Err = c.Commit(ctx, it.reply)
				}
				if r.Err != nil {
					_ = c.Abort(ctx)
				}
			}
		case bCommit, bAbort:
			if it.claim == nil {
				r.Err = fmt.Errorf("%w: batch item %d: nil claim", ErrInvalidRequest, i)
				continue
			}
			if it.kind == bAbort {
				r.Err = it.claim.Abort(ctx)
			} else if len(it.adv) > 0 {
				r.Err = it.claim.CommitAdvance(ctx, it.reply, it.adv...)
			} else {
				r.Err = it.claim.Commit(ctx, it.reply)
			}
		case bAck:
			r.Err = e.Ack(context.WithoutCancel(ctx), it.scope, it.ids...)
		case bAdvance:
			r.Err = e.Advance(context.WithoutCancel(ctx), it.adv...)
		}
	}
	return out, nil
}
