package idemstream_test

// The broker scenarios: the idemstream consumers against real brokers,
// through the source packages (jetstream, redisstream), which import
// idemstream: hence an external test package, with the internal harness
// (crashable world, ledgers, hooks) from export_test.go.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	. "github.com/idemdb/idem/idemstream" // the scenarios read as the package's own tests
	"github.com/idemdb/idem/idemstream/internal/brokertest"
	streamjs "github.com/idemdb/idem/idemstream/jetstream"
	"github.com/idemdb/idem/idemstream/redisstream"
	"github.com/idemdb/idem/idemstream/streamprom"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
)

var errKilled = errors.New("test: consumer killed")

// brokerLedger is the effect target of the broker tests: it counts
// applications per event id; the effect of a held event waits until its
// gate opens (the test opens it once the broker has handed the event to
// another consumer, which found it in progress).
type brokerLedger struct {
	mu      sync.Mutex
	applied map[string]int
	held    map[string]chan struct{}
	fail    map[string]int // fail this many first attempts
}

func (l *brokerLedger) handler(ctx context.Context, ev Event) (Effect, error) {
	l.mu.Lock()
	gate := l.held[string(ev.ID)]
	if l.fail[string(ev.ID)] > 0 {
		l.fail[string(ev.ID)]--
		l.mu.Unlock()
		return Effect{}, errors.New("ledger: transient failure")
	}
	l.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return Effect{}, ctx.Err()
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.applied[string(ev.ID)]++
	return Effect{Result: []byte("ok")}, nil
}

func (l *brokerLedger) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.applied)
}

func brokerEvents(n, dups int) (ids []string) {
	for i := 0; i < n; i++ {
		ids = append(ids, fmt.Sprintf("order-%04d", i))
	}
	for d := 0; d < dups; d++ {
		ids = append(ids, ids[d*3]) // producer retries: same event id, new position
	}
	return ids
}

