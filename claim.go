package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
)

// Claim is the ownership of one request handed out by a Fresh Begin (or by
// InDoubt after a restart). Exactly one of Commit, CommitAdvance or Abort
// should be called; a second one returns ErrLeaseLost and writes nothing.
// The exception is a finish whose outcome is unknown (an error matching
// ErrInDoubt, from a store across a network): the same finish may then be
// called again (the store answers it with the recorded outcome), and the
// other one is refused with ErrInvalidRequest.
//
// The contract, for every Store: once a claim exists, Commit and Abort
// always write their record, whatever ctx says; ctx may only bound how
// long the caller waits for the outcome. So a handler may pass the
// request's own context (r.Context() after the client hung up, a gRPC
// deadline that passed): the id is committed or released, never left in
// flight until its lease runs out. The Engine does not consult ctx in
// Commit and Abort at all (they wait for their fsync); a Store that stops
// waiting returns an error matching ErrInDoubt.
type Claim struct {
	b          ClaimBackend // nil for the Engine's own claims (ec)
	ec         engineClaim
	leaseUntil time.Time
	finished   atomic.Bool
	doubt      atomic.Uint32 // the finish whose outcome is unknown (doubtCommit, doubtAbort), 0: none
}

// engineClaim is the Engine's backend of a claim, kept inside Claim so
// that a Fresh Begin allocates one object.
type engineClaim struct {
	e   *Engine
	k   reqKey
	lsn wal.LSN
	// sl is k.key's slot as Begin left it (nil: unknown). It stays the
	// key's slot while the claim is in flight (an in-flight slot is never
	// evicted), so the finish takes it without a lookup unless it was
	// evicted after a takeover.
	sl *slot
	// ups, when not nil, holds the updates that the claim's record and
	// its finish go through (a single-request Begin's claim: see
	// freshClaim); set to nil once the finish used its own.
	ups *claimUpdates
}

// claimUpdates are the applier's updates of a claim's record and of its
// finish, each with room for its one transition, carried in the claim's
// own allocation (freshClaim): a Fresh Begin and its Commit then allocate
// no update and no transition slice of their own (four allocations per
// request). Each goes to the WAL once; the WAL and the applier read it
// until its record is applied, and nothing writes it after its append.
// The claim stays reachable from them until then.
type claimUpdates struct {
	claim, finish     pinnedUpdate
	claimTs, finishTs [1]index.Transition
}

// freshClaim is the Claim that a single-request Begin hands out, with its
// claimUpdates and the entry of its claim (the key's entry until the
// finish replaces it) in the same allocation. The table, the pending set
// and the WAL keep the whole object while they refer to that entry: until
// the claim is finished and its finish applied.
type freshClaim struct {
	Claim
	ups   claimUpdates
	entry index.Entry
}

func newEngineClaim(e *Engine, k reqKey, lsn wal.LSN, leaseUntil time.Time) *Claim {
	return &Claim{ec: engineClaim{e: e, k: k, lsn: lsn}, leaseUntil: leaseUntil}
}

// LeaseUntil is when the claim's lease runs out.
func (c *Claim) LeaseUntil() time.Time { return c.leaseUntil }

// Commit stores reply as the id's reply, durably (in SyncAlways mode) when it
// returns, and wakes callers waiting for it. If the lease ran out and another
// caller took the id over, it returns ErrLeaseLost and changes nothing. It
// writes its record whatever ctx says (see Claim). A reply larger than
// Options.MaxReplySize is ErrInvalidRequest, and the claim stays open.
func (c *Claim) Commit(ctx context.Context, reply []byte) error {
	return c.finish(ctx, false, reply, nil)
}

// Abort releases the id: it is unknown again (a sequence number is not
// consumed). Use it when the side effect failed and did not happen. It
// writes its record whatever ctx says (see Claim).
func (c *Claim) Abort(ctx context.Context) error {
	return c.finish(ctx, true, nil, nil)
}

