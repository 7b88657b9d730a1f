// Package redisstream is idemstream's source for Redis Streams: it reads a
// consumer group and hands its entries to idemstream.Consume or
// idemstream.ConsumeTwoPhase, which acknowledge each (XACK) only after its
// effect is committed. It is a package of its own so that a program using
// idemstream with another broker does not link the Redis client.
package redisstream

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/idemdb/idem/idemstream"
	"github.com/redis/go-redis/v9"
)

// Options configure a RedisStreamSource.
type Options struct {
	Stream   string // the stream key (required)
	Group    string // the consumer group (required; created from the start of the stream if missing)
	Consumer string // this consumer's name in the group (required)
	// Block bounds how long Fetch waits for new entries (default 1 s).
	Block time.Duration
	// CheckpointPeriod is the longest an entry stays pending between its
	// delivery and its ack: the batch interval (Block) plus the drain
	// (applying the batch, or running its checkpoint, then acking). The
	// consumers acknowledge only after the commit, so every entry of a
	// batch stays pending that long. Default 30 s; at least Block.
	CheckpointPeriod time.Duration
	// ClaimMinIdle: entries pending on other consumers for longer than
	// this are taken over with XAUTOCLAIM (a consumer that died or
	// stalls). It must exceed CheckpointPeriod, or entries are claimed
	// by another consumer in the middle of a checkpoint (NewSource
	// refuses that); zero means twice CheckpointPeriod; negative turns
	// claiming off. A claimed entry whose first delivery is still running
	// is reported Busy by the sink and left pending, never run twice.
	ClaimMinIdle time.Duration
	// IDField names the entry field holding the stable event id (default
	// "id"); entries without it get "<stream>/<entry id>".
	IDField string
	// PayloadField names the entry field holding the payload (default
	// "data").
	PayloadField string
	// DeadLetterStream, if set, is the stream terminated entries go to (an
	// event that failed for good, or too often:
	// idemstream.ConsumeOptions.MaxDeliveries): in one MULTI/EXEC the entry is added
	// there (its id and payload fields, plus reason, stream, entry and
	// deliveries) and acknowledged. Without it a terminated entry is only
	// acknowledged.
	DeadLetterStream string
}

// Source reads a Redis stream through a consumer group with
// XREADGROUP, acknowledging each entry with XACK only after its effect is
// committed. Redis has no negative acknowledgement (Message.Nak is nil): a
// failed entry stays pending and is delivered again when this consumer
// re-reads its pending entries or another claims it; its delivery count
// is the group's (XPENDING). It first re-reads its own pending entries (deliveries of a
// previous run of the same consumer that were not acknowledged; again
// whenever no new entry arrived within Block, so that failed deliveries
// are retried), then takes over entries idle on other consumers
// (XAUTOCLAIM), then reads new ones. Partition is the stream key and Offset the entry id packed by
// Offset.
type Source struct {
	rdb       redis.UniversalClient
	opts      Options
	ownDone   bool
	ownCursor string
	cursor    string
}