// runBrokerScenario runs the forced-redelivery scenario against a broker:
// consumer A commits a batch and is killed before it acks it; consumers B
// and C then share the stream; one event's effect is held until the broker
// has handed it to the other consumer (its redelivery timeout passed) and
// that delivery was found Busy. done reports when the broker has nothing
// pending.
func runBrokerScenario(t *testing.T, ctx context.Context, ids []string, newSource func(name string) Source, done func() bool) {
	e := OpenEngine(t, vfs.NewMem(), nil)
	defer e.Close()
	s, err := NewSink(ctx, e, "ledger", &SinkOptions{})
	if err != nil {
		t.Fatal(err)
	}
	held := ids[77]
	gate := make(chan struct{})
	l := &brokerLedger{applied: map[string]int{}, held: map[string]chan struct{}{held: gate},
		fail: map[string]int{ids[150]: 2, ids[190]: 1}} // retried after a failure: not acked, redelivered
	var open sync.Once
	onBatch := func(msgs []Message, outs []Outcome) {
		for i, o := range outs {
			if o.Status == Busy && string(msgs[i].Event.ID) == held {
				open.Do(func() { close(gate) })
			}
		}
	}
	// Consumer A: killed after committing its second batch, before acking.
	var batches atomic.Int32
	SetSinkHook(s, func(w Window, ev *Event) error {
		if w == WindowBeforeAck && batches.Add(1) == 2 {
			return errKilled
		}
		return nil
	})
	err = Consume(ctx, newSource("a"), s, l.handler, &ConsumeOptions{BatchSize: 10})
	if !errors.Is(err, errKilled) {
		t.Fatalf("consumer a: %v", err)
	}
	SetSinkHook(s, nil)
	t.Logf("consumer a killed with %d events committed and 10 of them unacked", l.count())

	cctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, name := range []string{"b", "c"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := Consume(cctx, newSource(name), s, l.handler, &ConsumeOptions{BatchSize: 10, OnBatch: onBatch}); err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("consumer %s: %v", name, err)
			}
		}()
	}
	distinct := distinctIDs(ids)
	awaitConsumers(t, ctx, cancel, &wg, len(distinct), l.count, done, func() string {
		return fmt.Sprintf("%d of %d events applied; stats %+v", l.count(), len(distinct), s.Stats())
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	for id := range distinct {
		if l.applied[id] != 1 {
			t.Fatalf("event %s applied %d times", id, l.applied[id])
		}
	}
	st := s.Stats()
	t.Logf("sink stats %+v", st)
	if st.Replayed < 10 {
		t.Fatalf("the unacked batch of the killed consumer was not replayed (%d replays)", st.Replayed)
	}
	if st.Busy == 0 { // the held event's gate opens only on a Busy delivery
		t.Fatal("no delivery found its event in progress elsewhere")
	}
}

// distinctIDs is the set of ids (brokerEvents repeats some).
func distinctIDs(ids []string) map[string]bool {
	d := make(map[string]bool, len(ids))
	for _, id := range ids {
		d[id] = true
	}
	return d
}

// awaitConsumers waits until count() reaches want and the broker says
// done, then stops the consumers (cancel) and waits for them. At ctx's
// deadline it stops them and fails the test with progress().
func awaitConsumers(t *testing.T, ctx context.Context, cancel func(), wg *sync.WaitGroup, want int, count func() int, done func() bool, progress func() string) {
	t.Helper()
	for count() < want || !done() {
		if ctx.Err() != nil {
			cancel()
			wg.Wait()
			t.Fatalf("timed out: %s", progress())
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	wg.Wait()
}

// consumeUntilCrash runs consumer a (consume) with a ctx that ends when
// w's process crashes, and fails the test unless it crashed (at win).
func consumeUntilCrash(t *testing.T, ctx context.Context, w *World, win Window, consume func(ctx context.Context) error) {
	t.Helper()
	actx, acancel := context.WithCancel(ctx)
	dead := w.Dead()
	go func() {
		select {
		case <-dead:
			acancel()
		case <-actx.Done():
		}
	}()
	_ = consume(actx)
	acancel()
	if !w.Crashed() {
		t.Fatalf("consumer a did not crash at %s", win)
	}
}

// shareUntilOnce runs consumers b and c (consume) until counts holds every
// distinct id of ids and the broker says done, and fails the test unless
// each of them was counted once (what: "committed", "applied").
func shareUntilOnce(t *testing.T, ctx context.Context, ids []string, done func() bool, what string, counts func() map[string]int, consume func(ctx context.Context, name string) error) {
	t.Helper()
	cctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for _, name := range []string{"b", "c"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := consume(cctx, name); err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("consumer %s: %v", name, err)
			}
		}()
	}
	distinct := distinctIDs(ids)
	count := func() int { return len(counts()) }
	awaitConsumers(t, ctx, cancel, &wg, len(distinct), count, done, func() string {
		return fmt.Sprintf("%d of %d events %s", count(), len(distinct), what)
	})
	got := counts()
	for id := range distinct {
		if got[id] != 1 {
			t.Fatalf("event %s %s %d times", id, what, got[id])
		}
	}
}

// TestJetStreamExactlyOnce: a real (embedded) NATS server with JetStream,
// a durable pull consumer with a short AckWait, forced redeliveries (a
// consumer killed between commit and ack; events slower than AckWait), and
// every event applied exactly once with nothing left pending.
func TestJetStreamExactlyOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()
	ids := brokerEvents(200, 10)
	f := jetStreamFeed(t, ctx, pubsOf(ids))
	runBrokerScenario(t, ctx, ids, f.newSource, f.done)
	info, err := f.cons.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("consumer: delivered %d, ack floor %d, redelivered %d", info.Delivered.Stream, info.AckFloor.Stream, info.NumRedelivered)
	if info.AckFloor.Stream != uint64(len(ids)) {
		t.Fatalf("ack floor %d, want %d", info.AckFloor.Stream, len(ids))
	}
}

// brokerFeed is a stream on a real broker with the events published: the
// sources that read it (one per consumer name), whether every event was
// acked, and the dead letters of the terminated ones.
type brokerFeed struct {
	newSource   func(name string) Source
	done        func() bool
	deadLetters func() []deadLetter
	cons        jetstream.Consumer // JetStream only
}

