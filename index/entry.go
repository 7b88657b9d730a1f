package index

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/idemdb/idem/internal/msgp"
	"github.com/idemdb/idem/wal"
	"github.com/vmihailenco/msgpack/v5"
)

// Entry is the state of one key of the dedup set.
//
// An id-mode key (ModeID) is either in flight (claimed, not finished) or
// committed, never both. A client key (ModeClient, sequence mode) holds the
// client's last committed sequence number with, while it is kept, that
// request's reply; and at the same time, possibly, the claim of the next
// sequence number. A sequence key (ModeSeq) holds the kept reply of one
// older sequence number of a client (see SeqKey): committed, never in
// flight.
//
// Entries are immutable once published: transitions return a new *Entry.
// (A Batch fills in place the entry of a claim it made, which no Get has
// returned, when the claim's commit follows at once: see Batch.Add.)
type Entry struct {
	// The fields are ordered for size, not by part: the three slices
	// (the only pointers) first, so that the collector's scan of an entry
	// ends after them, and the three flags together at the end, which
	// makes an Entry 184 bytes (the 192-byte size class) rather than 200
	// (208). Every table slot and pending set holds one per key.

	// The committed part.
	Reply       []byte
	Fingerprint []byte // of the committed request; nil = stored without one
	Seq         uint64 // client keys: last committed sequence number
	CommitTime  int64  // unix ns
	CommitLSN   wal.LSN
	ExpiresAt   int64 // unix ns when the reply's TTL runs out (from its claim); 0 = never

	// The in-flight part.
	ClaimFP    []byte
	ClaimLSN   wal.LSN // identifies the claim: a commit or abort must name it
	ClaimSeq   uint64
	ClaimTime  int64
	LeaseUntil int64
	// ClaimExpires is the claim's TTL deadline, which its commit keeps as
	// ExpiresAt; 0 = none.
	ClaimExpires int64
	// ClaimKeep and ClaimKeepFor are the claim's reply window (client
	// keys; from the claim record): when the claim commits, the replies of
	// the last ClaimKeep sequence numbers stay (0 and 1: the latest only),
	// each older one while younger than ClaimKeepFor ns (0: no age bound).
	ClaimKeep    uint64
	ClaimKeepFor int64

	// KeptFrom (client keys) is the lowest sequence number that may still
	// have a sequence key (ModeSeq); 0 = none. Every sequence key of the
	// client lies in [KeptFrom, Seq-1], a range never wider than the
	// largest window asked for, so a commit or an advance that drops them
	// looks up a bounded number of keys.
	KeptFrom uint64

	// LSN of the last record that changed this entry.
	LSN wal.LSN

	// Flags (committed part: Committed, ReplyKept; in-flight part:
	// InFlight).
	Committed bool
	ReplyKept bool // false once acked, forgotten, or (client keys) superseded by the next claim
	InFlight  bool
}

// HasTimeKey says whether the entry has a row in the time index: it does
// while it holds a committed reply, which is what forget and expiry remove.
func (e *Entry) HasTimeKey() bool { return e != nil && e.Committed && e.ReplyKept }

// HasExpiryKey says whether the entry has a row in the expiry index: a kept
// reply with a per-request TTL.
func (e *Entry) HasExpiryKey() bool { return e.HasTimeKey() && e.ExpiresAt != 0 }

// Mark is the newest forget tombstone: every reply committed before Before
// by a record with LSN below LSN is gone, and so is every claim made before
// LSN whose lease ended before Before (abandoned in-flight claims). Before
// only grows (the engine writes max(previous, requested)), so the newest mark
// subsumes all older ones.
type Mark struct {
	Before int64
	LSN    wal.LSN
}

// Forgotten says whether m removed e's committed reply.
func (m Mark) Forgotten(e *Entry) bool {
	return e.HasTimeKey() && e.CommitTime < m.Before && e.CommitLSN < m.LSN
}

// ClaimForgotten says whether m removed e's in-flight claim.
func (m Mark) ClaimForgotten(e *Entry) bool {
	return e != nil && e.InFlight && e.LeaseUntil < m.Before && e.ClaimLSN < m.LSN
}

