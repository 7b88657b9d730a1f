package idem

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
	"unsafe"

	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
)

var payloadPool = sync.Pool{New: func() any { b := make([]byte, 0, 512); return &b }}

// putPayload returns a payloadPool buffer, unless it grew past 64 KiB.
func putPayload(pb *[]byte) {
	if cap(*pb) <= 64<<10 {
		payloadPool.Put(pb)
	}
}

// ---- keys and the in-memory table ----

// reqKey is a validated request identity.
type reqKey struct {
	scope  string
	mode   byte
	ident  []byte // id, or client name
	seq    uint64
	key    []byte // index entry key
	acked  [][]byte
	ackKey [][]byte
}

func (e *Engine) validate(r *Request) (reqKey, error) {
	max := e.o.MaxIDLen
	if len(r.Scope) > max {
		return reqKey{}, invalid("scope of %d bytes exceeds %d", len(r.Scope), max)
	}
	if len(r.Fingerprint) > max {
		return reqKey{}, invalid("fingerprint of %d bytes exceeds %d", len(r.Fingerprint), max)
	}
	if r.TTL < 0 {
		return reqKey{}, invalid("negative TTL %v", r.TTL)
	}
	if r.KeepReplies < 0 || r.KeepReplies > MaxKeepReplies {
		return reqKey{}, invalid("KeepReplies %d out of range 0..%d", r.KeepReplies, MaxKeepReplies)
	}
	if r.KeepRepliesFor < 0 {
		return reqKey{}, invalid("negative KeepRepliesFor %v", r.KeepRepliesFor)
	}
	if (r.KeepReplies != 0 || r.KeepRepliesFor != 0) && r.Client == "" {
		return reqKey{}, invalid("KeepReplies and KeepRepliesFor apply to sequence mode (Client and Seq) only")
	}
	k := reqKey{scope: r.Scope}
	mode, ident, err := requestIdentity(r, max)
	if err != nil {
		return reqKey{}, err
	}
	k.mode, k.seq = mode, r.Seq
	k.key = index.EntryKey(nil, k.scope, k.mode, ident)
	// The identifier as the key holds it (its last bytes): the engine's
	// own, never the caller's ID buffer, which the caller may reuse once
	// the call returns while a claim keeps k until its finish writes
	// k.ident into the commit or abort record (TestClaimIDNotCallers).
	k.ident = k.key[len(k.key)-len(ident):]
	if len(r.Acked) > 4096 {
		return reqKey{}, invalid("%d acked ids exceed 4096", len(r.Acked))
	}
	for _, a := range r.Acked {
		if len(a) == 0 || len(a) > max {
			return reqKey{}, invalid("acked id of %d bytes (want 1..%d)", len(a), max)
		}
		if k.mode == index.ModeID && string(a) == string(r.ID) {
			return reqKey{}, invalid("a request cannot ack its own id")
		}
		k.acked = append(k.acked, a)
		k.ackKey = append(k.ackKey, index.EntryKey(nil, k.scope, index.ModeID, a))
	}
	return k, nil
}

// requestIdentity checks r's identity, an id or a client with a
// sequence number, and returns its mode and identifier: r.ID, or the
// client's name as a read-only view of r.Client (not copied). validate
// and Engine.Prefetch both take a request's identity from it, so the key
// a prefetch loads is the key the lookup reads.
func requestIdentity(r *Request, max int) (mode byte, ident []byte, err error) {
	switch {
	case len(r.ID) > 0 && (r.Client != "" || r.Seq != 0):
		return 0, nil, invalid("both an id and a client/seq were given; use one identity")
	case len(r.ID) > 0:
		if len(r.ID) > max {
			return 0, nil, invalid("id of %d bytes exceeds %d", len(r.ID), max)
		}
		return index.ModeID, r.ID, nil
	case r.Client != "":
		if r.Seq == 0 {
			return 0, nil, invalid("client %q without a sequence number (sequences start at 1)", r.Client)
		}
		if len(r.Client) > max {
			return 0, nil, invalid("client name of %d bytes exceeds %d", len(r.Client), max)
		}
		return index.ModeClient, unsafe.Slice(unsafe.StringData(r.Client), len(r.Client)), nil
	case r.Seq != 0:
		return 0, nil, invalid("sequence number %d without a client", r.Seq)
	default:
		return 0, nil, invalid("empty id")
	}
}

