package idemstream

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/internal/msgp"
	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// TwoPhaseCommitSink is a transactional sink driven by checkpoints (the
// "plan B" of exactly-once stream processing, the protocol of Flink's
// TwoPhaseCommitSinkFunction). Txn is the sink's transaction handle; it
// is serialized with msgpack (exported fields) into the checkpoint, so
// after a crash the coordinator hands the recovered value to
// RecoverAndCommit or RecoverAndAbort.
//
// The coordinator calls, for checkpoint k: BeginTransaction(k) (and
// records the handle while the events are invoked), Invoke for each new
// event, PreCommit, then records the checkpoint with the handle and the
// events in one record, then Commit, and only then lets the source
// acknowledge the events. Abort is called when a step before the
// checkpoint record fails.
//
// RecoverAndCommit must be idempotent: it is called for the last recorded
// checkpoint at every recovery, whether or not Commit committed it (its
// commit is recorded by recovery only, so that a checkpoint costs two
// records), and again if the recovery itself crashes. RecoverAndAbort
// likewise for a transaction that may already be aborted, or that the
// sink never saw pre-committed.
type TwoPhaseCommitSink[Txn any] interface {
	BeginTransaction(ctx context.Context, checkpointID uint64) (Txn, error)
	Invoke(ctx context.Context, txn Txn, ev Event) error
	PreCommit(ctx context.Context, txn Txn) error
	Commit(ctx context.Context, txn Txn) error
	Abort(ctx context.Context, txn Txn) error
	RecoverAndCommit(ctx context.Context, txn Txn) error
	RecoverAndAbort(ctx context.Context, txn Txn) error
}

// CheckpointAborter is optionally implemented by a TwoPhaseCommitSink
// whose transactions can be found by checkpoint id (as Kafka's
// transactional ids are). A crash between BeginTransaction and the durable
// record of its handle leaves a transaction the coordinator has no handle
// for; recovery therefore calls AbortCheckpoint with the id after the last
// recorded checkpoint's, every time (it must do nothing when no
// transaction of that id exists). Without it such a transaction is left
// to the sink (it was never pre-committed, so nothing of it is visible; a
// sink expires it as Kafka does after transaction.timeout.ms).
type CheckpointAborter interface {
	AbortCheckpoint(ctx context.Context, checkpointID uint64) error
}

// TwoPhaseOptions configure a TwoPhase coordinator.
type TwoPhaseOptions struct {
	// MaxHandleSize bounds the serialized transaction handle (default 64
	// KiB). A larger handle fails the checkpoint (ErrTooLarge) before
	// anything is recorded; a larger one read back fails recovery
	// (ErrCorruptRecord).
	MaxHandleSize int
	// CommitRetries is how many times a failing sink Commit of a recorded
	// checkpoint is retried before Checkpoint returns (default 3, with
	// 50 ms doubling pauses); the next Checkpoint call retries it again
	// through RecoverAndCommit before doing anything else.
	CommitRetries int
	// NoFingerprint turns off the payload check of redelivered events.
	NoFingerprint bool
	// TTL is how long the events' dedup entries are kept (as
	// SinkOptions.TTL); zero keeps them until Retention or Forget.
	TTL time.Duration
	// Logger receives recovery decisions. Default: discard.
	Logger *slog.Logger
}

// RecoveryReport says what NewTwoPhase's recovery found and did.
type RecoveryReport struct {
	// LastCheckpoint is the last checkpoint opened before the restart.
	LastCheckpoint uint64
	// Action: "none", "committed" (the checkpoint record was durable:
	// RecoverAndCommit, whether or not the sink had committed it before
	// the restart), "aborted" (it was not: RecoverAndAbort), "finished"
	// (its outcome was recorded already: an earlier recovery, or an
	// aborted checkpoint).
	Action string
	// EventsCommitted and EventsReleased count the events left in doubt
	// that recovery committed (part of the recovered checkpoint) or
	// released (they run again in a later checkpoint when redelivered).
	EventsCommitted, EventsReleased int
	// OrphanAborted: the sink implements CheckpointAborter, and recovery
	// called AbortCheckpoint(LastCheckpoint+1) for a transaction that may
	// have been begun without a durable handle.
	OrphanAborted bool
}

// TwoPhase is the checkpoint coordinator of a TwoPhaseCommitSink, with idem
// as its durable log. One checkpoint runs at a time.
//
// Records (scope "idemstream.2pc/<name>"): sequence client "ckpt", number k,
// holds checkpoint k's handle as begun (and the frontier so far), written
// with the removal of checkpoint k-1's records; id "c/<k>" holds the
// pre-committed handle, the event ids and fingerprints and the frontier
// (the checkpoint), and is written in one batch with the frontier's
// advances and a Put (claim and commit at once) of every event of the
// checkpoint in the sink's event scope, so that the events are committed
// (their redeliveries replay) exactly when the checkpoint is recorded;
// "d/<k>" and "a/<k>" record that recovery committed it, or that it was
// aborted. Two records per checkpoint on a store with batches, whatever
// its size; the package doc says why a crash anywhere is still exactly
// once. All records are sealed (version, length, CRC-32C) and checked when
// read back.
type TwoPhase[Txn any] struct {
	st     idem.Store
	name   string
	scope  string // coordinator records
	escope string // events
	fscope string // frontier clients
	who    string // for errors: two-phase "<name>"
	sink   TwoPhaseCommitSink[Txn]
	opts   TwoPhaseOptions
	log    *slog.Logger
	hook   func(window, uint64) error
	poison poisonCounters // counted by ConsumeTwoPhase
	// lookupChunk: on an engine, a checkpoint of more events than this
	// overlaps its lookups with the preparation of its events and with
	// its Invokes, handed over in chunks of this many (lookupBatch);
	// tests make it small.
	lookupChunk int

	mu         sync.Mutex
	last       uint64 // last checkpoint opened
	frontier   map[string]uint64
	unfinished *unfinishedCheckpoint
	closed     bool
	bufs       checkpointBufs // a checkpoint's lookups; guarded by mu
}

