package idemstream

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemdb/idem"
)

// Handler runs an event's effect and returns what to commit with it.
type Handler func(ctx context.Context, ev Event) (Effect, error)

// InDoubtEvent is an event whose claim a crash left in flight: the effect
// may or may not have happened. SinkOptions.Recover decides.
type InDoubtEvent struct {
	ID          []byte
	Fingerprint []byte // SHA-256 of the payload (nil with NoFingerprint)
	ClaimedAt   time.Time
}

// Resolution is Recover's answer for an event left in doubt.
type Resolution struct {
	// Applied: the effect happened. The event is committed with Result
	// (and Outbox), so redeliveries replay it. Otherwise the claim is
	// released and the next delivery runs the effect.
	Applied bool
	Result  []byte
	Outbox  []OutboxMessage
	// Partition and Offset, if known, are committed with the event.
	Partition string
	Offset    uint64
}

// SinkOptions configure a Sink.
type SinkOptions struct {
	// TTL is how long an event's dedup entry (and its stored result) is
	// kept after the event is claimed: a redelivery after that runs the
	// effect again. Zero keeps entries until the engine's Retention or
	// an administrator's Forget removes them. Each sink has its own TTL on
	// an engine opened with default options.
	TTL time.Duration
	// Recover resolves events a crash left in doubt between their claim
	// and their commit, when NewSink runs: the effect's target says
	// whether the effect happened (for example the ledger has a row with
	// the event id). Nil releases every such claim, so the effect runs
	// again on redelivery: exactly once only if the handler's effects are
	// all in its Effect (result and outbox), at least once otherwise.
	Recover func(ctx context.Context, ev InDoubtEvent) (Resolution, error)
	// Outbox receives the events' outbox messages. Required if a handler
	// returns any.
	Outbox *Outbox
	// MaxRecordSize bounds an event's committed record (result, outbox and
	// position; default 1 MiB, at most the engine's MaxReplySize).
	MaxRecordSize int
	// NoFingerprint turns off the payload check: by default a redelivery
	// of a committed id with a different payload is ErrConflict.
	NoFingerprint bool
	// Logger receives recovery decisions and warnings. Default: discard.
	Logger *slog.Logger
}

// Sink is the idempotent sink (the "plan A" of exactly-once stream
// processing): it runs each event's effect at most once per stable event
// id, commits the result, the event's position and its outbox messages in
// one idem record, and replays the stored result for redeliveries. It also
// keeps the per-partition commit frontier. Safe for concurrent use.
type Sink struct {
	st     idem.Store
	name   string
	scope  string
	fscope string
	opts   SinkOptions
	log    *slog.Logger
	hook   func(window, *Event) error // fault injection (tests)
	closed atomic.Bool

	applied, replayed, busy, failed      atomic.Uint64
	recoveredCommitted, recoveredAborted atomic.Uint64
	frontierWrites                       atomic.Uint64
	poison                               poisonCounters // counted by Consume
}

// SinkStats are a sink's counters since NewSink.
type SinkStats struct {
	Applied, Replayed, Busy, Failed uint64
	// RecoveredCommitted and RecoveredAborted count the events left in
	// doubt by a crash that NewSink committed (Recover said applied) or
	// released.
	RecoveredCommitted, RecoveredAborted uint64
	// FrontierWrites counts the records that carried a partition's
	// frontier: every commit of an event with an offset (the frontier
	// goes with the effect), and advances past replayed deliveries found
	// at a higher offset.
	FrontierWrites uint64
	// Retried, Terminated and DeadLettered count what Consume did with
	// the deliveries that failed: handed back for a redelivery (Nak);
	// ended without their effect (Term: failed for good, or at
	// ConsumeOptions.MaxDeliveries); of those, handed to the source's
	// dead-letter destination.
	Retried, Terminated, DeadLettered uint64
}

func sinkScope(name string) string     { return "idemstream/" + name }
func frontierScope(name string) string { return "idemstream.frontier/" + name }
func frontierClient(p string) string   { return "p:" + p }

var (
	namesMu sync.Mutex
	names   = map[idem.Store]map[string]bool{}
)

