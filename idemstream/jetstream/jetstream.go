// Package jetstream is idemstream's source for NATS JetStream: it reads a
// durable pull consumer and hands its messages to idemstream.Consume or
// idemstream.ConsumeTwoPhase, which acknowledge each only after its effect
// is committed. It is a package of its own so that a program using
// idemstream with another broker does not link the NATS client.
package jetstream

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/idemdb/idem/idemstream"
	"github.com/nats-io/nats.go"
	njs "github.com/nats-io/nats.go/jetstream"
)

// Options configure a JetStreamSource.
type Options struct {
	// FetchWait bounds how long Fetch waits for the first message
	// (default 1 s).
	FetchWait time.Duration
	// IDHeader names the header holding the stable event id (default
	// "Nats-Msg-Id", JetStream's own dedup header). Messages without it get
	// "<stream>/<stream sequence>", stable across redeliveries too.
	IDHeader string
	// DeadLetterSubject, if set, is where terminated messages go (an event
	// that failed for good, or too often: idemstream.ConsumeOptions.MaxDeliveries),
	// published through DeadLetterJS to a stream that captures the
	// subject, before the message is terminated. The dead letter keeps the
	// original headers and data and adds Idem-Dead-Letter-Reason,
	// -Stream, -Sequence and -Deliveries; its Nats-Msg-Id is
	// "dead-letter/<event id>", so a repeat within the stream's duplicate
	// window is dropped.
	DeadLetterSubject string
	// DeadLetterJS publishes the dead letters (required with
	// DeadLetterSubject).
	DeadLetterJS njs.JetStream
}

// Headers of a dead letter published by a JetStreamSource.
const (
	DeadLetterReasonHeader     = "Idem-Dead-Letter-Reason"
	DeadLetterStreamHeader     = "Idem-Dead-Letter-Stream"
	DeadLetterSequenceHeader   = "Idem-Dead-Letter-Sequence"
	DeadLetterDeliveriesHeader = "Idem-Dead-Letter-Deliveries"
)

// Source reads a NATS JetStream pull consumer (durable, with
// AckExplicit). Each message is acknowledged with a double ack (the
// server confirms it) only after its effect is committed; until then
// JetStream redelivers it after the consumer's AckWait, to this or another
// subscriber of the consumer, and the sink replays it (or reports it Busy
// while the first delivery is still running). Partition is the stream
// name and Offset the stream sequence.
type Source struct {
	cons njs.Consumer
	opts Options
}

// NewSource reads cons (opts nil: the defaults).
func NewSource(cons njs.Consumer, opts *Options) (*Source, error) {
	if cons == nil {
		return nil, errors.New("jetstream: NewSource: nil consumer")
	}
	var o Options
	if opts != nil {
		o = *opts
	}
	opts = &o
	if o.FetchWait < 0 {
		return nil, fmt.Errorf("jetstream: Options.FetchWait %v is negative", o.FetchWait)
	}
	if opts.FetchWait == 0 {
		opts.FetchWait = time.Second
	}
	if opts.IDHeader == "" {
		opts.IDHeader = nats.MsgIdHdr
	}
	if opts.DeadLetterSubject != "" && opts.DeadLetterJS == nil {
		return nil, fmt.Errorf("jetstream: Options.DeadLetterSubject %q needs DeadLetterJS to publish with", opts.DeadLetterSubject)
	}
	return &Source{cons: cons, opts: o}, nil
}

// Fetch implements idemstream.Source.
func (s *Source) Fetch(ctx context.Context, n int) ([]idemstream.Message, error) {
	wait := s.opts.FetchWait
	if dl, ok := ctx.Deadline(); ok {
		if left := time.Until(dl); left < wait {
			wait = max(left, 10*time.Millisecond)
		}
	}
	batch, err := s.cons.Fetch(n, njs.FetchMaxWait(wait))
	if err != nil {
		return nil, fmt.Errorf("jetstream: fetch: %w", err)
	}
	var out []idemstream.Message
	for m := range batch.Messages() {
		md, err := m.Metadata()
		if err != nil {
			return out, fmt.Errorf("jetstream: message metadata: %w", err)
		}
		id := m.Headers().Get(s.opts.IDHeader)
		if id == "" {
			id = md.Stream + "/" + strconv.FormatUint(md.Sequence.Stream, 10)
		}
		out = append(out, idemstream.Message{
			Event:      idemstream.Event{ID: []byte(id), Partition: md.Stream, Offset: md.Sequence.Stream, Payload: m.Data()},
			Deliveries: int(md.NumDelivered),
			DeadLetter: s.opts.DeadLetterSubject,
			Ack:        func(ctx context.Context) error { return m.DoubleAck(ctx) },
			Nak:        func(_ context.Context, delay time.Duration) error { return m.NakWithDelay(delay) },
			Term: func(ctx context.Context, reason string) error {
				if err := s.deadLetter(ctx, m, md, id, reason); err != nil {
					return err
				}
				return m.TermWithReason(reason)
			},
		})
	}
	if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, njs.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) {
		return out, fmt.Errorf("jetstream: fetch: %w", err)
	}
	return out, nil
}

// deadLetter publishes m to the dead-letter subject, if there is one.
func (s *Source) deadLetter(ctx context.Context, m njs.Msg, md *njs.MsgMetadata, id, reason string) error {
	if s.opts.DeadLetterSubject == "" {
		return nil
	}
	dl := nats.NewMsg(s.opts.DeadLetterSubject)
	for k, v := range m.Headers() {
		dl.Header[k] = v
	}
	dl.Header.Set(nats.MsgIdHdr, "dead-letter/"+id)
	dl.Header.Set(DeadLetterReasonHeader, reason)
	dl.Header.Set(DeadLetterStreamHeader, md.Stream)
	dl.Header.Set(DeadLetterSequenceHeader, strconv.FormatUint(md.Sequence.Stream, 10))
	dl.Header.Set(DeadLetterDeliveriesHeader, strconv.FormatUint(md.NumDelivered, 10))
	dl.Data = m.Data()
	if _, err := s.opts.DeadLetterJS.PublishMsg(ctx, dl); err != nil {
		return fmt.Errorf("jetstream: publishing event %q to dead-letter subject %q: %w", id, s.opts.DeadLetterSubject, err)
	}
	return nil
}