// Normalize returns e as the forget mark m leaves it: for an id key a
// forgotten entry is gone (nil); a client key keeps its sequence number and
// loses the reply (or the abandoned claim). The index applies marks
// physically, so this only matters for copies of entries held in memory.
func Normalize(e *Entry, mode byte, m Mark) *Entry {
	if m.ClaimForgotten(e) {
		e = dropClaim(e, mode)
	}
	if !m.Forgotten(e) {
		return e
	}
	return DropReply(e, mode)
}

func dropClaim(e *Entry, mode byte) *Entry {
	if mode == ModeID && !e.Committed {
		return nil
	}
	n := *e
	n.clearClaim()
	return &n
}

func (n *Entry) clearClaim() {
	n.InFlight, n.ClaimLSN, n.ClaimSeq, n.ClaimFP, n.ClaimTime, n.LeaseUntil, n.ClaimExpires = false, 0, 0, nil, 0, 0, 0
	n.ClaimKeep, n.ClaimKeepFor = 0, 0
}

// DropReply returns e without its committed reply, as a forget leaves it:
// nil for an id key or a sequence key, the sequence number alone for a
// client key (its older sequence keys are separate entries: they go by
// their own time and expiry rows).
func DropReply(e *Entry, mode byte) *Entry {
	if mode != ModeClient {
		if e.InFlight { // cannot happen for id keys; keep the claim to be safe
			n := *e
			n.Committed, n.ReplyKept, n.Reply, n.ExpiresAt = false, false, nil, 0
			return &n
		}
		return nil
	}
	n := *e
	n.ReplyKept, n.Reply, n.ExpiresAt = false, nil, 0
	return &n
}

// Transition is one key's change made by one record.
type Transition struct {
	Key  []byte
	Mode byte
	Prev *Entry // as stored (after forget marks), nil = absent
	Next *Entry // nil = delete
}

// ErrNoClaim is returned by Transitions when a commit or abort does not
// name the key's current claim. The engine checks this before appending, so
// in the log it only appears through corruption.
var ErrNoClaim = errors.New("index: record does not match the current claim")

// Transitions computes the changes that op, appended at lsn, makes.
// get returns the current state of a key (after forget marks). The same
// function serves the live engine and replay, which is what makes replay
// rebuild exactly the set the engine had.
//
// Forget records change no single key; they are applied by Index.Apply.
//
// A batch record's operations are applied in order, each reading what the
// previous ones left (see Batch); a key changed twice keeps its first Prev
// and its last Next.
func Transitions(op *wal.Op, lsn wal.LSN, get func(key []byte, mode byte) (*Entry, error)) ([]Transition, error) {
	if op.Type == wal.OpBatch {
		b := NewBatch(lsn, get, len(op.Ops))
		for i := range op.Ops {
			if _, err := b.Add(&op.Ops[i], nil); err != nil {
				return nil, fmt.Errorf("batch operation %d: %w", i, err)
			}
		}
		return b.Transitions(), nil
	}
	return appendTransitionsInto(nil, op, lsn, op.ClaimLSN, nil, nil, nil, nil, get)
}

// AppendTransitions is Transitions that appends the changes to out (which
// may be a caller's buffer with room: the engine's single-request path
// then allocates no slice) and takes key, the entry key of op's request
// when the caller has it (nil: computed from op; it must be the key that
// op's scope and id or client make). The transitions of a request name key
// itself as their Key, so its bytes must not change while they are in use.
// For a claim or a commit record, own (when not nil) is filled with the
// request's new entry instead of one allocated here: it must be an entry
// that nothing refers to (the engine's claim entry is carried in the
// Claim it hands out; a commit's is allocated with its reply's bytes).
func AppendTransitions(out []Transition, op *wal.Op, lsn wal.LSN, key []byte, own *Entry, get func(key []byte, mode byte) (*Entry, error)) ([]Transition, error) {
	if op.Type == wal.OpBatch {
		ts, err := Transitions(op, lsn, get)
		if err != nil {
			return nil, err
		}
		return append(out, ts...), nil
	}
	return appendTransitionsInto(out, op, lsn, op.ClaimLSN, key, nil, own, nil, get)
}

