package idemstream

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/idemdb/idem"
)

// Message is one delivery from a Source.
type Message struct {
	Event Event
	// Ack acknowledges the delivery to the broker (JetStream ack, XACK).
	// The consumers call it only after the event's effect is committed.
	Ack func(ctx context.Context) error
}

// Source is a stream a consumer reads: JetStreamSource and
// RedisStreamSource, or your own (a Kafka partition reader).
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
	// Concurrency is how many events of a batch Consume applies at once
	// (default BatchSize: all of them; their engine records share group
	// commits, so the batch costs about two fsyncs).
	Concurrency int
	// Logger receives handler failures (the event is not acknowledged, so
	// the broker redelivers it) and source errors. Default: discard.
	Logger *slog.Logger
	// OnBatch, if set, is called after each batch has been acknowledged,
	// with the outcomes of its deliveries (in fetch order).
	OnBatch func(msgs []Message, outs []Outcome)
}

func (o *ConsumeOptions) defaults() {
	if o.BatchSize <= 0 {
		o.BatchSize = 128
	}
	if o.Concurrency <= 0 {
		o.Concurrency = o.BatchSize
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
}

// fatal reports whether err stops a consumer: the engine is closed or
// failed, or only recovery may go on.
func fatal(err error) bool {
	return errors.Is(err, idem.ErrClosed) || errors.Is(err, idem.ErrFailed) ||
		errors.Is(err, ErrNeedsRecovery) || errors.Is(err, ErrClosed)
}

// Consume moves events from src through sink with h until ctx ends (it
// then returns ctx's error) or a fatal error (engine closed or failed).
// For each batch: every delivery is applied (concurrently; each commit
// raises its partition's frontier in the same record), and only then are
// the committed deliveries acknowledged. A delivery whose handler failed,
// or that is Busy, is not acknowledged: the broker redelivers it.
func Consume(ctx context.Context, src Source, sink *Sink, h Handler, opts ConsumeOptions) error {
	opts.defaults()
	return fetchBatches(ctx, src, opts, func(msgs []Message, _ *backoff) error {
		outs := make([]Outcome, len(msgs))
		errs := make([]error, len(msgs))
		var wg sync.WaitGroup
		sem := make(chan struct{}, opts.Concurrency)
		for i := range msgs {
			sem <- struct{}{}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				outs[i], errs[i] = sink.Apply(ctx, msgs[i].Event, h)
			}()
		}
		wg.Wait()
		for i, err := range errs {
			if err == nil {
				continue
			}
			if fatal(err) {
				return err
			}
			outs[i] = Outcome{Status: Failed, Err: err}
			opts.Logger.Warn("idemstream: event not processed; it will be redelivered", "id", string(msgs[i].Event.ID), "err", err)
		}
		return ackBatch(ctx, msgs, outs, opts, func() error { return sink.hookAt(WindowBeforeAck, nil) })
	})
}

// ConsumeTwoPhase moves events from src into tp's sink, one checkpoint per
// fetched batch, until ctx ends or a fatal error. The batch's deliveries
// are acknowledged only after the checkpoint's transaction is committed
// and recorded.
func ConsumeTwoPhase[Txn any](ctx context.Context, src Source, tp *TwoPhase[Txn], opts ConsumeOptions) error {
	opts.defaults()
	return fetchBatches(ctx, src, opts, func(msgs []Message, backoff *backoff) error {
		evs := make([]Event, len(msgs))
		for i := range msgs {
			evs[i] = msgs[i].Event
		}
		outs, err := tp.Checkpoint(ctx, evs)
		if err != nil {
			if fatal(err) || ctx.Err() != nil {
				return err
			}
			opts.Logger.Warn("idemstream: checkpoint failed; its events will be redelivered", "err", err)
			return backoff.wait(ctx)
		}
		for i, o := range outs {
			if o.Status == Failed {
				opts.Logger.Warn("idemstream: event not processed", "id", string(msgs[i].Event.ID), "err", o.Err)
			}
		}
		return ackBatch(ctx, msgs, outs, opts, nil)
	})
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

func ackBatch(ctx context.Context, msgs []Message, outs []Outcome, opts ConsumeOptions, beforeAck func() error) error {
	if beforeAck != nil {
		if err := beforeAck(); err != nil {
			return err
		}
	}
	var wg sync.WaitGroup
	for i, o := range outs {
		if !o.Status.Ackable() || msgs[i].Ack == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := msgs[i].Ack(ctx); err != nil {
				// The effect is committed: a redelivery is replayed.
				opts.Logger.Warn("idemstream: ack failed; the redelivery will be replayed", "id", string(msgs[i].Event.ID), "err", err)
			}
		}()
	}
	wg.Wait()
	if opts.OnBatch != nil {
		opts.OnBatch(msgs, outs)
	}
	return nil
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
