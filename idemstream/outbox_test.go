package idemstream

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemstream/internal/brokertest"
	"github.com/idemdb/idem/internal/testclock"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// receiver is the external system the outbox delivers to. It keeps every
// delivery it accepted (it does not drop repeats: the test counts them),
// fails the first two attempts of every third key, and, when publish is
// set, forwards each accepted delivery to a real broker.
type receiver struct {
	w         *world
	mu        sync.Mutex
	attempts  map[string]int      // attempts that reached it, per key
	delivered map[string][]string // key -> payload of each accepted delivery
	failures  int
	publish   func(d Delivery) error
}

func newReceiver(w *world) *receiver {
	return &receiver{w: w, attempts: map[string]int{}, delivered: map[string][]string{}}
}

func (r *receiver) deliver(ctx context.Context, d Delivery) error {
	return r.w.do(func() error {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.attempts[d.Key]++
		h := fnv.New32a()
		h.Write([]byte(d.Key))
		if h.Sum32()%3 == 0 && r.attempts[d.Key] <= 2 {
			r.failures++
			return errors.New("receiver: 503")
		}
		if r.publish != nil {
			if err := r.publish(d); err != nil {
				return err
			}
		}
		r.delivered[d.Key] = append(r.delivered[d.Key], d.Destination+":"+string(d.Payload))
		return nil
	})
}

func outboxHandler(ctx context.Context, ev Event) (Effect, error) {
	return Effect{Result: []byte("queued"), Outbox: []OutboxMessage{
		{Destination: "bank", Payload: ev.Payload},
		{Destination: "audit", Payload: ev.ID},
	}}, nil
}

// computations counts the effect computations of a handler in the live
// process, and numbers them: the outbox payloads carry the number.
type computations struct {
	w     *world
	mu    sync.Mutex
	n     int
	perEv map[string][]int
}

func (c *computations) handler(ctx context.Context, ev Event) (Effect, error) {
	var n int
	err := c.w.do(func() error {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.n++
		n = c.n
		c.perEv[string(ev.ID)] = append(c.perEv[string(ev.ID)], n)
		return nil
	})
	if err != nil {
		return Effect{}, err
	}
	return Effect{Result: []byte("queued"), Outbox: []OutboxMessage{
		{Destination: "bank", Payload: fmt.Appendf(nil, "%s#%d", ev.Payload, n)},
		{Destination: "audit", Payload: fmt.Appendf(nil, "%s#%d", ev.ID, n)},
	}}, nil
}

// TestOutboxDeliversExactlyOnceAcrossCrashes runs a consumer whose handler
// only records outbox messages, with the dispatcher delivering them to a
// flaky receiver (kept in memory, or forwarded to a real JetStream stream
// with the delivery key as Nats-Msg-Id), crashes at each outbox window (and
// after the event's commit, before the messages are registered), restarts,
// and checks what the outbox promises: each event's effect computed once
// (the live computations are the events plus those recovery released, whose
// results were never committed), every message delivered at least once,
// every delivery of a key carrying the same payload, from one computation
// of its event, the backlog drained and the delivered entries removed;
// with JetStream, the stream holds each message exactly once (the broker
// drops the repeats by key).
func TestOutboxDeliversExactlyOnceAcrossCrashes(t *testing.T) {
	for _, recv := range []string{"memory", "jetstream"} {
		for _, win := range []window{windowAfterCommit, windowBeforeDelivery, windowAfterDelivery} {
			t.Run(recv+"/"+string(win), func(t *testing.T) { testOutboxAcrossCrash(t, recv, win) })
		}
	}
}