// takeName reserves kind/name on st: one component of a name per store.
func takeName(st idem.Store, kind, name string) error {
	if st == nil {
		return fmt.Errorf("idemstream: %s %q: nil store", kind, name)
	}
	if t := reflect.TypeOf(st); !t.Comparable() {
		return fmt.Errorf("idemstream: %s %q: a store of type %v cannot be told apart from another (not comparable): pass a pointer", kind, name, t)
	}
	if name == "" || len(name) > 200 || strings.ContainsAny(name, "/\x00") {
		return fmt.Errorf("idemstream: invalid %s name %q: 1-200 bytes, no '/' or NUL", kind, name)
	}
	namesMu.Lock()
	defer namesMu.Unlock()
	m := names[st]
	if m == nil {
		m = map[string]bool{}
		names[st] = m
	}
	k := kind + "/" + name
	if m[k] {
		return fmt.Errorf("%w: %s %q", ErrInUse, kind, name)
	}
	m[k] = true
	return nil
}

func releaseName(st idem.Store, kind, name string) {
	namesMu.Lock()
	defer namesMu.Unlock()
	delete(names[st], kind+"/"+name)
	if len(names[st]) == 0 {
		delete(names, st)
	}
}

// NewSink opens the idempotent sink name on st (one per name and store;
// opts nil: the defaults) and resolves what a crash left in doubt:
// in-doubt events go to opts.Recover.
func NewSink(ctx context.Context, st idem.Store, name string, opts *SinkOptions) (*Sink, error) {
	var o SinkOptions
	if opts != nil {
		o = *opts
	}
	if o.TTL < 0 {
		return nil, fmt.Errorf("idemstream: sink %q: SinkOptions.TTL %v is negative", name, o.TTL)
	}
	if o.MaxRecordSize < 0 {
		return nil, fmt.Errorf("idemstream: sink %q: SinkOptions.MaxRecordSize %d is negative", name, o.MaxRecordSize)
	}
	if o.MaxRecordSize == 0 {
		o.MaxRecordSize = 1 << 20
	}
	if err := takeName(st, "sink", name); err != nil {
		return nil, err
	}
	s := newSink(st, name, o)
	if err := s.recover(ctx); err != nil {
		releaseName(st, "sink", name)
		return nil, err
	}
	return s, nil
}

// newSink is the sink of checked options, before recovery.
func newSink(st idem.Store, name string, opts SinkOptions) *Sink {
	s := &Sink{st: st, name: name, scope: sinkScope(name), fscope: frontierScope(name), opts: opts, log: opts.Logger}
	if s.log == nil {
		s.log = discardLogger()
	}
	return s
}

// Name returns the sink's name.
func (s *Sink) Name() string { return s.name }

// Close releases the sink's name. It does not close the engine.
func (s *Sink) Close() error {
	if s.closed.CompareAndSwap(false, true) {
		releaseName(s.st, "sink", s.name)
	}
	return nil
}

// inDoubt lists the claims in doubt in scope exactly (InDoubt takes a
// prefix: "idemstream/a" also names the scope of a sink "ab").
func inDoubt(ctx context.Context, st idem.Store, scope string) ([]idem.InDoubtClaim, error) {
	all, err := st.InDoubt(ctx, scope)
	if err != nil {
		return nil, fmt.Errorf("listing the claims in doubt in %q: %w", scope, err)
	}
	ds := all[:0]
	for _, d := range all {
		if d.Scope == scope {
			ds = append(ds, d)
		}
	}
	return ds, nil
}

func (s *Sink) recover(ctx context.Context) error {
	// Frontiers are advanced inside event commits, never claimed: a claim
	// here was left by a version that recorded the frontier in records of
	// its own. Release it; the frontier is at least what that version had
	// committed.
	old, err := inDoubt(ctx, s.st, s.fscope)
	if err != nil {
		return fmt.Errorf("idemstream: sink %q: %w", s.name, err)
	}
	for _, d := range old {
		s.log.Warn("idemstream: released a frontier claim left by an earlier version", "sink", s.name, "client", d.Client, "seq", d.Seq)
		if err := d.Claim.Abort(ctx); err != nil {
			return fmt.Errorf("idemstream: sink %q: releasing frontier claim %s/%d: %w", s.name, d.Client, d.Seq, err)
		}
	}
	doubts, err := inDoubt(ctx, s.st, s.scope)
	if err != nil {
		return fmt.Errorf("idemstream: sink %q: %w", s.name, err)
	}
	for _, d := range doubts {
		if err := s.hookAt(windowDuringRecovery, nil); err != nil {
			return err
		}
		if err := s.resolve(ctx, d); err != nil {
			return err
		}
	}
	return nil
}