// finish runs the one finish a claim gets. A finish that wrote nothing
// because the request was refused (ErrInvalidRequest, ErrInFlight) leaves
// the claim open. A finish whose outcome is unknown (ErrInDoubt, from a
// store across a network) may be retried, as the same finish only: the
// claim then accepts that finish again (the backend answers a retry with
// the recorded outcome) and refuses the other one.
func (c *Claim) finish(ctx context.Context, abort bool, reply []byte, adv []Advance) error {
	kind := uint32(doubtCommit)
	if abort {
		kind = doubtAbort
	}
	if d := c.doubt.Load(); d != 0 && d != kind {
		return fmt.Errorf("%w: the claim's %s is in doubt: retry it (the other finish cannot follow it)", ErrInvalidRequest, doubtName(d))
	}
	if c.finished.Swap(true) {
		return fmt.Errorf("%w: the claim was already committed or aborted", ErrLeaseLost)
	}
	if reply == nil && !abort {
		reply = []byte{}
	}
	var err error
	switch {
	case c.b == nil && abort:
		err = c.ec.abort()
	case c.b == nil:
		err = c.ec.commit(reply, adv)
	case abort:
		err = c.b.Abort(ctx)
	default:
		err = c.b.Commit(ctx, reply, adv)
	}
	switch {
	case err == nil:
		if c.doubt.Load() != 0 { // a store, not a load, per commit otherwise
			c.doubt.Store(0)
		}
	case errors.Is(err, ErrInDoubt):
		c.doubt.Store(kind)
		c.finished.Store(false)
	case errors.Is(err, ErrInvalidRequest) || errors.Is(err, ErrInFlight):
		c.finished.Store(false)
	}
	return err
}

// The finish a claim's doubt is about (Claim.doubt).
const (
	doubtCommit = 1
	doubtAbort  = 2
)