// checkpointBufs are the buffers of a checkpoint's lookups (lookupBatch),
// kept from one checkpoint to the next: allocated per checkpoint they
// were about 600 bytes per event. Each is reset when a checkpoint starts
// and cleared when it ends (nothing of a batch is kept between
// checkpoints). Guarded by TwoPhase.mu: one checkpoint at a time.
type checkpointBufs struct {
	byID  map[string]*eventClaim // keyed by the events' own id bytes
	all   []eventClaim
	order []*eventClaim
	fresh []*eventClaim
	hints []idem.PutHint
	reqs  []idem.Request     // a chunk's lookups, handed to the engine's Prefetch
	ids   [][]byte           // the checkpoint record's events
	fps   [][]byte           // and their fingerprints
	res   []idem.BatchResult // the record's batch results (appendRun), cleared after use
}

// reset sizes the buffers for a batch of n events.
func (b *checkpointBufs) reset(n int) {
	if b.byID == nil {
		b.byID = make(map[string]*eventClaim, n)
	}
	b.all = reuse(b.all, n)
	b.order = reuse(b.order, n)[:0]
	b.fresh = reuse(b.fresh, n)[:0]
}

// release drops what the buffers point to (the batch's events, the
// engine's slots) once the checkpoint is over, and gives up buffers of an
// exceptionally large batch.
func (b *checkpointBufs) release() {
	clear(b.byID)
	clear(b.all)
	clear(b.order[:cap(b.order)])
	clear(b.fresh[:cap(b.fresh)])
	clear(b.hints)
	clear(b.reqs)
	clear(b.ids)
	clear(b.fps)
	if len(b.all) > maxKeptBatchBuffer {
		*b = checkpointBufs{}
	}
}

// unfinishedCheckpoint is a recorded checkpoint whose sink commit has not
// succeeded yet.
type unfinishedCheckpoint struct {
	k        uint64
	txn      any // the Txn of the coordinator
	frontier map[string]uint64
	tried    bool // Commit was called: retry with RecoverAndCommit
}

// eventClaim is a distinct event of a checkpoint's batch. It points into
// the batch (Checkpoint's events, which outlive it) rather than copying
// the event and its request: a checkpoint makes one per event.
type eventClaim struct {
	ev    *Event // its first delivery in the batch
	fp    []byte // the payload's fingerprint (nil with NoFingerprint)
	first int    // its first position in the batch
	more  []int  // the positions of its repeats (a batch may repeat an id)
	fresh bool   // looked up absent: to run
	err   error  // the lookup's
	// hint, when not nil, is what the engine's LookupHint read of the
	// event for its Put (idem.PutHint): the key validated and its slot
	// found once, by the lookup.
	hint *idem.PutHint
}

// hintLookuper is the engine's LookupHint: a Lookup that hands its read
// on to the Put that follows (idem.PutHint).
type hintLookuper interface {
	LookupHint(ctx context.Context, req idem.Request, h *idem.PutHint) (idem.Result, error)
}

// prefetcher is the engine's Prefetch: it loads what the lookups of
// reqs will read first (the key filter's blocks) together, so that their
// cache misses overlap instead of coming one per lookup.
type prefetcher interface {
	Prefetch(reqs []idem.Request)
}

// put adds c's Put with rec to b: through its hint when it has one.
func (c *eventClaim) put(b idem.Batch, escope string, ttl time.Duration, rec []byte) {
	if c.hint != nil {
		c.hint.Put(b, rec)
		return
	}
	b.Put(c.req(escope, ttl), rec)
}

// req is c's request in the event scope escope (id, fingerprint, TTL).
func (c *eventClaim) req(escope string, ttl time.Duration) idem.Request {
	return idem.Request{Scope: escope, ID: c.ev.ID, Fingerprint: c.fp, TTL: ttl}
}

type openRecord struct {
	K        uint64            `msgpack:"k"`
	Handle   []byte            `msgpack:"h"`
	Frontier map[string]uint64 `msgpack:"f"`
}

type checkpointRecord struct {
	K      uint64   `msgpack:"k"`
	Handle []byte   `msgpack:"h"`
	Events [][]byte `msgpack:"e"`
	// Fingerprints are the events' (SHA-256 of the payload, in the order
	// of Events; absent with NoFingerprint and in records of versions
	// that claimed events one by one): recovery puts a listed event that
	// a store without batches did not commit with the request its
	// redeliveries will make.
	Fingerprints [][]byte          `msgpack:"p,omitempty"`
	Frontier     map[string]uint64 `msgpack:"f"`
}

// appendBody appends r's msgpack encoding, as msgpack.Marshal writes it
// (a map keyed by the tags, integers as uint64 in their full 9 bytes) but
// for the frontier's partitions, which come sorted (Marshal's follow the
// map's random order): a checkpoint lists every event of its batch, and
// reflection over them cost as much as the rest of the coordinator's own
// work, so the values are appended directly (internal/msgp, as the event
// records; TestCheckpointRecordBody checks the bytes against Marshal's).
func (r *checkpointRecord) appendBody(b []byte) []byte {
	fields := 4
	if len(r.Fingerprints) > 0 {
		fields = 5 // omitempty
	}
	b = appendMapLen(b, fields)
	b = msgp.AppendString(b, "k")
	b = appendUint64(b, r.K)
	b = msgp.AppendString(b, "h")
	b = msgp.AppendBytes(b, r.Handle)
	b = msgp.AppendString(b, "e")
	b = appendBinList(b, r.Events)
	if fields == 5 {
		b = msgp.AppendString(b, "p")
		b = appendBinList(b, r.Fingerprints)
	}
	b = msgp.AppendString(b, "f")
	if r.Frontier == nil {
		return append(b, msgpcode.Nil)
	}
	parts := make([]string, 0, len(r.Frontier))
	for p := range r.Frontier {
		parts = append(parts, p)
	}
	slices.Sort(parts)
	b = appendMapLen(b, len(parts))
	for _, p := range parts {
		b = msgp.AppendString(b, p)
		b = appendUint64(b, r.Frontier[p])
	}
	return b
}

// appendUint64 appends n as msgpack's Encoder writes a uint64 without
// compact integers: the uint64 code and 8 bytes.
func appendUint64(b []byte, n uint64) []byte {
	return binary.BigEndian.AppendUint64(append(b, msgpcode.Uint64), n)
}

// appendMapLen appends a map header of n pairs, as the Encoder does.
func appendMapLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, msgpcode.FixedMapLow|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, msgpcode.Map16), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, msgpcode.Map32), uint32(n))
}

// sizeHint is about the length of r's body.
func (r *checkpointRecord) sizeHint() int {
	n := 64 + len(r.Handle) + 34*len(r.Fingerprints) + 10*len(r.Events)
	for _, id := range r.Events {
		n += len(id)
	}
	return n
}

