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
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// receiver is the external system the outbox delivers to: it dedupes on
// the delivery key (as an Idempotency-Key endpoint does) and fails now and
// then.
type receiver struct {
	w        *world
	mu       sync.Mutex
	raw      map[string]int    // attempts that reached it, per key
	accepted map[string]string // key -> payload, once
	failures int
}

func newReceiver(w *world) *receiver {
	return &receiver{w: w, raw: map[string]int{}, accepted: map[string]string{}}
}

func (r *receiver) deliver(ctx context.Context, d Delivery) error {
	return r.w.do(func() error {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.raw[d.Key]++
		// Every third message fails its first two attempts.
		h := fnv.New32a()
		h.Write([]byte(d.Key))
		if h.Sum32()%3 == 0 && r.raw[d.Key] <= 2 {
			r.failures++
			return errors.New("receiver: 503")
		}
		if _, dup := r.accepted[d.Key]; !dup {
			r.accepted[d.Key] = d.Destination + ":" + string(d.Payload)
		}
		return nil
	})
}

func outboxHandler(ctx context.Context, ev Event) (Effect, error) {
	return Effect{Result: []byte("queued"), Outbox: []OutboxMessage{
		{Destination: "bank", Payload: ev.Payload},
		{Destination: "audit", Payload: ev.ID},
	}}, nil
}

// TestOutboxDeliversExactlyOnceAcrossCrashes runs a consumer whose handler
// only records outbox messages, with the dispatcher delivering them to a
// flaky receiver, crashes at each outbox window (and after the event's
// commit, before the messages are registered), restarts, and checks: every
// message delivered with its key and payload (the receiver saw each key,
// retries included, and accepted it once), the backlog drains to zero, the
// delivered entries are removed, and the effects were computed once per
// event.
func TestOutboxDeliversExactlyOnceAcrossCrashes(t *testing.T) {
	for _, win := range []Window{WindowAfterCommit, WindowBeforeDelivery, WindowAfterDelivery} {
		t.Run(string(win), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			w := newWorld()
			evs := makeEvents(40, 2, 6)
			b := newMemBroker(w, evs)
			r := newReceiver(w)
			var hits atomic.Int32
			crashAt := func(got Window) error {
				if got == win && hits.Add(1) == 7 {
					return w.crash()
				}
				return nil
			}
			run := func(hooked bool) *idem.Engine {
				e := openEngine(t, w.mem, nil)
				ob, err := NewOutbox(ctx, e, "out", OutboxOptions{Deliver: r.deliver, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond})
				if err != nil {
					t.Fatal(err)
				}
				s, err := NewSink(ctx, e, "orders", SinkOptions{Outbox: ob})
				if err != nil {
					t.Fatal(err)
				}
				if hooked {
					ob.hook = func(got Window, _ *Delivery) error { return crashAt(got) }
					s.hook = func(got Window, _ *Event) error { return crashAt(got) }
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
					return Consume(ctx, b, s, outboxHandler, o)
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
				return e
			}
			e := run(true)
			if !w.crashed {
				t.Fatalf("no crash at %s", win)
			}
			e.Close()
			w.restart()
			e = run(false)
			defer e.Close()
			if !b.allAcked() {
				t.Fatal("stream not consumed")
			}
			// Every message of every distinct event accepted once.
			want := map[string]string{}
			for _, ev := range evs {
				_, k0 := outboxID("orders", ev.ID, 0)
				_, k1 := outboxID("orders", ev.ID, 1)
				want[k0], want[k1] = "bank:"+string(ev.Payload), "audit:"+string(ev.ID)
			}
			if len(r.accepted) != len(want) {
				t.Fatalf("receiver accepted %d messages, want %d", len(r.accepted), len(want))
			}
			for k, v := range want {
				if r.accepted[k] != v {
					t.Fatalf("message %s: %q, want %q", k, r.accepted[k], v)
				}
			}
			if r.failures == 0 {
				t.Fatal("no delivery failed: retries untested")
			}
			// Delivered messages are removed from idem.
			waitApplied(t, e)
			for _, ev := range evs {
				id, key := outboxID("orders", ev.ID, 0)
				if res, _ := e.Lookup(context.Background(), idem.Request{Scope: outboxScope("out"), ID: id}); res.Status != idem.Absent {
					t.Fatalf("delivered message %s still recorded (%v)", key, res.Status)
				}
			}
			dups := 0
			for _, n := range r.raw {
				if n > 1 {
					dups++
				}
			}
			t.Logf("%d keys, %d failures, %d keys sent more than once (retries, or resent after the crash: the receiver dropped the repeats)", len(r.raw), r.failures, dups)
		})
	}
}