func (s *Sink) resolve(ctx context.Context, d idem.InDoubtClaim) error {
	if s.opts.Recover == nil {
		s.log.Warn("idemstream: event left in doubt by a crash released: it runs again when redelivered", "sink", s.name, "id", string(d.ID))
		if err := d.Claim.Abort(ctx); err != nil {
			return fmt.Errorf("idemstream: sink %q: releasing in-doubt event %q: %w", s.name, d.ID, err)
		}
		s.recoveredAborted.Add(1)
		return nil
	}
	r, err := s.opts.Recover(ctx, InDoubtEvent{ID: d.ID, Fingerprint: d.Fingerprint, ClaimedAt: d.ClaimedAt})
	if err != nil {
		return fmt.Errorf("idemstream: sink %q: recovering in-doubt event %q: %w", s.name, d.ID, err)
	}
	if !r.Applied {
		if err := d.Claim.Abort(ctx); err != nil {
			return fmt.Errorf("idemstream: sink %q: releasing in-doubt event %q: %w", s.name, d.ID, err)
		}
		s.recoveredAborted.Add(1)
		s.log.Info("idemstream: in-doubt event had not run; released", "sink", s.name, "id", string(d.ID))
		return nil
	}
	rec := &eventRecord{Result: r.Result, Partition: r.Partition, Offset: r.Offset, Outbox: r.Outbox}
	b, err := s.encode(rec, d.ID)
	if err != nil {
		return err
	}
	if len(r.Outbox) > 0 && s.opts.Outbox == nil {
		return fmt.Errorf("idemstream: sink %q: in-doubt event %q has outbox messages and the sink has no Outbox", s.name, d.ID)
	}
	if err := s.commit(ctx, d.Claim, b, r.Partition, r.Offset); err != nil {
		return fmt.Errorf("idemstream: sink %q: committing in-doubt event %q: %w", s.name, d.ID, err)
	}
	s.recoveredCommitted.Add(1)
	s.log.Info("idemstream: in-doubt event had run; committed", "sink", s.name, "id", string(d.ID))
	if len(r.Outbox) > 0 {
		if err := s.opts.Outbox.register(ctx, s.name, d.ID, r.Outbox); err != nil {
			return err
		}
	}
	return nil
}

func (s *Sink) hookAt(w window, ev *Event) error {
	if s.hook != nil {
		return s.hook(w, ev)
	}
	return nil
}

func (s *Sink) encode(rec *eventRecord, id []byte) ([]byte, error) {
	b, err := encodeEventRecord(rec)
	if err != nil {
		return nil, fmt.Errorf("idemstream: sink %q: encoding the record of event %q: %w", s.name, id, err)
	}
	if len(b) > s.opts.MaxRecordSize {
		return nil, fmt.Errorf("%w: sink %q: event %q: record of %d bytes (result %d bytes, %d outbox messages), bound %d", ErrTooLarge, s.name, id, len(b), len(rec.Result), len(rec.Outbox), s.opts.MaxRecordSize)
	}
	return b, nil
}