// appendBinList appends l as a msgpack array of bin (nil as nil), as
// Marshal encodes a [][]byte.
func appendBinList(b []byte, l [][]byte) []byte {
	if l == nil {
		return append(b, msgpcode.Nil)
	}
	b = msgp.AppendArrayLen(b, len(l))
	for _, v := range l {
		b = msgp.AppendBytes(b, v)
	}
	return b
}

type markerRecord struct {
	K        uint64            `msgpack:"k"`
	Frontier map[string]uint64 `msgpack:"f"`
}

const (
	ckptClient     = "ckpt"
	maxSealedBytes = 12 << 20
)

func twoPhaseScope(name string) string { return "idemstream.2pc/" + name }
func ckptID(kind string, k uint64) []byte {
	return []byte(kind + "/" + strconv.FormatUint(k, 10))
}

// NewTwoPhase opens the coordinator name on st (a name shared with no Sink;
// opts nil: the defaults)
// and runs recovery: the last checkpoint is recovered-and-committed if its
// record with the handle is durable and the sink's commit is not recorded,
// recovered-and-aborted if it was begun and not recorded; events left in
// doubt are committed with their checkpoint or released.
func NewTwoPhase[Txn any](ctx context.Context, st idem.Store, name string, sink TwoPhaseCommitSink[Txn], opts *TwoPhaseOptions) (*TwoPhase[Txn], RecoveryReport, error) {
	var o TwoPhaseOptions
	if opts != nil {
		o = *opts
	}
	if sink == nil {
		return nil, RecoveryReport{}, fmt.Errorf("idemstream: two-phase %q: nil sink", name)
	}
	switch {
	case o.TTL < 0:
		return nil, RecoveryReport{}, fmt.Errorf("idemstream: two-phase %q: TwoPhaseOptions.TTL %v is negative", name, o.TTL)
	case o.MaxHandleSize < 0 || o.MaxHandleSize > 8<<20:
		return nil, RecoveryReport{}, fmt.Errorf("idemstream: two-phase %q: TwoPhaseOptions.MaxHandleSize %d is out of range (0 for 64 KiB, at most 8 MiB)", name, o.MaxHandleSize)
	case o.CommitRetries < 0:
		return nil, RecoveryReport{}, fmt.Errorf("idemstream: two-phase %q: TwoPhaseOptions.CommitRetries %d is negative", name, o.CommitRetries)
	}
	if o.MaxHandleSize == 0 {
		o.MaxHandleSize = 64 << 10
	}
	if o.CommitRetries == 0 {
		o.CommitRetries = 3
	}
	if err := takeName(st, "sink", name); err != nil {
		return nil, RecoveryReport{}, err
	}
	t := newTwoPhase(st, name, sink, o)
	rep, err := t.recover(ctx)
	if err != nil {
		releaseName(st, "sink", name)
		return nil, rep, err
	}
	return t, rep, nil
}

// newTwoPhase is the coordinator of checked options, before recovery.
func newTwoPhase[Txn any](st idem.Store, name string, sink TwoPhaseCommitSink[Txn], opts TwoPhaseOptions) *TwoPhase[Txn] {
	t := &TwoPhase[Txn]{st: st, name: name, scope: twoPhaseScope(name), escope: sinkScope(name), fscope: frontierScope(name), who: fmt.Sprintf("two-phase %q", name), sink: sink, opts: opts, log: opts.Logger, frontier: map[string]uint64{}, lookupChunk: defaultLookupChunk}
	if t.log == nil {
		t.log = discardLogger()
	}
	return t
}

// Close releases the coordinator's name. A checkpoint left unfinished by
// a failing sink commit is finished by the recovery of the next
// coordinator (after the engine is reopened).
func (t *TwoPhase[Txn]) Close() error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.closed {
		t.closed = true
		releaseName(t.st, "sink", t.name)
	}
	return nil
}

// TwoPhaseStats are a coordinator's counters since NewTwoPhase.
type TwoPhaseStats struct {
	// LastCheckpoint is the id of the last checkpoint opened.
	LastCheckpoint uint64
	// Retried, Terminated and DeadLettered count what ConsumeTwoPhase did
	// with the deliveries that failed (as in SinkStats).
	Retried, Terminated, DeadLettered uint64
}

// Name returns the coordinator's name.
func (t *TwoPhase[Txn]) Name() string { return t.name }

// Stats returns the coordinator's counters.
func (t *TwoPhase[Txn]) Stats() TwoPhaseStats {
	return TwoPhaseStats{LastCheckpoint: t.LastCheckpoint(), Retried: t.poison.retried.Load(),
		Terminated: t.poison.terminated.Load(), DeadLettered: t.poison.deadLettered.Load()}
}

// LastCheckpoint returns the id of the last checkpoint opened.
func (t *TwoPhase[Txn]) LastCheckpoint() uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.last
}

// Frontier returns the partition's offset as of the last committed
// checkpoint (ok false if none): it is recorded in the checkpoint record
// itself, with the transaction handle.
func (t *TwoPhase[Txn]) Frontier(partition string) (uint64, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	o, ok := t.frontier[partition]
	return o, ok
}

func (t *TwoPhase[Txn]) hookAt(w window, k uint64) error {
	if t.hook != nil {
		return t.hook(w, k)
	}
	return nil
}

func (t *TwoPhase[Txn]) encodeHandle(txn Txn) ([]byte, error) {
	h, err := msgpack.Marshal(txn)
	if err != nil {
		return nil, fmt.Errorf("idemstream: two-phase %q: serializing the transaction handle: %w", t.name, err)
	}
	if len(h) > t.opts.MaxHandleSize {
		return nil, fmt.Errorf("%w: two-phase %q: transaction handle of %d bytes, bound %d", ErrTooLarge, t.name, len(h), t.opts.MaxHandleSize)
	}
	return h, nil
}

func (t *TwoPhase[Txn]) decodeHandle(h []byte, k uint64) (Txn, error) {
	var txn Txn
	if len(h) > t.opts.MaxHandleSize {
		return txn, fmt.Errorf("%w: two-phase %q: checkpoint %d: transaction handle of %d bytes exceeds the bound %d", ErrCorruptRecord, t.name, k, len(h), t.opts.MaxHandleSize)
	}
	if err := unmarshal(h, &txn); err != nil {
		return txn, fmt.Errorf("%w: two-phase %q: checkpoint %d: transaction handle: %v", ErrCorruptRecord, t.name, k, err)
	}
	return txn, nil
}

