package index

import (
	"bytes"
	"fmt"
	"unsafe"

	"github.com/idemdb/idem/wal"
)

// Batch computes the transitions of a batch record (wal.OpBatch) one
// operation at a time: each operation reads, through Get, what the
// previous ones left (an overlay over the get it was made with), and the
// record's transitions keep, for a key changed more than once, its first
// Prev and its last Next. Transitions of a batch record is a Batch fed
// every operation; the engine feeds one the operations it decides on,
// classifying each request against Get first (GetUnchanged for a key it
// knows the batch has not changed), so that the live engine and replay
// compute a batch with the same code.
//
// Every claim of the batch gets the batch's LSN as its claim LSN, and a
// commit or abort naming claim 0 finishes the claim made earlier in the
// same record (it must find a claim with the batch's LSN).
type Batch struct {
	lsn wal.LSN
	get func(key []byte, mode byte) (*Entry, error)
	// at maps a key changed by the batch to its transition in out, for
	// the first nat transitions: the others are added when a lookup
	// needs them (find), so that a batch whose keys are never looked up
	// (each changed by one item of the engine's, which knows that the
	// batch has not changed it before: GetUnchanged) hashes none of them.
	at   map[string]int
	nat  int
	out  []Transition
	step []Transition // the transitions of the last Add
	// last is the key of the last transition added to out (at index
	// len(out)-1): an operation on the key the previous one changed (a
	// Put's commit after its claim) finds it without hashing.
	last []byte
	// getFn is b.get bound once (handed to the operations' transitions).
	getFn func(key []byte, mode byte) (*Entry, error)
	// claim is the entry of the claim the last Add made, while nothing
	// but the batch refers to it: no Get has returned it since (Add's
	// transitions are only valid until the next Add). A commit of that
	// claim that follows at once (a Put: claim and commit of one request,
	// back to back) fills it in place rather than allocating an entry and
	// dropping this one. nil otherwise.
	claim *Entry
	// read is the key that the last Get read through get, not from the
	// batch (readMode its mode, readEntry what get returned), until the
	// next Add: the Add of that key's own operation (the caller's Get,
	// its classification, then its Add) finds it without probing at again,
	// and knows the key is not in at yet. nil: none.
	read      []byte
	readMode  byte
	readEntry *Entry
	// found is the key that find found last, as its caller gave it, and
	// foundAt its transition's index in out (which only grows until the
	// next Reset or Transitions): a caller that looks the same key up
	// again by the same slice (the engine's commits of a stream's events,
	// each reading its partition's client key, one slice for the whole
	// batch: batchRun.raising) finds it without hashing it, and without
	// adding the transitions made since to at. nil: none.
	found   []byte
	foundAt int
	// scratch is where advanceKey builds a client's key to look it up.
	scratch []byte
	// fills are the entries an operation's advances fill in place once
	// all of them apply (advanceTransitions).
	fills []advanceFill
}

// advanceFill is an entry of the batch that an advance of the current
// operation raises to seq.
type advanceFill struct {
	e   *Entry
	seq uint64
}

// NewBatch returns an empty batch record appended at lsn (0 when not
// known yet: Stamp fills it in) over the state get returns, sized for
// about n keys.
func NewBatch(lsn wal.LSN, get func(key []byte, mode byte) (*Entry, error), n int) *Batch {
	b := &Batch{lsn: lsn, get: get, at: make(map[string]int, n), out: make([]Transition, 0, n)}
	b.getFn = b.lookup
	return b
}

// Reset empties b for the next batch record at lsn over the same get,
// keeping its memory (its key map, its working transitions). Slices
// returned by Transitions stay valid: they are copies.
func (b *Batch) Reset(lsn wal.LSN) {
	b.lsn = lsn
	clear(b.at)
	b.nat = 0
	clear(b.out) // hold no key or entry of the last record
	b.out = b.out[:0]
	b.step = b.step[:0]
	b.last = nil
	b.claim = nil
	b.read, b.readEntry = nil, nil
	b.found = nil
}