// appendTransitionsInto appends the transitions of op, appended at lsn,
// to out. claimLSN is the claim a commit or abort must find: op.ClaimLSN,
// or in a batch the batch's LSN for an operation naming claim 0 (the claim
// made earlier in the same record). key is the entry key of op's request
// when the caller has it (nil: computed). into, if not nil, is an entry
// that nothing else refers to, which a claim or a commit fills with the
// request's new entry instead of allocating one. reuse, if not nil, is an
// entry that nothing but the caller refers to (a Batch's claim that nobody
// read): a commit of an id whose current entry it is, given no into,
// fills it in place instead of allocating its own. ov is the Batch whose
// record op belongs to (nil for a record of its own): its advances find
// their clients through it (advanceTransitions).
func appendTransitionsInto(out []Transition, op *wal.Op, lsn, claimLSN wal.LSN, key []byte, reuse, into *Entry, ov *Batch, get func(key []byte, mode byte) (*Entry, error)) ([]Transition, error) {
	// Acked ids are removed first: they name earlier requests.
	for _, id := range op.Acked {
		k := EntryKey(nil, op.Scope, ModeID, id)
		prev, err := get(k, ModeID)
		if err != nil {
			return nil, err
		}
		if prev == nil || !prev.Committed {
			continue // unknown, or still in flight: an ack cannot drop a claim
		}
		out = append(out, Transition{Key: k, Mode: ModeID, Prev: prev, Next: nil})
	}
	if op.Type == wal.OpExpire {
		// Every named key whose reply is still kept loses it. The engine
		// names only keys whose TTL it found run out, holding their locks
		// while it appends, so replay removes exactly what it removed.
		for _, k := range op.Keys {
			_, mode, _, err := ParseEntryKey(k)
			if err != nil {
				return nil, fmt.Errorf("index: expire record: %w", err)
			}
			prev, err := get(k, mode)
			if err != nil {
				return nil, err
			}
			if !prev.HasTimeKey() {
				continue
			}
			next := DropReply(prev, mode)
			if next != nil {
				next.LSN = lsn
			}
			out = append(out, Transition{Key: k, Mode: mode, Prev: prev, Next: next})
		}
		return out, nil
	}
	if op.Type == wal.OpAck || op.Type == wal.OpForget {
		return out, nil
	}
	if op.Type == wal.OpAdvance {
		return advanceTransitions(out, op, lsn, nil, ov, get)
	}
	mode, ident := ModeID, op.ID
	if op.Client != "" {
		mode, ident = ModeClient, []byte(op.Client)
	}
	k := key
	if k == nil {
		k = EntryKey(nil, op.Scope, mode, ident)
	}
	var prev *Entry
	if op.Type != wal.OpClaim || op.Flags&wal.ClaimFlagNew == 0 || mode != ModeID {
		var err error
		if prev, err = get(k, mode); err != nil {
			return nil, err
		}
	}
	var next *Entry
	switch op.Type {
	case wal.OpClaim:
		n := Entry{}
		if mode == ModeClient && prev != nil {
			n = *prev
			if op.KeepReplies <= 1 {
				// Starting seq N promises that N-1 is never retried: its
				// reply can go; the sequence number stays.
				n.ReplyKept, n.Reply, n.ExpiresAt = false, nil, 0
			} // else: a window keeps N-1's reply; the commit moves it to its sequence key
		}
		if mode == ModeClient {
			n.ClaimKeep, n.ClaimKeepFor = op.KeepReplies, op.KeepFor
		}
		n.InFlight = true
		n.ClaimLSN = lsn
		n.ClaimSeq = op.Seq
		n.ClaimFP = op.Fingerprint
		n.ClaimTime = op.Time
		n.LeaseUntil = op.LeaseUntil
		n.ClaimExpires = op.ExpiresAt
		n.LSN = lsn
		// As for a commit below: n stays on the stack, and the entry
		// stored is the caller's when it gave one.
		if next = into; next == nil {
			next = new(Entry)
		}
		*next = n
	case wal.OpCommit, wal.OpCommitAdvance:
		if prev == nil || !prev.InFlight || prev.ClaimLSN != claimLSN {
			return nil, fmt.Errorf("%w: commit at LSN %d names claim %d", ErrNoClaim, lsn, claimLSN)
		}
		n := Entry{
			Committed:   true,
			Seq:         prev.ClaimSeq,
			CommitTime:  op.Time,
			CommitLSN:   lsn,
			ReplyKept:   true,
			Reply:       op.Reply,
			Fingerprint: prev.ClaimFP,
			ExpiresAt:   prev.ClaimExpires,
			LSN:         lsn,
		}
		if n.Reply == nil {
			n.Reply = []byte{}
		}
		if mode == ModeClient {
			var err error
			if out, n.KeptFrom, err = seqWindow(out, op, prev, n.Seq, lsn, get); err != nil {
				return nil, err
			}
		}
		// n stays on the stack (its address is never taken): only the
		// entry stored is allocated, and not even that when the caller
		// gave one (into: allocated with the reply's bytes) or the
		// claim's own entry, which nothing else refers to, can take it.
		switch {
		case into != nil:
			next = into
		case prev == reuse && mode == ModeID:
			next = reuse
		default:
			next = new(Entry)
		}
		*next = n
	case wal.OpAbort:
		if prev == nil || !prev.InFlight || prev.ClaimLSN != claimLSN {
			return nil, fmt.Errorf("%w: abort at LSN %d names claim %d", ErrNoClaim, lsn, claimLSN)
		}
		if mode == ModeClient && prev.Committed {
			n := *prev
			n.clearClaim()
			n.LSN = lsn
			next = &n
		} // else: the key is free again
	default:
		return nil, fmt.Errorf("index: cannot apply record kind %d", op.Type)
	}
	out = append(out, Transition{Key: k, Mode: mode, Prev: prev, Next: next})
	if op.Type == wal.OpCommitAdvance {
		return advanceTransitions(out, op, lsn, k, ov, get)
	}
	return out, nil
}