// record writes a sealed record under id: a Put, or the commit of the
// given claim that a crash left in doubt (a Put split by a store without
// batches).
func (t *TwoPhase[Txn]) record(ctx context.Context, id []byte, v any, c *idem.Claim) error {
	b, err := seal(v, maxSealedBytes)
	if err != nil {
		return fmt.Errorf("idemstream: two-phase %q: record %s: %w", t.name, id, err)
	}
	if c != nil {
		err = c.Commit(ctx, b)
	} else {
		err = t.put(ctx, idem.Request{Scope: t.scope, ID: id}, b)
	}
	if err != nil {
		return fmt.Errorf("idemstream: two-phase %q: record %s: %w", t.name, id, err)
	}
	return nil
}

// put writes one record with a Put (claim and commit at once): new, or
// an error.
func (t *TwoPhase[Txn]) put(ctx context.Context, req idem.Request, b []byte) error {
	bt := newBatch(t.st)
	bt.Put(req, b)
	res, err := bt.Run(context.WithoutCancel(ctx))
	if err == nil {
		err = putErr(res[0])
	}
	return err
}

// putErr is the error of a Put item that must write a new record.
func putErr(r idem.BatchResult) error {
	if r.Err == nil && r.Result.Status != idem.Fresh {
		return fmt.Errorf("already %v", r.Result.Status)
	}
	return r.Err
}

// read returns the sealed record id into v (false if absent).
func (t *TwoPhase[Txn]) read(id []byte, v any) (bool, error) {
	res, err := t.st.Lookup(context.Background(), idem.Request{Scope: t.scope, ID: id})
	if err != nil {
		return false, fmt.Errorf("idemstream: two-phase %q: reading %s: %w", t.name, id, err)
	}
	if res.Status != idem.Done {
		return false, nil
	}
	if err := unseal(res.Reply, maxSealedBytes, v); err != nil {
		return false, fmt.Errorf("idemstream: two-phase %q: record %s: %w", t.name, id, err)
	}
	return true, nil
}

func (t *TwoPhase[Txn]) recover(ctx context.Context) (RecoveryReport, error) {
	rep := RecoveryReport{Action: "none"}
	evDoubts, err := inDoubt(ctx, t.st, t.escope)
	if err != nil {
		return rep, fmt.Errorf("idemstream: two-phase %q: %w", t.name, err)
	}
	doubts, err := inDoubt(ctx, t.st, t.scope)
	if err != nil {
		return rep, fmt.Errorf("idemstream: two-phase %q: %w", t.name, err)
	}
	k, err := t.st.ClientState(ctx, t.scope, ckptClient)
	if err != nil {
		return rep, fmt.Errorf("idemstream: two-phase %q: %w", t.name, err)
	}
	rep.LastCheckpoint = k
	t.last = k
	// Claims in doubt are the halves of Puts that a store without batches
	// wrote as a claim and a commit (or claims of an earlier version).
	events := map[string]*idem.Claim{}
	markers := map[string]*idem.Claim{}
	for _, d := range evDoubts {
		events[string(d.ID)] = d.Claim
	}
	for _, d := range doubts {
		switch {
		case d.Client == ckptClient:
			// The opening of checkpoint d.Seq never became durable (its
			// transaction is aborted below, as k+1's).
			if err := d.Claim.Abort(ctx); err != nil {
				return rep, fmt.Errorf("idemstream: two-phase %q: releasing the open of checkpoint %d: %w", t.name, d.Seq, err)
			}
			t.log.Info("idemstream: checkpoint begun without a durable handle", "name", t.name, "checkpoint", d.Seq)
		case len(d.ID) > 2 && d.ID[0] == 'c':
			// The checkpoint record never became durable.
			if err := d.Claim.Abort(ctx); err != nil {
				return rep, err
			}
		default:
			markers[string(d.ID)] = d.Claim
		}
	}
	// A transaction may have been begun for checkpoint k+1 without its
	// opening record becoming durable: nothing of it was recorded, so it
	// is aborted by its id when the sink can do that.
	if a, ok := any(t.sink).(CheckpointAborter); ok {
		if err := a.AbortCheckpoint(ctx, k+1); err != nil {
			return rep, fmt.Errorf("idemstream: two-phase %q: aborting checkpoint %d, which has no durable handle: %w", t.name, k+1, err)
		}
		rep.OrphanAborted = true
	}
	var ckpt checkpointRecord // the last checkpoint if it is committed
	if k > 0 {
		var open openRecord
		hasOpen := false
		res, err := t.st.Lookup(ctx, idem.Request{Scope: t.scope, Client: ckptClient, Seq: k})
		switch {
		case err == nil && res.Status == idem.Done:
			if err := unseal(res.Reply, maxSealedBytes, &open); err != nil {
				return rep, fmt.Errorf("idemstream: two-phase %q: checkpoint %d's opening record: %w", t.name, k, err)
			}
			hasOpen = true
		case err == nil || errors.Is(err, idem.ErrAlreadyCommitted):
			// The reply is gone: a later open was begun and released, so
			// checkpoint k was finished (a marker says how).
		default:
			return rep, fmt.Errorf("idemstream: two-phase %q: checkpoint %d's opening record: %w", t.name, k, err)
		}
		var done, aborted markerRecord
		hasDone, err := t.read(ckptID("d", k), &done)
		if err != nil {
			return rep, err
		}
		hasAborted, err := t.read(ckptID("a", k), &aborted)
		if err != nil {
			return rep, err
		}
		hasCkpt, err := t.read(ckptID("c", k), &ckpt)
		if err != nil {
			return rep, err
		}
		if hasCkpt && ckpt.K != k || hasOpen && open.K != k {
			return rep, fmt.Errorf("%w: two-phase %q: records of checkpoint %d name checkpoint %d/%d", ErrCorruptRecord, t.name, k, ckpt.K, open.K)
		}
		if hasCkpt && ckpt.Fingerprints != nil && len(ckpt.Fingerprints) != len(ckpt.Events) {
			return rep, fmt.Errorf("%w: two-phase %q: checkpoint %d lists %d events and %d fingerprints", ErrCorruptRecord, t.name, k, len(ckpt.Events), len(ckpt.Fingerprints))
		}
		switch {
		case hasDone:
			rep.Action = "finished"
			if !hasCkpt {
				return rep, fmt.Errorf("%w: two-phase %q: checkpoint %d is marked committed but its record is missing", ErrCorruptRecord, t.name, k)
			}
			if err := t.settleEvents(ctx, k, &ckpt, events, &rep); err != nil {
				return rep, err
			}
			t.frontier = done.Frontier
		case hasAborted:
			rep.Action = "finished"
			if err := t.settleEvents(ctx, k, nil, events, &rep); err != nil {
				return rep, err
			}
			t.frontier = aborted.Frontier
		case hasCkpt:
			// The checkpoint with the handle is durable: the sink must
			// commit it (again: RecoverAndCommit is idempotent; the sink's
			// commit of the last checkpoint is recorded only here).
			txn, err := t.decodeHandle(ckpt.Handle, k)
			if err != nil {
				return rep, err
			}
			if err := t.sink.RecoverAndCommit(ctx, txn); err != nil {
				return rep, fmt.Errorf("idemstream: two-phase %q: recover-and-commit of checkpoint %d: %w", t.name, k, err)
			}
			if err := t.hookAt(windowDuringRecovery, k); err != nil {
				return rep, err
			}
			if err := t.settleEvents(ctx, k, &ckpt, events, &rep); err != nil {
				return rep, err
			}
			if err := t.record(ctx, ckptID("d", k), &markerRecord{K: k, Frontier: ckpt.Frontier}, markers[string(ckptID("d", k))]); err != nil {
				return rep, err
			}
			rep.Action = "committed"
			t.log.Info("idemstream: recovered and committed checkpoint", "name", t.name, "checkpoint", k, "events", len(ckpt.Events))
			t.frontier = ckpt.Frontier
		case hasOpen:
			txn, err := t.decodeHandle(open.Handle, k)
			if err != nil {
				return rep, err
			}
			if err := t.sink.RecoverAndAbort(ctx, txn); err != nil {
				return rep, fmt.Errorf("idemstream: two-phase %q: recover-and-abort of checkpoint %d: %w", t.name, k, err)
			}
			if err := t.hookAt(windowDuringRecovery, k); err != nil {
				return rep, err
			}
			if err := t.settleEvents(ctx, k, nil, events, &rep); err != nil {
				return rep, err
			}
			if err := t.record(ctx, ckptID("a", k), &markerRecord{K: k, Frontier: open.Frontier}, markers[string(ckptID("a", k))]); err != nil {
				return rep, err
			}
			rep.Action = "aborted"
			t.log.Info("idemstream: recovered and aborted checkpoint (not recorded before the crash)", "name", t.name, "checkpoint", k)
			t.frontier = open.Frontier
		default:
			return rep, fmt.Errorf("%w: two-phase %q: checkpoint %d has no record", ErrCorruptRecord, t.name, k)
		}
		if t.frontier == nil {
			t.frontier = map[string]uint64{}
		}
	} else if err := t.settleEvents(ctx, 0, nil, events, &rep); err != nil {
		return rep, err
	}
	return rep, nil
}