// Apply runs h for ev unless the event's id was committed before, in which
// case the stored result is returned (Replayed) and h does not run. The
// event is claimed durably first, then h runs, then its result, position
// and outbox messages are committed in one record; h's error (or panic)
// releases the claim, so a redelivery runs it again. Busy means another
// delivery of the id is in progress: do not acknowledge this one.
//
// Once h has returned, the commit is written whatever ctx says (the
// store's Claim contract): a ctx cancelled meanwhile never strands the
// event in flight.
//
// Acknowledge the delivery to the source only once Apply returned an
// Ackable status: acknowledging earlier is the window where an effect can
// be lost.
func (s *Sink) Apply(ctx context.Context, ev Event, h Handler) (out Outcome, err error) {
	if s.closed.Load() {
		return Outcome{}, ErrClosed
	}
	if err := ev.validate(); err != nil {
		return Outcome{}, err
	}
	req := eventRequest(s.scope, &ev, s.opts.NoFingerprint, s.opts.TTL)
	claim, out, err := claimEvent(ctx, s.st, req, fmt.Sprintf("sink %q", s.name), &ev)
	if err != nil {
		s.failed.Add(1)
		return Outcome{}, err
	}
	switch out.Status {
	case Replayed:
		if len(out.outbox) > 0 {
			// The delivery that committed may have crashed before it
			// registered the messages: register again (idempotent).
			if s.opts.Outbox == nil {
				s.failed.Add(1)
				return Outcome{}, fmt.Errorf("idemstream: sink %q: event %q has outbox messages and the sink has no Outbox", s.name, ev.ID)
			}
			if err := s.opts.Outbox.register(ctx, s.name, ev.ID, out.outbox); err != nil {
				s.failed.Add(1)
				return Outcome{}, err
			}
			out.outbox = nil
		}
		if err := s.advanceReplayed(ctx, &ev); err != nil {
			s.failed.Add(1)
			return Outcome{}, err
		}
		s.replayed.Add(1)
		return out, nil
	case Busy:
		s.busy.Add(1)
		return out, nil
	}
	expiresAt := out.ExpiresAt
	finished := false
	defer func() {
		if !finished {
			// h panicked, or a step failed before the commit: release.
			_ = claim.Abort(ctx)
			s.failed.Add(1)
		}
	}()
	if err := s.hookAt(windowAfterClaim, &ev); err != nil {
		finished = true // a simulated crash leaves the claim in doubt
		return Outcome{}, err
	}
	eff, err := h(ctx, ev)
	if err != nil {
		return Outcome{}, fmt.Errorf("idemstream: sink %q: event %q (partition %q, offset %d): %w", s.name, ev.ID, ev.Partition, ev.Offset, err)
	}
	if len(eff.Outbox) > 0 && s.opts.Outbox == nil {
		return Outcome{}, fmt.Errorf("idemstream: sink %q: event %q: the handler returned outbox messages and the sink has no Outbox", s.name, ev.ID)
	}
	rec := &eventRecord{Result: eff.Result, Partition: ev.Partition, Offset: ev.Offset, Outbox: eff.Outbox}
	b, err := s.encode(rec, ev.ID)
	if err != nil {
		return Outcome{}, err
	}
	if err := s.hookAt(windowAfterEffect, &ev); err != nil {
		finished = true
		return Outcome{}, err
	}
	finished = true
	if err := s.commit(ctx, claim, b, ev.Partition, ev.Offset); err != nil {
		s.failed.Add(1)
		return Outcome{}, fmt.Errorf("idemstream: sink %q: committing event %q: %w", s.name, ev.ID, err)
	}
	if err := s.hookAt(windowAfterCommit, &ev); err != nil {
		return Outcome{}, err
	}
	if len(eff.Outbox) > 0 {
		if err := s.opts.Outbox.register(ctx, s.name, ev.ID, eff.Outbox); err != nil {
			return Outcome{}, err
		}
	}
	s.applied.Add(1)
	return Outcome{Status: Applied, Result: eff.Result, Partition: ev.Partition, Offset: ev.Offset, ExpiresAt: expiresAt}, nil
}

// Lookup reports whether the event id is committed, and its record, without
// claiming it.
func (s *Sink) Lookup(id []byte) (Outcome, bool, error) {
	res, err := s.st.Lookup(context.Background(), idem.Request{Scope: s.scope, ID: id})
	if err != nil {
		return Outcome{}, false, err
	}
	switch res.Status {
	case idem.Done:
		rec, err := decodeEventRecord(s.scope, id, res.Reply)
		if err != nil {
			return Outcome{}, false, err
		}
		return Outcome{Status: Replayed, Result: rec.Result, Partition: rec.Partition, Offset: rec.Offset, Checkpoint: rec.Checkpoint, ExpiresAt: res.ExpiresAt}, true, nil
	case idem.InFlight:
		return Outcome{Status: Busy, BusyUntil: res.LeaseUntil}, false, nil
	}
	return Outcome{}, false, nil
}

