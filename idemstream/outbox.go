package idemstream

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemdb/idem"
	"github.com/vmihailenco/msgpack/v5"
)

// Delivery is one outbox message handed to OutboxOptions.Deliver.
type Delivery struct {
	// Key is the message's stable delivery key: "<sink>/<base64url event
	// id>/<index>". Every attempt of the message carries the same key,
	// so the receiving system can drop repeats (an Idempotency-Key header,
	// a unique column, a NATS Nats-Msg-Id).
	Key         string
	Destination string
	Payload     []byte
	// Attempt counts the attempts of this message in this process, from 1.
	Attempt int
}

// OutboxOptions configure an Outbox.
type OutboxOptions struct {
	// Deliver sends one message; nil error means the receiver has it. It
	// must be idempotent on Delivery.Key: a crash after the send and
	// before the message is marked delivered sends it again. Required.
	Deliver func(ctx context.Context, d Delivery) error
	// Workers is the number of concurrent deliveries (default 4).
	Workers int
	// MinBackoff and MaxBackoff bound the exponential backoff between
	// attempts of a failing message (defaults 100 ms and 30 s; each wait
	// is doubled, capped, and jittered by up to +-20%). Messages are
	// retried until delivered: none is dropped.
	MinBackoff, MaxBackoff time.Duration
	// AttemptTimeout bounds one Deliver call (default 30 s).
	AttemptTimeout time.Duration
	// Logger receives failures and recovery information. Default: discard.
	Logger *slog.Logger
}

// OutboxStats are an outbox's counters; Pending is the backlog.
type OutboxStats struct {
	Pending   int    // messages recorded and not yet delivered (the backlog)
	Delivered uint64 // messages delivered and removed since NewOutbox
	Attempts  uint64 // Deliver calls
	Failures  uint64 // Deliver calls that failed
	// Orphaned counts pending messages found at start-up whose event
	// record had already expired (sink TTL shorter than the outage): their
	// payload is gone. Each is logged with its key.
	Orphaned uint64
	// OldestPending is the age of the oldest undelivered message.
	OldestPending time.Duration
	LastError     string
}

// Outbox is the transactional outbox ("plan C"): a handler's outbox
// messages are committed in the same idem record as the event's dedup
// entry; each is then registered as a pending delivery (an idem claim on
// its delivery key, left in flight until the message is delivered) and a
// dispatcher delivers it with retries and exponential backoff, then
// releases the claim, which removes it. After a crash,
// pending deliveries are the claims idem lists as in doubt, and their
// payloads are read back from the event records. Run the dispatcher with
// Run.
type Outbox struct {
	st    idem.Store
	name  string
	scope string
	opts  OutboxOptions
	log   *slog.Logger
	hook  func(window, *Delivery) error

	mu      sync.Mutex
	pending map[string]*pendingMsg // by claim id
	wake    chan struct{}
	closed  bool

	delivered, attempts, failures, orphaned atomic.Uint64
	lastErr                                 atomic.Value // string
}

type pendingMsg struct {
	id      []byte
	claim   *idem.Claim
	d       Delivery
	since   time.Time
	next    time.Time
	backoff time.Duration
	running bool
}

func outboxScope(name string) string { return "idemstream.outbox/" + name }

// outboxID is the claim id of message i of event id in sink: a msgpack
// array, so that recovery finds the event record again.
func outboxID(sink string, id []byte, i int) ([]byte, string) {
	b, _ := msgpack.Marshal([]any{sink, id, i})
	return b, sink + "/" + base64.RawURLEncoding.EncodeToString(id) + "/" + strconv.Itoa(i)
}

func parseOutboxID(b []byte) (sink string, id []byte, i int, err error) {
	var v []any
	if err := unmarshal(b, &v); err != nil || len(v) != 3 {
		return "", nil, 0, fmt.Errorf("%w: outbox id %q", ErrCorruptRecord, b)
	}
	sink, ok1 := v[0].(string)
	id, ok2 := v[1].([]byte)
	var n int64
	var ok3 bool
	switch x := v[2].(type) {
	case int8:
		n, ok3 = int64(x), true
	case int16:
		n, ok3 = int64(x), true
	case int32:
		n, ok3 = int64(x), true
	case int64:
		n, ok3 = x, true
	case uint8:
		n, ok3 = int64(x), true
	case uint16:
		n, ok3 = int64(x), true
	case uint32:
		n, ok3 = int64(x), true
	case uint64:
		n, ok3 = int64(x), x < 1<<31
	}
	if !ok1 || !ok2 || !ok3 || n < 0 {
		return "", nil, 0, fmt.Errorf("%w: outbox id %q", ErrCorruptRecord, b)
	}
	return sink, id, int(n), nil
}