// pub is one message published to a feed: an event id and its payload.
type pub struct{ id, data string }

// pubsOf publishes each id with the payload "payload-of-<id>".
func pubsOf(ids []string) []pub {
	ps := make([]pub, len(ids))
	for i, id := range ids {
		ps[i] = pub{id, "payload-of-" + id}
	}
	return ps
}

// deadLetter is a message found on a dead-letter destination.
type deadLetter struct{ id, data, reason string }

// jetStreamFeed starts an embedded NATS server with JetStream, publishes
// msgs (with the id in the Event-Id header) to the stream ORDERS, and reads
// them with a durable pull consumer whose AckWait is 300 ms. Terminated
// messages go to the subject dead.orders, kept by the stream DEAD.
func jetStreamFeed(t *testing.T, ctx context.Context, msgs []pub) brokerFeed {
	t.Helper()
	ns := brokertest.StartNATS(t)
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}}); err != nil {
		t.Fatal(err)
	}
	dead, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "DEAD", Subjects: []string{"dead.>"}})
	if err != nil {
		t.Fatal(err)
	}
	for i, p := range msgs {
		m := nats.NewMsg("orders.new")
		m.Header.Set("Event-Id", p.id)
		m.Data = []byte(p.data)
		if _, err := js.PublishMsg(ctx, m); err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, "ORDERS", jetstream.ConsumerConfig{
		Durable: "ledger", AckPolicy: jetstream.AckExplicitPolicy, AckWait: 300 * time.Millisecond, MaxAckPending: 1000,
	})
	if err != nil {
		t.Fatal(err)
	}
	return brokerFeed{
		newSource: func(string) Source {
			src, err := streamjs.NewSource(cons, &streamjs.Options{FetchWait: 100 * time.Millisecond, IDHeader: "Event-Id",
				DeadLetterSubject: "dead.orders", DeadLetterJS: js})
			if err != nil {
				t.Fatal(err)
			}
			return src
		},
		done: func() bool {
			info, err := cons.Info(ctx)
			return err == nil && info.NumAckPending == 0 && info.NumPending == 0
		},
		deadLetters: func() []deadLetter {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second) // also after the test's deadline
			defer cancel()
			info, err := dead.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var out []deadLetter
			for seq := uint64(1); seq <= info.State.LastSeq; seq++ {
				m, err := dead.GetMsg(ctx, seq)
				if err != nil {
					t.Fatal(err)
				}
				out = append(out, deadLetter{m.Header.Get("Event-Id"), string(m.Data), m.Header.Get(streamjs.DeadLetterReasonHeader)})
			}
			return out
		},
		cons: cons,
	}
}

// redisFeed adds msgs to stream on rdb (fields id and data) and reads them
// through the consumer group "ledger", taking over entries idle for 300 ms.
// Terminated entries go to the stream "<stream>.dead".
func redisFeed(t *testing.T, ctx context.Context, rdb *redis.Client, stream string, msgs []pub) brokerFeed {
	t.Helper()
	for _, p := range msgs {
		if err := rdb.XAdd(ctx, &redis.XAddArgs{Stream: stream, Values: map[string]any{"id": p.id, "data": p.data}}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	return brokerFeed{
		newSource: func(name string) Source {
			src, err := redisstream.NewSource(ctx, rdb, &redisstream.Options{Stream: stream, Group: "ledger", Consumer: name,
				Block: 100 * time.Millisecond, CheckpointPeriod: 200 * time.Millisecond, ClaimMinIdle: 300 * time.Millisecond,
				DeadLetterStream: stream + ".dead"})
			if err != nil {
				t.Fatal(err)
			}
			return src
		},
		done: func() bool {
			p, err := rdb.XPending(ctx, stream, "ledger").Result()
			if err != nil || p.Count != 0 {
				return false
			}
			groups, err := rdb.XInfoGroups(ctx, stream).Result()
			return err == nil && len(groups) == 1 && groups[0].Lag == 0
		},
		deadLetters: func() []deadLetter {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second) // also after the test's deadline
			defer cancel()
			entries, err := rdb.XRange(ctx, stream+".dead", "-", "+").Result()
			if err != nil {
				t.Fatal(err)
			}
			var out []deadLetter
			for _, e := range entries {
				str := func(k string) string { v, _ := e.Values[k].(string); return v }
				out = append(out, deadLetter{str("id"), str("data"), str("reason")})
			}
			return out
		},
	}
}

// TestRedisStreamsExactlyOnce: a real redis-server, a consumer group read
// with XREADGROUP, acks (XACK) only after commit, a consumer killed
// between commit and ack whose pending entries the others take over with
// XAUTOCLAIM after their idle time, events slower than that idle time
// taken over while still running, and every event applied exactly once
// with nothing left pending.
func TestRedisStreamsExactlyOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()
	ids := brokerEvents(200, 10)
	f := redisFeed(t, ctx, brokertest.StartRedis(t), "orders", pubsOf(ids))
	runBrokerScenario(t, ctx, ids, f.newSource, f.done)
}