// Stats returns the sink's counters.
func (s *Sink) Stats() SinkStats {
	return SinkStats{
		Applied: s.applied.Load(), Replayed: s.replayed.Load(), Busy: s.busy.Load(), Failed: s.failed.Load(),
		RecoveredCommitted: s.recoveredCommitted.Load(), RecoveredAborted: s.recoveredAborted.Load(),
		FrontierWrites: s.frontierWrites.Load(),
		Retried:        s.poison.retried.Load(), Terminated: s.poison.terminated.Load(), DeadLettered: s.poison.deadLettered.Load(),
	}
}

// commit commits the event's record and, when the event has a position,
// raises its partition's frontier in the same engine record.
func (s *Sink) commit(ctx context.Context, c *idem.Claim, rec []byte, partition string, offset uint64) error {
	if offset == 0 {
		return c.Commit(ctx, rec)
	}
	err := c.CommitAdvance(ctx, rec, idem.Advance{Scope: s.fscope, Client: frontierClient(partition), Seq: offset})
	if err == nil {
		s.frontierWrites.Add(1)
	}
	return err
}

// advanceReplayed moves the frontier past a replayed delivery: its event
// was committed by an earlier record, perhaps at a lower offset (the same
// event published again). Nothing is written when the frontier is there
// already, as it is for a plain redelivery.
func (s *Sink) advanceReplayed(ctx context.Context, ev *Event) error {
	if ev.Offset == 0 {
		return nil
	}
	client := frontierClient(ev.Partition)
	n, err := s.st.ClientState(ctx, s.fscope, client)
	if err == nil && n < ev.Offset {
		if err = s.st.Advance(ctx, idem.Advance{Scope: s.fscope, Client: client, Seq: ev.Offset}); err == nil {
			s.frontierWrites.Add(1)
		}
	}
	if err != nil {
		return fmt.Errorf("idemstream: sink %q: advancing the frontier of partition %q past replayed event %q (offset %d): %w", s.name, ev.Partition, ev.ID, ev.Offset, err)
	}
	return nil
}

// Frontier returns the partition's commit frontier: the highest offset
// whose event's effect is committed (ok false if none). It is raised in
// the very engine record that commits each event, so after a crash it is
// exactly the highest committed offset: never ahead of an effect, never
// behind one. A consumer that resumes from positions (a Kafka-style
// partition reader) resumes at Frontier+1.
//
// It is the highest committed offset, not the end of a contiguous run:
// with Consume applying a batch's events concurrently, an event below the
// frontier may have failed (its handler returned an error) and is then
// not committed. Brokers that track unacknowledged messages (JetStream,
// Redis Streams) redeliver it regardless; a source that resumes from the
// frontier alone should apply each partition's events in order
// (ConsumeOptions.Concurrency 1, or one consumer per partition).
func (s *Sink) Frontier(partition string) (offset uint64, ok bool, err error) {
	n, err := s.st.ClientState(context.Background(), s.fscope, frontierClient(partition))
	if err != nil {
		return 0, false, fmt.Errorf("idemstream: sink %q: frontier of partition %q: %w", s.name, partition, err)
	}
	return n, n > 0, nil
}

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// applyBatch is Apply for a batch of events (Consume's path): the
// events are claimed in one batch (one record on a Batcher), the
// handler runs for the fresh ones (up to conc at once), and their
// commits, each raising its partition's frontier as Apply's does, go
// with the releases of the failed ones and the frontier advances of
// replayed ones in a second batch. It returns each event's outcome or
// error, as Apply would have.
func (s *Sink) applyBatch(ctx context.Context, evs []Event, h Handler, conc int) ([]Outcome, []error) {
	sb := &sinkBatch{evs: evs}
	s.startBatch(sb, ctx, h, conc)
	return sb.finish()
}

// sinkBatch is a batch of applyBatch between its two steps: claimed, its
// handlers run, its commits not written. Consume reuses one for every
// other batch: startBatch keeps its buffers (all but outs, which the
// caller keeps) and finish drops what they point to.
type sinkBatch struct {
	s        *Sink
	ctx      context.Context
	evs      []Event
	outs     []Outcome
	errs     []error
	fresh    []freshEvent
	replayed []int
	finished bool // nothing left to write (the claims failed)

	// Buffers of the two steps.
	items    []int              // claims batch item -> event
	advs     []idem.Advance     // the commits' advances
	finItems []*freshEvent      // finish batch item -> fresh event
	res      []idem.BatchResult // either batch's results (appendRun), cleared after use
}

