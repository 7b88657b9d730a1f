package idemstream

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem"
)

// runUntilAcked runs a consumer until the broker has every message acked
// (or the process crashes, or the time runs out).
func runUntilAcked(ctx context.Context, b *memBroker, run func(ctx context.Context, opts ConsumeOptions) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	dead := b.w.deadCh()
	go func() {
		// The last ack may land after the last batch's OnBatch (acks are
		// settled while the next fetch waits): stop when it does.
		select {
		case <-dead:
			cancel()
		case <-b.ackedCh():
			cancel()
		case <-ctx.Done():
		}
	}()
	opts := ConsumeOptions{BatchSize: 8, Concurrency: 4, OnBatch: func([]Message, []Outcome) {
		if b.allAcked() {
			cancel()
		}
	}}
	err := run(ctx, opts)
	if errors.Is(err, context.Canceled) && b.allAcked() {
		return nil
	}
	return err
}

// TestSinkCrashWindows crashes the idempotent-sink consumer at each of its
// windows (the in-memory FS keeps only what was synced; the broker and the
// ledger keep everything the process did before the crash and nothing
// after), restarts it on the crash image, and checks after the stream is
// consumed that every event's effect happened exactly once, nothing was
// lost, the frontier is each partition's highest offset and redeliveries
// replay the stored result. A crash during recovery is tested too.
func TestSinkCrashWindows(t *testing.T) {
	windows := []window{windowAfterClaim, windowAfterEffect, windowAfterCommit, windowBeforeAck, windowDuringRecovery}
	for _, path := range storePaths {
		for _, win := range windows {
			for _, at := range []int{1, 5} {
				t.Run(fmt.Sprintf("%s/%s/%d", path.name, win, at), func(t *testing.T) {
					ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
					defer cancel()
					w := newWorld()
					w.oneAtATime = path.oneAtATime
					evs := makeEvents(60, 3, 10)
					b := newMemBroker(w, evs)
					l := newLedger(w)
					crashAt := win
					if win == windowDuringRecovery {
						crashAt = windowAfterEffect // leaves events in doubt for recovery
					}
					var hits atomic.Int32
					hook := func(got window, ev *Event) error {
						if got == crashAt && hits.Add(1) == int32(at) {
							return w.crash()
						}
						return nil
					}
					e := openEngine(t, w.mem, nil)
					s, err := NewSink(ctx, w.store(e), "ledger", &SinkOptions{Recover: l.recoverFn})
					if err != nil {
						t.Fatal(err)
					}
					s.hook = hook
					err = runUntilAcked(ctx, b, func(ctx context.Context, o ConsumeOptions) error {
						return Consume(ctx, b, s, l.handler, &o)
					})
					if !w.crashed {
						t.Fatalf("the crash at %s never happened (consumer returned %v)", crashAt, err)
					}
					s.Close()
					e.Close()
					// The crash image: each partition's frontier is exactly its
					// highest committed offset, before recovery and after it.
					w.restart()
					e = openEngine(t, w.mem, nil)
					checkFrontierExact(t, e, "ledger", evs)
					if win != windowDuringRecovery { // that one crashes in the recovery below
						s, err = NewSink(ctx, w.store(e), "ledger", &SinkOptions{Recover: l.recoverFn})
						if err != nil {
							t.Fatal(err)
						}
						checkFrontierExact(t, e, "ledger", evs)
						s.Close()
					}
					e.Close()
					if win == windowDuringRecovery {
						// Crash again in the middle of recovery's decisions.
						w.restart()
						e = openEngine(t, w.mem, nil)
						if len(mustInDoubt(t, e)) == 0 {
							t.Fatal("no event in doubt after a crash after the effect")
						}
						var n atomic.Int32
						_, err := newSinkWithHook(ctx, w.store(e), "ledger", &SinkOptions{Recover: l.recoverFn}, func(got window, _ *Event) error {
							if got == windowDuringRecovery && n.Add(1) == 1 {
								return w.crash()
							}
							return nil
						})
						if !errors.Is(err, errCrashed) {
							t.Fatalf("recovery did not crash: %v", err)
						}
						e.Close()
						w.restart()
						e = openEngine(t, w.mem, nil)
						checkFrontierExact(t, e, "ledger", evs)
						e.Close()
					}
					w.restart()
					e = openEngine(t, w.mem, nil)
					defer e.Close()
					s, err = NewSink(ctx, w.store(e), "ledger", &SinkOptions{Recover: l.recoverFn})
					if err != nil {
						t.Fatal(err)
					}
					if left := mustInDoubt(t, e); len(left) != 0 {
						t.Fatalf("%d claims still in doubt after recovery", len(left))
					}
					if err := runUntilAcked(ctx, b, func(ctx context.Context, o ConsumeOptions) error {
						return Consume(ctx, b, s, l.handler, &o)
					}); err != nil {
						t.Fatal(err)
					}
					checkExactlyOnce(t, l.applied, evs)
					for p, want := range maxOffsets(evs) {
						if got, ok, err := s.Frontier(p); err != nil || got != want || !ok {
							t.Fatalf("frontier of %s: %d %v %v, want %d", p, got, ok, err, want)
						}
					}
					// Every event redelivered now replays the ledger's result.
					for _, ev := range evs[:10] {
						out, err := s.Apply(ctx, ev, l.handler)
						if err != nil || out.Status != Replayed || string(out.Result) != l.results[string(ev.ID)] {
							t.Fatalf("redelivery of %s: %+v %v (ledger says %q)", ev.ID, out, err, l.results[string(ev.ID)])
						}
					}
					checkExactlyOnce(t, l.applied, evs)
					t.Logf("deliveries %d, acks %d, recovered %+v", b.deliveries, b.acks.Load(), s.Stats())
				})
			}
		}
	}
}