// NewSource creates the group if it does not exist yet (reading
// from the start of the stream, MKSTREAM) and returns the source.
func NewSource(ctx context.Context, rdb redis.UniversalClient, o *Options) (*Source, error) {
	if o == nil || o.Stream == "" || o.Group == "" || o.Consumer == "" {
		return nil, errors.New("redisstream: Options.Stream, Group and Consumer are required")
	}
	if rdb == nil {
		return nil, errors.New("redisstream: nil Redis client")
	}
	opts := *o
	if opts.Block < 0 || opts.CheckpointPeriod < 0 {
		return nil, fmt.Errorf("redisstream: negative Options.Block %v or CheckpointPeriod %v", opts.Block, opts.CheckpointPeriod)
	}
	if opts.Block == 0 {
		opts.Block = time.Second
	}
	if opts.CheckpointPeriod == 0 {
		opts.CheckpointPeriod = max(30*time.Second, opts.Block)
	}
	if opts.CheckpointPeriod < opts.Block {
		return nil, fmt.Errorf("redisstream: Options.CheckpointPeriod %v is shorter than Block %v: a batch waits up to Block before its checkpoint starts", opts.CheckpointPeriod, opts.Block)
	}
	switch {
	case opts.ClaimMinIdle == 0:
		opts.ClaimMinIdle = 2 * opts.CheckpointPeriod
	case opts.ClaimMinIdle > 0 && opts.ClaimMinIdle <= opts.CheckpointPeriod:
		return nil, fmt.Errorf("redisstream: Options.ClaimMinIdle %v must exceed CheckpointPeriod %v: entries stay pending until their checkpoint is committed, so other consumers would claim them mid-checkpoint", opts.ClaimMinIdle, opts.CheckpointPeriod)
	}
	if opts.IDField == "" {
		opts.IDField = "id"
	}
	if opts.PayloadField == "" {
		opts.PayloadField = "data"
	}
	err := rdb.XGroupCreateMkStream(ctx, opts.Stream, opts.Group, "0").Err()
	if err != nil && !strings.HasPrefix(err.Error(), "BUSYGROUP") {
		return nil, fmt.Errorf("redisstream: creating group %q on stream %q: %w", opts.Group, opts.Stream, err)
	}
	return &Source{rdb: rdb, opts: opts, ownCursor: "0", cursor: "0-0"}, nil
}

// Offset packs a stream entry id "ms-seq" into an offset (ms << 20 |
// seq), ordered as the ids are. It fails for ids beyond year 2527 or with
// seq >= 2^20.
func Offset(id string) (uint64, error) {
	msS, seqS, ok := strings.Cut(id, "-")
	if !ok {
		return 0, fmt.Errorf("redisstream: stream entry id %q is not ms-seq", id)
	}
	ms, err1 := strconv.ParseUint(msS, 10, 64)
	seq, err2 := strconv.ParseUint(seqS, 10, 64)
	if err1 != nil || err2 != nil || ms >= 1<<44 || seq >= 1<<20 {
		return 0, fmt.Errorf("redisstream: stream entry id %q cannot be packed into an offset", id)
	}
	return ms<<20 | seq, nil
}

// convert makes the messages of entries; deliveries gives each entry's
// delivery count (nil: first deliveries).
func (s *Source) convert(msgs []redis.XMessage, deliveries map[string]int64) []idemstream.Message {
	out := make([]idemstream.Message, 0, len(msgs))
	for _, m := range msgs {
		id := s.opts.Stream + "/" + m.ID
		if v, ok := m.Values[s.opts.IDField].(string); ok && v != "" {
			id = v
		}
		payload, _ := m.Values[s.opts.PayloadField].(string)
		off, _ := Offset(m.ID) // zero (no frontier) for an unpackable id
		entry := m.ID
		n := 1
		if deliveries != nil {
			n = int(deliveries[entry])
		}
		out = append(out, idemstream.Message{
			Event:      idemstream.Event{ID: []byte(id), Partition: s.opts.Stream, Offset: off, Payload: []byte(payload)},
			Deliveries: n,
			DeadLetter: s.opts.DeadLetterStream,
			Ack: func(ctx context.Context) error {
				return s.rdb.XAck(ctx, s.opts.Stream, s.opts.Group, entry).Err()
			},
			Term: func(ctx context.Context, reason string) error {
				return s.term(ctx, entry, id, payload, n, reason)
			},
		})
	}
	return out
}