// settleEvents makes the events of checkpoint k committed in idem when
// ckpt (its record) is given: each is put (claimed and committed at
// once) unless it is committed already, and a claim of it left in doubt
// is committed. Every other event claim left in doubt is released: its
// transaction was aborted or it never reached one, and it runs again when
// redelivered. An atomic batch commits a checkpoint's events in its
// record; this completes what a store without batches (one request at a
// time) may have left half done, and claims of earlier versions.
func (t *TwoPhase[Txn]) settleEvents(ctx context.Context, k uint64, ckpt *checkpointRecord, inDoubt map[string]*idem.Claim, rep *RecoveryReport) error {
	b := newBatch(t.st)
	rec, err := encodeEventRecord(&eventRecord{Checkpoint: k})
	if err != nil {
		return err
	}
	puts := 0
	if ckpt != nil {
		for n, id := range ckpt.Events {
			if c := inDoubt[string(id)]; c != nil {
				delete(inDoubt, string(id))
				b.Commit(c, rec)
				rep.EventsCommitted++
				continue
			}
			req := idem.Request{Scope: t.escope, ID: id, TTL: t.opts.TTL}
			if ckpt.Fingerprints != nil {
				req.Fingerprint = ckpt.Fingerprints[n]
			}
			b.Put(req, rec)
			puts++
		}
	}
	for _, c := range inDoubt {
		b.Abort(c)
		rep.EventsReleased++
	}
	if b.Len() == 0 {
		return nil
	}
	res, err := b.Run(context.WithoutCancel(ctx))
	if err == nil {
		for _, r := range res {
			if r.Err != nil {
				err = r.Err
				break
			}
			if puts > 0 && r.Result.Status == idem.Fresh && r.Result.Claim == nil {
				rep.EventsCommitted++
			}
		}
	}
	if err != nil {
		return fmt.Errorf("idemstream: two-phase %q: settling the events of checkpoint %d: %w", t.name, k, err)
	}
	return nil
}