// shardIdx is key's lock shard. A client's older sequence replies
// (index.ModeSeq keys) share the client key's shard (index.ShardHash), so
// the client's lock covers them: the commit that moves and drops them, and
// the reads of older sequence numbers, hold that one lock.
func (e *Engine) shardIdx(key []byte) int { return int(index.ShardHash(e.seed, key) % numShards) }

func (e *Engine) shardOf(key []byte) *shard { return &e.shards[e.shardIdx(key)] }

// slotShard is the shard whose table holds sl (or held it, if evicted).
func (e *Engine) slotShard(sl *slot) *shard { return &e.shards[sl.shard] }

// keyTag returns key's shard and key's tag in that shard's table (the top
// 32 bits of key's own hash), from one hash computation for every key but
// a client's older sequence keys (index.KeyHashes): the shard index is the
// low bits of the same hash, which every key of a shard shares, the tag
// its high bits.
func (e *Engine) keyTag(key []byte) (*shard, uint32) {
	s, own := index.KeyHashes(e.seed, key)
	return &e.shards[s%numShards], uint32(own >> 32)
}

// keyTagOf is keyTag for a key whose slot, evicted or not, was was (nil:
// unknown): an evicted slot keeps its shard and tag, which spares hashing
// the key again.
func (e *Engine) keyTagOf(key []byte, was *slot) (*shard, uint32) {
	if was != nil {
		return e.slotShard(was), was.tag
	}
	return e.keyTag(key)
}

// lockKeys locks the shards of keys in index order (so that multi-key
// operations never deadlock) and returns the unlock function.
func (e *Engine) lockKeys(keys ...[]byte) func() {
	if len(keys) == 1 {
		sh := e.shardOf(keys[0])
		sh.mu.Lock()
		return sh.unlock
	}
	idx := make([]int, 0, len(keys))
	for _, k := range keys {
		idx = append(idx, e.shardIdx(k))
	}
	slices.Sort(idx)
	idx = slices.Compact(idx)
	for _, i := range idx {
		e.shards[i].mu.Lock()
	}
	return func() {
		for j := len(idx) - 1; j >= 0; j-- {
			e.shards[idx[j]].mu.Unlock()
		}
	}
}

func (e *Engine) lockAll() func() {
	for i := range e.shards {
		e.shards[i].mu.Lock()
	}
	return func() {
		for i := len(e.shards) - 1; i >= 0; i-- {
			e.shards[i].mu.Unlock()
		}
	}
}

// slotLocked returns key's slot, loading it from the index if needed. The
// shard's lock must be held.
func (e *Engine) slotLocked(key []byte) (*slot, error) { return e.slotLockedKeep(key, false) }

// slotLockedKeep is slotLocked that, with keep (a batch's run,
// batchRun.get), installs a slot by installForBatchLocked, which makes
// key's bytes the slot's key: the caller guarantees that they never change.
func (e *Engine) slotLockedKeep(key []byte, keep bool) (*slot, error) {
	sh, tag := e.keyTag(key)
	return e.slotLockedIn(sh, key, tag, keep)
}

// slotLockedIn is slotLockedKeep for a caller that knows sh and tag, key's
// shard and tag (keyTag's).
func (e *Engine) slotLockedIn(sh *shard, key []byte, tag uint32, keep bool) (*slot, error) {
	if sl := sh.find(key, tag); sl != nil {
		return sl, nil
	}
	return e.loadSlotLocked(sh, key, tag, keep)
}

// loadSlotLocked is slotLockedIn for a key that has no slot in sh (its
// caller probed the table already): it reads the key from the index and
// installs its slot.
func (e *Engine) loadSlotLocked(sh *shard, key []byte, tag uint32, keep bool) (*slot, error) {
	en, err := e.ix.Get(key)
	if err != nil {
		return nil, wrapCorrupt(err)
	}
	if keep {
		return e.installForBatchLocked(sh, key, tag, en), nil
	}
	return e.installLocked(sh, key, tag, en, false), nil
}