// term acknowledges a terminated entry, adding it to the dead-letter
// stream in the same MULTI/EXEC.
func (s *Source) term(ctx context.Context, entry, id, payload string, deliveries int, reason string) error {
	_, err := s.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		if s.opts.DeadLetterStream != "" {
			p.XAdd(ctx, &redis.XAddArgs{Stream: s.opts.DeadLetterStream, Values: []any{
				s.opts.IDField, id, s.opts.PayloadField, payload, "reason", reason,
				"stream", s.opts.Stream, "entry", entry, "deliveries", deliveries}})
		}
		p.XAck(ctx, s.opts.Stream, s.opts.Group, entry)
		return nil
	})
	if err != nil {
		return fmt.Errorf("redisstream: terminating entry %s of %q (dead-letter stream %q): %w", entry, s.opts.Stream, s.opts.DeadLetterStream, err)
	}
	return nil
}

// deliveries returns the delivery counts of pending entries msgs (a
// re-read or a claim counted one more delivery each).
func (s *Source) deliveries(ctx context.Context, msgs []redis.XMessage) (map[string]int64, error) {
	pend, err := s.rdb.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: s.opts.Stream, Group: s.opts.Group,
		Start: msgs[0].ID, End: msgs[len(msgs)-1].ID, Count: int64(len(msgs)), Consumer: s.opts.Consumer}).Result()
	if err != nil {
		return nil, fmt.Errorf("redisstream: XPENDING of %q: %w", s.opts.Stream, err)
	}
	n := make(map[string]int64, len(pend))
	for _, p := range pend {
		n[p.ID] = p.RetryCount
	}
	return n, nil
}

// Fetch implements idemstream.Source.
func (s *Source) Fetch(ctx context.Context, n int) ([]idemstream.Message, error) {
	if !s.ownDone {
		// Our own pending entries from a previous run.
		res, err := s.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: s.opts.Group, Consumer: s.opts.Consumer,
			Streams: []string{s.opts.Stream, s.ownCursor}, Count: int64(n)}).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return nil, fmt.Errorf("redisstream: XREADGROUP own pending of %q: %w", s.opts.Stream, err)
		}
		if len(res) > 0 && len(res[0].Messages) > 0 {
			msgs := res[0].Messages
			s.ownCursor = msgs[len(msgs)-1].ID
			n, err := s.deliveries(ctx, msgs)
			if err != nil {
				return nil, err
			}
			return s.convert(msgs, n), nil
		}
		s.ownDone = true
	}
	if s.opts.ClaimMinIdle > 0 {
		msgs, next, err := s.rdb.XAutoClaim(ctx, &redis.XAutoClaimArgs{Stream: s.opts.Stream, Group: s.opts.Group,
			Consumer: s.opts.Consumer, MinIdle: s.opts.ClaimMinIdle, Start: s.cursor, Count: int64(n)}).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return nil, fmt.Errorf("redisstream: XAUTOCLAIM on %q: %w", s.opts.Stream, err)
		}
		s.cursor = next
		if s.cursor == "" {
			s.cursor = "0-0"
		}
		if len(msgs) > 0 {
			n, err := s.deliveries(ctx, msgs)
			if err != nil {
				return nil, err
			}
			return s.convert(msgs, n), nil
		}
	}
	block := s.opts.Block
	if dl, ok := ctx.Deadline(); ok {
		if left := time.Until(dl); left < block {
			block = max(left, time.Millisecond)
		}
	}
	res, err := s.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: s.opts.Group, Consumer: s.opts.Consumer,
		Streams: []string{s.opts.Stream, ">"}, Count: int64(n), Block: block}).Result()
	if err != nil {
		if errors.Is(err, redis.Nil) {
			s.idle()
			return nil, nil
		}
		return nil, fmt.Errorf("redisstream: XREADGROUP on %q: %w", s.opts.Stream, err)
	}
	if len(res) == 0 || len(res[0].Messages) == 0 {
		s.idle()
		return nil, nil
	}
	return s.convert(res[0].Messages, nil), nil
}

// idle: nothing new arrived; the next Fetch re-reads this consumer's own
// pending entries (deliveries whose handler failed, or that were Busy),
// so they are retried even with ClaimMinIdle off.
func (s *Source) idle() {
	s.ownDone, s.ownCursor = false, "0"
}
