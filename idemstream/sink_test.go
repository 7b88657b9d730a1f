package idemstream

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/internal/testclock"

	"github.com/cockroachdb/pebble/v2/vfs"
)

func TestSinkAppliesOnceAndReplays(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	e := openEngine(t, vfs.NewMem(), nil)
	defer e.Close()
	s, err := NewSink(ctx, e, "ledger", &SinkOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := NewSink(ctx, e, "ledger", &SinkOptions{}); !errors.Is(err, ErrInUse) {
		t.Fatalf("second sink of the same name: %v, want ErrInUse", err)
	}
	var runs atomic.Int32
	h := func(ctx context.Context, ev Event) (Effect, error) {
		runs.Add(1)
		return Effect{Result: []byte("ok:" + string(ev.Payload))}, nil
	}
	ev := Event{ID: []byte("e1"), Partition: "p", Offset: 7, Payload: []byte("x")}
	out, err := s.Apply(ctx, ev, h)
	if err != nil || out.Status != Applied || string(out.Result) != "ok:x" {
		t.Fatalf("first apply: %+v %v", out, err)
	}
	redelivered := ev
	redelivered.Offset = 9 // a redelivery at another position replays the original
	out, err = s.Apply(ctx, redelivered, h)
	if err != nil || out.Status != Replayed || string(out.Result) != "ok:x" || out.Offset != 7 || out.Partition != "p" {
		t.Fatalf("redelivery: %+v %v", out, err)
	}
	if runs.Load() != 1 {
		t.Fatalf("handler ran %d times", runs.Load())
	}
	// Same id, different payload: a conflict, never a silent replay.
	bad := ev
	bad.Payload = []byte("y")
	if _, err := s.Apply(ctx, bad, h); !errors.Is(err, ErrConflict) {
		t.Fatalf("conflicting payload: %v", err)
	}
	// A failing handler releases the claim: the next delivery runs it.
	fails := true
	h2 := func(ctx context.Context, ev Event) (Effect, error) {
		runs.Add(1)
		if fails {
			return Effect{}, errors.New("target down")
		}
		return Effect{Result: []byte("late")}, nil
	}
	ev2 := Event{ID: []byte("e2"), Payload: []byte("z")}
	if _, err := s.Apply(ctx, ev2, h2); err == nil {
		t.Fatal("failing handler: no error")
	}
	fails = false
	if out, err := s.Apply(ctx, ev2, h2); err != nil || out.Status != Applied || string(out.Result) != "late" {
		t.Fatalf("retry after failure: %+v %v", out, err)
	}
	// A panicking handler releases the claim too, and the panic goes on.
	ev3 := Event{ID: []byte("e3")}
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("panic swallowed")
			}
		}()
		_, _ = s.Apply(ctx, ev3, func(context.Context, Event) (Effect, error) { panic("boom") })
	}()
	if out, err := s.Apply(ctx, ev3, h); err != nil || out.Status != Applied {
		t.Fatalf("after panic: %+v %v", out, err)
	}
	// Invalid events are refused with a clear error, nothing claimed.
	if _, err := s.Apply(ctx, Event{}, h); !errors.Is(err, ErrInvalidEvent) {
		t.Fatalf("empty id: %v", err)
	}
	if _, err := s.Apply(ctx, Event{ID: make([]byte, MaxEventIDLen+1)}, h); !errors.Is(err, ErrInvalidEvent) {
		t.Fatalf("long id: %v", err)
	}
	// A result over the bound is refused and the claim released.
	big := Event{ID: []byte("big")}
	if _, err := s.Apply(ctx, big, func(context.Context, Event) (Effect, error) {
		return Effect{Result: make([]byte, 2<<20)}, nil
	}); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("huge result: %v", err)
	}
	if _, ok, _ := s.Lookup(big.ID); ok {
		t.Fatal("huge result was committed")
	}
	st := s.Stats()
	if st.Applied != 3 || st.Replayed != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestSinkConcurrentDeliveriesRunOnce(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	e := openEngine(t, vfs.NewMem(), nil)
	defer e.Close()
	s, err := NewSink(ctx, e, "s", &SinkOptions{})
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	var runs atomic.Int32
	h := func(ctx context.Context, ev Event) (Effect, error) {
		runs.Add(1)
		<-release
		return Effect{Result: []byte("r")}, nil
	}
	ev := Event{ID: []byte("same")}
	first := make(chan Outcome)
	go func() {
		out, err := s.Apply(ctx, ev, h)
		if err != nil {
			t.Error(err)
		}
		first <- out
	}()
	for runs.Load() == 0 {
		if ctx.Err() != nil {
			t.Fatalf("the first delivery never ran its handler: %v", ctx.Err())
		}
		time.Sleep(time.Millisecond) // polling the handler's count
	}
	out, err := s.Apply(ctx, ev, h) // a second delivery while the first runs
	if err != nil || out.Status != Busy || out.Status.Ackable() {
		t.Fatalf("concurrent delivery: %+v %v", out, err)
	}
	close(release)
	if o := <-first; o.Status != Applied {
		t.Fatalf("first: %+v", o)
	}
	if out, _ := s.Apply(ctx, ev, h); out.Status != Replayed {
		t.Fatalf("after: %+v", out)
	}
	if runs.Load() != 1 {
		t.Fatalf("ran %d times", runs.Load())
	}
}

