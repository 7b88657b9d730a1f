package idemstream

import (
	"context"
	"fmt"
	"sync"

	"github.com/idemdb/idem"
)

// newBatch returns a batch of st: the store's own when it implements
// idem.Batcher (an *idem.Engine: one record for the whole batch), else a
// storeBatch that runs the items as single calls of st (one request at a
// time: an idemcluster client, a test double).
//
// The protocols here never rely on a batch being atomic: every record they
// batch is ordered so that a crash between two of its items (a storeBatch)
// leaves a state that recovery completes (see the package doc, "Records").
// An atomic batch only removes those intermediate states.
func newBatch(st idem.Store) idem.Batch {
	if bs, ok := st.(idem.Batcher); ok {
		return bs.NewBatch()
	}
	return &storeBatch{st: st}
}

// appendRun runs b with its results appended to dst: through
// idem.RunAppender when b has it (the engine's batch: the results go in
// dst's spare capacity, so a caller that keeps dst from batch to batch
// allocates none for them), else through Run and a copy. It returns dst
// as given when err is for the batch as a whole. The caller clears what
// it keeps of the results once it is done with them: they hold the
// claims and replies of the batch.
func appendRun(ctx context.Context, b idem.Batch, dst []idem.BatchResult) ([]idem.BatchResult, error) {
	if ra, ok := b.(idem.RunAppender); ok {
		return ra.AppendRun(ctx, dst)
	}
	res, err := b.Run(ctx)
	if err != nil {
		return dst, err
	}
	return append(dst, res...), nil
}

// storeBatch is an idem.Batch over a Store without Batcher: each item is
// the single call it stands for, with the same result. Items run in the
// order they were added, except that a run of consecutive items of the
// same kind (Begin, Put, Commit or Abort) in the same scope naming
// distinct keys runs concurrently, so that their records share the
// store's group commits. An item of another kind or scope waits for the
// items before it: a checkpoint's record is durable before its events are
// put.
type storeBatch struct {
	st    idem.Store
	items []storeItem
	ran   bool
}

type storeItem struct {
	kind  storeItemKind
	req   idem.Request
	claim *idem.Claim
	reply []byte
	adv   []idem.Advance
	scope string
	ids   [][]byte
}

type storeItemKind uint8

const (
	itemBegin storeItemKind = iota
	itemPut
	itemCommit
	itemAbort
	itemAck
	itemAdvance
)

func (b *storeBatch) add(it storeItem) { b.items = append(b.items, it) }

func (b *storeBatch) Begin(req idem.Request) { b.add(storeItem{kind: itemBegin, req: req}) }
func (b *storeBatch) Put(req idem.Request, reply []byte, adv ...idem.Advance) {
	b.add(storeItem{kind: itemPut, req: req, reply: reply, adv: adv})
}
func (b *storeBatch) Commit(c *idem.Claim, reply []byte, adv ...idem.Advance) {
	b.add(storeItem{kind: itemCommit, claim: c, reply: reply, adv: adv})
}
func (b *storeBatch) Abort(c *idem.Claim) { b.add(storeItem{kind: itemAbort, claim: c}) }
func (b *storeBatch) Ack(scope string, ids ...[]byte) {
	b.add(storeItem{kind: itemAck, scope: scope, ids: ids})
}
func (b *storeBatch) Advance(adv ...idem.Advance) { b.add(storeItem{kind: itemAdvance, adv: adv}) }
func (b *storeBatch) Len() int                    { return len(b.items) }

// key names what an item changes, for the concurrency rule above.
func (it *storeItem) key() any {
	switch it.kind {
	case itemBegin, itemPut:
		return struct {
			scope, id, client string
			seq               uint64
		}{it.req.Scope, string(it.req.ID), it.req.Client, it.req.Seq}
	case itemCommit, itemAbort:
		return it.claim
	}
	return nil
}

// reqScope is the scope of a Begin or Put ("" for the others: a claim's
// finish is ordered by its claim).
func (it *storeItem) reqScope() string { return it.req.Scope }

func (b *storeBatch) Run(ctx context.Context) ([]idem.BatchResult, error) {
	if b.ran {
		return nil, fmt.Errorf("%w: the batch was run already", idem.ErrInvalidRequest)
	}
	b.ran = true
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	out := make([]idem.BatchResult, len(b.items))
	for i := 0; i < len(b.items); {
		j := i + 1
		if k := b.items[i].key(); k != nil {
			seen := map[any]bool{k: true}
			for j < len(b.items) && b.items[j].kind == b.items[i].kind && b.items[j].reqScope() == b.items[i].reqScope() && !seen[b.items[j].key()] {
				seen[b.items[j].key()] = true
				j++
			}
		}
		if j-i == 1 {
			b.run(ctx, i, &out[i])
		} else {
			var wg sync.WaitGroup
			sem := make(chan struct{}, 64)
			for n := i; n < j; n++ {
				sem <- struct{}{}
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer func() { <-sem }()
					b.run(ctx, n, &out[n])
				}()
			}
			wg.Wait()
		}
		i = j
	}
	return out, nil
}

// run runs item i as its single call.
func (b *storeBatch) run(ctx context.Context, i int, r *idem.BatchResult) {
	it := &b.items[i]
	switch it.kind {
	case itemBegin:
		r.Result, r.Err = b.st.Begin(ctx, it.req)
	case itemPut:
		r.Result, r.Err = b.st.Begin(ctx, it.req)
		if r.Err == nil && r.Result.Status == idem.Fresh {
			c := r.Result.Claim
			r.Result.Claim = nil
			if r.Err = finish(ctx, c, it.reply, it.adv); r.Err != nil {
				_ = c.Abort(ctx)
			}
		}
	case itemCommit, itemAbort:
		switch {
		case it.claim == nil:
			r.Err = fmt.Errorf("%w: batch item %d: nil claim", idem.ErrInvalidRequest, i)
		case it.kind == itemAbort:
			r.Err = it.claim.Abort(ctx)
		default:
			r.Err = finish(ctx, it.claim, it.reply, it.adv)
		}
	case itemAck:
		r.Err = b.st.Ack(ctx, it.scope, it.ids...)
	case itemAdvance:
		r.Err = b.st.Advance(ctx, it.adv...)
	}
}

// finish commits c with reply, raising adv in the same record.
func finish(ctx context.Context, c *idem.Claim, reply []byte, adv []idem.Advance) error {
	if len(adv) > 0 {
		return c.CommitAdvance(ctx, reply, adv...)
	}
	return c.Commit(ctx, reply)
}