// checkFrontierExact checks the commit frontier of every partition of evs
// against the events the engine holds as committed: it is at or above the
// offset in every committed event's record (no effect above it), and it is
// the offset of a delivery of a committed event (never ahead of an effect;
// 0 when none is committed).
func checkFrontierExact(t *testing.T, e *idem.Engine, name string, evs []Event) {
	t.Helper()
	if err := frontierExact(e, name, evs); err != nil {
		t.Fatal(err)
	}
}

func frontierExact(e *idem.Engine, name string, evs []Event) error {
	scope := sinkScope(name)
	committed := map[string]bool{}
	lo := map[string]uint64{}
	for _, ev := range evs {
		res, err := e.Lookup(context.Background(), idem.Request{Scope: scope, ID: ev.ID})
		if err != nil {
			return err
		}
		if res.Status != idem.Done {
			continue
		}
		committed[string(ev.ID)] = true
		rec, err := decodeEventRecord(scope, ev.ID, res.Reply)
		if err != nil {
			return err
		}
		lo[rec.Partition] = max(lo[rec.Partition], rec.Offset)
	}
	for p := range maxOffsets(evs) {
		f, err := e.ClientState(context.Background(), frontierScope(name), frontierClient(p))
		if err != nil {
			return err
		}
		if f < lo[p] {
			return fmt.Errorf("partition %s: frontier %d below the committed offset %d", p, f, lo[p])
		}
		if f == 0 {
			continue
		}
		ok := false
		for _, ev := range evs {
			ok = ok || (ev.Partition == p && ev.Offset == f && committed[string(ev.ID)])
		}
		if !ok {
			return fmt.Errorf("partition %s: frontier %d is not the offset of a committed event", p, f)
		}
	}
	return nil
}

func newSinkWithHook(ctx context.Context, st idem.Store, name string, opts *SinkOptions, hook func(window, *Event) error) (*Sink, error) {
	if err := takeName(st, "sink", name); err != nil {
		return nil, err
	}
	o := *opts
	o.MaxRecordSize = 1 << 20
	s := newSink(st, name, o)
	s.hook = hook // in place before recovery runs
	if err := s.recover(ctx); err != nil {
		releaseName(st, "sink", name)
		return nil, err
	}
	return s, nil
}

func mustInDoubt(t *testing.T, e idem.Store) []idem.InDoubtClaim {
	t.Helper()
	d, err := e.InDoubt(context.Background(), "")
	if err != nil {
		t.Fatal(err)
	}
	return d
}