// installLocked puts a slot holding en, as read from the index, into sh
// (whose lock is held) and evicts past the shard's share, never that slot.
// tag is key's tag (keyTag's). With keep, key's bytes become the slot's
// key as they are (no copy): the caller guarantees that they never
// change.
func (e *Engine) installLocked(sh *shard, key []byte, tag uint32, en *index.Entry, keep bool) *slot {
	sl := e.insertLocked(sh, key, tag, en, keep)
	e.evictLocked(sh, sl)
	return sl
}

// installForBatchLocked is installLocked, with keep, for a slot that a
// batch record is about to write (a batch's run, LookupHint for the Put
// that follows): it leaves the eviction that the insertion calls for to
// the applier, which evicts in the shard once it has applied the record
// (applyBatch), off the batch's thread, unless the shard is past its
// share by a quarter already (which bounds the memory of slots installed
// for a record never written, and of a shard whose records the applier
// has not reached yet).
func (e *Engine) installForBatchLocked(sh *shard, key []byte, tag uint32, en *index.Entry) *slot {
	sl := e.insertLocked(sh, key, tag, en, true)
	if limit := e.o.CacheSize / numShards; sh.bytes > limit+limit/4 {
		e.evictLocked(sh, sl)
	}
	return sl
}

// insertLocked is installLocked without the eviction. key has no slot in
// sh.
func (e *Engine) insertLocked(sh *shard, key []byte, tag uint32, en *index.Entry, keep bool) *slot {
	sl := &slot{shard: uint8(sh.idx), e: en, size: slotSize(key, en), inFlight: en != nil && en.InFlight}
	if keep && len(key) > 0 {
		sl.key = unsafe.String(&key[0], len(key))
	} else {
		sl.key = string(key)
	}
	sh.add(sl, tag)
	sh.installs++
	sh.bytes += sl.size
	return sl
}

// lockSlot locks key's shard and returns key's slot and the unlock
// function. key (a reqKey.key, made by validate) must never change: a
// slot installed here keeps its bytes as its key. A slot that is not in memory is read from the index without
// holding the shard's lock, so that a lookup that has to read the disk (a
// duplicate of an id committed long ago, while Pebble compacts) does not
// stall every other key of its shard behind it. A key that the index's
// key filter does not hold (ix.MayContain: nearly every new id) needs no
// read: its slot is installed at once, under the lock already held.
//
// The read is installed only if the key still has no slot and no slot of
// the shard was evicted meanwhile. That makes it current: every change to
// a key goes through its slot, which stays in memory (pinned) until the
// index has applied it; so if no slot was evicted, no change to the key
// can have been made and applied during the read. Forget marks change the
// index without the slots, but readers apply the newest mark to whatever
// they read (Engine.current). Otherwise the key is read again under the
// lock.
func (e *Engine) lockSlot(key []byte) (*slot, func(), error) {
	return e.lockSlotFor(key, slotWrite)
}

// slotUse says what lockSlotFor's caller does with the slot.
type slotUse uint8

const (
	slotWrite slotUse = iota // lockSlot
	slotRead                 // lockSlotRead
	// slotHint: LookupHint, for the Put that follows in a batch: as
	// slotWrite, except that a new key's slot is installed by
	// installForBatchLocked.
	slotHint
)

// lockSlotFor is lockSlot, lockSlotRead, or LookupHint's (use).
func (e *Engine) lockSlotFor(key []byte, use slotUse) (*slot, func(), error) {
	read := use == slotRead
	sh, tag := e.keyTag(key)
	sh.mu.Lock()
	if sl := sh.find(key, tag); sl != nil {
		return sl, sh.unlock, nil
	}
	if !e.ix.MayContain(key) {
		// Nearly every new id: the key filter says the index does not
		// hold it, in memory and at once, so the shard's lock is kept
		// (no second lock, no second probe). That answer is current: with
		// no slot, every change to the key is applied (see lockSlotRead),
		// and the filter holds every key applied.
		switch use {
		case slotRead:
			sh.mu.Unlock()
			return nil, nil, nil
		case slotHint:
			return e.installForBatchLocked(sh, key, tag, nil), sh.unlock, nil
		}
		return e.installLocked(sh, key, tag, nil, true), sh.unlock, nil
	}
	gen, installs := sh.gen, sh.installs
	sh.mu.Unlock()
	en, err := e.ix.Get(key)
	if testHookUnlockedRead != nil {
		testHookUnlockedRead(key)
	}
	if read && err == nil && en == nil {
		return nil, nil, nil
	}
	return e.lockSlotAfterRead(sh, key, tag, en, err, gen, installs)
}

