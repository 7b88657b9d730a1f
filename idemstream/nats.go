package idemstream

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// JetStreamOptions configure a JetStreamSource.
type JetStreamOptions struct {
	// FetchWait bounds how long Fetch waits for the first message
	// (default 1 s).
	FetchWait time.Duration
	// IDHeader names the header holding the stable event id (default
	// "Nats-Msg-Id", JetStream's own dedup header). Messages without it get
	// "<stream>/<stream sequence>", stable across redeliveries too.
	IDHeader string
	// DeadLetterSubject, if set, is where terminated messages go (an event
	// that failed for good, or too often: ConsumeOptions.MaxDeliveries),
	// published through DeadLetterJS to a stream that captures the
	// subject, before the message is terminated. The dead letter keeps the
	// original headers and data and adds Idem-Dead-Letter-Reason,
	// -Stream, -Sequence and -Deliveries; its Nats-Msg-Id is
	// "dead-letter/<event id>", so a repeat within the stream's duplicate
	// window is dropped.
	DeadLetterSubject string
	// DeadLetterJS publishes the dead letters (required with
	// DeadLetterSubject).
	DeadLetterJS jetstream.JetStream
}

// Headers of a dead letter published by a JetStreamSource.
const (
	DeadLetterReasonHeader     = "Idem-Dead-Letter-Reason"
	DeadLetterStreamHeader     = "Idem-Dead-Letter-Stream"
	DeadLetterSequenceHeader   = "Idem-Dead-Letter-Sequence"
	DeadLetterDeliveriesHeader = "Idem-Dead-Letter-Deliveries"
)

// JetStreamSource reads a NATS JetStream pull consumer (durable, with
// AckExplicit). Each message is acknowledged with a double ack (the
// server confirms it) only after its effect is committed; until then
// JetStream redelivers it after the consumer's AckWait, to this or another
// subscriber of the consumer, and the sink replays it (or reports it Busy
// while the first delivery is still running). Partition is the stream
// name and Offset the stream sequence.
type JetStreamSource struct {
	cons jetstream.Consumer
	opts JetStreamOptions
}

// NewJetStreamSource reads cons.
func NewJetStreamSource(cons jetstream.Consumer, opts JetStreamOptions) (*JetStreamSource, error) {
	if cons == nil {
		return nil, errors.New("idemstream: NewJetStreamSource: nil consumer")
	}
	if opts.FetchWait <= 0 {
		opts.FetchWait = time.Second
	}
	if opts.IDHeader == "" {
		opts.IDHeader = nats.MsgIdHdr
	}
	if opts.DeadLetterSubject != "" && opts.DeadLetterJS == nil {
		return nil, fmt.Errorf("idemstream: JetStreamOptions.DeadLetterSubject %q needs DeadLetterJS to publish with", opts.DeadLetterSubject)
	}
	return &JetStreamSource{cons: cons, opts: opts}, nil
}

// Fetch implements Source.
func (s *JetStreamSource) Fetch(ctx context.Context, n int) ([]Message, error) {
	wait := s.opts.FetchWait
	if dl, ok := ctx.Deadline(); ok {
		if left := time.Until(dl); left < wait {
			wait = max(left, 10*time.Millisecond)
		}
	}
	batch, err := s.cons.Fetch(n, jetstream.FetchMaxWait(wait))
	if err != nil {
		return nil, fmt.Errorf("idemstream: jetstream fetch: %w", err)
	}
	var out []Message
	for m := range batch.Messages() {
		md, err := m.Metadata()
		if err != nil {
			return out, fmt.Errorf("idemstream: jetstream message metadata: %w", err)
		}
		id := m.Headers().Get(s.opts.IDHeader)
		if id == "" {
			id = md.Stream + "/" + strconv.FormatUint(md.Sequence.Stream, 10)
		}
		out = append(out, Message{
			Event:      Event{ID: []byte(id), Partition: md.Stream, Offset: md.Sequence.Stream, Payload: m.Data()},
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
	if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) {
		return out, fmt.Errorf("idemstream: jetstream fetch: %w", err)
	}
	return out, nil
}

// deadLetter publishes m to the dead-letter subject, if there is one.
func (s *JetStreamSource) deadLetter(ctx context.Context, m jetstream.Msg, md *jetstream.MsgMetadata, id, reason string) error {
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
		return fmt.Errorf("idemstream: publishing event %q to dead-letter subject %q: %w", id, s.opts.DeadLetterSubject, err)
	}
	return nil
}