// guardedSource: a crashed process cannot ack.
type guardedSource struct {
	w   *World
	src Source
}

func (g guardedSource) Fetch(ctx context.Context, n int) ([]Message, error) {
	msgs, err := g.src.Fetch(ctx, n)
	for i := range msgs {
		ack, nak, term := msgs[i].Ack, msgs[i].Nak, msgs[i].Term
		msgs[i].Ack = func(ctx context.Context) error { return g.w.Do(func() error { return ack(ctx) }) }
		if nak != nil {
			msgs[i].Nak = func(ctx context.Context, d time.Duration) error { return g.w.Do(func() error { return nak(ctx, d) }) }
		}
		if term != nil {
			msgs[i].Term = func(ctx context.Context, r string) error { return g.w.Do(func() error { return term(ctx, r) }) }
		}
	}
	return msgs, err
}

// runTwoPhaseBrokerScenario: consumer A runs checkpoints against the
// broker and crashes at win in its second checkpoint (the idem directory
// keeps only what was synced, the broker never gets A's later acks);
// after recovery consumers B and C share the stream, getting A's unacked
// messages again once the broker's redelivery timeout passes. The
// transactional ledger must hold every event exactly once, with every
// transaction ended and no protocol violation.
func runTwoPhaseBrokerScenario(t *testing.T, ctx context.Context, win Window, ids []string, newSource func(name string) Source, done func() bool) {
	w := NewWorld()
	l := NewTxnLedger(w)
	tp, _, err := NewTwoPhaseWithHook(t, ctx, w, l, func(got Window, k uint64) error {
		if got == win && k == 2 {
			return w.Crash()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	consumeUntilCrash(t, ctx, w, win, func(ctx context.Context) error {
		return ConsumeTwoPhase(ctx, guardedSource{w, newSource("a")}, tp, &ConsumeOptions{BatchSize: 20})
	})
	w.Restart()
	tp, rep, err := NewTwoPhaseWithHook(t, ctx, w, l, nil)
	if err != nil {
		t.Fatal(err)
	}
	shareUntilOnce(t, ctx, ids, done, "committed", l.Committed, func(ctx context.Context, name string) error {
		return ConsumeTwoPhase(ctx, guardedSource{w, newSource(name)}, tp, &ConsumeOptions{BatchSize: 20})
	})
	l.Check(t)
	t.Logf("recovery %+v, %d checkpoints", rep, tp.LastCheckpoint())
}

var twoPhaseBrokerWindows = []Window{WindowAfterPreCommit, WindowAfterCheckpoint, WindowBeforeAck}

func TestJetStreamTwoPhase(t *testing.T) {
	runBrokerWindows(t, twoPhaseBrokerWindows, jetStreamWindowFeed, runTwoPhaseBrokerScenario)
}

func TestRedisStreamsTwoPhase(t *testing.T) {
	runBrokerWindows(t, twoPhaseBrokerWindows, redisWindowFeed(brokertest.StartRedis(t), "orders-"), runTwoPhaseBrokerScenario)
}

// A windowFeed publishes msgs on a broker for the scenario of one crash
// window.
type windowFeed func(t *testing.T, ctx context.Context, win Window, msgs []pub) brokerFeed

// jetStreamWindowFeed: a JetStream server of the window's own.
func jetStreamWindowFeed(t *testing.T, ctx context.Context, _ Window, msgs []pub) brokerFeed {
	return jetStreamFeed(t, ctx, msgs)
}

// redisWindowFeed: the stream prefix+window on rdb.
func redisWindowFeed(rdb *redis.Client, prefix string) windowFeed {
	return func(t *testing.T, ctx context.Context, win Window, msgs []pub) brokerFeed {
		return redisFeed(t, ctx, rdb, prefix+string(win), msgs)
	}
}

// runBrokerWindows runs scenario (runTwoPhaseBrokerScenario or
// runSinkBrokerCrash) in a subtest per crash window, each bounded to 30
// seconds, over 120 events, 8 of them sent twice, that feed publishes.
func runBrokerWindows(t *testing.T, windows []Window, feed windowFeed,
	scenario func(t *testing.T, ctx context.Context, win Window, ids []string, newSource func(name string) Source, done func() bool)) {
	for _, win := range windows {
		t.Run(string(win), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			ids := brokerEvents(120, 8)
			f := feed(t, ctx, win, pubsOf(ids))
			scenario(t, ctx, win, ids, f.newSource, f.done)
		})
	}
}

// runSinkBrokerCrash: consumer A applies events through the idempotent
// sink and its process crashes at win (the idem directory keeps only what
// was synced; the ledger and the broker nothing A does afterwards); after
// recovery (the ledger tells which in-doubt events had run) consumers B and
// C finish the stream from the broker's redeliveries.
func runSinkBrokerCrash(t *testing.T, ctx context.Context, win Window, ids []string, newSource func(name string) Source, done func() bool) {
	w := NewWorld()
	l := NewLedger(w)
	e := OpenEngine(t, w.FS(), nil)
	s, err := NewSink(ctx, e, "ledger", &SinkOptions{Recover: l.Recover})
	if err != nil {
		t.Fatal(err)
	}
	var hits atomic.Int32
	SetSinkHook(s, func(got Window, _ *Event) error {
		if got == win && hits.Add(1) == 25 {
			return w.Crash()
		}
		return nil
	})
	consumeUntilCrash(t, ctx, w, win, func(ctx context.Context) error {
		return Consume(ctx, guardedSource{w, newSource("a")}, s, l.Handler, &ConsumeOptions{BatchSize: 20})
	})
	s.Close()
	e.Close()
	w.Restart()
	e = OpenEngine(t, w.FS(), nil)
	defer e.Close()
	s, err = NewSink(ctx, e, "ledger", &SinkOptions{Recover: l.Recover})
	if err != nil {
		t.Fatal(err)
	}
	shareUntilOnce(t, ctx, ids, done, "applied", l.Applied, func(ctx context.Context, name string) error {
		return Consume(ctx, guardedSource{w, newSource(name)}, s, l.Handler, &ConsumeOptions{BatchSize: 20})
	})
	t.Logf("sink after recovery: %+v", s.Stats())
}

var sinkBrokerWindows = []Window{WindowAfterEffect, WindowAfterCommit}

func TestJetStreamSinkCrash(t *testing.T) {
	runBrokerWindows(t, sinkBrokerWindows, jetStreamWindowFeed, runSinkBrokerCrash)
}

func TestRedisStreamsSinkCrash(t *testing.T) {
	runBrokerWindows(t, sinkBrokerWindows, redisWindowFeed(brokertest.StartRedis(t), "sink-"), runSinkBrokerCrash)
}

// lockedBuffer is a log destination shared by goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) count(s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Count(l.b.String(), s)
}

// poisonPubs is a stream with events that cannot succeed: an id reused
// with another payload (ErrConflict), an id over MaxEventIDLen
// (ErrInvalidEvent), an event whose handler always fails, and one whose
// handler fails for good (ErrPermanent), among 20 good ones.
func poisonPubs() (msgs []pub, good []string, long string) {
	for i := 0; i < 20; i++ {
		id := fmt.Sprintf("good-%02d", i)
		good = append(good, id)
		msgs = append(msgs, pub{id, "payload-of-" + id})
		if i == 10 {
			msgs = append(msgs, pub{"always-fails", "x"}, pub{"bad-amount", "x"})
		}
	}
	long = strings.Repeat("L", MaxEventIDLen+1)
	msgs = append(msgs, pub{long, "x"}, pub{"good-03", "another payload"})
	return msgs, good, long
}

// runPoisonScenario consumes poisonPubs from a real broker with
// MaxDeliveries 3: the good events are applied once each, the failing
// handler runs exactly 3 times, every event that cannot succeed is
// terminated at the broker (nothing left pending) and found on the
// dead-letter destination with its reason; the sink's counters and the
// error log count the 4 of them.
func runPoisonScenario(t *testing.T, ctx context.Context, f brokerFeed, good []string, long string) {
	e := OpenEngine(t, vfs.NewMem(), nil)
	defer e.Close()
	var logs lockedBuffer
	s, err := NewSink(ctx, e, "ledger", &SinkOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	runs := map[string]int{}
	h := func(ctx context.Context, ev Event) (Effect, error) {
		mu.Lock()
		defer mu.Unlock()
		runs[string(ev.ID)]++
		switch string(ev.ID) {
		case "always-fails":
			return Effect{}, errors.New("ledger: account locked")
		case "bad-amount":
			return Effect{}, fmt.Errorf("ledger: amount %q is not a number: %w", ev.Payload, ErrPermanent)
		}
		return Effect{Result: []byte("ok")}, nil
	}
	cctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		err := Consume(cctx, f.newSource("a"), s, h, &ConsumeOptions{BatchSize: 5, MaxDeliveries: 3, RetryDelay: 10 * time.Millisecond,
			Logger: slog.New(slog.NewTextHandler(&logs, nil))})
		if !errors.Is(err, context.Canceled) {
			t.Errorf("consumer: %v", err)
		}
	}()
	awaitConsumers(t, ctx, cancel, &wg, 4, func() int { return len(f.deadLetters()) }, f.done, func() string {
		mu.Lock()
		defer mu.Unlock()
		return fmt.Sprintf("dead letters %v, handler runs %v, stats %+v, pending left: %v", f.deadLetters(), runs, s.Stats(), !f.done())
	})
	mu.Lock()
	defer mu.Unlock()
	for _, id := range good {
		if runs[id] != 1 {
			t.Fatalf("good event %s ran %d times", id, runs[id])
		}
	}
	if runs["always-fails"] != 3 || runs["bad-amount"] != 1 {
		t.Fatalf("the failing handler ran %d times (want MaxDeliveries, 3), the permanent failure %d (want 1)", runs["always-fails"], runs["bad-amount"])
	}
	want := map[string]string{
		"always-fails": "at delivery 3 (MaxDeliveries 3): ",
		"bad-amount":   "failed for good: ",
		long:           "invalid event",
		"good-03":      "different payload",
	}
	dl := f.deadLetters()
	if len(dl) != len(want) {
		t.Fatalf("dead letters %v, want one for each of %d events", dl, len(want))
	}
	for _, d := range dl {
		if w, ok := want[d.id]; !ok || !strings.Contains(d.reason, w) {
			t.Fatalf("dead letter %q (reason %q): want a reason with %q", d.id, d.reason, w)
		}
		if d.id == "good-03" && d.data != "another payload" {
			t.Fatalf("the conflicting dead letter carries %q", d.data)
		}
	}
	st := s.Stats()
	if st.Terminated != 4 || st.DeadLettered != 4 || st.Retried != 2 {
		t.Fatalf("stats %+v: want 4 terminated and dead-lettered, 2 retried", st)
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(streamprom.NewCollector([]*Sink{s}, nil, nil))
	if err := testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP idemstream_sink_dead_lettered_total Terminated events handed to the source's dead-letter destination.
# TYPE idemstream_sink_dead_lettered_total counter
idemstream_sink_dead_lettered_total{sink="ledger"} 4
# HELP idemstream_sink_terminated_total Events terminated without their effect: failed for good (conflict, invalid, permanent) or at MaxDeliveries.
# TYPE idemstream_sink_terminated_total counter
idemstream_sink_terminated_total{sink="ledger"} 4
`), "idemstream_sink_terminated_total", "idemstream_sink_dead_lettered_total"); err != nil {
		t.Fatal(err)
	}
	if n := logs.count("event terminated without its effect"); n != 4 {
		t.Fatalf("%d terminations logged, want 4:\n%s", n, logs.b.String())
	}
	t.Logf("sink stats %+v", st)
}

// TestJetStreamPoisonMessages: see runPoisonScenario (JetStream: failed
// deliveries are nak'd with a delay, terminated with a reason, dead letters
// published to a subject).
func TestJetStreamPoisonMessages(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msgs, good, long := poisonPubs()
	runPoisonScenario(t, ctx, jetStreamFeed(t, ctx, msgs), good, long)
}

// TestRedisStreamsPoisonMessages: see runPoisonScenario (Redis Streams:
// failed entries stay pending and are re-read, terminated ones are added
// to the dead-letter stream and acknowledged in one MULTI/EXEC).
func TestRedisStreamsPoisonMessages(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msgs, good, long := poisonPubs()
	runPoisonScenario(t, ctx, redisFeed(t, ctx, brokertest.StartRedis(t), "orders", msgs), good, long)
}

// TestJetStreamTwoPhasePoison: an event whose Invoke always fails aborts
// its checkpoint each time; ConsumeTwoPhase counts that as the event's
// failure and terminates it at MaxDeliveries (to the dead-letter subject),
// so the rest of the stream commits; an id reused with another payload
// and an invalid id are terminated at once.
func TestJetStreamTwoPhasePoison(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msgs, good, long := poisonPubs()
	f := jetStreamFeed(t, ctx, msgs)
	w := NewWorld()
	l := NewTxnLedger(w)
	l.FailInvoke("always-fails")
	tp, _, err := NewTwoPhaseWithHook(t, ctx, w, l, nil)
	if err != nil {
		t.Fatal(err)
	}
	cctx, ccancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := ConsumeTwoPhase(cctx, f.newSource("a"), tp, &ConsumeOptions{BatchSize: 5, MaxDeliveries: 3, RetryDelay: 10 * time.Millisecond}); !errors.Is(err, context.Canceled) {
			t.Errorf("consumer: %v", err)
		}
	}()
	// bad-amount only fails in the sink scenario's handler: here it commits.
	awaitConsumers(t, ctx, ccancel, &wg, 3, func() int { return len(f.deadLetters()) }, f.done, func() string {
		return fmt.Sprintf("dead letters %v, stats %+v", f.deadLetters(), tp.Stats())
	})
	l.Check(t)
	committed := l.Committed()
	for _, id := range append(good, "bad-amount") {
		if committed[id] != 1 {
			t.Fatalf("event %s committed %d times", id, committed[id])
		}
	}
	if n := l.Invokes("always-fails"); n != 3 {
		t.Fatalf("the failing event was invoked %d times, want MaxDeliveries (3)", n)
	}
	got := map[string]string{}
	for _, d := range f.deadLetters() {
		got[d.id] = d.reason
	}
	if !strings.Contains(got["always-fails"], "at delivery 3") || !strings.Contains(got["good-03"], "different payload") || !strings.Contains(got[long], "invalid event") || len(got) != 3 {
		t.Fatalf("dead letters %v", got)
	}
	if st := tp.Stats(); st.Terminated != 3 || st.DeadLettered != 3 {
		t.Fatalf("stats %+v", st)
	}
}