// lockSlotAfterRead is the end of lockSlot: sh's lock is taken again
// after the read (en, err) of key (table tag tag) made without it, which
// began when the shard had evicted gen slots and installed installs.
func (e *Engine) lockSlotAfterRead(sh *shard, key []byte, tag uint32, en *index.Entry, err error, gen, installs uint64) (*slot, func(), error) {
	sh.mu.Lock()
	if sh.installs != installs { // else no slot can have appeared: the table was probed above
		if sl := sh.find(key, tag); sl != nil {
			return sl, sh.unlock, nil
		}
	}
	if err != nil || sh.gen != gen {
		sl, err := e.slotLocked(key)
		if err != nil {
			sh.mu.Unlock()
			return nil, nil, err
		}
		return sl, sh.unlock, nil
	}
	return e.installLocked(sh, key, tag, en, true), sh.unlock, nil
}

// lockSlotRead is lockSlot for a read (Lookup, Wait, ClientState): a key
// that has no slot and that the index does not hold is answered as absent
// without installing a slot and without taking the shard's lock again. It
// then returns a nil slot and a nil unlock function (no lock is held);
// otherwise it returns what lockSlot returns.
//
// Why that read is linearizable: a slot is taken out of its table only
// when it is clean (its records applied to the index: the applier applies
// a batch of records before it unpins their slots) and nobody waits on
// it, and every change to a key is published into its slot under the
// shard's lock. So when the first probe finds no slot, the index holds
// every change to the key made so far, and the index read that follows
// sees that state or a newer one: one made by a change decided after the
// probe (concurrent with this read) and already applied, hence durable
// (the index takes only fsynced records). "Absent" read that way was the
// key's state at some moment between the probe and the read's end: a
// write acknowledged before the read began is seen, and a write that may
// still be lost is not. Nothing is installed, so nothing later trusts
// the read: lockSlot's check that no slot of the shard was evicted
// meanwhile is what an installed read needs (it becomes the key's state
// for writers), not an answer given once. A read that finds an entry
// goes through lockSlot's check and installs it as before, so that
// repeated reads of a stored id find it in memory.
func (e *Engine) lockSlotRead(key []byte) (*slot, func(), error) {
	return e.lockSlotFor(key, slotRead)
}

// testHookUnlockedRead, set by tests only, runs after lockSlot read key
// from the index without the shard's lock, before it takes the lock again.
var testHookUnlockedRead func(key []byte)

// slotSize is the memory that a slot of key holding en takes, as the
// shard's share of CacheSize counts it: the key's bytes, the slot
// (slotBytes) and its part of the shard's table (tableBytesPerSlot), and
// the entry (entryBytes) with its byte slices. The slot alone holds its
// entry once the index has applied it.
func slotSize(key []byte, en *index.Entry) int64 {
	n := int64(len(key)) + slotBytes + tableBytesPerSlot
	if en != nil {
		n += entryBytes + int64(len(en.Reply)+len(en.Fingerprint)+len(en.ClaimFP))
	}
	return n
}

// The fixed parts of slotSize. TestSlotSize checks slotBytes and
// entryBytes against the structs' sizes rounded up to their size classes
// (what the allocator hands out), so that a field added to either cannot
// leave the accounting behind.
const (
	slotBytes  = 64  // a slot (64 bytes)
	entryBytes = 192 // an index.Entry (184 bytes)
	// tableBytesPerSlot is a slot's part of its shard's table at most:
	// 16 bytes of tab (8-byte entries, the table 7/16 to 7/8 full) and 8
	// of slab (a pointer; a free position adds 4 in free until reused).
	tableBytesPerSlot = 24
)