func doubtName(d uint32) string {
	if d == doubtAbort {
		return "abort"
	}
	return "commit"
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
// drops it, and so are the older replies of its reply window
// (Request.KeepReplies): an advance is not a request of the client.
func (c *Claim) CommitAdvance(ctx context.Context, reply []byte, adv ...Advance) error {
	return c.finish(ctx, false, reply, adv)
}

// checkAdvances validates adv and returns them for the WAL with the keys
// to lock: own (the committed key; nil for none) first, then one per
// advance.
func (e *Engine) checkAdvances(adv []Advance, own []byte) ([]wal.Advance, [][]byte, error) {
	return e.checkAdvancesInto(nil, nil, nil, adv, own)
}

// clientKeys remembers the client keys that checkAdvancesInto built for a
// batch: the items of a stream sink's batch advance the same few
// partitions, and each item sharing one key's bytes spares building it
// again (keys are never changed once built). It holds the last
// len(clientKeys.few) distinct clients.
type clientKeys struct {
	few  [16]clientKey
	n    int // entries of few in use
	next int // the entry the next new key replaces once few is full
}

type clientKey struct {
	scope, client string
	key           []byte
}

// key returns the entry key of the client (scope, client), built once.
func (c *clientKeys) key(scope, client string) []byte {
	if c == nil {
		return index.EntryKey(nil, scope, index.ModeClient, []byte(client))
	}
	for i := range c.few[:c.n] {
		if x := &c.few[i]; x.client == client && x.scope == scope {
			return x.key
		}
	}
	k := index.EntryKey(nil, scope, index.ModeClient, []byte(client))
	x := clientKey{scope: scope, client: client, key: k}
	if c.n < len(c.few) {
		c.few[c.n] = x
		c.n++
	} else {
		c.few[c.next] = x
		c.next = (c.next + 1) % len(c.few)
	}
	return k
}

// reset forgets the keys (a batch's buffers going back to their pool).
func (c *clientKeys) reset() { *c = clientKeys{} }

// checkAdvancesInto is checkAdvances that puts the advances and the keys
// at the end of wbuf and kbuf when they have the room (a batch's reused
// buffers), and allocates them otherwise; the client keys come from ck
// when not nil (a batch's, shared by its items).
func (e *Engine) checkAdvancesInto(wbuf []wal.Advance, kbuf [][]byte, ck *clientKeys, adv []Advance, own []byte) ([]wal.Advance, [][]byte, error) {
	if len(adv) > maxAdvances {
		return nil, nil, invalid("%d advances exceed %d", len(adv), maxAdvances)
	}
	nk := len(adv)
	if own != nil {
		nk++
	}
	var keys [][]byte
	if l := len(kbuf); cap(kbuf)-l >= nk {
		keys = kbuf[l : l : l+nk]
	} else {
		keys = make([][]byte, 0, nk)
	}
	var seen index.KeySet
	if own != nil {
		keys = append(keys, own)
		seen.Add(own)
	}
	var wadv []wal.Advance
	if l := len(wbuf); cap(wbuf)-l >= len(adv) {
		wadv = wbuf[l : l+len(adv) : l+len(adv)]
	} else {
		wadv = make([]wal.Advance, len(adv))
	}
	for i, a := range adv {
		if a.Client == "" || len(a.Client) > e.o.MaxIDLen || len(a.Scope) > e.o.MaxIDLen {
			return nil, nil, invalid("advance %d: client name must be 1..%d bytes and scope at most %d (client %d bytes, scope %d)", i, e.o.MaxIDLen, e.o.MaxIDLen, len(a.Client), len(a.Scope))
		}
		if a.Seq == 0 {
			return nil, nil, invalid("advance %d: client %q to sequence number 0 (numbers start at 1)", i, a.Client)
		}
		k := ck.key(a.Scope, a.Client)
		if !seen.Add(k) {
			return nil, nil, invalid("advance %d: client %q in scope %q is named twice or is the committed key", i, a.Client, a.Scope)
		}
		keys = append(keys, k)
		wadv[i] = wal.Advance{Scope: a.Scope, Client: a.Client, Seq: a.Seq}
	}
	return wadv, keys, nil
}

// advancesInFlightLocked returns ErrInFlight if a client of adv (whose keys
// are locked) has a claim in flight, read through the batch ov when not
// nil (Batch.Run).
func (e *Engine) advancesInFlightLocked(adv []wal.Advance, keys [][]byte, ov *index.Batch) error {
	for i, a := range adv {
		var en *index.Entry
		var err error
		if ov != nil {
			en, err = ov.Get(keys[i], index.ModeClient)
		} else {
			en, err = e.getLocked(keys[i], index.ModeClient)
		}
		if err != nil {
			return err
		}
		if err := advanceInFlight(a, en); err != nil {
			return err
		}
	}
	return nil
}

// advanceInFlight returns ErrInFlight if en, the entry of a's client, has
// a claim in flight.
func advanceInFlight(a wal.Advance, en *index.Entry) error {
	if en != nil && en.InFlight {
		return fmt.Errorf("%w: cannot advance client %q in scope %q to %d: its sequence number %d is claimed", ErrInFlight, a.Client, a.Scope, a.Seq, en.ClaimSeq)
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
	if err := e.advancesInFlightLocked(wadv, keys, nil); err != nil {
		unlock()
		return err
	}
	op := &wal.Op{Type: wal.OpAdvance, Time: e.o.Clock().UnixNano(), Advances: wadv}
	ts, err := index.Transitions(op, 0, e.getLockedFn)
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

func (c *engineClaim) commit(reply []byte, adv []Advance) error {
	e := c.e
	if len(reply) > e.o.MaxReplySize {
		return invalid("reply of %d bytes exceeds %d", len(reply), e.o.MaxReplySize)
	}
	if len(adv) == 0 {
		return c.write(wal.OpCommit, reply, nil, nil)
	}
	wadv, keys, err := e.checkAdvances(adv, c.k.key)
	if err != nil {
		return err
	}
	return c.write(wal.OpCommitAdvance, reply, wadv, keys)
}

func (c *engineClaim) abort() error { return c.write(wal.OpAbort, nil, nil, nil) }

// write appends the claim's commit or abort record and waits for its
// fsync. It does not take a ctx: once a claim exists its finish is always
// written (see Claim).
func (c *engineClaim) write(typ byte, reply []byte, adv []wal.Advance, keys [][]byte) error {
	e := c.e
	if err := e.enter(); err != nil {
		return err
	}
	// One deferred call in a function of few returns, which the compiler
	// open-codes (see Engine.begin).
	var pb *[]byte // the record's pooled buffer, until given back
	defer func() {
		if pb != nil {
			putPayload(pb)
		}
		e.leave()
	}()
	return c.writeEntered(typ, reply, adv, keys, &pb)
}

// writeEntered is write once the engine entered. It takes the record's
// buffer from the pool into *pbp, and sets *pbp to nil once it gave it
// back (the caller gives back any other).
func (c *engineClaim) writeEntered(typ byte, reply []byte, adv []wal.Advance, keys [][]byte, pbp **[]byte) error {
	e := c.e
	k := c.k
	// op is zero here and filled once, by setFinish (clearing it first
	// would pass over it again: a second pass over 300 bytes of a stack that
	// at hundreds of callers is no longer in the processor's cache when
	// the caller comes back from its handler).
	op := &wal.Op{}
	var (
		payload []byte
		pb      *[]byte      // payload's pooled buffer, returned once appended
		own     *index.Entry // the commit's entry, allocated with its reply (nil: none)
	)
	if keys == nil {
		// Commit and Abort: the record depends on the claim alone, so its
		// time, its copy of the reply and its encoding (compression
		// included) are made before the shard's lock is taken, shortening
		// the time the key's shard is held (at hundreds of callers its
		// lock is the engine's most contended). The time is still no
		// earlier than any record of the key before it (those were
		// appended before Begin handed the claim out), and a record that
		// the key gets after it takes its own time after its caller took
		// the lock that this one releases; the LSN, the check that the
		// claim is held and the slot's update stay under the lock.
		// CommitAdvance, which changes other clients' keys, reads its
		// time under their locks as before.
		if typ == wal.OpCommit {
			// The commit's entry and its copy of the reply in one
			// allocation (two before: the copy, and the entry that
			// the index's transition allocated).
			var r []byte
			own, r, _ = newCommitEntry(reply, nil)
			setFinish(op, typ, &k, c.lsn, e.o.Clock().UnixNano(), r, adv)
		} else {
			setFinish(op, typ, &k, c.lsn, e.o.Clock().UnixNano(), cloneExact(reply), adv)
		}
		pb = payloadPool.Get().(*[]byte)
		*pbp = pb
		var err error
		payload, err = wal.EncodeOp((*pb)[:0], op)
		*pb = payload
		if err != nil {
			return err
		}
	}
	var (
		unlock func()
		sl     *slot
	)
	switch {
	case keys == nil && c.sl != nil: // Commit, Abort: the claim's key alone, its slot in hand
		sh := e.slotShard(c.sl)
		sh.mu.Lock()
		unlock = sh.unlock
		if !c.sl.evicted {
			sl = c.sl
		}
	case keys == nil:
		unlock = e.lockKeys(k.key)
	default:
		unlock = e.lockKeys(keys...)
	}
	if sl == nil {
		var err error
		if sl, err = e.slotLocked(k.key); err != nil {
			unlock()
			return err
		}
	}
	cur := e.current(sl, k.mode)
	if cur == nil || !cur.InFlight || cur.ClaimLSN != c.lsn {
		unlock()
		e.st.leaseLost.Add(1)
		return fmt.Errorf("%w: scope %q %s", ErrLeaseLost, k.scope, printable(k.ident))
	}
	if len(adv) > 0 {
		if err := e.advancesInFlightLocked(adv, keys[1:], nil); err != nil {
			unlock()
			return err
		}
	}
	if keys != nil {
		setFinish(op, typ, &k, c.lsn, e.o.Clock().UnixNano(), cloneExact(reply), adv)
	}
	var (
		up *pinnedUpdate
		ts []index.Transition
	)
	if c.ups != nil {
		up, ts = &c.ups.finish, c.ups.finishTs[:0]
	}
	ts, err := e.slotShard(sl).transitionsHinted(ts, op, k.key, sl, own)
	if err != nil {
		unlock()
		return err
	}
	c.ups = nil // appended below (or failed for good): never handed out again
	var lsn wal.LSN
	if payload != nil {
		if lsn, err = e.appendRecordSlot(op.Type, payload, ts, k.key, sl, up); err == nil {
			e.countRemovals(removals(op.Type, ts))
		}
		putPayload(pb) // the WAL copied it
		*pbp = nil
	} else {
		lsn, err = e.appendOpSlot(op, ts, k.key, sl, up)
	}
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

// cloneExact is bytes.Clone with the capacity cut to the length: the
// entry's reply is handed to every reader of the id, and spare capacity
// behind it would let one reader's append write into another's.
func cloneExact(b []byte) []byte {
	c := bytes.Clone(b)
	return c[:len(c):len(c)]
}

// setFinish fills the zero op with the commit, commit-advance or abort
// (typ) of the claim claimLSN of key k, at time now (unix ns), with reply,
// which the caller copied already (the entry keeps it, in the table and
// then in the index, and the caller's buffer is the caller's again once
// Commit returns): its fields are set, the others left as they are.
func setFinish(op *wal.Op, typ byte, k *reqKey, claimLSN wal.LSN, now int64, reply []byte, adv []wal.Advance) {
	op.Type, op.Scope, op.ClaimLSN, op.Time, op.Reply, op.Advances = typ, k.scope, claimLSN, now, reply, adv
	if k.mode == index.ModeID {
		op.ID = k.ident
	} else {
		op.Client, op.Seq = string(k.ident), k.seq
	}
}

// newCommitEntry returns an entry for a commit's transition to fill
// (index.AppendTransitions) and a copy of reply allocated with it: one
// object instead of two for a reply of up to maxEntryRoom bytes (the entry
// alone for a longer one, the copy then allocated apart). fp, when not
// nil, is the fingerprint the committed entry keeps (a batch's Put: its
// claim is made in the same record), copied into the same object when
// reply and fp fit together (apart otherwise); nil for a commit that keeps
// its claim's (the transition takes the claim's ClaimFP), and then f is
// nil. The copies' capacities are their lengths, so that nothing appended
// to a reply or fingerprint read back can reach the rest of the object.
// The entry lives as long as its reply would: the table, the pending set
// and every reader keep the one through the other.
func newCommitEntry(reply, fp []byte) (en *index.Entry, r, f []byte) {
	n := len(reply)
	if fp != nil && n+len(fp) <= maxEntryRoom {
		n += len(fp)
	} else if fp != nil {
		f = cloneExact(fp)
	}
	en, room := entryWithRoom(n)
	if room == nil {
		return en, cloneExact(reply), f
	}
	r = room[:len(reply):len(reply)]
	copy(r, reply)
	if fp != nil && f == nil {
		f = room[len(reply):n:n]
		copy(f, fp)
	}
	return en, r, f
}

// entryWithRoom returns a zero entry allocated with at least n bytes of
// room after it (nil room, and the entry alone, for n over maxEntryRoom),
// in the smallest of the objects below that holds n: their sizes are the
// allocator's size classes exactly (TestEntryRoomSizeClasses), so a reply
// of 30 bytes takes 224 bytes with its entry, not 256.
func entryWithRoom(n int) (*index.Entry, []byte) {
	switch {
	case n <= 8:
		x := new(entryRoom8)
		return &x.e, x.r[:]
	case n <= 24:
		x := new(entryRoom24)
		return &x.e, x.r[:]
	case n <= 40:
		x := new(entryRoom40)
		return &x.e, x.r[:]
	case n <= 56:
		x := new(entryRoom56)
		return &x.e, x.r[:]
	case n <= 72:
		x := new(entryRoom72)
		return &x.e, x.r[:]
	case n <= 104:
		x := new(entryRoom104)
		return &x.e, x.r[:]
	case n <= 136:
		x := new(entryRoom136)
		return &x.e, x.r[:]
	case n <= 200:
		x := new(entryRoom200)
		return &x.e, x.r[:]
	case n <= maxEntryRoom:
		x := new(entryRoom264)
		return &x.e, x.r[:]
	}
	return new(index.Entry), nil
}

// maxEntryRoom is the most bytes entryWithRoom allocates with an entry.
const maxEntryRoom = 264

// An entry and room for its reply (and fingerprint), in one allocation
// (entryWithRoom): with the 184-byte index.Entry, the size classes 192,
// 208, 224, 240, 256, 288, 320, 384 and 448.
type (
	entryRoom8 struct {
		e index.Entry
		r [8]byte
	}
	entryRoom24 struct {
		e index.Entry
		r [24]byte
	}
	entryRoom40 struct {
		e index.Entry
		r [40]byte
	}
	entryRoom56 struct {
		e index.Entry
		r [56]byte
	}
	entryRoom72 struct {
		e index.Entry
		r [72]byte
	}
	entryRoom104 struct {
		e index.Entry
		r [104]byte
	}
	entryRoom136 struct {
		e index.Entry
		r [136]byte
	}
	entryRoom200 struct {
		e index.Entry
		r [200]byte
	}
	entryRoom264 struct {
		e index.Entry
		r [maxEntryRoom]byte
	}
)