// Checkpoint runs one checkpoint over a batch of events: each event is
// looked up (a redelivery of a committed one is Replayed, one in progress
// elsewhere Busy), the new ones are invoked into a transaction begun for
// the checkpoint, which is pre-committed, recorded with its handle, the
// events and the frontier (one record), and committed.
// Acknowledge to the source exactly the events whose Outcome is Ackable,
// after Checkpoint returns. On an error nothing of the batch is
// acknowledgeable: the events run again, in a later checkpoint, when
// redelivered (the transaction was aborted, or it is committed by the
// next Checkpoint call or the next recovery, and the redelivery replays).
// Events whose own processing failed (invalid, or ErrConflict) get Status
// Failed with Outcome.Err; the rest of the batch goes on.
func (t *TwoPhase[Txn]) Checkpoint(ctx context.Context, events []Event) ([]Outcome, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, ErrClosed
	}
	if t.unfinished != nil {
		if err := t.finishUnfinished(ctx); err != nil {
			return nil, err
		}
	}
	defer t.bufs.release()
	// The sink's calls get ctx; the coordinator's records are written even
	// if ctx ends meanwhile, so that a shutdown finishes or aborts the
	// checkpoint in progress rather than leaving its outcome unknown.
	k := t.last + 1
	var (
		txn      Txn
		begun    bool
		beginErr error
		opened   chan error
	)
	// begin begins checkpoint k's transaction and starts recording its
	// opening (the handle, durable before PreCommit: a crash before
	// leaves a transaction that recovery aborts by checkpoint id, or from
	// this record). It runs once the first new event is found, so that
	// the opening's write overlaps the rest of the lookups and the
	// Invokes, and never for a batch of redeliveries (which writes
	// nothing).
	begin := func() {
		txn, beginErr = t.sink.BeginTransaction(ctx, k)
		if beginErr != nil {
			beginErr = fmt.Errorf("idemstream: two-phase %q: BeginTransaction(%d): %w", t.name, k, beginErr)
			return
		}
		handle, err := t.encodeHandle(txn)
		var open []byte
		if err == nil {
			open, err = seal(&openRecord{K: k, Handle: handle, Frontier: t.frontier}, maxSealedBytes)
		}
		if err != nil {
			_ = t.sink.Abort(context.WithoutCancel(ctx), txn)
			beginErr = fmt.Errorf("idemstream: two-phase %q: recording checkpoint %d's transaction: %w", t.name, k, err)
			return
		}
		opened = make(chan error, 1)
		go func() { opened <- t.open(ctx, k, open) }()
		t.last = k
		begun = true
	}
	waitOpen := func() error {
		if err := <-opened; err != nil {
			// Whether the opening is durable is unknown: recovery decides.
			_ = t.sink.Abort(context.WithoutCancel(ctx), txn)
			t.closed = true
			return fmt.Errorf("%w: two-phase %q: recording checkpoint %d's transaction: %v", ErrNeedsRecovery, t.name, k, err)
		}
		return nil
	}
	abortTxn := func(cause error) error {
		// The sink's Abort must run to the end even on a shutdown (it is
		// the caller's system, not an idem claim).
		if err := t.sink.Abort(context.WithoutCancel(ctx), txn); err != nil {
			t.log.Warn("idemstream: sink abort failed", "name", t.name, "checkpoint", k, "err", err)
		}
		if err := t.record(ctx, ckptID("a", k), &markerRecord{K: k, Frontier: t.frontier}, nil); err != nil {
			// Without the record, recovery must settle checkpoint k
			// (from its opening record) before another one opens.
			t.closed = true
			return fmt.Errorf("%w: %v (and recording the abort: %v)", ErrNeedsRecovery, cause, err)
		}
		return cause
	}
	// The new events are invoked as the lookups find them, in batch
	// order (on an engine, while the rest of the batch is looked up: see
	// lookupBatch). The transaction begins at the first one.
	var frontier map[string]uint64
	// The frontier is raised once per run of events of one partition (a
	// batch is mostly such runs), not with a map access per event.
	var runPart string
	var runTop uint64
	inRun := false
	endRun := func() {
		if inRun && runTop > frontier[runPart] {
			frontier[runPart] = runTop
		}
	}
	invoke := func(c *eventClaim) error {
		if !begun {
			if begin(); beginErr != nil {
				return beginErr
			}
			frontier = make(map[string]uint64, len(t.frontier)+1)
			for p, o := range t.frontier {
				frontier[p] = o
			}
		}
		if err := t.sink.Invoke(ctx, txn, *c.ev); err != nil {
			return fmt.Errorf("idemstream: two-phase %q: checkpoint %d: Invoke: %w", t.name, k, &EventError{ID: c.ev.ID, Err: err})
		}
		if !inRun || c.ev.Partition != runPart {
			endRun()
			runPart, runTop, inRun = c.ev.Partition, 0, true
		}
		runTop = max(runTop, c.ev.Offset)
		return nil
	}
	outs, fresh, err := t.lookupBatch(ctx, events, invoke)
	switch {
	case beginErr != nil: // begin failed: nothing begun
		return nil, beginErr
	case err != nil && begun: // a lookup or an Invoke failed
		if err := waitOpen(); err != nil {
			return nil, err
		}
		return nil, abortTxn(err)
	case err != nil || len(fresh) == 0:
		return outs, err
	}
	endRun()
	if err := waitOpen(); err != nil {
		return nil, err
	}
	if err := t.hookAt(windowBeforePreCommit, k); err != nil {
		return nil, err
	}
	if err := t.sink.PreCommit(ctx, txn); err != nil {
		return nil, abortTxn(fmt.Errorf("idemstream: two-phase %q: checkpoint %d: PreCommit: %w", t.name, k, err))
	}
	if err := t.hookAt(windowAfterPreCommit, k); err != nil {
		return nil, err
	}
	// The checkpoint, in one record: the pre-committed handle, the event
	// ids (and fingerprints) and the frontier, with the frontier's
	// advances, then every event committed (Put).
	handle, err := t.encodeHandle(txn)
	if err != nil {
		return nil, abortTxn(err)
	}
	if err := t.recordCheckpoint(ctx, k, handle, fresh, frontier); err != nil {
		if errors.Is(err, ErrTooLarge) {
			return nil, abortTxn(err)
		}
		// Whether the record is durable is unknown: only recovery may
		// decide between commit and abort now.
		t.closed = true
		return nil, fmt.Errorf("%w: two-phase %q: recording checkpoint %d failed: %v", ErrNeedsRecovery, t.name, k, err)
	}
	if err := t.hookAt(windowAfterCheckpoint, k); err != nil {
		return nil, err
	}
	t.unfinished = &unfinishedCheckpoint{k: k, txn: txn, frontier: frontier}
	if err := t.finishUnfinished(ctx); err != nil {
		return nil, err
	}
	for _, c := range fresh {
		outs[c.first] = Outcome{Status: Applied, Partition: c.ev.Partition, Offset: c.ev.Offset, Checkpoint: k}
		for _, i := range c.more {
			outs[i] = outs[c.first]
		}
	}
	if err := t.hookAt(windowBeforeAck, k); err != nil {
		return nil, err
	}
	return outs, nil
}

// open records the opening of checkpoint k (its sequence number, with the
// transaction handle) and drops the records of checkpoint k-1, which
// recovery no longer reads, in one batch (the opening first: a store
// without batches may stop between the two).
func (t *TwoPhase[Txn]) open(ctx context.Context, k uint64, rec []byte) error {
	b := newBatch(t.st)
	b.Put(idem.Request{Scope: t.scope, Client: ckptClient, Seq: k}, rec)
	if k > 1 {
		b.Ack(t.scope, ckptID("c", k-1), ckptID("d", k-1), ckptID("a", k-1))
	}
	res, err := b.Run(context.WithoutCancel(ctx))
	if err != nil {
		return err
	}
	if err := putErr(res[0]); err != nil {
		return err
	}
	if len(res) > 1 && res[1].Err != nil {
		t.log.Warn("idemstream: dropping the previous checkpoint's records failed", "name", t.name, "checkpoint", k-1, "err", res[1].Err)
	}
	return nil
}

