package idemstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/idemdb/idem"
	"github.com/vmihailenco/msgpack/v5"
)

// TwoPhaseCommitSink is a transactional sink driven by checkpoints (the
// "plan B" of exactly-once stream processing, the protocol of Flink's
// TwoPhaseCommitSinkFunction). Txn is the sink's transaction handle; it
// is serialized with msgpack (exported fields) into the checkpoint, so
// after a crash the coordinator hands the recovered value to
// RecoverAndCommit or RecoverAndAbort.
//
// The coordinator calls, for checkpoint k: BeginTransaction(k), Invoke for
// each new event, PreCommit, then records the checkpoint with the handle,
// then Commit, then records that the sink committed, and only then lets
// the source acknowledge the events. Abort is called when a step before the
// checkpoint record fails.
//
// RecoverAndCommit must be idempotent: it may be called for a transaction
// that Commit already committed (a crash between the sink's commit and
// its record), and again if the recovery itself crashes. RecoverAndAbort
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
// for; recovery then calls AbortCheckpoint with its id. Without it such a
// transaction is left to the sink (it was never pre-committed, so nothing
// of it is visible; a sink expires it as Kafka does after
// transaction.timeout.ms).
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
	// RecoverAndCommit), "aborted" (it was not: RecoverAndAbort),
	// "finished" (it was already committed or aborted and recorded).
	Action string
	// EventsCommitted and EventsReleased count the events left in doubt
	// that recovery committed (part of the recovered checkpoint) or
	// released (they run again in a later checkpoint when redelivered).
	EventsCommitted, EventsReleased int
	// OrphanAborted: a transaction begun without a durable handle was
	// aborted through CheckpointAborter.
	OrphanAborted bool
}

// TwoPhase is the checkpoint coordinator of a TwoPhaseCommitSink, with idem
// as its durable log. One checkpoint runs at a time.
//
// Records (scope "idemstream.2pc/<name>"): sequence client "ckpt", number k,
// holds checkpoint k's handle as begun (and the frontier so far); id
// "c/<k>" holds the pre-committed handle, the event ids and the frontier
// (the checkpoint); "d/<k>" and "a/<k>" record that the sink committed or
// aborted it. Each event of the batch is claimed in the sink's event scope
// before it is invoked and committed after "d/<k>", so redeliveries of it
// are replayed, and a crash in between leaves it in doubt for recovery to
// settle with its checkpoint. All records are sealed (version, length,
// CRC-32C) and checked when read back.
type TwoPhase[Txn any] struct {
	st     idem.Store
	name   string
	scope  string // coordinator records
	escope string // events
	sink   TwoPhaseCommitSink[Txn]
	opts   TwoPhaseOptions
	log    *slog.Logger
	hook   func(window, uint64) error
	poison poisonCounters // counted by ConsumeTwoPhase

	mu         sync.Mutex
	last       uint64 // last checkpoint opened
	frontier   map[string]uint64
	unfinished *unfinishedCheckpoint
	closed     bool
}

type unfinishedCheckpoint struct {
	k        uint64
	txn      any // the Txn of the coordinator
	handle   []byte
	claims   []*eventClaim
	frontier map[string]uint64
	stage    int // 1: checkpoint recorded, sink not committed; 2: sink committed, not recorded
}

type eventClaim struct {
	ev    Event
	claim *idem.Claim
	idx   []int // positions in the batch (a batch may repeat an id)
}

type openRecord struct {
	K        uint64            `msgpack:"k"`
	Handle   []byte            `msgpack:"h"`
	Frontier map[string]uint64 `msgpack:"f"`
}