// evictLocked drops clean, unpinned slots while the shard is over its share
// of CacheSize, never the slot keep (just loaded: its caller is about to use
// it). It sweeps the shard's slab from where the previous sweep stopped
// (sh.evictAt): a clock over slab positions, which new slots reuse once
// freed, so the slots looked at first are about the oldest. Cheap, and good
// enough in front of Pebble's own cache.
//
// The slots are looked at in runs of evictRun: a run's slots are loaded
// first, in one loop of independent loads, and then decided on one by one.
// The slots lie at random places in memory, so a loop that loads one slot
// and then drops it waited for a cache miss per slot in turn; loaded
// together, a run's misses overlap. Dropping a slot reads no key bytes (its
// table entry is found by its tag and position).
func (e *Engine) evictLocked(sh *shard, keep *slot) {
	limit := e.o.CacheSize / numShards
	if sh.bytes <= limit {
		return
	}
	target := limit - limit/8
	// Look at a bounded number of slots: when most are pinned (a burst of
	// claims, or SyncNever before its next fsync) a full scan on every
	// insert would be quadratic. The shard may then stay over its share
	// until slots are unpinned; pinned slots are needed anyway.
	var run evictCands
	seen := 0
	n := len(sh.slab)
	at := sh.evictAt
	defer func() { sh.evictAt = at }()
	for range n {
		if at >= n {
			at = 0
		}
		sl := sh.slab[at]
		at++
		if sl == nil {
			continue
		}
		run.slots[run.n] = sl
		run.n++
		seen++
		if run.n < evictRun && seen < evictScan {
			continue
		}
		if !e.evictRunLocked(sh, &run, keep, target) || seen >= evictScan {
			return
		}
	}
	e.evictRunLocked(sh, &run, keep, target)
}

// evictScan bounds the slots one eviction pass looks at.
const evictScan = 64

// evictRun is the number of slots evictLocked loads at once.
const evictRun = 16

// evictCands is a run of slots that evictLocked looks at together.
type evictCands struct {
	slots [evictRun]*slot
	n     int
}

// evictRunLocked drops the slots of run that can go, in order, while sh is
// over target, and empties run. It says whether sh is still over target.
func (e *Engine) evictRunLocked(sh *shard, run *evictCands, keep *slot, target int64) bool {
	var can [evictRun]bool
	for i, sl := range run.slots[:run.n] {
		can[i] = sl.dirty == 0 && sl.waiters == nil && !sl.inFlight && sl != keep
	}
	over := true
	for i, sl := range run.slots[:run.n] {
		if sh.bytes <= target {
			over = false
			break
		}
		if !can[i] {
			continue
		}
		sh.remove(sl)
		sl.evicted = true
		if sl.batch == sh.evictMark {
			sh.markEvicted = true
		}
		sh.gen++
		sh.bytes -= sl.size
	}
	clear(run.slots[:run.n])
	run.n = 0
	return over && sh.bytes > target
}

// ---- the shard's table ----
//
// A shard finds its slots without a Go map, whose entries (a string key
// and a *slot each) the collector traced on every cycle and whose probe
// and insertion were a tenth of the batch path's CPU. The slots are kept
// in a slab (sh.slab, positions reused through sh.free) and found through
// sh.tab, an open-addressing index with linear probing: each entry is 0
// (empty) or a key's tag (the top 32 bits of its own hash, keyTag) above
// its slot's position plus one. A key's home entry is its tag masked by the
// table's size, so that an entry alone says where it belongs (deletion
// by backward shift and growth read no slot). A probe compares key bytes
// only when a tag matches: a key with no slot (nearly every new id) costs
// a hash and, usually, one cache line. The table is at most 7/8 full and
// doubles when it would be fuller; it never shrinks (neither did the
// map).

// tabMinLen is the size of a shard's table when its first slot comes.
const tabMinLen = 16