// seqWindow computes the sequence keys that the commit op (at lsn) of the
// client's sequence number seq changes, appending them to out, and returns
// the client's new KeptFrom. prev is the client's entry before the commit
// (it holds the claim, with its window, and the last committed reply).
//
// The window is the claim's: the replies of the last w = ClaimKeep (at least
// 1) numbers stay, the latest in the client's entry and the others under
// their sequence keys. So the commit moves the previous reply (if kept and
// inside the window) to its sequence key, and drops the sequence keys at or
// below seq-w. A moved reply keeps its commit time and LSN (forget marks
// and retention judge it by them), and its expiry becomes the earlier of
// its TTL and commit time + ClaimKeepFor; one already past that age when the
// record was written (op.Time) is not moved. Everything is decided from
// the record and the entries, never from a clock, so replay and replicas
// rebuild the same keys.
func seqWindow(out []Transition, op *wal.Op, prev *Entry, seq uint64, lsn wal.LSN, get func(key []byte, mode byte) (*Entry, error)) ([]Transition, uint64, error) {
	w := max(prev.ClaimKeep, 1)
	var cut uint64 // sequence keys at or below go
	if seq > w {
		cut = seq - w
	}
	from := prev.KeptFrom
	var kb []byte
	if from != 0 {
		var err error
		if out, err = dropSeqKeys(out, op.Scope, op.Client, from, min(cut, seq-1), get); err != nil {
			return nil, 0, err
		}
		if from <= cut {
			from = cut + 1
		}
		if from >= seq {
			from = 0
		}
	}
	if prev.Committed && prev.ReplyKept && prev.Seq > cut && prev.Seq < seq {
		age := prev.ExpiresAt
		if prev.ClaimKeepFor > 0 {
			until := prev.CommitTime + prev.ClaimKeepFor
			if until < op.Time {
				return out, from, nil // aged out already
			}
			if age == 0 || until < age {
				age = until
			}
		}
		kb = SeqKey(nil, op.Scope, []byte(op.Client), prev.Seq)
		old, err := get(kb, ModeSeq)
		if err != nil {
			return nil, 0, err
		}
		se := &Entry{
			Committed:   true,
			Seq:         prev.Seq,
			CommitTime:  prev.CommitTime,
			CommitLSN:   prev.CommitLSN,
			ReplyKept:   true,
			Reply:       prev.Reply,
			Fingerprint: prev.Fingerprint,
			ExpiresAt:   age,
			LSN:         lsn,
		}
		out = append(out, Transition{Key: kb, Mode: ModeSeq, Prev: old, Next: se})
		if from == 0 {
			from = prev.Seq
		}
	}
	return out, from, nil
}