// freshEvent is a claimed event of a sinkBatch.
type freshEvent struct {
	i     int
	claim *idem.Claim
	rec   []byte
	eff   Effect
	state runState
}

// startBatch is applyBatch's first step: the claims, and the handlers of
// the fresh events.
func (s *Sink) startBatch(sb *sinkBatch, ctx context.Context, h Handler, conc int) {
	evs := sb.evs
	outs := make([]Outcome, len(evs))
	errs := reuse(sb.errs, len(evs))
	clear(errs)
	sb.s, sb.ctx, sb.outs, sb.errs, sb.finished = s, ctx, outs, errs, false
	sb.fresh, sb.replayed = sb.fresh[:0], sb.replayed[:0]
	if s.closed.Load() {
		for i := range errs {
			errs[i] = ErrClosed
		}
		sb.finished = true
		return
	}
	who := s.who()
	claims := newBatch(s.st)
	items := reuse(sb.items, len(evs))[:0] // batch item -> event
	sb.items = items
	var fps fingerprints
	if !s.opts.NoFingerprint {
		fps.reserve(len(evs))
	}
	for i := range evs {
		if err := evs[i].validate(); err != nil {
			errs[i] = err
			continue
		}
		claims.Begin(eventRequestFP(s.scope, &evs[i], s.opts.NoFingerprint, s.opts.TTL, &fps))
		items = append(items, i)
	}
	res, err := appendRun(ctx, claims, sb.res[:0])
	// Drop the results (claims, replies) once classified: fresh and outs
	// keep what the batch goes on with.
	defer func() { sb.res = keepResults(res) }()
	if err != nil {
		for _, i := range items {
			errs[i] = fmt.Errorf("idemstream: %s: claiming event %q: %w", who, evs[i].ID, err)
		}
		s.countFailed(errs)
		sb.finished = true
		return
	}
	// Classify. fresh lists the events to run, with their claims.
	fresh := reuse(sb.fresh, len(items))[:0]
	replayed := sb.replayed[:0]
	for j, i := range items {
		c, o, err := classifyEvent(res[j].Result, res[j].Err, s.scope, who, &evs[i])
		switch {
		case err != nil:
			errs[i] = err
		case c != nil:
			outs[i] = o
			fresh = append(fresh, freshEvent{i: i, claim: c})
		case o.Status == Replayed:
			outs[i] = o
			replayed = append(replayed, i)
		default:
			outs[i] = o
			s.busy.Add(1)
		}
	}
	// Run the effects.
	parallelN(len(fresh), conc, func(n int) {
		r := &fresh[n]
		ev := &evs[r.i]
		returned := false
		defer func() {
			if !returned {
				_ = r.claim.Abort(ctx) // h panicked: release, as Apply does; the panic goes on
			}
		}()
		s.runEffect(ctx, ev, h, &r.state, &r.rec, &r.eff, &errs[r.i])
		returned = true
	})
	sb.fresh, sb.replayed = fresh, replayed
}

// keepResults clears a batch's results (appendRun's) for the next batch
// to reuse, so that the buffer holds no claim, reply or error between
// batches, and drops it if it is of an exceptionally large batch.
func keepResults(res []idem.BatchResult) []idem.BatchResult {
	clear(res)
	if cap(res) > maxKeptBatchBuffer {
		return nil
	}
	return res[:0]
}

// maxKeptBatchBuffer bounds the batch size (in events) whose buffers the
// consumers keep from one batch to the next.
const maxKeptBatchBuffer = 1 << 14

// reuse returns buf with length n: buf itself when it has the room and is
// not of an exceptionally large batch (then it would be kept for good).
func reuse[T any](buf []T, n int) []T {
	if cap(buf) < n || cap(buf) > maxKeptBatchBuffer && n <= maxKeptBatchBuffer {
		return make([]T, n)
	}
	return buf[:n]
}

