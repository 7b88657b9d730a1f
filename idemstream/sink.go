package idemstream

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
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
	e      *idem.Engine
	name   string
	scope  string
	fscope string
	opts   SinkOptions
	log    *slog.Logger
	hook   func(Window, *Event) error // fault injection (tests)
	closed atomic.Bool

	fmu       sync.Mutex
	frontiers map[string]*frontier

	applied, replayed, busy, failed      atomic.Uint64
	recoveredCommitted, recoveredAborted atomic.Uint64
	frontierWrites                       atomic.Uint64
}

type frontier struct {
	mu     sync.Mutex
	loaded bool
	seq    uint64 // the frontier client's last committed sequence number
	offset uint64
}

// SinkStats are a sink's counters since NewSink.
type SinkStats struct {
	Applied, Replayed, Busy, Failed uint64
	// RecoveredCommitted and RecoveredAborted count the events left in
	// doubt by a crash that NewSink committed (Recover said applied) or
	// released.
	RecoveredCommitted, RecoveredAborted uint64
	FrontierWrites                       uint64
}

func sinkScope(name string) string     { return "idemstream/" + name }
func frontierScope(name string) string { return "idemstream.frontier/" + name }
func frontierClient(p string) string   { return "p:" + p }

var (
	namesMu sync.Mutex
	names   = map[*idem.Engine]map[string]bool{}
)

func takeName(e *idem.Engine, kind, name string) error {
	if name == "" || len(name) > 200 || strings.ContainsAny(name, "/\x00") {
		return fmt.Errorf("idemstream: invalid %s name %q: 1-200 bytes, no '/' or NUL", kind, name)
	}
	namesMu.Lock()
	defer namesMu.Unlock()
	m := names[e]
	if m == nil {
		m = map[string]bool{}
		names[e] = m
	}
	k := kind + "/" + name
	if m[k] {
		return fmt.Errorf("%w: %s %q", ErrInUse, kind, name)
	}
	m[k] = true
	return nil
}

func releaseName(e *idem.Engine, kind, name string) {
	namesMu.Lock()
	defer namesMu.Unlock()
	delete(names[e], kind+"/"+name)
	if len(names[e]) == 0 {
		delete(names, e)
	}
}

// NewSink opens the idempotent sink name on e (one per name and engine)
// and resolves what a crash left in doubt: interrupted frontier updates
// are completed (their offset was committed with an event first) and
// in-doubt events go to opts.Recover.
func NewSink(ctx context.Context, e *idem.Engine, name string, opts SinkOptions) (*Sink, error) {
	if err := takeName(e, "sink", name); err != nil {
		return nil, err
	}
	if opts.TTL < 0 {
		releaseName(e, "sink", name)
		return nil, fmt.Errorf("idemstream: sink %q: negative TTL %v", name, opts.TTL)
	}
	if opts.MaxRecordSize <= 0 {
		opts.MaxRecordSize = 1 << 20
	}
	s := &Sink{
		e: e, name: name, scope: sinkScope(name), fscope: frontierScope(name), opts: opts,
		log:       opts.Logger,
		frontiers: map[string]*frontier{},
	}
	if s.log == nil {
		s.log = discardLogger()
	}
	if err := s.recover(ctx); err != nil {
		releaseName(e, "sink", name)
		return nil, err
	}
	return s, nil
}

// Name returns the sink's name.
func (s *Sink) Name() string { return s.name }

// Close releases the sink's name. It does not close the engine.
func (s *Sink) Close() error {
	if s.closed.CompareAndSwap(false, true) {
		releaseName(s.e, "sink", s.name)
	}
	return nil
}