type checkpointRecord struct {
	K        uint64            `msgpack:"k"`
	Handle   []byte            `msgpack:"h"`
	Events   [][]byte          `msgpack:"e"`
	Frontier map[string]uint64 `msgpack:"f"`
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
	t := &TwoPhase[Txn]{st: st, name: name, scope: twoPhaseScope(name), escope: sinkScope(name), sink: sink, opts: opts, log: opts.Logger, frontier: map[string]uint64{}}
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

// record commits a sealed record under id (claiming it first, or with the
// given in-doubt claim).
func (t *TwoPhase[Txn]) record(ctx context.Context, id []byte, v any, c *idem.Claim) error {
	b, err := seal(v, maxSealedBytes)
	if err != nil {
		return fmt.Errorf("idemstream: two-phase %q: record %s: %w", t.name, id, err)
	}
	if c == nil {
		res, err := t.begin(ctx, idem.Request{Scope: t.scope, ID: id})
		if err != nil {
			return fmt.Errorf("idemstream: two-phase %q: record %s: %w", t.name, id, err)
		}
		if res.Status != idem.Fresh {
			return fmt.Errorf("idemstream: two-phase %q: record %s is already %v", t.name, id, res.Status)
		}
		c = res.Claim
	}
	if err := c.Commit(ctx, b); err != nil {
		return fmt.Errorf("idemstream: two-phase %q: record %s: %w", t.name, id, err)
	}
	return nil
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
	events := map[string]*idem.Claim{}
	markers := map[string]*idem.Claim{}
	for _, d := range evDoubts {
		events[string(d.ID)] = d.Claim
	}
	for _, d := range doubts {
		switch {
		case d.Client == ckptClient:
			// Checkpoint d.Seq was being opened: its handle never
			// became durable.
			if err := d.Claim.Abort(ctx); err != nil {
				return rep, fmt.Errorf("idemstream: two-phase %q: releasing the open of checkpoint %d: %w", t.name, d.Seq, err)
			}
			if a, ok := any(t.sink).(CheckpointAborter); ok {
				if err := a.AbortCheckpoint(ctx, d.Seq); err != nil {
					return rep, fmt.Errorf("idemstream: two-phase %q: aborting checkpoint %d begun without a handle: %w", t.name, d.Seq, err)
				}
				rep.OrphanAborted = true
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
	// committedEvents lists the events of the last checkpoint if it is
	// committed; the frontier is that of the last finished checkpoint.
	var committedEvents map[string]bool
	finish := func(commit bool, frontier map[string]uint64, listed [][]byte) {
		if commit {
			committedEvents = map[string]bool{}
			for _, id := range listed {
				committedEvents[string(id)] = true
			}
		}
		if frontier != nil {
			t.frontier = frontier
		}
	}
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
		var ckpt checkpointRecord
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
		switch {
		case hasDone:
			rep.Action = "finished"
			if !hasCkpt {
				return rep, fmt.Errorf("%w: two-phase %q: checkpoint %d is marked committed but its record is missing", ErrCorruptRecord, t.name, k)
			}
			finish(true, done.Frontier, ckpt.Events)
		case hasAborted:
			rep.Action = "finished"
			finish(false, aborted.Frontier, nil)
		case hasCkpt:
			// The checkpoint with the handle is durable: the sink must
			// commit it (again: RecoverAndCommit is idempotent).
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
			if err := t.record(ctx, ckptID("d", k), &markerRecord{K: k, Frontier: ckpt.Frontier}, markers[string(ckptID("d", k))]); err != nil {
				return rep, err
			}
			rep.Action = "committed"
			t.log.Info("idemstream: recovered and committed checkpoint", "name", t.name, "checkpoint", k, "events", len(ckpt.Events))
			finish(true, ckpt.Frontier, ckpt.Events)
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
			if err := t.record(ctx, ckptID("a", k), &markerRecord{K: k, Frontier: open.Frontier}, markers[string(ckptID("a", k))]); err != nil {
				return rep, err
			}
			rep.Action = "aborted"
			t.log.Info("idemstream: recovered and aborted checkpoint (not recorded before the crash)", "name", t.name, "checkpoint", k)
			finish(false, open.Frontier, nil)
		default:
			return rep, fmt.Errorf("%w: two-phase %q: checkpoint %d has no record", ErrCorruptRecord, t.name, k)
		}
	}
	// Settle the events left in doubt: those of a committed checkpoint
	// are committed, every other one is released (its transaction was
	// aborted or it never reached one) and runs again when redelivered.
	var toCommit, toAbort []func() error
	for id, c := range events {
		if committedEvents[id] {
			rec := &eventRecord{Checkpoint: k}
			b, err := encodeEventRecord(rec)
			if err != nil {
				return rep, err
			}
			toCommit = append(toCommit, func() error { return c.Commit(ctx, b) })
			rep.EventsCommitted++
		} else {
			toAbort = append(toAbort, func() error { return c.Abort(ctx) })
			rep.EventsReleased++
		}
	}
	if err := parallel(append(toCommit, toAbort...)); err != nil {
		return rep, fmt.Errorf("idemstream: two-phase %q: settling in-doubt events: %w", t.name, err)
	}
	t.dropPrevious(ctx, k)
	return rep, nil
}

// parallel runs fns with up to 256 goroutines (so that their engine
// records share group commits) and returns the first error.
func parallel(fns []func() error) error {
	if len(fns) == 1 {
		return fns[0]()
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	sem := make(chan struct{}, 256)
	for _, fn := range fns {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if err := fn(); err != nil {
				mu.Lock()
				if first == nil {
					first = err
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return first
}

// Checkpoint runs one checkpoint over a batch of events: each event is
// claimed (a redelivery of a committed one is Replayed, one in progress
// elsewhere is Busy), the new ones are invoked into a transaction begun
// for the checkpoint, which is pre-committed, recorded with its handle,
// committed, and recorded as committed; then the events are committed.
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
	outs, fresh, err := t.claimBatch(ctx, events)
	if err != nil || len(fresh) == 0 {
		return outs, err
	}
	releaseAll := func() { t.release(ctx, fresh) }
	// The sink's calls get ctx; the coordinator's records are written even
	// if ctx ends meanwhile (t.begin), so that a shutdown finishes or
	// aborts the checkpoint in progress rather than leaving its outcome
	// unknown.
	// Open checkpoint k: its handle is durable before any Invoke.
	k := t.last + 1
	res, err := t.begin(ctx, idem.Request{Scope: t.scope, Client: ckptClient, Seq: k})
	if err != nil || res.Status != idem.Fresh {
		releaseAll()
		if err == nil {
			err = fmt.Errorf("status %v", res.Status)
		}
		return nil, fmt.Errorf("idemstream: two-phase %q: opening checkpoint %d: %w", t.name, k, err)
	}
	openClaim := res.Claim
	t.last = k
	txn, err := t.sink.BeginTransaction(ctx, k)
	if err != nil {
		_ = openClaim.Abort(ctx)
		t.last = k - 1
		releaseAll()
		return nil, fmt.Errorf("idemstream: two-phase %q: BeginTransaction(%d): %w", t.name, k, err)
	}
	frontier := make(map[string]uint64, len(t.frontier)+1)
	for p, o := range t.frontier {
		frontier[p] = o
	}
	abortTxn := func(cause error) error {
		// The sink's Abort must run to the end even on a shutdown (it is
		// the caller's system, not an idem claim).
		if err := t.sink.Abort(context.WithoutCancel(ctx), txn); err != nil {
			t.log.Warn("idemstream: sink abort failed", "name", t.name, "checkpoint", k, "err", err)
		}
		releaseAll()
		if err := t.record(ctx, ckptID("a", k), &markerRecord{K: k, Frontier: t.frontier}, nil); err != nil {
			// Without the record, recovery must settle checkpoint k
			// (from its opening record) before another one opens.
			t.closed = true
			return fmt.Errorf("%w: %v (and recording the abort: %v)", ErrNeedsRecovery, cause, err)
		}
		t.dropPrevious(ctx, k)
		return cause
	}
	handle, err := t.encodeHandle(txn)
	if err == nil {
		var b []byte
		b, err = seal(&openRecord{K: k, Handle: handle, Frontier: frontier}, maxSealedBytes)
		if err == nil {
			err = openClaim.Commit(ctx, b)
		}
	}
	if err != nil {
		_ = openClaim.Abort(ctx)
		_ = t.sink.Abort(context.WithoutCancel(ctx), txn)
		releaseAll()
		t.last = k - 1
		return nil, fmt.Errorf("idemstream: two-phase %q: recording checkpoint %d's transaction: %w", t.name, k, err)
	}

	for _, c := range fresh {
		if err := t.sink.Invoke(ctx, txn, c.ev); err != nil {
			return nil, abortTxn(fmt.Errorf("idemstream: two-phase %q: checkpoint %d: Invoke: %w", t.name, k, &EventError{ID: c.ev.ID, Err: err}))
		}
		if c.ev.Offset > frontier[c.ev.Partition] {
			frontier[c.ev.Partition] = c.ev.Offset
		}
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
	// The checkpoint: pre-committed handle, events, frontier.
	handle, err = t.encodeHandle(txn)
	if err != nil {
		return nil, abortTxn(err)
	}
	ids := make([][]byte, len(fresh))
	for j, c := range fresh {
		ids[j] = c.ev.ID
	}
	b, err := seal(&checkpointRecord{K: k, Handle: handle, Events: ids, Frontier: frontier}, maxSealedBytes)
	if err != nil {
		return nil, abortTxn(fmt.Errorf("idemstream: two-phase %q: checkpoint %d: %w", t.name, k, err))
	}
	res, err = t.begin(ctx, idem.Request{Scope: t.scope, ID: ckptID("c", k)})
	if err != nil || res.Status != idem.Fresh {
		if err == nil {
			err = fmt.Errorf("status %v", res.Status)
		}
		return nil, abortTxn(fmt.Errorf("idemstream: two-phase %q: recording checkpoint %d: %w", t.name, k, err))
	}
	if err := res.Claim.Commit(ctx, b); err != nil {
		// Whether the record is durable is unknown: only recovery may
		// decide between commit and abort now.
		t.closed = true
		return nil, fmt.Errorf("%w: two-phase %q: recording checkpoint %d failed: %v", ErrNeedsRecovery, t.name, k, err)
	}
	if err := t.hookAt(windowAfterCheckpoint, k); err != nil {
		return nil, err
	}
	t.unfinished = &unfinishedCheckpoint{k: k, txn: txn, handle: handle, claims: fresh, frontier: frontier, stage: 1}
	if err := t.finishUnfinished(ctx); err != nil {
		return nil, err
	}
	for _, c := range fresh {
		for _, i := range c.idx {
			outs[i] = Outcome{Status: Applied, Partition: c.ev.Partition, Offset: c.ev.Offset, Checkpoint: k}
		}
	}
	if err := t.hookAt(windowBeforeAck, k); err != nil {
		return nil, err
	}
	return outs, nil
}

// claimBatch claims every distinct event id of the batch (concurrently,
// so that the claims share group commits) and classifies each as
// claimEvent does: the outcomes of the events not to run (Replayed, Busy,
// Failed for an invalid event, a conflict or a corrupt record) and the
// fresh claims, one per distinct id. A store error releases the fresh
// claims and fails the batch.
func (t *TwoPhase[Txn]) claimBatch(ctx context.Context, events []Event) ([]Outcome, []*eventClaim, error) {
	outs := make([]Outcome, len(events))
	byID := map[string]*eventClaim{}
	var order []*eventClaim
	for i := range events {
		ev := events[i]
		if err := ev.validate(); err != nil {
			outs[i] = Outcome{Status: Failed, Err: err, Partition: ev.Partition, Offset: ev.Offset}
			continue
		}
		if c := byID[string(ev.ID)]; c != nil {
			c.idx = append(c.idx, i)
			continue
		}
		c := &eventClaim{ev: ev, idx: []int{i}}
		byID[string(ev.ID)] = c
		order = append(order, c)
	}
	who := fmt.Sprintf("two-phase %q", t.name)
	res := make([]Outcome, len(order))
	errs := make([]error, len(order))
	fns := make([]func() error, len(order))
	for j, c := range order {
		fns[j] = func() error {
			req := eventRequest(t.escope, &c.ev, t.opts.NoFingerprint, t.opts.TTL)
			c.claim, res[j], errs[j] = claimEvent(ctx, t.st, req, who, &c.ev)
			return nil
		}
	}
	_ = parallel(fns)
	var fresh []*eventClaim
	var storeErr error
	for j, c := range order {
		o := res[j]
		switch err := errs[j]; {
		case errors.Is(err, ErrConflict) || errors.Is(err, ErrCorruptRecord):
			o = Outcome{Status: Failed, Err: err, Partition: c.ev.Partition, Offset: c.ev.Offset}
		case err != nil:
			storeErr = err
			continue
		case c.claim != nil:
			fresh = append(fresh, c)
			continue
		}
		o.outbox = nil
		for _, i := range c.idx {
			outs[i] = o
		}
	}
	if storeErr != nil {
		t.release(ctx, fresh)
		return nil, nil, storeErr
	}
	return outs, fresh, nil
}

// release aborts the fresh claims of a checkpoint that does not go on.
func (t *TwoPhase[Txn]) release(ctx context.Context, fresh []*eventClaim) {
	fns := make([]func() error, len(fresh))
	for j, c := range fresh {
		fns[j] = func() error { return c.claim.Abort(ctx) }
	}
	_ = parallel(fns)
}

// begin claims a coordinator record. It is taken even when ctx has ended:
// once a checkpoint has started, its records (open, checkpoint, commit or
// abort mark) must be written, never refused half way. Their Commit and
// Abort need no such help: a claim's finish is written whatever ctx says.
func (t *TwoPhase[Txn]) begin(ctx context.Context, req idem.Request) (idem.Result, error) {
	return t.st.Begin(context.WithoutCancel(ctx), req)
}

// finishUnfinished commits the sink's transaction of a recorded checkpoint
// (retrying), records it, commits its events and drops the previous
// checkpoint's records.
func (t *TwoPhase[Txn]) finishUnfinished(ctx context.Context) error {
	u := t.unfinished
	txn := u.txn.(Txn)
	if u.stage == 1 {
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
			} else {
				err = t.sink.Commit(ctx, txn)
			}
			if err == nil {
				break
			}
			t.log.Warn("idemstream: sink commit of a recorded checkpoint failed; retrying", "name", t.name, "checkpoint", u.k, "err", err)
		}
		if err != nil {
			return fmt.Errorf("idemstream: two-phase %q: the sink's commit of recorded checkpoint %d keeps failing (the next Checkpoint or recovery retries it): %w", t.name, u.k, err)
		}
		if err := t.hookAt(windowAfterSinkCommit, u.k); err != nil {
			return err
		}
		u.stage = 2
	}
	if err := t.record(ctx, ckptID("d", u.k), &markerRecord{K: u.k, Frontier: u.frontier}, nil); err != nil {
		t.closed = true
		return fmt.Errorf("%w: %v", ErrNeedsRecovery, err)
	}
	rec, err := encodeEventRecord(&eventRecord{Checkpoint: u.k})
	if err != nil {
		return err
	}
	fns := make([]func() error, 0, len(u.claims))
	for _, c := range u.claims {
		b := rec
		if c.ev.Offset != 0 || c.ev.Partition != "" {
			b, err = encodeEventRecord(&eventRecord{Checkpoint: u.k, Partition: c.ev.Partition, Offset: c.ev.Offset})
			if err != nil {
				return err
			}
		}
		fns = append(fns, func() error { return c.claim.Commit(ctx, b) })
	}
	if err := parallel(fns); err != nil {
		t.closed = true
		return fmt.Errorf("%w: two-phase %q: committing the events of checkpoint %d: %v", ErrNeedsRecovery, t.name, u.k, err)
	}
	t.frontier = u.frontier
	t.unfinished = nil
	t.dropPrevious(ctx, u.k)
	return nil
}

// dropPrevious removes the records of checkpoint k-1 once k is finished:
// recovery only ever reads the last checkpoint's.
func (t *TwoPhase[Txn]) dropPrevious(ctx context.Context, k uint64) {
	if k <= 1 {
		return
	}
	prev := k - 1
	if err := t.st.Ack(ctx, t.scope, ckptID("c", prev), ckptID("d", prev), ckptID("a", prev)); err != nil {
		t.log.Warn("idemstream: dropping the previous checkpoint's records failed", "name", t.name, "checkpoint", prev, "err", err)
	}
}