func TestOutboxStatsAndBackoff(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	w := newWorld()
	e := openEngine(t, w.mem, nil)
	defer e.Close()
	var mu sync.Mutex
	var times []time.Time
	down := true
	ob, err := NewOutbox(ctx, e, "o", OutboxOptions{MinBackoff: 20 * time.Millisecond, MaxBackoff: 80 * time.Millisecond,
		Deliver: func(ctx context.Context, d Delivery) error {
			mu.Lock()
			defer mu.Unlock()
			times = append(times, time.Now())
			if down {
				return fmt.Errorf("down (attempt %d)", d.Attempt)
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := NewOutbox(ctx, e, "o", OutboxOptions{Deliver: func(context.Context, Delivery) error { return nil }}); !errors.Is(err, ErrInUse) {
		t.Fatalf("second outbox: %v", err)
	}
	s, err := NewSink(ctx, e, "s", SinkOptions{Outbox: ob})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Apply(ctx, Event{ID: []byte("a"), Payload: []byte("x")}, outboxHandler); err != nil {
		t.Fatal(err)
	}
	if st := ob.Stats(); st.Pending != 2 {
		t.Fatalf("backlog %+v, want 2", st)
	}
	rctx, rcancel := context.WithCancel(ctx)
	done := make(chan error)
	go func() { done <- ob.Run(rctx) }()
	time.Sleep(400 * time.Millisecond)
	mu.Lock()
	n := len(times)
	down = false
	mu.Unlock()
	for ob.Stats().Pending > 0 {
		time.Sleep(5 * time.Millisecond)
	}
	rcancel()
	<-done
	st := ob.Stats()
	// Two messages, backoff 20, 40, 80, 80... ms: about 6-8 attempts each
	// in 400 ms; without backoff there would be thousands.
	if n < 4 || n > 30 {
		t.Fatalf("%d attempts in 400 ms of failures: backoff not applied", n)
	}
	if st.Delivered != 2 || st.Failures < 4 || st.LastError == "" {
		t.Fatalf("stats %+v", st)
	}
	// A sink without an outbox refuses outbox effects (nothing committed).
	s2, _ := NewSink(ctx, e, "s2", SinkOptions{})
	if _, err := s2.Apply(ctx, Event{ID: []byte("b")}, outboxHandler); err == nil {
		t.Fatal("outbox effect accepted by a sink without an outbox")
	}
	if _, ok, _ := s2.Lookup([]byte("b")); ok {
		t.Fatal("committed without its outbox")
	}
}

func TestCollector(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	e := openEngine(t, newWorld().mem, nil)
	defer e.Close()
	ob, err := NewOutbox(ctx, e, "mail", OutboxOptions{Deliver: func(context.Context, Delivery) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewSink(ctx, e, "orders", SinkOptions{Outbox: ob})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		if _, err := s.Apply(ctx, Event{ID: []byte("a")}, outboxHandler); err != nil {
			t.Fatal(err)
		}
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(NewCollector([]*Sink{s}, []*Outbox{ob}))
	want := `
# HELP idemstream_outbox_pending Outbox messages recorded and not yet delivered (the backlog).
# TYPE idemstream_outbox_pending gauge
idemstream_outbox_pending{outbox="mail"} 2
# HELP idemstream_sink_events_total Events handled by an idempotent sink, by outcome.
# TYPE idemstream_sink_events_total counter
idemstream_sink_events_total{sink="orders",status="applied"} 1
idemstream_sink_events_total{sink="orders",status="busy"} 0
idemstream_sink_events_total{sink="orders",status="failed"} 0
idemstream_sink_events_total{sink="orders",status="replayed"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "idemstream_outbox_pending", "idemstream_sink_events_total"); err != nil {
		t.Fatal(err)
	}
	if _, err := ob.DeliverPending(ctx); err != nil {
		t.Fatal(err)
	}
	after := `
# HELP idemstream_outbox_delivered_total Outbox messages delivered and removed.
# TYPE idemstream_outbox_delivered_total counter
idemstream_outbox_delivered_total{outbox="mail"} 2
# HELP idemstream_outbox_pending Outbox messages recorded and not yet delivered (the backlog).
# TYPE idemstream_outbox_pending gauge
idemstream_outbox_pending{outbox="mail"} 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(after), "idemstream_outbox_pending", "idemstream_outbox_delivered_total"); err != nil {
		t.Fatal(err)
	}
}