// find returns the slot in sh of key, whose tag is tag (keyTag's), or
// nil. sh's lock is held.
func (sh *shard) find(key []byte, tag uint32) *slot {
	if len(sh.tab) == 0 {
		return nil
	}
	mask := uint64(len(sh.tab) - 1)
	for i := uint64(tag) & mask; ; i = (i + 1) & mask {
		v := sh.tab[i]
		if v == 0 {
			return nil
		}
		if uint32(v>>32) == tag {
			if sl := sh.slab[uint32(v)-1]; sl.key == string(key) {
				return sl
			}
		}
	}
}

// add puts sl, whose key has no slot in sh and whose tag is tag, into sh's
// table.
func (sh *shard) add(sl *slot, tag uint32) {
	if (sh.n+1)*8 > len(sh.tab)*7 {
		sh.grow()
	}
	var pos int32
	if k := len(sh.free); k > 0 {
		pos = sh.free[k-1]
		sh.free = sh.free[:k-1]
		sh.slab[pos] = sl
	} else {
		pos = int32(len(sh.slab))
		sh.slab = append(sh.slab, sl)
	}
	sl.tag, sl.pos = tag, pos
	sh.place(uint64(sl.tag)<<32 | uint64(pos) + 1)
	sh.n++
}

// place puts the table entry v at its home or the first empty entry after.
func (sh *shard) place(v uint64) {
	mask := uint64(len(sh.tab) - 1)
	i := v >> 32 & mask
	for sh.tab[i] != 0 {
		i = (i + 1) & mask
	}
	sh.tab[i] = v
}

// grow doubles sh's table (or makes its first one) and places its entries
// again.
func (sh *shard) grow() {
	old := sh.tab
	sh.tab = make([]uint64, max(tabMinLen, 2*len(old)))
	for _, v := range old {
		if v != 0 {
			sh.place(v)
		}
	}
}

// remove takes sl, which is in sh's table, out of it and frees its
// position. The entries after it in its probe run move back (backward
// shift deletion), so that no tombstone lengthens later probes.
func (sh *shard) remove(sl *slot) {
	mask := uint64(len(sh.tab) - 1)
	want := uint64(sl.tag)<<32 | uint64(sl.pos) + 1
	i := uint64(sl.tag) & mask
	for sh.tab[i] != want {
		i = (i + 1) & mask
	}
	for {
		sh.tab[i] = 0
		j := i
		for {
			j = (j + 1) & mask
			v := sh.tab[j]
			if v == 0 {
				sh.slab[sl.pos] = nil
				sh.free = append(sh.free, sl.pos)
				sh.n--
				return
			}
			// v may fill the hole at i unless its home lies after i, up
			// to j (cyclically): then a probe for it would stop at i.
			if home := v >> 32 & mask; (j-home)&mask >= (j-i)&mask {
				sh.tab[i] = v
				i = j
				break
			}
		}
	}
}

// setLocked publishes a new entry for a slot after its record was appended.
// The slot must be key's slot in the table (a dirty entry that is not in the
// table would be invisible to the next caller, who would read the index): it
// is, since its caller got it from the table under the lock it still holds.
func (e *Engine) setLocked(key []byte, sl *slot, en *index.Entry, lsn wal.LSN) {
	sh := e.slotShard(sl)
	sh.bytes -= sl.size
	sl.e = en
	sl.dirty = lsn
	sl.inFlight = en != nil && en.InFlight
	sl.size = slotSize(key, en)
	sh.bytes += sl.size
}

// current returns the slot's entry as the newest forget mark leaves it.
func (e *Engine) current(sl *slot, mode byte) *index.Entry {
	return index.Normalize(sl.e, mode, *e.mark.Load())
}

// expired says whether retention has expired en's reply (a decision made
// with the clock now; the log learns of it through forget records).
func (e *Engine) expired(en *index.Entry, now time.Time) bool {
	if !en.HasTimeKey() {
		return false
	}
	if en.ExpiresAt != 0 && en.ExpiresAt < now.UnixNano() {
		return true // its TTL ran out: expires_at < now
	}
	return e.o.Retention > 0 && en.CommitTime < now.Add(-e.o.Retention).UnixNano()
}