// finish is applyBatch's second step: the commits (with their frontier),
// the releases and the advances past replayed events, in one batch; then
// each event's outcome or error.
func (sb *sinkBatch) finish() ([]Outcome, []error) {
	if sb.finished {
		return sb.outs, sb.errs
	}
	sb.finished = true
	s, ctx, evs, outs, errs, fresh, replayed := sb.s, sb.ctx, sb.evs, sb.outs, sb.errs, sb.fresh, sb.replayed
	who := s.who()
	// Finish: commits (with their frontier), releases, and the advances
	// past replayed deliveries, in one batch.
	fin := newBatch(s.st)
	finItems := reuse(sb.finItems, len(fresh))[:0]
	var enc eventRecordEncoder
	// The commits' advances, from one buffer, and their clients, one
	// string per partition.
	advs := reuse(sb.advs, len(fresh))
	sb.finItems, sb.advs = finItems, advs
	defer func() {
		// Drop what the buffers point to (claims, effects), for reuse.
		clear(fresh)
		clear(finItems[:cap(finItems)])
	}()
	// The items go in reverse order of the fetched batch, so that each
	// partition's commits come in falling order of their offsets when
	// the source delivers them in order: the first of them that applies
	// raises the frontier to the highest offset the record commits, and
	// the engine leaves the later advances, which raise nothing, out of
	// the record (one advance per partition per record, whichever
	// commits fail). Every commit still carries its own advance, so the
	// frontier is what it is when each does: the highest committed
	// offset, in every record, whatever the order.
	var client, clientOf string
	for n := len(fresh) - 1; n >= 0; n-- {
		r := &fresh[n]
		ev := &evs[r.i]
		switch r.state {
		case runCommit:
			if r.rec == nil {
				r.rec = enc.encode(r.eff.Result, 0, ev.Partition, ev.Offset)
			}
			if ev.Offset != 0 {
				if client == "" || clientOf != ev.Partition {
					client, clientOf = frontierClient(ev.Partition), ev.Partition
				}
				advs[n] = idem.Advance{Scope: s.fscope, Client: client, Seq: ev.Offset}
				fin.Commit(r.claim, r.rec, advs[n:n+1:n+1]...)
			} else {
				fin.Commit(r.claim, r.rec)
			}
		case runAbort:
			fin.Abort(r.claim)
		default:
			continue
		}
		finItems = append(finItems, r)
	}
	adv, advErr := s.replayedAdvances(ctx, evs, replayed)
	if len(adv) > 0 {
		fin.Advance(adv...)
	}
	var finRes []idem.BatchResult
	var err error
	if fin.Len() > 0 {
		// Once an effect has run, its commit is written whatever ctx says.
		finRes, err = appendRun(context.WithoutCancel(ctx), fin, sb.res[:0])
		defer func() { sb.res = keepResults(finRes) }()
	}
	// The counters are added once for the batch, not per event.
	var frontierWrites, applied uint64
	defer func() {
		s.frontierWrites.Add(frontierWrites)
		s.applied.Add(applied)
	}()
	// Back in event order (hooks, outbox registrations): item n is
	// finItems[n].
	for n := len(finItems) - 1; n >= 0; n-- {
		r := finItems[n]
		ev := &evs[r.i]
		if r.state != runCommit {
			continue
		}
		cerr := err
		if cerr == nil {
			cerr = finRes[n].Err
		}
		if cerr != nil {
			errs[r.i] = fmt.Errorf("idemstream: %s: committing event %q: %w", who, ev.ID, cerr)
			continue
		}
		if ev.Offset != 0 {
			frontierWrites++
		}
		if err := s.hookAt(windowAfterCommit, ev); err != nil {
			errs[r.i] = err
			continue
		}
		if len(r.eff.Outbox) > 0 {
			if err := s.opts.Outbox.register(ctx, s.name, ev.ID, r.eff.Outbox); err != nil {
				errs[r.i] = err
				continue
			}
		}
		applied++
		outs[r.i] = Outcome{Status: Applied, Result: r.eff.Result, Partition: ev.Partition, Offset: ev.Offset, ExpiresAt: outs[r.i].ExpiresAt}
	}
	if len(adv) > 0 {
		if err == nil {
			err = finRes[len(finRes)-1].Err
		}
		if err == nil {
			s.frontierWrites.Add(uint64(len(adv)))
		} else {
			advErr = fmt.Errorf("idemstream: %s: advancing the frontier past replayed events: %w", who, err)
		}
	}
	for _, i := range replayed {
		o := &outs[i]
		if advErr != nil && evs[i].Offset != 0 {
			errs[i] = advErr
			continue
		}
		if len(o.outbox) > 0 {
			// As Apply: register again (idempotent).
			if s.opts.Outbox == nil {
				errs[i] = fmt.Errorf("idemstream: %s: event %q has outbox messages and the sink has no Outbox", who, evs[i].ID)
				continue
			}
			if err := s.opts.Outbox.register(ctx, s.name, evs[i].ID, o.outbox); err != nil {
				errs[i] = err
				continue
			}
			o.outbox = nil
		}
		s.replayed.Add(1)
	}
	s.countFailed(errs)
	return outs, errs
}