// dropSeqKeys appends the removal of the client's sequence keys from lo to
// hi (those that exist) to out.
func dropSeqKeys(out []Transition, scope, client string, lo, hi uint64, get func(key []byte, mode byte) (*Entry, error)) ([]Transition, error) {
	for s := lo; s <= hi && s != 0; s++ {
		k := SeqKey(nil, scope, []byte(client), s)
		p, err := get(k, ModeSeq)
		if err != nil {
			return nil, err
		}
		if p != nil {
			out = append(out, Transition{Key: k, Mode: ModeSeq, Prev: p, Next: nil})
		}
		if s == hi {
			break // hi may be the largest uint64
		}
	}
	return out, nil
}

// ErrBadAdvance is returned by Transitions for a commit-advance or advance
// record whose advances cannot apply: one names the committed key itself or a
// client twice, or a client with a claim in flight. The engine checks
// this before appending, so in the log it only appears through corruption.
var ErrBadAdvance = errors.New("index: advance cannot apply")

// advanceTransitions appends the advances of a commit-advance record:
// each named client's last committed number becomes max(its number, seq).
// A client raised past its number loses its kept reply (starting at N
// promises that N-1 is never retried, as a claim does) and its older
// sequence keys (an advance is not a request of the client: it ends the
// reply window); one already at or past seq is unchanged (no transition).
//
// In a batch record (ov not nil) a client whose key an earlier operation of
// the record changed already is found through ov (Batch.advanceKey): its
// key's bytes are that transition's, and an entry the record made for it
// (a stream sink advances the same few partitions item after item) is
// filled in place rather than a new one allocated; the fills are done once
// every advance of op is known to apply, so that an error leaves nothing
// of op applied.
func advanceTransitions(out []Transition, op *wal.Op, lsn wal.LSN, committed []byte, ov *Batch, get func(key []byte, mode byte) (*Entry, error)) ([]Transition, error) {
	var seen KeySet
	if committed != nil {
		seen.Add(committed)
	}
	if ov != nil {
		ov.fills = ov.fills[:0]
	}
	for _, a := range op.Advances {
		var k []byte
		var prev, fill *Entry
		found := false
		if ov != nil {
			k, prev, fill, found = ov.advanceKey(a.Scope, a.Client)
		} else {
			k = EntryKey(nil, a.Scope, ModeClient, []byte(a.Client))
		}
		if a.Client == "" || a.Seq == 0 || !seen.Add(k) {
			return nil, fmt.Errorf("%w: %s at LSN %d: advance of client %q in scope %q to %d (empty, zero, repeated or the committed key)", ErrBadAdvance, wal.OpName(op.Type), lsn, a.Client, a.Scope, a.Seq)
		}
		if !found {
			var err error
			if prev, err = get(k, ModeClient); err != nil {
				return nil, err
			}
		}
		if prev != nil && prev.InFlight {
			return nil, fmt.Errorf("%w: %s at LSN %d: client %q in scope %q has a claim in flight", ErrBadAdvance, wal.OpName(op.Type), lsn, a.Client, a.Scope)
		}
		if prev != nil && prev.Committed && prev.Seq >= a.Seq {
			continue
		}
		if prev != nil && prev.KeptFrom != 0 {
			var err error
			if out, err = dropSeqKeys(out, a.Scope, a.Client, prev.KeptFrom, prev.Seq-1, get); err != nil {
				return nil, err
			}
		}
		next := fill
		if next == nil {
			next = &Entry{Committed: true, Seq: a.Seq, CommitTime: op.Time, CommitLSN: lsn, LSN: lsn}
		} else {
			ov.fills = append(ov.fills, advanceFill{e: fill, seq: a.Seq})
		}
		out = append(out, Transition{Key: k, Mode: ModeClient, Prev: prev, Next: next})
	}
	if ov != nil {
		for _, f := range ov.fills {
			*f.e = Entry{Committed: true, Seq: f.seq, CommitTime: op.Time, CommitLSN: lsn, LSN: lsn}
		}
		ov.fills = ov.fills[:0]
	}
	return out, nil
}