func (s *Sink) recover(ctx context.Context) error {
	doubts, err := s.e.InDoubt()
	if err != nil {
		return fmt.Errorf("idemstream: sink %q: listing in-doubt claims: %w", s.name, err)
	}
	for _, d := range doubts {
		switch d.Scope {
		case s.fscope:
			// A frontier update claims seq n+1 with the new offset as its
			// fingerprint, then commits it. The offset was committed with
			// its event before the update began, so finishing it is right.
			if len(d.Fingerprint) != 8 {
				s.log.Warn("idemstream: frontier claim without an offset, released", "sink", s.name, "client", d.Client, "seq", d.Seq)
				if err := d.Claim.Abort(ctx); err != nil {
					return fmt.Errorf("idemstream: sink %q: releasing frontier claim %s/%d: %w", s.name, d.Client, d.Seq, err)
				}
				continue
			}
			if err := d.Claim.Commit(ctx, d.Fingerprint); err != nil {
				return fmt.Errorf("idemstream: sink %q: completing frontier update %s/%d: %w", s.name, d.Client, d.Seq, err)
			}
			s.log.Info("idemstream: completed interrupted frontier update", "sink", s.name, "partition", strings.TrimPrefix(d.Client, "p:"), "offset", binary.BigEndian.Uint64(d.Fingerprint))
		case s.scope:
			if err := s.hookAt(WindowDuringRecovery, nil); err != nil {
				return err
			}
			if err := s.resolve(ctx, d); err != nil {
				return err
			}
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
	if err := d.Claim.Commit(ctx, b); err != nil {
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

func (s *Sink) hookAt(w Window, ev *Event) error {
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

func (s *Sink) request(ev *Event) idem.Request {
	req := idem.Request{Scope: s.scope, ID: ev.ID}
	if !s.opts.NoFingerprint {
		req.Fingerprint = fingerprint(ev.Payload)
	}
	setTTL(&req, s.opts.TTL)
	return req
}

// Apply runs h for ev unless the event's id was committed before, in which
// case the stored result is returned (Replayed) and h does not run. The
// event is claimed durably first, then h runs, then its result, position
// and outbox messages are committed in one record; h's error (or panic)
// releases the claim, so a redelivery runs it again. Busy means another
// delivery of the id is in progress: do not acknowledge this one.
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
	res, err := s.e.Begin(ctx, s.request(&ev))
	if err != nil {
		s.failed.Add(1)
		if errors.Is(err, idem.ErrConflict) {
			return Outcome{}, fmt.Errorf("%w: sink %q, event %q (partition %q, offset %d)", ErrConflict, s.name, ev.ID, ev.Partition, ev.Offset)
		}
		return Outcome{}, fmt.Errorf("idemstream: sink %q: claiming event %q: %w", s.name, ev.ID, err)
	}
	switch res.Status {
	case idem.Done:
		rec, err := decodeEventRecord(s.scope, ev.ID, res.Reply)
		if err != nil {
			s.failed.Add(1)
			return Outcome{}, err
		}
		if len(rec.Outbox) > 0 {
			// The delivery that committed may have crashed before it
			// registered the messages: register again (idempotent).
			if s.opts.Outbox == nil {
				return Outcome{}, fmt.Errorf("idemstream: sink %q: event %q has outbox messages and the sink has no Outbox", s.name, ev.ID)
			}
			if err := s.opts.Outbox.register(ctx, s.name, ev.ID, rec.Outbox); err != nil {
				s.failed.Add(1)
				return Outcome{}, err
			}
		}
		s.replayed.Add(1)
		return Outcome{Status: Replayed, Result: rec.Result, Partition: rec.Partition, Offset: rec.Offset, Checkpoint: rec.Checkpoint, ExpiresAt: expiresAt(res)}, nil
	case idem.InFlight:
		s.busy.Add(1)
		return Outcome{Status: Busy, BusyUntil: res.LeaseUntil, Partition: ev.Partition, Offset: ev.Offset}, nil
	case idem.Fresh:
	default:
		return Outcome{}, fmt.Errorf("idemstream: sink %q: event %q: unexpected status %v", s.name, ev.ID, res.Status)
	}
	claim := res.Claim
	finished := false
	defer func() {
		if !finished {
			// h panicked, or a step failed before the commit: release.
			_ = claim.Abort(context.WithoutCancel(ctx))
			s.failed.Add(1)
		}
	}()
	if err := s.hookAt(WindowAfterClaim, &ev); err != nil {
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
	if err := s.hookAt(WindowAfterEffect, &ev); err != nil {
		finished = true
		return Outcome{}, err
	}
	finished = true
	// The effect ran: commit even if ctx ended meanwhile (a claim left
	// in flight would make the redeliveries Busy until its lease ends).
	if err := claim.Commit(context.WithoutCancel(ctx), b); err != nil {
		s.failed.Add(1)
		return Outcome{}, fmt.Errorf("idemstream: sink %q: committing event %q: %w", s.name, ev.ID, err)
	}
	if err := s.hookAt(WindowAfterCommit, &ev); err != nil {
		return Outcome{}, err
	}
	if len(eff.Outbox) > 0 {
		if err := s.opts.Outbox.register(ctx, s.name, ev.ID, eff.Outbox); err != nil {
			return Outcome{}, err
		}
	}
	s.applied.Add(1)
	return Outcome{Status: Applied, Result: eff.Result, Partition: ev.Partition, Offset: ev.Offset, ExpiresAt: expiresAt(res)}, nil
}

// Lookup reports whether the event id is committed, and its record, without
// claiming it.
func (s *Sink) Lookup(id []byte) (Outcome, bool, error) {
	res, err := s.e.Lookup(s.scope, id)
	if err != nil {
		return Outcome{}, false, err
	}
	switch res.Status {
	case idem.Done:
		rec, err := decodeEventRecord(s.scope, id, res.Reply)
		if err != nil {
			return Outcome{}, false, err
		}
		return Outcome{Status: Replayed, Result: rec.Result, Partition: rec.Partition, Offset: rec.Offset, Checkpoint: rec.Checkpoint, ExpiresAt: expiresAt(res)}, true, nil
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
	}
}

// Frontier returns the partition's commit frontier: the highest offset
// recorded as committed (ok false if none). Every event at or below it
// whose effect ran is committed; events above it may be committed too
// (the frontier is recorded after the events' own records, which carry
// their offsets): a consumer resuming at Frontier+1 gets those again and
// the sink replays them, which moves the frontier up.
func (s *Sink) Frontier(partition string) (offset uint64, ok bool, err error) {
	f := s.frontierOf(partition)
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := s.loadFrontier(partition, f); err != nil {
		return 0, false, err
	}
	return f.offset, f.seq > 0, nil
}

func (s *Sink) frontierOf(partition string) *frontier {
	s.fmu.Lock()
	defer s.fmu.Unlock()
	f := s.frontiers[partition]
	if f == nil {
		f = &frontier{}
		s.frontiers[partition] = f
	}
	return f
}

func (s *Sink) loadFrontier(partition string, f *frontier) error {
	if f.loaded {
		return nil
	}
	client := frontierClient(partition)
	n, err := s.e.ClientState(s.fscope, client)
	if err != nil {
		return fmt.Errorf("idemstream: sink %q: frontier of partition %q: %w", s.name, partition, err)
	}
	f.seq, f.offset = n, 0
	if n > 0 {
		res, err := s.e.LookupSeq(s.fscope, client, n)
		if err != nil {
			return fmt.Errorf("idemstream: sink %q: frontier of partition %q (update %d): %w", s.name, partition, n, err)
		}
		if res.Status != idem.Done || len(res.Reply) != 8 {
			return fmt.Errorf("%w: sink %q: frontier of partition %q (update %d): status %v, %d-byte record", ErrCorruptRecord, s.name, partition, n, res.Status, len(res.Reply))
		}
		f.offset = binary.BigEndian.Uint64(res.Reply)
	}
	f.loaded = true
	return nil
}

// AdvanceFrontier records offset as the partition's frontier if it is
// higher than the recorded one. Call it only for offsets whose events are
// committed (Apply returned Applied or Replayed); the consumers do, once
// per batch, before acknowledging the batch.
func (s *Sink) AdvanceFrontier(ctx context.Context, partition string, offset uint64) error {
	if offset == 0 {
		return nil
	}
	f := s.frontierOf(partition)
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := s.loadFrontier(partition, f); err != nil {
		return err
	}
	if f.seq > 0 && offset <= f.offset {
		return nil
	}
	var enc [8]byte
	binary.BigEndian.PutUint64(enc[:], offset)
	client := frontierClient(partition)
	res, err := s.e.Begin(ctx, idem.Request{Scope: s.fscope, Client: client, Seq: f.seq + 1, Fingerprint: enc[:]})
	if err != nil {
		f.loaded = false
		return fmt.Errorf("idemstream: sink %q: advancing the frontier of partition %q to %d: %w", s.name, partition, offset, err)
	}
	if res.Status != idem.Fresh {
		f.loaded = false
		return fmt.Errorf("idemstream: sink %q: advancing the frontier of partition %q to %d: update %d is %v (another writer?)", s.name, partition, offset, f.seq+1, res.Status)
	}
	if err := res.Claim.Commit(ctx, enc[:]); err != nil {
		f.loaded = false
		return fmt.Errorf("idemstream: sink %q: advancing the frontier of partition %q to %d: %w", s.name, partition, offset, err)
	}
	f.seq++
	f.offset = offset
	s.frontierWrites.Add(1)
	return nil
}

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }
