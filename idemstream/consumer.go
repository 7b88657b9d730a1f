package idemstream

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/idemdb/idem"
)

// Message is one delivery from a Source.
type Message struct {
	Event Event
	// Deliveries counts the broker's deliveries of this message, this one
	// included (1 the first time); 0 when the source does not know. The
	// consumers bound the deliveries of a failing event with it
	// (ConsumeOptions.MaxDeliveries).
	Deliveries int
	// DeadLetter names where Term hands the message (a JetStream subject,
	// a Redis stream); empty when the source has no dead-letter
	// destination. For logs and counters only.
	DeadLetter string
	// Ack acknowledges the delivery to the broker (JetStream ack, XACK).
	// The consumers call it only after the event's effect is committed.
	Ack func(ctx context.Context) error
	// Nak hands the delivery back to the broker for a redelivery after
	// delay (JetStream NakWithDelay). Nil when the broker has no negative
	// acknowledgement: the delivery is then redelivered after the broker's
	// own timeout, as any unacknowledged one.
	Nak func(ctx context.Context, delay time.Duration) error
	// Term ends the message: the broker never delivers it again
	// (JetStream term, XACK). When the source has a dead-letter
	// destination, the message goes there first, with reason. Nil when
	// the source cannot terminate: the message is then left unacknowledged.
	Term func(ctx context.Context, reason string) error
}

// Source is a stream a consumer reads: jetstream.Source and
// redisstream.Source (the packages idemstream/jetstream and
// idemstream/redisstream), or your own (a Kafka partition reader).
type Source interface {
	// Fetch returns up to max deliveries, waiting a bounded time for the
	// first; an empty slice means none arrived in that time. Deliveries
	// not acknowledged are delivered again later (the broker's redelivery).
	Fetch(ctx context.Context, max int) ([]Message, error)
}

// ConsumeOptions configure Consume and ConsumeTwoPhase.
type ConsumeOptions struct {
	// BatchSize is the most deliveries fetched at once (default 128). For
	// ConsumeTwoPhase a batch is one checkpoint.
	BatchSize int
	// Concurrency is how many handlers of a batch Consume runs at once
	// (default BatchSize: all of them). The batch's claims are one
	// engine record and its commits another (on a store with batches),
	// so a batch costs two fsyncs whatever its size.
	Concurrency int
	// Logger receives handler failures (the event is not acknowledged, so
	// the broker redelivers it) and source errors. Default: discard.
	Logger *slog.Logger
	// OnBatch, if set, is called after each batch has been acknowledged,
	// with the outcomes of its deliveries (in fetch order). Calls come one
	// at a time, in batch order, but Consume makes them from the goroutine
	// that settles the batch, possibly while the next batch is fetched
	// and run.
	OnBatch func(msgs []Message, outs []Outcome)
	// MaxDeliveries bounds the deliveries of an event whose processing
	// keeps failing (its handler, or its Invoke in a checkpoint, returns
	// an error): the delivery that fails with Message.Deliveries at or
	// above it is terminated (Message.Term, to the source's dead-letter
	// destination) instead of handed back. Default 5; negative: never
	// (only the broker's own limit, if any, ends it). Events that fail
	// for good (ErrConflict, ErrInvalidEvent, ErrPermanent) are
	// terminated at their first delivery.
	MaxDeliveries int
	// RetryDelay is how long the broker waits before redelivering a
	// failed event (Message.Nak) after its first delivery; it doubles
	// with each further delivery, up to 64 times. Default 1 s.
	RetryDelay time.Duration
}

// consumeOptions returns the options with their defaults, or the
// configuration error.
func consumeOptions(opts *ConsumeOptions) (ConsumeOptions, error) {
	var o ConsumeOptions
	if opts != nil {
		o = *opts
	}
	switch {
	case o.BatchSize < 0:
		return o, fmt.Errorf("idemstream: ConsumeOptions.BatchSize %d is negative", o.BatchSize)
	case o.Concurrency < 0:
		return o, fmt.Errorf("idemstream: ConsumeOptions.Concurrency %d is negative", o.Concurrency)
	case o.RetryDelay < 0:
		return o, fmt.Errorf("idemstream: ConsumeOptions.RetryDelay %v is negative", o.RetryDelay)
	}
	if o.BatchSize == 0 {
		o.BatchSize = 128
	}
	if o.MaxDeliveries == 0 {
		o.MaxDeliveries = 5
	}
	if o.RetryDelay == 0 {
		o.RetryDelay = time.Second
	}
	if o.Concurrency == 0 {
		o.Concurrency = o.BatchSize
	}
	if o.Logger == nil {
		o.Logger = discardLogger()
	}
	return o, nil
}

// fatal reports whether err stops a consumer: the engine is closed or
// failed, or only recovery may go on.
func fatal(err error) bool {
	return errors.Is(err, idem.ErrClosed) || errors.Is(err, idem.ErrFailed) ||
		errors.Is(err, ErrNeedsRecovery) || errors.Is(err, ErrClosed)
}

// Consume moves events from src through sink with h until ctx ends (it
// then returns ctx's error) or a fatal error (engine closed or failed).
// For each batch: the deliveries are claimed together (one record when
// the store is an idem.Batcher, one request each otherwise), their
// handlers run (up to Concurrency at once), their commits (each raising
// its partition's frontier) are written together, and only then are the
// committed deliveries acknowledged. The commits and acks of a batch
// overlap with the fetch, claims and handlers of the next one. A delivery whose handler failed,
// or that is Busy, is not acknowledged: the broker redelivers it.
//
// opts nil means the defaults; a configuration error is returned at once.
func Consume(ctx context.Context, src Source, sink *Sink, h Handler, opts *ConsumeOptions) error {
	o, err := consumeOptions(opts)
	if err != nil {
		return err
	}
	return consume(ctx, src, sink, h, o)
}

func consume(ctx context.Context, src Source, sink *Sink, h Handler, opts ConsumeOptions) error {
	// Two batches overlap: batch n's commits are written, and its
	// deliveries then settled, by a goroutine while batch n+1 is fetched,
	// claimed and run, so that the commit record of one and the claim
	// record of the next share an fsync. At most one batch is finishing:
	// batch n+1's commits start after batch n is settled (OnBatch calls
	// stay in order).
	var finishing chan error
	wait := func() error {
		if finishing == nil {
			return nil
		}
		err := <-finishing
		finishing = nil
		return err
	}
	// Two sets of buffers (events, errors, claims) take turns: batch n+2
	// reuses batch n's, which finished before batch n+1 went on to its
	// commits (wait, below).
	var turns [2]sinkBatch
	turn := 0
	err := fetchBatches(ctx, src, opts, func(msgs []Message, _ *backoff) error {
		sb := &turns[turn]
		turn ^= 1
		sb.evs = batchEvents(sb.evs, msgs)
		sink.startBatch(sb, ctx, h, opts.Concurrency)
		if err := wait(); err != nil {
			_, _ = sb.finish() // its effects ran: commit them
			return err
		}
		finishing = make(chan error, 1)
		go func(done chan<- error) {
			outs, errs := sb.finish()
			for i, err := range errs {
				if err == nil {
					continue
				}
				if fatal(err) {
					done <- err
					return
				}
				outs[i] = Outcome{Status: Failed, Err: err}
			}
			done <- ackBatch(ctx, msgs, outs, opts, &sink.poison, func() error { return sink.hookAt(windowBeforeAck, nil) })
		}(finishing)
		return nil
	})
	if werr := wait(); werr != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		return werr
	}
	return err
}

// ConsumeTwoPhase moves events from src into tp's sink, one checkpoint per
// fetched batch, until ctx ends or a fatal error. The batch's deliveries
// are acknowledged only after the checkpoint's transaction is committed
// and recorded; they are acknowledged while the next batch is fetched and
// checkpointed.
// opts nil means the defaults; a configuration error is returned at once.
func ConsumeTwoPhase[Txn any](ctx context.Context, src Source, tp *TwoPhase[Txn], opts *ConsumeOptions) error {
	opts2, err := consumeOptions(opts)
	if err != nil {
		return err
	}
	return consumeTwoPhase(ctx, src, tp, opts2)
}

func consumeTwoPhase[Txn any](ctx context.Context, src Source, tp *TwoPhase[Txn], opts ConsumeOptions) error {
	// A checkpoint's deliveries are settled with the broker by a goroutine
	// while the next batch is fetched and its checkpoint runs (the acks
	// are the broker's round trips). At most one batch is settling: the
	// next one waits for it before it settles (OnBatch calls stay in
	// order).
	var settling chan error
	wait := func() error {
		if settling == nil {
			return nil
		}
		err := <-settling
		settling = nil
		return err
	}
	// The events of each batch, in one buffer: Checkpoint keeps nothing of
	// them once it returns.
	var evs []Event
	err := fetchBatches(ctx, src, opts, func(msgs []Message, backoff *backoff) error {
		evs = batchEvents(evs, msgs)
		outs, err := tp.Checkpoint(ctx, evs)
		if werr := wait(); werr != nil {
			return werr
		}
		if err != nil {
			if fatal(err) || ctx.Err() != nil {
				return err
			}
			opts.Logger.Warn("idemstream: checkpoint failed; its events will be redelivered", "err", err)
			// An event whose Invoke failed aborted the checkpoint: it
			// counts as that event's failure (bounded by MaxDeliveries);
			// the rest of the batch is handed back as it is.
			var ee *EventError
			errors.As(err, &ee)
			outs = make([]Outcome, len(msgs))
			for i := range msgs {
				outs[i] = Outcome{Status: Busy}
				if ee != nil && string(msgs[i].Event.ID) == string(ee.ID) {
					outs[i] = Outcome{Status: Failed, Err: err}
				}
			}
			if err := ackBatch(ctx, msgs, outs, opts, &tp.poison, nil); err != nil {
				return err
			}
			return backoff.wait(ctx)
		}
		settling = make(chan error, 1)
		go func(done chan<- error) {
			done <- ackBatch(ctx, msgs, outs, opts, &tp.poison, nil)
		}(settling)
		return nil
	})
	if werr := wait(); werr != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		return werr
	}
	return err
}

// batchEvents returns the events of msgs in buf (grown if need be).
func batchEvents(buf []Event, msgs []Message) []Event {
	buf = reuse(buf, len(msgs))
	for i := range msgs {
		buf[i] = msgs[i].Event
	}
	return buf
}

// fetchBatches fetches from src until ctx ends and hands each non-empty
// batch to batch; a batch error ends it. A failed fetch is logged and
// retried with backoff, which batch may use too.
func fetchBatches(ctx context.Context, src Source, opts ConsumeOptions, batch func(msgs []Message, b *backoff) error) error {
	backoff := newBackoff()
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		msgs, err := src.Fetch(ctx, opts.BatchSize)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			opts.Logger.Warn("idemstream: fetch failed", "err", err)
			if err := backoff.wait(ctx); err != nil {
				return err
			}
			continue
		}
		backoff.reset()
		if len(msgs) == 0 {
			continue
		}
		if err := batch(msgs, backoff); err != nil {
			return err
		}
	}
}

// ackBatch settles a processed batch with the broker: committed
// deliveries are acknowledged, failed ones handed back (Nak) or, when they
// fail for good or too often, terminated (Term, to the dead-letter
// destination); Busy ones are left alone.
func ackBatch(ctx context.Context, msgs []Message, outs []Outcome, opts ConsumeOptions, pc *poisonCounters, beforeAck func() error) error {
	if beforeAck != nil {
		if err := beforeAck(); err != nil {
			return err
		}
	}
	todo := make([]int, 0, len(outs))
	for i, o := range outs {
		switch {
		case o.Status.Ackable() && msgs[i].Ack != nil:
		case o.Status == Failed:
		default:
			continue
		}
		todo = append(todo, i)
	}
	// Acks are network calls for a broker: a few at once.
	parallelN(len(todo), 64, func(n int) {
		i := todo[n]
		settle(ctx, &msgs[i], outs[i], opts, pc)
	})
	if opts.OnBatch != nil {
		opts.OnBatch(msgs, outs)
	}
	return nil
}

// settle hands one delivery's outcome to the broker (see ackBatch).
func settle(ctx context.Context, m *Message, o Outcome, opts ConsumeOptions, pc *poisonCounters) {
	if o.Status.Ackable() {
		if err := m.Ack(ctx); err != nil {
			// The effect is committed: a redelivery is replayed.
			opts.Logger.Warn("idemstream: ack failed; the redelivery will be replayed", "id", string(m.Event.ID), "err", err)
		}
		return
	}
	id := string(m.Event.ID) // for the logs below: not made per acked event
	var reason string
	switch {
	case permanent(o.Err):
		reason = "failed for good: " + o.Err.Error()
	case opts.MaxDeliveries > 0 && m.Deliveries >= opts.MaxDeliveries:
		reason = fmt.Sprintf("failed at delivery %d (MaxDeliveries %d): %v", m.Deliveries, opts.MaxDeliveries, o.Err)
	}
	if reason == "" || m.Term == nil {
		delay := opts.RetryDelay << min(max(m.Deliveries-1, 0), 6)
		opts.Logger.Warn("idemstream: event not processed; it will be redelivered", "id", id, "deliveries", m.Deliveries, "retry_in", delay, "err", o.Err)
		pc.retried.Add(1)
		if m.Nak != nil {
			if err := m.Nak(ctx, delay); err != nil {
				opts.Logger.Warn("idemstream: nak failed; the broker redelivers after its timeout", "id", id, "err", err)
			}
		}
		return
	}
	if err := m.Term(ctx, reason); err != nil {
		pc.retried.Add(1)
		opts.Logger.Warn("idemstream: terminating a failed event failed; it will be redelivered", "id", id, "reason", reason, "err", err)
		return
	}
	pc.terminated.Add(1)
	if m.DeadLetter != "" {
		pc.deadLettered.Add(1)
	}
	opts.Logger.Error("idemstream: event terminated without its effect", "id", id, "partition", m.Event.Partition, "offset", m.Event.Offset,
		"deliveries", m.Deliveries, "dead_letter", m.DeadLetter, "reason", reason)
}

// permanent reports whether err fails its event for good: redelivering it
// cannot succeed.
func permanent(err error) bool {
	return errors.Is(err, ErrConflict) || errors.Is(err, ErrInvalidEvent) || errors.Is(err, ErrPermanent)
}

// poisonCounters count, per Sink or TwoPhase, the deliveries the consumers
// handed back or terminated.
type poisonCounters struct {
	retried, terminated, deadLettered atomic.Uint64
}

type backoff struct{ d time.Duration }

func newBackoff() *backoff { return &backoff{d: 50 * time.Millisecond} }
func (b *backoff) reset()  { b.d = 50 * time.Millisecond }
func (b *backoff) wait(ctx context.Context) error {
	t := time.NewTimer(b.d)
	defer t.Stop()
	b.d = min(2*b.d, 5*time.Second)
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