// Entry value encoding: a msgpack array. Frozen; append fields only.
//
//	[flags, seq, commitTime, commitLSN, reply, fingerprint,
//	 claimLSN, claimSeq, claimFP, claimTime, leaseUntil, lsn,
//	 expiresAt, claimExpires, claimKeep, claimKeepFor, keptFrom]
//
// expiresAt and claimExpires (format 2, per-request TTL) are written only
// when one of the five last fields is set, so entries without a TTL keep
// the 12-field form; the reply window's three (claimKeep, claimKeepFor,
// keptFrom: client keys) only when one of them is set, so entries without
// a window keep the 12- or 14-field form.
//
// flags: 1 committed, 2 replyKept, 4 inFlight, 8 fingerprint present,
// 16 claim fingerprint present (nil and empty fingerprints differ).
const (
	flagCommitted = 1 << iota
	flagReplyKept
	flagInFlight
	flagFP
	flagClaimFP
)

const (
	entryFields       = 12
	entryFieldsTTL    = 14
	entryFieldsWindow = 17
)

// EncodeEntry appends the value encoding of e to dst.
func EncodeEntry(dst []byte, e *Entry) []byte {
	var flags uint64
	if e.Committed {
		flags |= flagCommitted
	}
	if e.ReplyKept {
		flags |= flagReplyKept
	}
	if e.InFlight {
		flags |= flagInFlight
	}
	if e.Fingerprint != nil {
		flags |= flagFP
	}
	if e.ClaimFP != nil {
		flags |= flagClaimFP
	}
	if dst == nil {
		dst = make([]byte, 0, 40+len(e.Reply)+len(e.Fingerprint)+len(e.ClaimFP))
	}
	window := e.ClaimKeep != 0 || e.ClaimKeepFor != 0 || e.KeptFrom != 0
	ttl := window || e.ExpiresAt != 0 || e.ClaimExpires != 0
	if window {
		dst = msgp.AppendArrayLen(dst, entryFieldsWindow)
	} else if ttl {
		dst = msgp.AppendArrayLen(dst, entryFieldsTTL)
	} else {
		dst = msgp.AppendArrayLen(dst, entryFields)
	}
	dst = msgp.AppendUint(dst, flags)
	dst = msgp.AppendUint(dst, e.Seq)
	dst = msgp.AppendInt(dst, e.CommitTime)
	dst = msgp.AppendUint(dst, uint64(e.CommitLSN))
	dst = msgp.AppendBytes(dst, e.Reply)
	dst = msgp.AppendBytes(dst, e.Fingerprint)
	dst = msgp.AppendUint(dst, uint64(e.ClaimLSN))
	dst = msgp.AppendUint(dst, e.ClaimSeq)
	dst = msgp.AppendBytes(dst, e.ClaimFP)
	dst = msgp.AppendInt(dst, e.ClaimTime)
	dst = msgp.AppendInt(dst, e.LeaseUntil)
	dst = msgp.AppendUint(dst, uint64(e.LSN))
	if ttl {
		dst = msgp.AppendInt(dst, e.ExpiresAt)
		dst = msgp.AppendInt(dst, e.ClaimExpires)
	}
	if window {
		dst = msgp.AppendUint(dst, e.ClaimKeep)
		dst = msgp.AppendInt(dst, e.ClaimKeepFor)
		dst = msgp.AppendUint(dst, e.KeptFrom)
	}
	return dst
}