// runEffect runs h for a claimed event of applyBatch and says what to do
// with its claim (state), its record, its effect, or its error.
func (s *Sink) runEffect(ctx context.Context, ev *Event, h Handler, state *runState, rec *[]byte, eff *Effect, errp *error) {
	*state = runAbort
	if err := s.hookAt(windowAfterClaim, ev); err != nil {
		*state, *errp = runLeave, err // a simulated crash leaves the claim in doubt
		return
	}
	e, err := h(ctx, *ev)
	if err != nil {
		*errp = fmt.Errorf("idemstream: %s: event %q (partition %q, offset %d): %w", s.who(), ev.ID, ev.Partition, ev.Offset, err)
		return
	}
	if len(e.Outbox) > 0 && s.opts.Outbox == nil {
		*errp = fmt.Errorf("idemstream: %s: event %q: the handler returned outbox messages and the sink has no Outbox", s.who(), ev.ID)
		return
	}
	if len(e.Outbox) > 0 || len(e.Result)+len(ev.Partition)+eventRecordOverhead > s.opts.MaxRecordSize {
		// Else applyBatch encodes it, without reflection.
		*rec, err = s.encode(&eventRecord{Result: e.Result, Partition: ev.Partition, Offset: ev.Offset, Outbox: e.Outbox}, ev.ID)
		if err != nil {
			*errp = err
			return
		}
	}
	if err := s.hookAt(windowAfterEffect, ev); err != nil {
		*state, *errp = runLeave, err
		return
	}
	*eff, *state = e, runCommit
}

// runState is what applyBatch does with a fresh event's claim.
type runState uint8

const (
	runAbort  runState = iota // the handler failed (or panicked): release
	runCommit                 // the effect ran: commit
	runLeave                  // a simulated crash: leave it in doubt
)

func (s *Sink) who() string { return fmt.Sprintf("sink %q", s.name) }

// countFailed counts the events that failed after their claim was asked
// for (as Apply counts them: an invalid event is not counted).
func (s *Sink) countFailed(errs []error) {
	for _, err := range errs {
		if err != nil && !errors.Is(err, ErrInvalidEvent) {
			s.failed.Add(1)
		}
	}
}

// replayedAdvances are the advances that move each partition's frontier
// past the replayed deliveries found above it (advanceReplayed for a
// batch): nothing for a plain redelivery.
func (s *Sink) replayedAdvances(ctx context.Context, evs []Event, replayed []int) ([]idem.Advance, error) {
	var top map[string]uint64
	for _, i := range replayed {
		if ev := &evs[i]; ev.Offset > top[ev.Partition] {
			if top == nil {
				top = map[string]uint64{}
			}
			top[ev.Partition] = ev.Offset
		}
	}
	var adv []idem.Advance
	for p, off := range top {
		n, err := s.st.ClientState(ctx, s.fscope, frontierClient(p))
		if err != nil {
			return nil, fmt.Errorf("idemstream: %s: reading the frontier of partition %q: %w", s.who(), p, err)
		}
		if n < off {
			adv = append(adv, idem.Advance{Scope: s.fscope, Client: frontierClient(p), Seq: off})
		}
	}
	return adv, nil
}

// parallelN runs fn(0..n-1) on up to conc goroutines (inline when one
// suffices).
func parallelN(n, conc int, fn func(int)) {
	if conc > n {
		conc = n
	}
	if conc <= 1 {
		for i := 0; i < n; i++ {
			fn(i)
		}
		return
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for g := 0; g < conc; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				fn(i)
			}
		}()
	}
	wg.Wait()
}