// recordCheckpoint writes checkpoint k in one batch: first the checkpoint
// record "c/<k>" (handle, event ids and fingerprints, frontier) raising
// the frontier clients in the same item, then a Put of each event. On a
// Batcher it is one record; a store without batches may stop after the
// checkpoint record, and recovery puts the events it lists.
func (t *TwoPhase[Txn]) recordCheckpoint(ctx context.Context, k uint64, handle []byte, fresh []*eventClaim, frontier map[string]uint64) error {
	// The record's lists, from the checkpoint's buffers (seal copies
	// them into the record).
	t.bufs.ids = reuse(t.bufs.ids, len(fresh))
	ids := t.bufs.ids
	var fps [][]byte
	if !t.opts.NoFingerprint {
		t.bufs.fps = reuse(t.bufs.fps, len(fresh))
		fps = t.bufs.fps
	}
	for j, c := range fresh {
		ids[j] = c.ev.ID
		if fps != nil {
			fps[j] = c.fp
		}
	}
	rec, err := seal(&checkpointRecord{K: k, Handle: handle, Events: ids, Fingerprints: fps, Frontier: frontier}, maxSealedBytes)
	if err != nil {
		return fmt.Errorf("idemstream: two-phase %q: checkpoint %d: %w", t.name, k, err)
	}
	var adv []idem.Advance
	for p, o := range frontier {
		if o > t.frontier[p] {
			adv = append(adv, idem.Advance{Scope: t.fscope, Client: frontierClient(p), Seq: o})
		}
	}
	b := newBatch(t.st)
	b.Put(idem.Request{Scope: t.scope, ID: ckptID("c", k)}, rec, adv...)
	var enc eventRecordEncoder
	for _, c := range fresh {
		c.put(b, t.escope, t.opts.TTL, enc.encode(nil, k, c.ev.Partition, c.ev.Offset))
	}
	res, err := appendRun(context.WithoutCancel(ctx), b, t.bufs.res[:0])
	defer func() { t.bufs.res = keepResults(res) }()
	if err != nil {
		return err
	}
	for j := range res {
		if err := putErr(res[j]); err != nil {
			if j == 0 {
				return fmt.Errorf("checkpoint record: %w", err)
			}
			return fmt.Errorf("event %q: %w", fresh[j-1].ev.ID, err)
		}
	}
	return nil
}

// lookupBatch looks up every distinct event id of the batch and classifies
// each as claimEvent does, without writing anything: the outcomes of the
// events not to run (Replayed, Busy, Failed for an invalid event, a
// conflict or a corrupt record) and the fresh events, one per distinct id.
// Only this coordinator commits in its event scope (one per name and
// store), so an event absent here is still absent when the checkpoint is
// recorded. onFresh, if not nil, is called from this goroutine for each
// fresh event, in batch order, as soon as the lookups before it are
// classified; its error stops the lookups and is returned as it is, as
// is a lookup's (other than a conflict or a corrupt record), after which
// no more events are handed to onFresh.
//
// On an engine, whose lookups answer from memory, a batch of more than
// t.lookupChunk events is looked up by a helper goroutine, chunk by
// chunk, as this one prepares them (validates, finds the repeats,
// fingerprints) and then, once all are prepared, hands the fresh events
// of the chunks looked up to onFresh (the checkpoint's Invokes): the
// preparation and the Invokes both overlap the lookups, on two cores.
// The helper has ended when lookupBatch returns (or panics). On a store
// without batches the lookups run concurrently (network round trips) and
// onFresh is called after them.
func (t *TwoPhase[Txn]) lookupBatch(ctx context.Context, events []Event, onFresh func(*eventClaim) error) ([]Outcome, []*eventClaim, error) {
	outs := make([]Outcome, len(events))
	// byID is keyed by the events' own id bytes, not copies: events
	// outlive the map (it is cleared when the checkpoint ends).
	t.bufs.reset(len(events))
	byID, all := t.bufs.byID, t.bufs.all
	// order lists the distinct events in batch order, written at
	// order[n] by prepare; the helper reads the entries prepare has
	// handed over, never the slice header prepare changes.
	order := t.bufs.order[:len(events)]
	n := 0
	var fps fingerprints
	if !t.opts.NoFingerprint {
		fps.reserve(len(events))
	}
	// prepare takes the events up to end (from where the last call
	// stopped) and returns how many distinct ones there are so far.
	next := 0
	prepare := func(end int) int {
		for ; next < end; next++ {
			i := next
			ev := &events[i]
			if err := ev.validate(); err != nil {
				outs[i] = Outcome{Status: Failed, Err: err, Partition: ev.Partition, Offset: ev.Offset}
				continue
			}
			id := unsafe.String(unsafe.SliceData(ev.ID), len(ev.ID))
			if c := byID[id]; c != nil {
				if c.fp != nil {
					// A repeat with another payload is not the same event:
					// a conflict, as a redelivery of a committed id would be.
					if s := sha256.Sum256(ev.Payload); !bytes.Equal(s[:], c.fp) {
						outs[i] = Outcome{Status: Failed, Partition: ev.Partition, Offset: ev.Offset,
							Err: fmt.Errorf("%w: %s, event %q (partition %q, offset %d): repeats the event at partition %q, offset %d of the same batch with another payload",
								ErrConflict, t.who, ev.ID, ev.Partition, ev.Offset, c.ev.Partition, c.ev.Offset)}
						continue
					}
				}
				// Only this goroutine reads more, once the lookups are over.
				c.more = append(c.more, i)
				continue
			}
			c := &all[i]
			*c = eventClaim{ev: ev, first: i}
			if !t.opts.NoFingerprint {
				c.fp = fps.of(ev.Payload)
			}
			byID[id] = c
			order[n] = c
			n++
		}
		return n
	}
	// An engine's lookups hand their reads on to the Puts of the fresh
	// events (hints[j] for order[j]).
	hl, _ := t.st.(hintLookuper)
	var hints []idem.PutHint
	if hl != nil {
		if cap(t.bufs.hints) < len(events) {
			t.bufs.hints = make([]idem.PutHint, len(events))
		}
		hints = t.bufs.hints[:len(events)]
	}
	// lookup classifies order[j]: fresh, or its outcome (at its first
	// position) or error.
	lookup := func(j int) {
		c := order[j]
		var r idem.Result
		var err error
		if hl != nil {
			r, err = hl.LookupHint(ctx, c.req(t.escope, t.opts.TTL), &hints[j])
			if err == nil && r.Status == idem.Absent {
				c.hint = &hints[j]
			}
		} else {
			r, err = t.st.Lookup(ctx, c.req(t.escope, t.opts.TTL))
		}
		_, o, err := classifyEvent(r, err, t.escope, t.who, c.ev)
		c.err, c.fresh = err, err == nil && r.Status == idem.Absent
		if err == nil && !c.fresh {
			o.outbox = nil
			outs[c.first] = o
		}
	}
	// prefetch readies the store for the lookups of order[from:to]
	// (an engine: idem.Engine.Prefetch), from the goroutine that makes
	// them. It decides nothing.
	pf, _ := t.st.(prefetcher)
	prefetch := func(from, to int) {
		if pf == nil || hl == nil || to <= from {
			return
		}
		reqs := t.bufs.reqs[:0]
		for _, c := range order[from:to] {
			reqs = append(reqs, c.req(t.escope, t.opts.TTL))
		}
		pf.Prefetch(reqs)
		t.bufs.reqs = reqs
	}
	fresh := t.bufs.fresh
	// settle takes c's classification, in batch order: a failed event's
	// outcome, the end on an error, or a fresh event to hand on.
	settle := func(c *eventClaim) error {
		switch err := c.err; {
		case errors.Is(err, ErrConflict) || errors.Is(err, ErrCorruptRecord):
			outs[c.first] = Outcome{Status: Failed, Err: err, Partition: c.ev.Partition, Offset: c.ev.Offset}
		case err != nil:
			return err
		case c.fresh:
			fresh = append(fresh, c)
			if onFresh != nil {
				return onFresh(c)
			}
		}
		return nil
	}
	var err error
	if _, ok := t.st.(idem.Batcher); !ok {
		prepare(len(events))
		parallelN(n, 64, lookup)
		for _, c := range order[:n] {
			if err = settle(c); err != nil {
				break
			}
		}
	} else if chunk := t.lookupChunk; len(events) <= chunk || chunk <= 0 {
		// An embedded engine answers from memory: no goroutines.
		prepare(len(events))
		prefetch(0, n)
		for j, c := range order[:n] {
			lookup(j)
			if err = settle(c); err != nil {
				break
			}
		}
	} else {
		err = pipelineLookups(len(events), chunk, prepare, prefetch, lookup, func(j int) error { return settle(order[j]) })
	}
	// The buffers keep what this batch used (release clears it).
	t.bufs.order, t.bufs.fresh = order[:n], fresh
	if hints != nil {
		t.bufs.hints = hints[:n]
	}
	if err != nil {
		return nil, nil, err
	}
	for _, c := range order[:n] {
		if !c.fresh {
			for _, i := range c.more {
				outs[i] = outs[c.first]
			}
		}
	}
	return outs, fresh, nil
}