// TestSinkTTL: each sink has its own TTL on one engine opened with default
// options; within it a redelivery replays, after it the event runs again.
func TestSinkTTL(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	clk := testclock.New()
	e := openEngine(t, vfs.NewMem(), clk.Now)
	defer e.Close()
	short, err := NewSink(ctx, e, "short", &SinkOptions{TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	long, err := NewSink(ctx, e, "long", &SinkOptions{TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	runs := map[string]int{}
	var mu sync.Mutex
	h := func(name string) Handler {
		return func(ctx context.Context, ev Event) (Effect, error) {
			mu.Lock()
			defer mu.Unlock()
			runs[name]++
			return Effect{Result: []byte(fmt.Sprint(runs[name]))}, nil
		}
	}
	ev := Event{ID: []byte("e")}
	out, err := short.Apply(ctx, ev, h("short"))
	if err != nil || !out.ExpiresAt.Equal(clk.Now().Add(time.Minute)) {
		t.Fatalf("short: %+v %v", out, err)
	}
	if _, err := long.Apply(ctx, ev, h("long")); err != nil {
		t.Fatal(err)
	}
	clk.Advance(30 * time.Second)
	if out, _ := short.Apply(ctx, ev, h("short")); out.Status != Replayed || string(out.Result) != "1" {
		t.Fatalf("within TTL: %+v", out)
	}
	clk.Advance(31 * time.Second)
	if out, _ := short.Apply(ctx, ev, h("short")); out.Status != Applied || string(out.Result) != "2" {
		t.Fatalf("after the short TTL: %+v", out)
	}
	if out, _ := long.Apply(ctx, ev, h("long")); out.Status != Replayed {
		t.Fatalf("long TTL not over: %+v", out)
	}
	clk.Advance(2 * time.Hour)
	waitApplied(t, e)
	n, err := e.CleanupExpired(ctx)
	if err != nil || n < 2 {
		t.Fatalf("cleanup removed %d: %v", n, err)
	}
	if _, ok, _ := long.Lookup(ev.ID); ok {
		t.Fatal("expired entry still there")
	}
}

func TestFrontierAdvancesAndSurvivesReopen(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	w := newWorld()
	e := openEngine(t, w.mem, nil)
	s, err := NewSink(ctx, e, "f", &SinkOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok, err := s.Frontier("p"); ok || err != nil {
		t.Fatalf("empty frontier: %v %v", ok, err)
	}
	noop := func(context.Context, Event) (Effect, error) { return Effect{}, nil }
	apply := func(id string, off uint64, want Status) {
		t.Helper()
		out, err := s.Apply(ctx, Event{ID: []byte(id), Partition: "p", Offset: off}, noop)
		if err != nil || out.Status != want {
			t.Fatalf("apply %s at %d: %v %v, want %v", id, off, out.Status, err, want)
		}
	}
	apply("a", 5, Applied)
	apply("b", 3, Applied) // a lower offset commits but does not lower the frontier
	apply("c", 9, Applied)
	apply("c", 9, Replayed) // a plain redelivery writes nothing
	apply("d", 0, Applied)  // no position
	if off, ok, _ := s.Frontier("p"); !ok || off != 9 {
		t.Fatalf("frontier %d %v, want 9", off, ok)
	}
	if st := s.Stats(); st.FrontierWrites != 3 {
		t.Fatalf("frontier writes %d, want 3 (the commits of a, b, c)", st.FrontierWrites)
	}
	apply("a", 12, Replayed) // the same event published again, at 12
	if off, _, _ := s.Frontier("p"); off != 12 {
		t.Fatalf("frontier %d after a replay at 12", off)
	}
	// A crash with an event in doubt whose Recover says it ran at offset
	// 20, and a frontier claim left by a version that recorded frontiers
	// in records of their own: recovery commits the event with its offset
	// and releases the old claim.
	if _, err := e.Begin(ctx, idem.Request{Scope: s.scope, ID: []byte("e")}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Begin(ctx, frontierReq(s, "old", 1, 7)); err != nil {
		t.Fatal(err)
	}
	w.crash()
	e.Close()
	w.restart()
	e = openEngine(t, w.mem, nil)
	defer e.Close()
	s, err = NewSink(ctx, e, "f", &SinkOptions{Recover: func(ctx context.Context, d InDoubtEvent) (Resolution, error) {
		return Resolution{Applied: true, Partition: "p", Offset: 20}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	if off, ok, _ := s.Frontier("p"); !ok || off != 20 {
		t.Fatalf("frontier after recovery %d %v, want 20", off, ok)
	}
	if left := mustInDoubt(t, e); len(left) != 0 {
		t.Fatalf("%d claims left in doubt", len(left))
	}
	if _, ok, _ := s.Frontier("old"); ok {
		t.Fatal("the released old-format claim raised a frontier")
	}
}

// cancellingSink cancels the checkpoint's ctx in PreCommit: everything
// after it (the checkpoint record, the sink's commit, the events'
// commits) runs with an ended ctx.
type cancellingSink struct {
	*txnLedger
	cancel func()
}

func (c cancellingSink) PreCommit(ctx context.Context, t *ledgerTxn) error {
	c.cancel()
	return c.txnLedger.PreCommit(ctx, t)
}

// TestCancelledBeforeCommit: the caller's ctx ends after the effect ran and
// before the commit. The commit is written all the same (a Claim's finish
// does not depend on ctx, and a batch of finishes runs with
// context.WithoutCancel: Batch.Run refuses an ended ctx), so the event is
// Done, not stranded in flight: its redelivery replays.
func TestCancelledBeforeCommit(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	w := newWorld()
	e := openEngine(t, w.mem, nil)
	defer e.Close()
	s, err := NewSink(ctx, e, "s", nil)
	if err != nil {
		t.Fatal(err)
	}
	cctx, ccancel := context.WithCancel(ctx)
	ev := Event{ID: []byte("e1"), Partition: "p", Offset: 3, Payload: []byte("x")}
	out, err := s.Apply(cctx, ev, func(context.Context, Event) (Effect, error) {
		ccancel() // the request is cancelled while its effect runs
		return Effect{Result: []byte("r")}, nil
	})
	if err != nil || out.Status != Applied {
		t.Fatalf("apply with ctx cancelled before the commit: %+v %v", out, err)
	}
	if res, err := e.Lookup(ctx, idem.Request{Scope: sinkScope("s"), ID: ev.ID}); err != nil || res.Status != idem.Done {
		t.Fatalf("event after the commit: %v %v, want Done", res.Status, err)
	}
	if out, err := s.Apply(ctx, ev, nil); err != nil || out.Status != Replayed || string(out.Result) != "r" {
		t.Fatalf("redelivery: %+v %v", out, err)
	}
	// Consume's batches: the same, for a batch whose ctx ends while its
	// effects run (the batch of commits is written all the same).
	bctx, bcancel := context.WithCancel(ctx)
	bevs := makeEvents(6, 2, 0)
	var ran atomic.Int32
	outs, errs := s.applyBatch(bctx, bevs, func(context.Context, Event) (Effect, error) {
		if ran.Add(1) == 3 {
			bcancel()
		}
		return Effect{Result: []byte("r")}, nil
	}, 1)
	for i := range bevs {
		res, err := e.Lookup(ctx, idem.Request{Scope: sinkScope("s"), ID: bevs[i].ID})
		if errs[i] != nil || outs[i].Status != Applied || err != nil || res.Status != idem.Done {
			t.Fatalf("batch event %s with ctx cancelled before the commit: %+v %v, stored %v %v", bevs[i].ID, outs[i], errs[i], res.Status, err)
		}
	}

	l := newTxnLedger(w)
	tctx, tcancel := context.WithCancel(ctx)
	tp, _, err := NewTwoPhase[*ledgerTxn](ctx, e, "tx", cancellingSink{l, tcancel}, nil)
	if err != nil {
		t.Fatal(err)
	}
	evs := makeEvents(5, 1, 0)
	outs, err = tp.Checkpoint(tctx, evs)
	if err != nil {
		t.Fatalf("checkpoint with ctx cancelled in PreCommit: %v", err)
	}
	for i, o := range outs {
		res, err := e.Lookup(ctx, idem.Request{Scope: sinkScope("tx"), ID: evs[i].ID})
		if o.Status != Applied || err != nil || res.Status != idem.Done {
			t.Fatalf("event %s: %+v, stored %v %v, want Applied and Done", evs[i].ID, o, res.Status, err)
		}
	}
	l.check(t)
	checkExactlyOnce(t, l.committed, evs)
}

// TestFrontierAfterBatch pins each partition's frontier after one batch of
// Consume's path (applyBatch) holding commits, failed handlers, a commit
// whose claim was taken over, and replayed deliveries, through both ways
// the sink writes: the frontier is the highest offset whose event the
// batch (or an earlier record) committed, past a failed event below it
// but never to a failed one, raised by a replayed delivery found above
// it, and the same after a crash and recovery.
func TestFrontierAfterBatch(t *testing.T) {
	for _, sp := range storePaths {
		t.Run(sp.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			clk := testclock.New()
			w := newWorld()
			w.oneAtATime = sp.oneAtATime
			e := openEngine(t, w.mem, clk.Now)
			s, err := NewSink(ctx, w.store(e), "fb", nil)
			if err != nil {
				t.Fatal(err)
			}
			ok := func(context.Context, Event) (Effect, error) { return Effect{Result: []byte("ok")}, nil }
			// Committed before the batch: p at 3, v at 50.
			for _, ev := range []Event{{ID: []byte("p-old"), Partition: "p", Offset: 3}, {ID: []byte("v-old"), Partition: "v", Offset: 50}} {
				if out, err := s.Apply(ctx, ev, ok); err != nil || out.Status != Applied {
					t.Fatalf("apply %s: %+v %v", ev.ID, out, err)
				}
			}
			evs := []Event{
				{ID: []byte("p10"), Partition: "p", Offset: 10}, // fails
				{ID: []byte("p11"), Partition: "p", Offset: 11},
				{ID: []byte("p-old"), Partition: "p", Offset: 12}, // replayed above the frontier
				{ID: []byte("p13"), Partition: "p", Offset: 13},   // fails
				{ID: []byte("q5"), Partition: "q", Offset: 5},
				{ID: []byte("q6"), Partition: "q", Offset: 6},
				{ID: []byte("q7"), Partition: "q", Offset: 7}, // fails
				{ID: []byte("r19"), Partition: "r", Offset: 19},
				{ID: []byte("r20"), Partition: "r", Offset: 20}, // its claim is taken over: the commit fails
				{ID: []byte("r21"), Partition: "r", Offset: 21}, // fails
				{ID: []byte("s31"), Partition: "s", Offset: 31}, // out of order
				{ID: []byte("s30"), Partition: "s", Offset: 30},
				{ID: []byte("u1"), Partition: "u", Offset: 1},     // fails: no frontier
				{ID: []byte("v-old"), Partition: "v", Offset: 45}, // replayed below the frontier
				{ID: []byte("nopos")},                             // no position
			}
			fails := map[string]bool{"p10": true, "p13": true, "q7": true, "r21": true, "u1": true}
			var takeover *idem.Claim
			h := func(ctx context.Context, ev Event) (Effect, error) {
				switch id := string(ev.ID); {
				case fails[id]:
					return Effect{}, errors.New("target down")
				case id == "r20":
					// Another delivery takes the claim over once its lease
					// has run out (as after a handler that ran too long).
					clk.Advance(2 * time.Hour)
					res, err := e.Begin(ctx, idem.Request{Scope: s.scope, ID: ev.ID, Fingerprint: fingerprint(ev.Payload)})
					if err != nil || res.Status != idem.Fresh {
						t.Errorf("takeover of r20: %v %v", res.Status, err)
					}
					takeover = res.Claim
				}
				return Effect{Result: []byte("ok")}, nil
			}
			writes := s.Stats().FrontierWrites
			outs, errs := s.applyBatch(ctx, evs, h, 1) // in order: the takeover happens during r20's handler
			for i, ev := range evs {
				id := string(ev.ID)
				switch {
				case fails[id]:
					if errs[i] == nil {
						t.Errorf("%s: no error", id)
					}
				case id == "r20":
					if !errors.Is(errs[i], idem.ErrLeaseLost) {
						t.Errorf("r20: %v, want ErrLeaseLost", errs[i])
					}
				case id == "p-old" || id == "v-old":
					if errs[i] != nil || outs[i].Status != Replayed {
						t.Errorf("%s: %+v %v, want Replayed", id, outs[i], errs[i])
					}
				default:
					if errs[i] != nil || outs[i].Status != Applied {
						t.Errorf("%s: %+v %v, want Applied", id, outs[i], errs[i])
					}
				}
			}
			// The commits of p11, q5, q6, r19, s31 and s30, and the
			// advance past p-old's replay.
			if got := s.Stats().FrontierWrites - writes; got != 7 {
				t.Errorf("frontier writes %d, want 7", got)
			}
			want := map[string]uint64{"p": 12, "q": 6, "r": 19, "s": 31, "u": 0, "v": 50}
			check := func(when string) {
				t.Helper()
				for p, off := range want {
					got, has, err := s.Frontier(p)
					if err != nil || got != off || has != (off > 0) {
						t.Errorf("%s: frontier of %s: %d %v %v, want %d", when, p, got, has, err, off)
					}
				}
			}
			check("after the batch")
			// A crash, and recovery (which releases the takeover's claim,
			// left in doubt): the same frontiers, from the log.
			if takeover == nil {
				t.Fatal("no takeover")
			}
			s.Close()
			w.crash()
			e.Close()
			w.restart()
			e = openEngine(t, w.mem, clk.Now)
			defer e.Close()
			if s, err = NewSink(ctx, w.store(e), "fb", nil); err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			check("after a crash")
			if st := s.Stats(); st.RecoveredAborted != 1 {
				t.Errorf("recovery released %d claims, want 1 (r20's takeover)", st.RecoveredAborted)
			}
		})
	}
}