// Get returns key's state as the operations added so far leave it.
func (b *Batch) Get(key []byte, mode byte) (*Entry, error) {
	b.claim = nil // the caller may keep what it reads: never changed in place
	if sameBytes(key, b.last) {
		return b.out[len(b.out)-1].Next, nil
	}
	if mode == b.readMode && sameBytes(key, b.read) {
		return b.readEntry, nil
	}
	if i, ok := b.find(key); ok {
		return b.out[i].Next, nil
	}
	en, err := b.get(key, mode)
	if err == nil {
		b.read, b.readMode, b.readEntry = key, mode, en
	}
	return en, err
}

// GetUnchanged is Get for a key that the caller knows no operation added
// since the batch was made, Reset or gave its Transitions has changed: it
// reads key through get without looking it up among the keys the batch
// changed (the engine knows it from its table: batchRun.getItem). A caller
// that cannot tell calls Get; called for a key the batch did change, it
// returns the state before the batch, which is wrong.
func (b *Batch) GetUnchanged(key []byte, mode byte) (*Entry, error) {
	b.claim = nil // as Get
	if mode == b.readMode && sameBytes(key, b.read) {
		return b.readEntry, nil
	}
	en, err := b.get(key, mode)
	if err == nil {
		b.read, b.readMode, b.readEntry = key, mode, en
	}
	return en, err
}

// lookup is Get for the operations' own transitions.
func (b *Batch) lookup(key []byte, mode byte) (*Entry, error) {
	if sameBytes(key, b.last) {
		return b.out[len(b.out)-1].Next, nil
	}
	if mode == b.readMode && sameBytes(key, b.read) {
		return b.readEntry, nil // not changed since: no Add came between
	}
	if i, ok := b.find(key); ok {
		return b.out[i].Next, nil
	}
	return b.get(key, mode)
}

// Add applies op, the next operation of the batch, and returns its own
// transitions (valid until the next Add or Reset, as are the entries they
// point to: the entry of a claim may be filled in place by the commit that
// follows it), as Transitions would give them for op alone in that state. key is the entry key of op's
// request when the caller has it (nil: computed); it must not change
// afterwards. On an error nothing of op is applied.
func (b *Batch) Add(op *wal.Op, key []byte) ([]Transition, error) {
	return b.AddInto(op, key, nil)
}

// AddInto is Add that, for a claim or a commit, fills into (when not nil)
// with the request's new entry instead of allocating one, as
// AppendTransitions does with own: into must be an entry that nothing
// else refers to. The engine hands in an entry allocated with its reply's
// bytes (one allocation for both): a commit's, or the claim's of a Put
// whose commit follows it at once and fills the claim's entry in place
// (the claim's entry is then the committed one, reply included).
func (b *Batch) AddInto(op *wal.Op, key []byte, into *Entry) ([]Transition, error) {
	if !wal.InBatch(op.Type) {
		return nil, fmt.Errorf("index: a batch cannot hold a %s record", wal.OpName(op.Type))
	}
	claimLSN := op.ClaimLSN
	if claimLSN == 0 {
		claimLSN = b.lsn // the claim made earlier in this record
	}
	reuse := b.claim
	b.claim = nil
	step, err := appendTransitionsInto(b.step[:0], op, b.lsn, claimLSN, key, reuse, into, b, b.getFn)
	read := b.read
	b.read, b.readEntry = nil, nil // op may change it: read through the batch again
	if err != nil {
		return nil, err
	}
	b.step = step
	if op.Type == wal.OpClaim && len(step) == 1 && step[0].Next != nil && step[0].Next != step[0].Prev {
		b.claim = step[0].Next // made just now by this Add
	}
	for _, t := range step {
		if sameBytes(t.Key, b.last) {
			b.out[len(b.out)-1].Next = t.Next
			continue
		}
		if sameBytes(t.Key, read) {
			read = nil // Get found it absent from at; added below
		} else if i, ok := b.find(t.Key); ok {
			b.out[i].Next = t.Next
			continue
		}
		b.out = append(b.out, t) // a new key: at gets it when find needs it
		b.last = t.Key
	}
	return step, nil
}