func testOutboxAcrossCrash(t *testing.T, recv string, win window) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w := newWorld()
	evs := makeEvents(40, 2, 6)
	b := newMemBroker(w, evs)
	r := newReceiver(w)
	var out jetstream.Stream
	if recv == "jetstream" {
		nc, err := nats.Connect(brokertest.StartNATS(t).ClientURL())
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		if out, err = js.CreateStream(ctx, jetstream.StreamConfig{Name: "OUT", Subjects: []string{"out.>"}}); err != nil {
			t.Fatal(err)
		}
		r.publish = func(d Delivery) error {
			m := nats.NewMsg("out." + d.Destination)
			m.Header.Set(nats.MsgIdHdr, d.Key)
			m.Data = d.Payload
			_, err := js.PublishMsg(ctx, m)
			return err
		}
	}
	comp := &computations{w: w, perEv: map[string][]int{}}
	var hits atomic.Int32
	crashAt := func(got window) error {
		if got == win && hits.Add(1) == 7 {
			return w.crash()
		}
		return nil
	}
	run := func(hooked bool) (*idem.Engine, SinkStats) {
		e := openEngine(t, w.mem, nil)
		ob, err := NewOutbox(ctx, e, "out", &OutboxOptions{Deliver: r.deliver, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		s, err := NewSink(ctx, e, "orders", &SinkOptions{Outbox: ob})
		if err != nil {
			t.Fatal(err)
		}
		if hooked {
			ob.hook = func(got window, _ *Delivery) error { return crashAt(got) }
			s.hook = func(got window, _ *Event) error { return crashAt(got) }
		}
		rctx, rcancel := context.WithCancel(ctx)
		defer rcancel()
		dead := w.deadCh()
		go func() {
			select {
			case <-dead:
				rcancel()
			case <-rctx.Done():
			}
		}()
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { defer wg.Done(); _ = ob.Run(rctx) }()
		_ = runUntilAcked(rctx, b, func(ctx context.Context, o ConsumeOptions) error {
			return Consume(ctx, b, s, comp.handler, &o)
		})
		// Drain the backlog (unless the process died).
		for rctx.Err() == nil && ob.Stats().Pending > 0 {
			time.Sleep(time.Millisecond)
		}
		rcancel()
		wg.Wait()
		if !w.crashed {
			st := ob.Stats()
			if st.Pending != 0 || st.OldestPending != 0 {
				t.Fatalf("backlog after the drain: %+v", st)
			}
			t.Logf("outbox stats %+v", st)
		}
		s.Close()
		ob.Close()
		return e, s.Stats()
	}
	e, _ := run(true)
	if !w.crashed {
		t.Fatalf("no crash at %s", win)
	}
	e.Close()
	w.restart()
	e, st := run(false)
	defer e.Close()
	if !b.allAcked() {
		t.Fatal("stream not consumed")
	}
	// Effects computed once: one computation per event, plus at most one
	// for each event recovery released (claimed before the crash, perhaps
	// computed, not committed: its messages never existed).
	distinct := map[string]Event{}
	for _, ev := range evs {
		distinct[string(ev.ID)] = ev
	}
	if extra := comp.n - len(distinct); extra < 0 || extra > int(st.RecoveredAborted) {
		t.Fatalf("%d effect computations for %d events and %d released by recovery", comp.n, len(distinct), st.RecoveredAborted)
	}
	// At least once, with stable keys: every message of every event
	// delivered, each delivery of a key with the same payload, both
	// messages of an event from the same computation.
	keys, dups := 0, 0
	for id, ev := range distinct {
		_, k0 := outboxID("orders", ev.ID, 0)
		_, k1 := outboxID("orders", ev.ID, 1)
		d0, d1 := r.delivered[k0], r.delivered[k1]
		if len(d0) == 0 || len(d1) == 0 {
			t.Fatalf("event %s: messages delivered %d and %d times", id, len(d0), len(d1))
		}
		for _, d := range [][]string{d0, d1} {
			for _, p := range d[1:] {
				if p != d[0] {
					t.Fatalf("event %s: one key delivered with payloads %q and %q", id, d[0], p)
				}
			}
			if len(d) > 1 {
				dups++
			}
		}
		_, n, _ := strings.Cut(d0[0], "#")
		if d0[0] != "bank:"+string(ev.Payload)+"#"+n || d1[0] != "audit:"+id+"#"+n {
			t.Fatalf("event %s: messages %q and %q are not of one computation of it", id, d0[0], d1[0])
		}
		if got := comp.perEv[id]; !strings.Contains(fmt.Sprint(got), n) {
			t.Fatalf("event %s: delivered computation #%s, computed %v", id, n, got)
		}
		keys += 2
	}
	if r.failures == 0 {
		t.Fatal("no delivery failed: retries untested")
	}
	if win == windowAfterDelivery && dups == 0 {
		t.Fatal("the message sent before the crash and not marked delivered was not sent again")
	}
	if out != nil {
		// The broker dropped the repeats by their key.
		info, err := out.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if info.State.Msgs != uint64(keys) {
			t.Fatalf("JetStream holds %d messages for %d keys", info.State.Msgs, keys)
		}
		for seq := uint64(1); seq <= info.State.LastSeq; seq++ {
			m, err := out.GetMsg(ctx, seq)
			if err != nil {
				t.Fatal(err)
			}
			k := m.Header.Get(nats.MsgIdHdr)
			if d := r.delivered[k]; len(d) == 0 || d[0] != strings.TrimPrefix(m.Subject, "out.")+":"+string(m.Data) {
				t.Fatalf("JetStream message %s: %s %q, delivered %v", k, m.Subject, m.Data, d)
			}
		}
	}
	// Delivered messages are removed from idem.
	waitApplied(t, e)
	for _, ev := range evs {
		id, key := outboxID("orders", ev.ID, 0)
		if res, _ := e.Lookup(context.Background(), idem.Request{Scope: outboxScope("out"), ID: id}); res.Status != idem.Absent {
			t.Fatalf("delivered message %s still recorded (%v)", key, res.Status)
		}
	}
	t.Logf("%d keys, %d computations (%d released by recovery), %d failed attempts, %d keys delivered more than once", keys, comp.n, st.RecoveredAborted, r.failures, dups)
}

// TestOutboxStatsAndBackoff drives the outbox's backoff with the test
// clock: a failed message is due again after its backoff (doubling from
// MinBackoff up to MaxBackoff, each jittered by at most 20%), never before;
// the stats count the attempts, failures and backlog.
func TestOutboxStatsAndBackoff(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	clk := testclock.New()
	w := newWorld()
	e := openEngine(t, w.mem, clk.Now)
	defer e.Close()
	var mu sync.Mutex
	attempts := 0
	down := true
	ob, err := NewOutbox(ctx, e, "o", &OutboxOptions{MinBackoff: 20 * time.Millisecond, MaxBackoff: 80 * time.Millisecond,
		Deliver: func(ctx context.Context, d Delivery) error {
			mu.Lock()
			defer mu.Unlock()
			attempts++
			if down {
				return fmt.Errorf("down (attempt %d)", d.Attempt)
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := NewOutbox(ctx, e, "o", &OutboxOptions{Deliver: func(context.Context, Delivery) error { return nil }}); !errors.Is(err, ErrInUse) {
		t.Fatalf("second outbox: %v", err)
	}
	s, err := NewSink(ctx, e, "s", &SinkOptions{Outbox: ob})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Apply(ctx, Event{ID: []byte("a"), Payload: []byte("x")}, outboxHandler); err != nil {
		t.Fatal(err)
	}
	if st := ob.Stats(); st.Pending != 2 {
		t.Fatalf("backlog %+v, want 2", st)
	}
	round := func() int {
		t.Helper()
		mu.Lock()
		before := attempts
		mu.Unlock()
		if _, err := ob.DeliverPending(ctx); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		defer mu.Unlock()
		return attempts - before
	}
	if n := round(); n != 2 {
		t.Fatalf("first round: %d attempts, want 2", n)
	}
	elapsed := time.Duration(0)
	for i, b := range []time.Duration{20, 40, 80, 80} {
		b *= time.Millisecond
		early := b*8/10 - time.Millisecond // before the earliest due time
		clk.Advance(early)
		if n := round(); n != 0 {
			t.Fatalf("retry %d: %d attempts %v after a failure, before the backoff %v-%v", i+1, n, early, b*8/10, b*12/10)
		}
		clk.Advance(b*4/10 + 2*time.Millisecond) // past the latest
		if n := round(); n != 2 {
			t.Fatalf("retry %d: %d attempts %v after a failure, want 2 (backoff %v)", i+1, n, early+b*4/10+2*time.Millisecond, b)
		}
		elapsed += b*12/10 + time.Millisecond
	}
	st := ob.Stats()
	if st.Attempts != 10 || st.Failures != 10 || st.Delivered != 0 || st.Pending != 2 || st.OldestPending != elapsed || st.LastError == "" {
		t.Fatalf("stats %+v, want 10 failed attempts and 2 pending for %v", st, elapsed)
	}
	mu.Lock()
	down = false
	mu.Unlock()
	clk.Advance(100 * time.Millisecond)
	if n := round(); n != 2 {
		t.Fatalf("after the receiver came back: %d attempts", n)
	}
	if st := ob.Stats(); st.Delivered != 2 || st.Pending != 0 || st.OldestPending != 0 || st.Attempts != 12 {
		t.Fatalf("stats %+v", st)
	}
	// A sink without an outbox refuses outbox effects (nothing committed).
	s2, _ := NewSink(ctx, e, "s2", &SinkOptions{})
	if _, err := s2.Apply(ctx, Event{ID: []byte("b")}, outboxHandler); err == nil {
		t.Fatal("outbox effect accepted by a sink without an outbox")
	}
	if _, ok, _ := s2.Lookup([]byte("b")); ok {
		t.Fatal("committed without its outbox")
	}
}