// transitionsHinted appends to out the transitions of op, the record of
// one request whose key is key and whose slot sl the caller holds, with sh
// (sl's shard) locked: op's own key is read from sl without being looked
// up again (through sh.getHint, bound once, not a closure made per call:
// that was an allocation of 160 bytes per commit), and the transition
// names key itself (not a key made again from op). With room in out (a
// claim's own buffers, see claimUpdates) the slice costs no allocation,
// and a claim's entry goes into claim when not nil (freshClaim's).
func (sh *shard) transitionsHinted(out []index.Transition, op *wal.Op, key []byte, sl *slot, claim *index.Entry) ([]index.Transition, error) {
	sh.hintKey, sh.hint = key, sl
	ts, err := index.AppendTransitions(out, op, 0, key, claim, sh.getHint)
	sh.hintKey, sh.hint = nil, nil
	return ts, err
}

// getHinted is sh.getHint: getLocked, except for sh.hintKey, whose slot is
// sh.hint (see transitionsHinted; sh's lock is held).
func (sh *shard) getHinted(key []byte, mode byte) (*index.Entry, error) {
	if sh.hint != nil && string(key) == string(sh.hintKey) {
		return sh.e.current(sh.hint, mode), nil
	}
	return sh.e.getLocked(key, mode)
}

// getLocked is the Transitions callback for the live path: every key it is
// asked for is locked by the caller.
func (e *Engine) getLocked(key []byte, mode byte) (*index.Entry, error) {
	sl, err := e.slotLocked(key)
	if err != nil {
		return nil, err
	}
	return e.current(sl, mode), nil
}

// appendOp appends op, whose transitions ts were computed with the caller
// holding the locks of every key they touch, stamps the LSN into them and
// publishes them to the slots. It returns the LSN; the caller still holds
// the locks and waits for durability after releasing them.
func (e *Engine) appendOp(op *wal.Op, ts []index.Transition) (wal.LSN, error) {
	return e.appendOpSlot(op, ts, nil, nil, nil)
}

// appendOpSlot is appendOp for a caller that holds key's slot sl (nil:
// none), which spares looking it up again. up, when not nil, is an unused
// update that the record's goes into (a claim's own, see claimUpdates)
// instead of one allocated here.
func (e *Engine) appendOpSlot(op *wal.Op, ts []index.Transition, key []byte, sl *slot, up *pinnedUpdate) (wal.LSN, error) {
	// The payload is copied into the WAL's buffer by AppendWith: encode it
	// into a pooled buffer.
	pb := payloadPool.Get().(*[]byte)
	defer putPayload(pb)
	payload, err := wal.EncodeOp((*pb)[:0], op)
	*pb = payload
	if err != nil {
		return 0, err
	}
	lsn, err := e.appendRecordSlot(op.Type, payload, ts, key, sl, up)
	if err != nil {
		return 0, err
	}
	e.countRemovals(removals(op.Type, ts))
	return lsn, nil
}

// pinnedUpdate is what a record appended by appendRecord hands the
// applier through the WAL: its index update and, for a record of one key
// whose slot the caller passed (nearly all: claims, commits, aborts), that
// slot, so that the applier unpins it without looking it up. A slot stays
// in its shard's table while it is dirty, so if it still carries the
// record's LSN when the applier comes, it is the key's slot. With slot nil
// the applier looks the keys up.
type pinnedUpdate struct {
	index.Update
	slot *slot
	// mem is the update's index.Update.MemSize, which the applier's
	// backlog counts: computed by the appender while the update is in
	// its processor's cache, not by the WAL's flusher (onSynced), whose
	// time delays the next fsync and which would read every record's
	// transitions and entries again, mostly from memory.
	mem int64
	// slots, for a record of several keys (a batch), holds the slot of
	// transition i's key as the writer found it (nil: unknown). The
	// applier unpins through it: a slot not evicted is its key's slot
	// (only eviction takes a slot out of its table), and one evicted
	// before it was published is not, so the applier then looks the key
	// up.
	slots []*slot
}

// appendRecord appends the record (kind typ, payload) whose transitions
// ts were computed with the caller holding the locks of every key they
// touch, stamps its LSN into them (index.Stamp) and publishes them to the
// slots. The caller still holds the locks.
func (e *Engine) appendRecord(typ byte, payload []byte, ts []index.Transition) (wal.LSN, error) {
	return e.appendRecordSlot(typ, payload, ts, nil, nil, nil)
}

