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
}

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
func NewJetStreamSource(cons jetstream.Consumer, opts JetStreamOptions) *JetStreamSource {
	if opts.FetchWait <= 0 {
		opts.FetchWait = time.Second
	}
	if opts.IDHeader == "" {
		opts.IDHeader = nats.MsgIdHdr
	}
	return &JetStreamSource{cons: cons, opts: opts}
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
			Event: Event{ID: []byte(id), Partition: md.Stream, Offset: md.Sequence.Stream, Payload: m.Data()},
			Ack:   func(ctx context.Context) error { return m.DoubleAck(ctx) },
		})
	}
	if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) {
		return out, fmt.Errorf("idemstream: jetstream fetch: %w", err)
	}
	return out, nil
}