// defaultLookupChunk is TwoPhase.lookupChunk: small enough that the
// lookups and the Invokes start early, large enough that a hand-over (a
// channel send) is a small part of a chunk's lookups.
const defaultLookupChunk = 64

// pipelineLookups runs, for a batch of n events, prepare on this
// goroutine chunk by chunk (prepare(end) takes the events up to end and
// returns how many lookups they make so far), prefetch(from, end) and
// lookup(from..end-1) on a helper goroutine for each chunk prepared, and then settle(j) on this one, in
// order, for each j whose chunk is looked up; the first error of settle
// stops both and is returned. The helper has ended when it returns or
// panics (settle runs the caller's sink): the lookups write into the
// checkpoint's buffers.
func pipelineLookups(n, chunk int, prepare func(end int) int, prefetch func(from, to int), lookup func(int), settle func(int) error) error {
	chunks := (n + chunk - 1) / chunk
	// Neither channel ever blocks its sender: one message per chunk.
	ready := make(chan int, chunks) // lookups prepared so far
	done := make(chan int, chunks)  // lookups made so far
	var stop atomic.Bool
	go func() {
		defer close(done)
		j := 0
		for end := range ready {
			prefetch(j, end)
			for ; j < end; j++ {
				if stop.Load() {
					return
				}
				lookup(j)
			}
			done <- end
		}
	}()
	closed := false
	defer func() {
		stop.Store(true)
		if !closed {
			close(ready)
		}
		for range done {
		}
	}()
	for i := 0; i < n; i += chunk {
		ready <- prepare(min(i+chunk, n))
	}
	close(ready)
	closed = true
	j := 0
	for end := range done {
		for ; j < end; j++ {
			if err := settle(j); err != nil {
				return err
			}
		}
	}
	return nil
}

// finishUnfinished commits the sink's transaction of a recorded checkpoint
// (retrying). Its events are committed in idem already (with the
// checkpoint record); that the sink committed is recorded only by
// recovery ("d/<k>"): until the next checkpoint opens, a crash makes
// recovery call RecoverAndCommit, which is idempotent.
func (t *TwoPhase[Txn]) finishUnfinished(ctx context.Context) error {
	u := t.unfinished
	txn := u.txn.(Txn)
	var err error
	pause := 50 * time.Millisecond
	for try := 0; try <= t.opts.CommitRetries; try++ {
		if try > 0 {
			select {
			case <-time.After(pause):
			case <-ctx.Done():
				return fmt.Errorf("idemstream: two-phase %q: committing checkpoint %d: %w (last error: %v)", t.name, u.k, ctx.Err(), err)
			}
			pause *= 2
			err = t.sink.RecoverAndCommit(ctx, txn)
		} else if u.tried {
			err = t.sink.RecoverAndCommit(ctx, txn)
		} else {
			err = t.sink.Commit(ctx, txn)
		}
		if err == nil {
			break
		}
		t.log.Warn("idemstream: sink commit of a recorded checkpoint failed; retrying", "name", t.name, "checkpoint", u.k, "err", err)
	}
	u.tried = true
	if err != nil {
		return fmt.Errorf("idemstream: two-phase %q: the sink's commit of recorded checkpoint %d keeps failing (the next Checkpoint or recovery retries it): %w", t.name, u.k, err)
	}
	if err := t.hookAt(windowAfterSinkCommit, u.k); err != nil {
		return err
	}
	t.frontier = u.frontier
	t.unfinished = nil
	return nil
}