// appendRecordSlot is appendRecord for a caller that holds key's slot sl
// (nil: none), through the unused update up when not nil (else one is
// allocated).
func (e *Engine) appendRecordSlot(typ byte, payload []byte, ts []index.Transition, key []byte, sl *slot, up *pinnedUpdate) (wal.LSN, error) {
	if up == nil {
		up = new(pinnedUpdate)
	}
	*up = pinnedUpdate{Update: index.Update{Transitions: ts}}
	// Set before the append: once appended, the record may reach the
	// applier at any time (which then waits for the locks held here
	// before it unpins anything). An evicted slot is no longer the key's.
	if len(ts) == 1 && sl != nil && !sl.evicted && string(ts[0].Key) == string(key) {
		up.slot = sl
	}
	return e.appendUpdate(typ, payload, up)
}

// appendRecordSlots is appendRecord for a caller that holds slots, one
// per transition of ts (nil: unknown), the slots of their keys when it
// looked them up (a slot evicted since is looked up again). It keeps
// slots: the applier unpins through them.
func (e *Engine) appendRecordSlots(typ byte, payload []byte, ts []index.Transition, slots []*slot) (wal.LSN, error) {
	return e.appendUpdate(typ, payload, &pinnedUpdate{Update: index.Update{Transitions: ts}, slots: slots})
}

// appendUpdate appends the record (typ, payload) of up, stamps its LSN and
// publishes its transitions to their slots: up.slot for a record of one
// key, else up.slots[i] for transition i when set and not evicted, else
// the key's slot in its shard's table.
func (e *Engine) appendUpdate(typ byte, payload []byte, up *pinnedUpdate) (wal.LSN, error) {
	ts := up.Transitions
	up.mem = up.MemSize()
	lsn, err := e.w.AppendWith(typ, payload, func(lsn wal.LSN) any {
		up.LSN = lsn
		index.Stamp(ts, typ, lsn)
		return up
	})
	if err != nil {
		return 0, e.failure(err)
	}
	for i, t := range ts {
		tsl := up.slot
		var was *slot // t.Key's slot, evicted
		if tsl == nil && up.slots != nil {
			// Installing a slot below may have evicted a later one: a
			// slot is checked just before it is used.
			if tsl = up.slots[i]; tsl != nil && tsl.evicted {
				was, tsl = tsl, nil
			}
		}
		if tsl == nil {
			sh, tag := e.keyTagOf(t.Key, was)
			if tsl = sh.find(t.Key, tag); tsl == nil {
				// Clean, and evicted when a later key of its shard was
				// loaded (a batch): its entry is t.Next now, so no index
				// read (which could fail after the append) is needed.
				tsl = e.installLocked(sh, t.Key, tag, t.Next, false)
			}
		}
		e.setLocked(t.Key, tsl, t.Next, lsn)
	}
	return lsn, nil
}

// removals counts the committed replies that the transitions ts of a
// record of kind typ remove: acked (or forgotten by a commit's reply
// window: seq) ones. Expire records count theirs elsewhere.
func removals(typ byte, ts []index.Transition) (acked, seq uint64) {
	for _, t := range ts {
		switch {
		case typ == wal.OpExpire || t.Next != nil || t.Prev == nil || !t.Prev.Committed:
		case t.Mode == index.ModeSeq:
			seq++ // left its client's reply window: a cleanup
		default:
			acked++
		}
	}
	return acked, seq
}

// countRemovals adds what removals counted to the stats.
func (e *Engine) countRemovals(acked, seq uint64) {
	if acked > 0 {
		e.st.acked.Add(acked)
	}
	if seq > 0 {
		e.st.ttlRemoved.Add(seq)
	}
}

func (e *Engine) failure(err error) error {
	if errors.Is(err, wal.ErrClosed) {
		return ErrClosed
	}
	if errors.Is(err, ErrFailed) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrFailed, err)
}

func (e *Engine) waitDurable(lsn wal.LSN) error {
	if err := e.w.WaitDurable(lsn); err != nil {
		return e.failure(err)
	}
	return nil
}