// advanceKey returns the entry key of the sequence-mode client (scope,
// client) for an advance. When an earlier operation of the record changed
// that key (found), key is that transition's own bytes (nothing is
// allocated: a sink advances the same few partitions item after item),
// prev the key's state as the record leaves it, and fill prev itself when
// the record made it, i.e. it is not the state the record started from:
// nothing but the batch refers to such an entry (Get's callers read it and
// let go; Add's transitions are only valid until the next Add), so an
// advance may overwrite it rather than allocate another. Otherwise key is
// a new slice, and prev is to be read with get.
func (b *Batch) advanceKey(scope, client string) (key []byte, prev, fill *Entry, found bool) {
	b.scratch = EntryKey(b.scratch[:0], scope, ModeClient, unsafe.Slice(unsafe.StringData(client), len(client)))
	i, ok := b.findMapped(b.scratch) // not find: scratch's bytes change
	if !ok {
		return bytes.Clone(b.scratch), nil, nil, false
	}
	t := &b.out[i]
	if t.Next != nil && t.Next != t.Prev {
		fill = t.Next
	}
	return t.Key, t.Next, fill, true
}

// find returns the index in out of key's transition, if the batch changed
// key: the one found last when key is the same slice (found), else
// through findMapped.
func (b *Batch) find(key []byte) (int, bool) {
	if sameBytes(key, b.found) {
		return b.foundAt, true
	}
	i, ok := b.findMapped(key)
	if ok {
		b.found, b.foundAt = key, i
	}
	return i, ok
}

// findMapped is find through at, after adding the transitions at does
// not hold yet to it.
func (b *Batch) findMapped(key []byte) (int, bool) {
	for ; b.nat < len(b.out); b.nat++ {
		// The map keeps the key's bytes without copying them: transition
		// keys are never changed once made (EntryKey's, or the caller's
		// key, which Add's contract freezes).
		k := b.out[b.nat].Key
		b.at[unsafe.String(unsafe.SliceData(k), len(k))] = b.nat
	}
	i, ok := b.at[string(key)]
	return i, ok
}

// sameBytes says whether a and b are the same slice (not only equal
// bytes): keys are never changed once made, so the same slice is the
// same key.
func sameBytes(a, b []byte) bool {
	return len(a) == len(b) && len(a) > 0 && unsafe.SliceData(a) == unsafe.SliceData(b)
}

// Len is the number of keys the batch changed since it was made, Reset or
// gave its Transitions.
func (b *Batch) Len() int { return len(b.out) }

// Transitions returns the record's transitions: one per key it changed,
// from the key's state before the record (Prev) to its state after it
// (Next). A key that was absent before and after (claimed and aborted,
// committed and acked within the batch) is left out. The slice is new and
// exactly as long as it needs to be (it lives as long as the record's
// update, until the record is applied): b keeps its working slice, whose
// capacity is that of the largest record it built, for the next record
// (Reset).
func (b *Batch) Transitions() []Transition {
	n := 0
	for _, t := range b.out {
		if t.Prev != nil || t.Next != nil {
			n++
		}
	}
	out := make([]Transition, 0, n)
	for _, t := range b.out {
		if t.Prev != nil || t.Next != nil {
			out = append(out, t)
		}
	}
	clear(b.out) // hold no key or entry of this record
	b.out = b.out[:0]
	clear(b.at) // the indices no longer hold; Reset before the next Add
	b.nat = 0
	b.found = nil
	b.last = nil
	b.claim = nil
	b.read, b.readEntry = nil, nil
	return out
}
