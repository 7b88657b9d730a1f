package idem

import (
	"context"

	"github.com/idemdb/idem/index"
)

// PutHint carries what Engine.LookupHint read of a request to the Put of
// the same request in a batch of the same engine (PutHint.Put): the
// request as validated (its key, built once) and its key's slot in the
// table. It is for the pattern "look up, run, then Put" of a store that
// only one writer changes (idemraft's FSM looks each command up, runs the
// new ones, then writes their replies as one batch of Puts): without it
// the Put validates the request again and reads its key again from the
// table, and for a key not in memory from the key filter or the index.
//
// A hint spares reads, it never decides a result: the Put is classified
// against the key's state when the batch runs, exactly as Batch.Put is,
// whatever changed since the lookup. The slot is taken only while it is
// still the key's (a slot evicted meanwhile is read again), as a claim's
// slot is. The zero PutHint holds no request: its Put adds an item that
// fails with ErrInvalidRequest.
type PutHint struct {
	e   *Engine
	req Request
	k   reqKey // validate's: its key bytes are the slot's key
	fp  []byte
	sl  *slot // nil: read the key when the batch runs
}

// LookupHint is Lookup (the same Result and error) that also fills h for a
// later PutHint.Put of req. Unlike Lookup it installs the key's slot in the
// table when req is absent, as Begin does, since the Put that follows
// needs it. h is left zero when req is invalid or the read fails.
func (e *Engine) LookupHint(ctx context.Context, req Request, h *PutHint) (Result, error) {
	*h = PutHint{}
	return e.lookup(ctx, req, h)
}

// Prefetch readies e for looking reqs up soon, in about this order
// (LookupHint, Lookup, Begin, or a batch's items): it loads into the CPU's
// cache what those reads take first for a key that is not in memory, the
// index's key filter, for all of reqs at once. A check of the key filter
// for a new id reads one block at a random place in megabytes, nearly
// always a cache miss; loaded together, the misses of many requests
// overlap instead of coming one per request. A caller that holds many
// requests before it looks them up one by one (idemraft's FSM, with a
// batch of raft entries) calls it first.
//
// It takes no lock, writes nothing and decides nothing: no result depends
// on it, whatever happens between it and the reads. Requests that are not
// valid are skipped; a closed engine does nothing.
func (e *Engine) Prefetch(reqs []Request) {
	if len(reqs) == 0 || e.enter() != nil {
		return
	}
	defer e.leave()
	var (
		hs  [prefetchRun]uint64
		n   int
		buf [128]byte // a key's bytes, while it is hashed
	)
	for i := range reqs {
		key := e.prefetchKey(buf[:0], &reqs[i])
		if key == nil {
			continue // invalid: its lookup reads nothing
		}
		hs[n] = e.ix.FilterHash(key)
		if n++; n == len(hs) {
			e.ix.PrefetchFilter(hs[:n])
			n = 0
		}
	}
	e.ix.PrefetchFilter(hs[:n])
}

// prefetchKey appends r's entry key to dst, as validate builds it (the
// key its lookup reads: requestIdentity), without copying the client's
// name; nil when r's scope or identity is not valid.
func (e *Engine) prefetchKey(dst []byte, r *Request) []byte {
	if len(r.Scope) > e.o.MaxIDLen {
		return nil
	}
	mode, ident, err := requestIdentity(r, e.o.MaxIDLen)
	if err != nil {
		return nil
	}
	return index.EntryKey(dst, r.Scope, mode, ident)
}

// Put adds req's Put with reply to b, as b.Put(req, reply) for the request
// LookupHint was given. When b is a batch of the engine that filled h, the
// item reuses the request's key and slot instead of validating and reading
// them again; any other batch gets b.Put. h must not change until b has
// run.
func (h *PutHint) Put(b Batch, reply []byte) {
	if eb, ok := b.(*engineBatch); ok && h.e != nil && eb.e == h.e {
		eb.add(batchCall{kind: bPut, req: h.req, reply: reply, hint: h})
		return
	}
	b.Put(h.req, reply)
}

// batchKey is an item's key and fingerprint as Batch.Put or Begin checks
// them: from its hint when it has one (validated already), else validated
// here.
func (e *Engine) batchKey(c *batchCall) (reqKey, []byte, error) {
	if h := c.hint; h != nil {
		return h.k, h.fp, nil
	}
	k, err := e.validate(&c.req)
	return k, fingerprint(&c.req), err
}

// hintSlot is the slot of an item's hint while it is still its key's
// (nil otherwise: the run reads the key). The key's shard is locked.
func (c *batchCall) hintSlot() *slot {
	if h := c.hint; h != nil && h.sl != nil && !h.sl.evicted {
		return h.sl
	}
	return nil
}