// ErrBadEntry wraps every entry decoding error.
var ErrBadEntry = errors.New("index: bad entry value")

// DecodeEntry parses a value written by EncodeEntry. It copies what it keeps,
// never panics, and never allocates more than len(b) for byte strings.
func DecodeEntry(b []byte) (*Entry, error) {
	d := msgpack.GetDecoder()
	defer msgpack.PutDecoder(d)
	br := bytes.NewReader(b)
	d.Reset(br)
	var err error
	keep := func(f error) {
		if err == nil {
			err = f
		}
	}
	n, f := d.DecodeArrayLen()
	keep(f)
	if err == nil && (n < entryFields || n > len(b)) {
		return nil, fmt.Errorf("%w: %d fields", ErrBadEntry, n)
	}
	u := func() uint64 {
		if err != nil {
			return 0
		}
		v, f := d.DecodeUint64()
		keep(f)
		return v
	}
	i := func() int64 {
		if err != nil {
			return 0
		}
		v, f := d.DecodeInt64()
		keep(f)
		return v
	}
	bs := func() []byte {
		if err != nil {
			return nil
		}
		v, f := wal.DecodeBin(d, br)
		keep(f)
		return v
	}
	e := &Entry{}
	flags := u()
	e.Seq = u()
	e.CommitTime = i()
	e.CommitLSN = wal.LSN(u())
	e.Reply = bs()
	e.Fingerprint = bs()
	e.ClaimLSN = wal.LSN(u())
	e.ClaimSeq = u()
	e.ClaimFP = bs()
	e.ClaimTime = i()
	e.LeaseUntil = i()
	e.LSN = wal.LSN(u())
	known := entryFields
	if n >= entryFieldsTTL {
		e.ExpiresAt = i()
		e.ClaimExpires = i()
		known = entryFieldsTTL
	}
	if n >= entryFieldsWindow {
		e.ClaimKeep = u()
		e.ClaimKeepFor = i()
		e.KeptFrom = u()
		known = entryFieldsWindow
	}
	for k := known; k < n && err == nil; k++ {
		keep(wal.SkipBounded(d, br, 0))
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrBadEntry, err)
	}
	e.Committed = flags&flagCommitted != 0
	e.ReplyKept = flags&flagReplyKept != 0
	e.InFlight = flags&flagInFlight != 0
	if flags&flagFP != 0 && e.Fingerprint == nil {
		e.Fingerprint = []byte{}
	} else if flags&flagFP == 0 {
		e.Fingerprint = nil
	}
	if flags&flagClaimFP != 0 && e.ClaimFP == nil {
		e.ClaimFP = []byte{}
	} else if flags&flagClaimFP == 0 {
		e.ClaimFP = nil
	}
	if e.Committed && e.Reply == nil && e.ReplyKept {
		e.Reply = []byte{}
	}
	return e, nil
}

// Stamp writes lsn into the entries that Transitions built for a record
// whose LSN was not known yet (the live engine computes transitions before
// appending; the WAL assigns the LSN under its lock).
func Stamp(ts []Transition, typ byte, lsn wal.LSN) {
	for i := range ts {
		n := ts[i].Next
		if n == nil {
			continue
		}
		n.LSN = lsn
		if ts[i].Mode == ModeSeq && typ != wal.OpBatch {
			continue // a moved reply keeps the commit LSN of its own record
		}
		switch typ {
		case wal.OpClaim:
			n.ClaimLSN = lsn
		case wal.OpCommit, wal.OpCommitAdvance, wal.OpAdvance:
			n.CommitLSN = lsn
		case wal.OpBatch:
			// Claims and commits made by the batch itself carry LSN 0
			// (nothing else does: LSNs start at 1).
			if n.InFlight && n.ClaimLSN == 0 {
				n.ClaimLSN = lsn
			}
			if n.Committed && n.CommitLSN == 0 {
				n.CommitLSN = lsn
			}
		}
	}
}