// NewOutbox opens the outbox name on st (one per name and store) and
// loads the deliveries a crash left pending. opts is required (its Deliver
// is); a zero field is its default. Give the outbox to the sinks
// (SinkOptions.Outbox) and run its dispatcher with Run.
func NewOutbox(ctx context.Context, st idem.Store, name string, opts *OutboxOptions) (*Outbox, error) {
	if opts == nil || opts.Deliver == nil {
		return nil, fmt.Errorf("idemstream: outbox %q: OutboxOptions.Deliver is required", name)
	}
	o := *opts
	switch {
	case o.Workers < 0:
		return nil, fmt.Errorf("idemstream: outbox %q: OutboxOptions.Workers %d is negative", name, o.Workers)
	case o.MinBackoff < 0 || o.MaxBackoff < 0 || o.AttemptTimeout < 0:
		return nil, fmt.Errorf("idemstream: outbox %q: negative OutboxOptions.MinBackoff %v, MaxBackoff %v or AttemptTimeout %v", name, o.MinBackoff, o.MaxBackoff, o.AttemptTimeout)
	case o.MaxBackoff > 0 && o.MaxBackoff < o.MinBackoff:
		return nil, fmt.Errorf("idemstream: outbox %q: OutboxOptions.MaxBackoff %v is below MinBackoff %v", name, o.MaxBackoff, o.MinBackoff)
	}
	if o.Workers == 0 {
		o.Workers = 4
	}
	if o.MinBackoff == 0 {
		o.MinBackoff = 100 * time.Millisecond
	}
	if o.MaxBackoff == 0 {
		o.MaxBackoff = max(30*time.Second, o.MinBackoff)
	}
	if o.AttemptTimeout == 0 {
		o.AttemptTimeout = 30 * time.Second
	}
	if err := takeName(st, "outbox", name); err != nil {
		return nil, err
	}
	ob := &Outbox{st: st, name: name, scope: outboxScope(name), opts: o, log: o.Logger,
		pending: map[string]*pendingMsg{}, wake: make(chan struct{}, 1)}
	if ob.log == nil {
		ob.log = discardLogger()
	}
	ob.lastErr.Store("")
	if err := ob.recover(ctx); err != nil {
		releaseName(st, "outbox", name)
		return nil, err
	}
	return ob, nil
}

func (o *Outbox) recover(ctx context.Context) error {
	doubts, err := inDoubt(ctx, o.st, o.scope)
	if err != nil {
		return fmt.Errorf("idemstream: outbox %q: %w", o.name, err)
	}
	for _, d := range doubts {
		sink, id, i, err := parseOutboxID(d.ID)
		if err != nil {
			o.log.Error("idemstream: outbox: unreadable pending message id, released", "outbox", o.name, "err", err)
			if err := d.Claim.Abort(ctx); err != nil {
				return err
			}
			continue
		}
		_, key := outboxID(sink, id, i)
		res, err := o.st.Lookup(ctx, idem.Request{Scope: sinkScope(sink), ID: id})
		if err != nil {
			return fmt.Errorf("idemstream: outbox %q: reading event %q of pending message %s: %w", o.name, id, key, err)
		}
		var msg *OutboxMessage
		if res.Status == idem.Done {
			rec, err := decodeEventRecord(sinkScope(sink), id, res.Reply)
			if err != nil {
				return err
			}
			if i < len(rec.Outbox) {
				msg = &rec.Outbox[i]
			}
		}
		if msg == nil {
			o.orphaned.Add(1)
			o.log.Error("idemstream: outbox: pending message's event record is gone (expired before delivery?); it cannot be delivered", "outbox", o.name, "key", key, "event_status", res.Status.String())
			if err := d.Claim.Abort(ctx); err != nil {
				return err
			}
			continue
		}
		o.add(d.ID, d.Claim, Delivery{Key: key, Destination: msg.Destination, Payload: msg.Payload}, d.ClaimedAt)
	}
	return nil
}

func (o *Outbox) add(id []byte, c *idem.Claim, d Delivery, since time.Time) {
	o.mu.Lock()
	o.pending[string(id)] = &pendingMsg{id: id, claim: c, d: d, since: since, backoff: o.opts.MinBackoff}
	o.mu.Unlock()
	select {
	case o.wake <- struct{}{}:
	default:
	}
}

// register records msgs of event id of sink as pending deliveries. It is
// idempotent: a message already pending or delivered is left alone.
func (o *Outbox) register(ctx context.Context, sink string, id []byte, msgs []OutboxMessage) error {
	for i := range msgs {
		cid, key := outboxID(sink, id, i)
		res, err := o.st.Begin(ctx, idem.Request{Scope: o.scope, ID: cid})
		if err != nil {
			return fmt.Errorf("idemstream: outbox %q: registering message %s: %w", o.name, key, err)
		}
		if res.Status == idem.Fresh {
			o.add(cid, res.Claim, Delivery{Key: key, Destination: msgs[i].Destination, Payload: msgs[i].Payload}, o.st.Now())
		}
	}
	return nil
}

// Stats returns the outbox's counters and backlog.
func (o *Outbox) Stats() OutboxStats {
	st := OutboxStats{Delivered: o.delivered.Load(), Attempts: o.attempts.Load(), Failures: o.failures.Load(), Orphaned: o.orphaned.Load()}
	st.LastError, _ = o.lastErr.Load().(string)
	now := o.st.Now()
	o.mu.Lock()
	st.Pending = len(o.pending)
	for _, p := range o.pending {
		if age := now.Sub(p.since); age > st.OldestPending {
			st.OldestPending = age
		}
	}
	o.mu.Unlock()
	return st
}

// Close releases the outbox's name. Pending messages stay recorded and
// are delivered by the next Outbox of that name (after the engine is
// reopened, or by this one's Run if it runs again).
func (o *Outbox) Close() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if !o.closed {
		o.closed = true
		releaseName(o.st, "outbox", o.name)
	}
	return nil
}

// Run is the dispatcher: it delivers pending messages with opts.Workers
// workers until ctx ends, then waits for the deliveries in progress and
// returns ctx's error.
func (o *Outbox) Run(ctx context.Context) error {
	sem := make(chan struct{}, o.opts.Workers)
	var wg sync.WaitGroup
	defer wg.Wait()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		now := o.st.Now()
		var due []*pendingMsg
		next := now.Add(time.Hour)
		o.mu.Lock()
		for _, p := range o.pending {
			if p.running {
				continue
			}
			if !p.next.After(now) {
				due = append(due, p)
			} else if p.next.Before(next) {
				next = p.next
			}
		}
		for _, p := range due {
			p.running = true
		}
		o.mu.Unlock()
		for _, p := range due {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				o.mu.Lock()
				for _, q := range due {
					q.running = false
				}
				o.mu.Unlock()
				return ctx.Err()
			}
			wg.Add(1)
			go func(p *pendingMsg) {
				defer wg.Done()
				defer func() { <-sem }()
				o.attempt(ctx, p)
				select {
				case o.wake <- struct{}{}:
				default:
				}
			}(p)
		}
		timer.Reset(next.Sub(now))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-o.wake:
		case <-timer.C:
		}
	}
}

// DeliverPending runs one round of deliveries synchronously (every message
// due now: not waiting out the backoff of a failed attempt) and returns how
// many are still pending; for tests and for draining before a shutdown.
//
// Backoff is measured on the engine's clock (Options.Clock), as the
// dispatcher's schedule is.
func (o *Outbox) DeliverPending(ctx context.Context) (int, error) {
	now := o.st.Now()
	o.mu.Lock()
	var due []*pendingMsg
	for _, p := range o.pending {
		if !p.running && !p.next.After(now) {
			p.running = true
			due = append(due, p)
		}
	}
	o.mu.Unlock()
	for _, p := range due {
		o.attempt(ctx, p)
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.pending), ctx.Err()
}

func (o *Outbox) attempt(ctx context.Context, p *pendingMsg) {
	p.d.Attempt++
	d := p.d
	fail := func(err error) {
		o.failures.Add(1)
		o.lastErr.Store(err.Error())
		o.mu.Lock()
		defer o.mu.Unlock()
		jitter := 0.8 + 0.4*rand.Float64()
		p.next = o.st.Now().Add(time.Duration(float64(p.backoff) * jitter))
		p.backoff = min(2*p.backoff, o.opts.MaxBackoff)
		p.running = false
	}
	if o.hook != nil {
		if err := o.hook(windowBeforeDelivery, &d); err != nil {
			fail(err)
			return
		}
	}
	o.attempts.Add(1)
	actx, cancel := context.WithTimeout(ctx, o.opts.AttemptTimeout)
	err := o.opts.Deliver(actx, d)
	cancel()
	if err != nil {
		o.log.Warn("idemstream: outbox delivery failed; retrying with backoff", "outbox", o.name, "key", d.Key, "attempt", d.Attempt, "err", err)
		fail(fmt.Errorf("delivering %s (attempt %d): %w", d.Key, d.Attempt, err))
		return
	}
	if o.hook != nil {
		if err := o.hook(windowAfterDelivery, &d); err != nil {
			fail(err)
			return
		}
	}
	// Delivered: release the pending claim. One record removes it (a
	// commit followed by an ack would leave a delivered entry behind if
	// the process died between the two); a crash before it resends the
	// message with the same key, which the receiver drops.
	if err := p.claim.Abort(ctx); err != nil && !errors.Is(err, idem.ErrLeaseLost) {
		fail(fmt.Errorf("removing delivered %s: %w", d.Key, err))
		return
	}
	o.delivered.Add(1)
	o.mu.Lock()
	if o.pending[string(p.id)] == p {
		delete(o.pending, string(p.id))
	}
	o.mu.Unlock()
}

// Name returns the outbox's name.
func (o *Outbox) Name() string { return o.name }
