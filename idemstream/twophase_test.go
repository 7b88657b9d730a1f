package idemstream

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem/internal/testclock"

	"github.com/idemdb/idem"
)

// ledgerTxn is the transaction handle of txnLedger: what is serialized
// into the checkpoint.
type ledgerTxn struct {
	ID         uint64
	Checkpoint uint64
}

type txnState int

const (
	txOpen txnState = iota
	txPrepared
	txCommitted
	txAborted
)

// txnLedger is an external transactional system (plan B): writes of a
// transaction become visible only when it commits. It records every
// protocol violation: committing what was not pre-committed, aborting
// what was committed, writing into a closed transaction.
type txnLedger struct {
	w          *world
	mu         sync.Mutex
	nextID     uint64
	txns       map[uint64]*ltxn
	committed  map[string]int // event id -> times made visible
	violations []string
	failCommit int            // Commit fails this many more times
	failInvoke string         // Invoke of this event id always fails
	invokes    map[string]int // Invoke calls per event id
}

type ltxn struct {
	ckpt   uint64
	events []string
	state  txnState
}

func newTxnLedger(w *world) *txnLedger {
	return &txnLedger{w: w, txns: map[uint64]*ltxn{}, committed: map[string]int{}}
}

func (l *txnLedger) violate(f string, a ...any) {
	l.violations = append(l.violations, fmt.Sprintf(f, a...))
}

func (l *txnLedger) act(fn func() error) error {
	return l.w.do(func() error {
		l.mu.Lock()
		defer l.mu.Unlock()
		return fn()
	})
}

func (l *txnLedger) BeginTransaction(ctx context.Context, k uint64) (*ledgerTxn, error) {
	var t *ledgerTxn
	err := l.act(func() error {
		l.nextID++
		l.txns[l.nextID] = &ltxn{ckpt: k}
		t = &ledgerTxn{ID: l.nextID, Checkpoint: k}
		return nil
	})
	return t, err
}

func (l *txnLedger) Invoke(ctx context.Context, t *ledgerTxn, ev Event) error {
	return l.act(func() error {
		x := l.txns[t.ID]
		if x == nil || x.state != txOpen {
			l.violate("invoke into txn %d in state %v", t.ID, x)
			return errors.New("txn not open")
		}
		if l.invokes == nil {
			l.invokes = map[string]int{}
		}
		id := string(ev.ID) // made once
		l.invokes[id]++
		if id == l.failInvoke {
			return errors.New("ledger: row rejected")
		}
		x.events = append(x.events, id)
		return nil
	})
}

func (l *txnLedger) PreCommit(ctx context.Context, t *ledgerTxn) error {
	return l.act(func() error {
		x := l.txns[t.ID]
		if x == nil || x.state != txOpen {
			l.violate("pre-commit of txn %d not open", t.ID)
			return errors.New("txn not open")
		}
		x.state = txPrepared
		return nil
	})
}

func (l *txnLedger) commitLocked(t *ledgerTxn, recovering bool) error {
	x := l.txns[t.ID]
	switch {
	case x == nil:
		l.violate("commit of unknown txn %d", t.ID)
		return errors.New("unknown txn")
	case x.state == txCommitted && recovering:
		return nil // idempotent
	case x.state != txPrepared:
		l.violate("commit of txn %d (checkpoint %d) in state %d", t.ID, x.ckpt, x.state)
		return errors.New("txn not prepared")
	}
	if l.failCommit > 0 {
		l.failCommit--
		return errors.New("ledger unavailable")
	}
	x.state = txCommitted
	for _, id := range x.events {
		l.committed[id]++
	}
	return nil
}

func (l *txnLedger) Commit(ctx context.Context, t *ledgerTxn) error {
	return l.act(func() error { return l.commitLocked(t, false) })
}

func (l *txnLedger) RecoverAndCommit(ctx context.Context, t *ledgerTxn) error {
	return l.act(func() error { return l.commitLocked(t, true) })
}

func (l *txnLedger) abortLocked(t *ledgerTxn) error {
	x := l.txns[t.ID]
	if x == nil {
		return nil
	}
	if x.state == txCommitted {
		l.violate("abort of committed txn %d", t.ID)
		return errors.New("txn committed")
	}
	x.state = txAborted
	return nil
}

func (l *txnLedger) Abort(ctx context.Context, t *ledgerTxn) error {
	return l.act(func() error { return l.abortLocked(t) })
}

func (l *txnLedger) RecoverAndAbort(ctx context.Context, t *ledgerTxn) error {
	return l.act(func() error { return l.abortLocked(t) })
}

func (l *txnLedger) AbortCheckpoint(ctx context.Context, k uint64) error {
	return l.act(func() error {
		for id, x := range l.txns {
			if x.ckpt == k && x.state == txOpen {
				_ = l.abortLocked(&ledgerTxn{ID: id})
			}
		}
		return nil
	})
}

// check: no violation, and every transaction ended (committed or aborted).
func (l *txnLedger) check(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.violations) > 0 {
		t.Fatalf("protocol violations: %s", strings.Join(l.violations, "; "))
	}
	for id, x := range l.txns {
		if x.state == txOpen || x.state == txPrepared {
			t.Fatalf("txn %d (checkpoint %d) left in state %d", id, x.ckpt, x.state)
		}
	}
}

func newTwoPhaseWithHook(t *testing.T, ctx context.Context, w *world, l *txnLedger, hook func(window, uint64) error) (*TwoPhase[*ledgerTxn], RecoveryReport, error) {
	e := openEngine(t, w.mem, nil)
	t.Cleanup(func() { e.Close() })
	st := w.store(e)
	// The hook is in place before recovery runs.
	if err := takeName(st, "sink", "tx"); err != nil {
		return nil, RecoveryReport{}, err
	}
	tp := newTwoPhase[*ledgerTxn](st, "tx", l, TwoPhaseOptions{MaxHandleSize: 64 << 10, CommitRetries: 3})
	tp.hook = hook
	rep, err := tp.recover(ctx)
	if err != nil {
		releaseName(st, "sink", "tx")
		e.Close()
		return nil, rep, err
	}
	return tp, rep, nil
}

// checkpointAppliesAll checkpoints evs again (after a checkpoint that was
// aborted) and checks every event applied in checkpoint want, the ledger
// consistent, and each event committed exactly once.
func checkpointAppliesAll(t *testing.T, ctx context.Context, tp *TwoPhase[*ledgerTxn], l *txnLedger, evs []Event, want uint64) {
	t.Helper()
	outs, err := tp.Checkpoint(ctx, evs)
	if err != nil {
		t.Fatal(err)
	}
	for i, o := range outs {
		if o.Status != Applied || o.Checkpoint != want {
			t.Fatalf("event %s: %+v, want applied in checkpoint %d", evs[i].ID, o, want)
		}
	}
	l.check(t)
	checkExactlyOnce(t, l.committed, evs)
}

// startTwoPhase starts a coordinator as newTwoPhaseWithHook does, without
// a hook, for a new transactional ledger in a world of its own; it is
// closed when the test ends.
func startTwoPhase(t *testing.T, ctx context.Context) (*TwoPhase[*ledgerTxn], *txnLedger) {
	t.Helper()
	w := newWorld()
	l := newTxnLedger(w)
	tp, _, err := newTwoPhaseWithHook(t, ctx, w, l, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tp.Close() })
	return tp, l
}

// startLookupFailTwoPhase is startTwoPhase on a store whose lookups fail
// for the id its failID names (closed, with the coordinator, at the end
// of the test).
func startLookupFailTwoPhase(t *testing.T, ctx context.Context) (*lookupFailStore, *TwoPhase[*ledgerTxn], *txnLedger) {
	t.Helper()
	w := newWorld()
	st := &lookupFailStore{Engine: openEngine(t, w.mem, nil)}
	t.Cleanup(func() { st.Close() })
	l := newTxnLedger(w)
	tp, _, err := NewTwoPhase[*ledgerTxn](ctx, st, "tx", l, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tp.Close() })
	return st, tp, l
}

// finishRecovered checks that a recovered coordinator left no claim in
// doubt on st, consumes the rest of b through it, and checks the ledger:
// no protocol violation, every event of evs committed once.
func finishRecovered(t *testing.T, ctx context.Context, st idem.Store, b *memBroker, tp *TwoPhase[*ledgerTxn], l *txnLedger, evs []Event) {
	t.Helper()
	if left := mustInDoubt(t, st); len(left) != 0 {
		t.Fatalf("%d claims in doubt after recovery", len(left))
	}
	if err := runUntilAcked(ctx, b, func(ctx context.Context, o ConsumeOptions) error {
		return ConsumeTwoPhase(ctx, b, tp, &o)
	}); err != nil {
		t.Fatal(err)
	}
	l.check(t)
	checkExactlyOnce(t, l.committed, evs)
}

// TestTwoPhaseCrashWindows crashes the two-phase consumer at every window
// of the protocol (before pre-commit, after pre-commit, after the
// checkpoint with the handle is durable, after the sink's commit, before
// the source's ack, and during recovery after a durable checkpoint or an
// unrecorded one), restarts it on the crash image and checks: the
// recovery decision (commit exactly the recorded checkpoints, abort the
// rest), no protocol violation, every transaction ended, every event's
// effect visible exactly once and nothing lost.
func TestTwoPhaseCrashWindows(t *testing.T) {
	type tc struct {
		crash      window
		recovery   window // also crash during recovery
		wantAction string
	}
	cases := []tc{
		{windowBeforePreCommit, "", "aborted"},
		{windowAfterPreCommit, "", "aborted"},
		{windowAfterCheckpoint, "", "committed"},
		{windowAfterSinkCommit, "", "committed"},
		// The sink's commit of the last checkpoint is recorded only by
		// recovery: RecoverAndCommit again (idempotent; the ledger
		// counts a second visible commit as a violation).
		{windowBeforeAck, "", "committed"},
		{windowAfterCheckpoint, windowDuringRecovery, "committed"},
		{windowBeforePreCommit, windowDuringRecovery, "aborted"},
	}
	for _, path := range storePaths {
		for _, c := range cases {
			for _, at := range []uint64{1, 4} {
				name := fmt.Sprintf("%s/%s/ckpt%d", path.name, c.crash, at)
				if c.recovery != "" {
					name = fmt.Sprintf("%s/%s+%s/ckpt%d", path.name, c.crash, c.recovery, at)
				}
				t.Run(name, func(t *testing.T) {
					ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
					defer cancel()
					w := newWorld()
					w.oneAtATime = path.oneAtATime
					evs := makeEvents(80, 3, 12)
					b := newMemBroker(w, evs)
					l := newTxnLedger(w)
					tp, _, err := newTwoPhaseWithHook(t, ctx, w, l, func(got window, k uint64) error {
						if got == c.crash && k == at {
							return w.crash()
						}
						return nil
					})
					if err != nil {
						t.Fatal(err)
					}
					err = runUntilAcked(ctx, b, func(ctx context.Context, o ConsumeOptions) error {
						return ConsumeTwoPhase(ctx, b, tp, &o)
					})
					if !w.crashed {
						t.Fatalf("no crash at %s (consumer: %v)", c.crash, err)
					}
					if c.recovery != "" {
						w.restart()
						var n atomic.Int32
						_, _, err := newTwoPhaseWithHook(t, ctx, w, l, func(got window, k uint64) error {
							if got == c.recovery && n.Add(1) == 1 {
								return w.crash()
							}
							return nil
						})
						if !errors.Is(err, errCrashed) {
							t.Fatalf("recovery did not crash: %v", err)
						}
					}
					w.restart()
					tp, rep, err := newTwoPhaseWithHook(t, ctx, w, l, nil)
					if err != nil {
						t.Fatal(err)
					}
					if rep.LastCheckpoint != at || rep.Action != c.wantAction {
						t.Fatalf("recovery %+v, want checkpoint %d %s", rep, at, c.wantAction)
					}
					finishRecovered(t, ctx, tp.st, b, tp, l, evs)
					// The frontier is the highest offset a checkpoint committed:
					// at least every original event's, at most the stream's end
					// (a redelivered duplicate that is only replayed does not
					// move it).
					lo, hi := maxOffsets(evs[:80]), maxOffsets(evs)
					for p := range hi {
						if got, ok := tp.Frontier(p); !ok || got < lo[p] || got > hi[p] {
							t.Fatalf("frontier of %s: %d, want %d..%d", p, got, lo[p], hi[p])
						}
					}
					t.Logf("recovery %+v; checkpoints %d, deliveries %d", rep, tp.LastCheckpoint(), b.deliveries)
				})
			}
		}
	}
}

// TestTwoPhaseSinkCommitFailure: a sink whose commit fails after the
// checkpoint is recorded is retried (RecoverAndCommit) and never aborted;
// nothing is acked until it commits.
func TestTwoPhaseSinkCommitFailure(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w := newWorld()
	l := newTxnLedger(w)
	l.failCommit = 10 // more than one Checkpoint call retries
	tp, _, err := newTwoPhaseWithHook(t, ctx, w, l, nil)
	if err != nil {
		t.Fatal(err)
	}
	evs := makeEvents(10, 1, 0)
	if _, err := tp.Checkpoint(ctx, evs); err == nil {
		t.Fatal("no error while the sink cannot commit")
	}
	l.mu.Lock()
	l.failCommit = 0
	l.mu.Unlock()
	// The next call finishes checkpoint 1 first; its events replay.
	outs, err := tp.Checkpoint(ctx, evs)
	if err != nil {
		t.Fatal(err)
	}
	for i, o := range outs {
		if o.Status != Replayed || o.Checkpoint != 1 {
			t.Fatalf("event %d: %+v", i, o)
		}
	}
	l.check(t)
	checkExactlyOnce(t, l.committed, evs)
}

// TestTwoPhaseHandleValidation: handles over the bound are refused before
// anything is recorded; a damaged checkpoint record fails recovery with
// ErrCorruptRecord instead of committing garbage.
func TestTwoPhaseHandleValidation(t *testing.T) {
	b, err := seal(&checkpointRecord{K: 3, Handle: []byte("h")}, 1<<10)
	if err != nil {
		t.Fatal(err)
	}
	var r checkpointRecord
	if err := unseal(b, 1<<10, &r); err != nil || r.K != 3 {
		t.Fatalf("round trip: %v %+v", err, r)
	}
	for name, bad := range map[string][]byte{
		"flipped byte": func() []byte { c := append([]byte(nil), b...); c[len(c)-1] ^= 1; return c }(),
		"truncated":    b[:len(b)-1],
		"version":      func() []byte { c := append([]byte(nil), b...); c[4] = 9; return c }(),
		"magic":        append([]byte("XXXX"), b[4:]...),
		"empty":        nil,
	} {
		if err := unseal(bad, 1<<10, &r); !errors.Is(err, ErrCorruptRecord) {
			t.Errorf("%s: %v", name, err)
		}
	}
	if err := unseal(b, 4, &r); !errors.Is(err, ErrCorruptRecord) {
		t.Errorf("over the size bound: %v", err)
	}
	if _, err := seal(&checkpointRecord{Handle: make([]byte, 100)}, 50); !errors.Is(err, ErrTooLarge) {
		t.Errorf("seal over bound: %v", err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w := newWorld()
	e := openEngine(t, w.mem, nil)
	defer e.Close()
	big := &bigSink{}
	tp, _, err := NewTwoPhase[*bigTxn](ctx, e, "big", big, &TwoPhaseOptions{MaxHandleSize: 128})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tp.Checkpoint(ctx, makeEvents(3, 1, 0)); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("oversized handle: %v", err)
	}
	if !big.aborted {
		t.Fatal("the transaction with the oversized handle was not aborted")
	}
}

type bigTxn struct{ Pad []byte }
type bigSink struct{ aborted bool }

func (s *bigSink) BeginTransaction(context.Context, uint64) (*bigTxn, error) {
	return &bigTxn{Pad: make([]byte, 1000)}, nil
}
func (s *bigSink) Invoke(context.Context, *bigTxn, Event) error    { return nil }
func (s *bigSink) PreCommit(context.Context, *bigTxn) error        { return nil }
func (s *bigSink) Commit(context.Context, *bigTxn) error           { return nil }
func (s *bigSink) Abort(context.Context, *bigTxn) error            { s.aborted = true; return nil }
func (s *bigSink) RecoverAndCommit(context.Context, *bigTxn) error { return nil }
func (s *bigSink) RecoverAndAbort(context.Context, *bigTxn) error  { return nil }

// TestTwoPhaseRecordsBounded: the coordinator keeps only the last
// checkpoint's records; event entries expire with the TTL.
func TestTwoPhaseRecordsBounded(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	clk := testclock.New()
	w := newWorld()
	e := openEngine(t, w.mem, clk.Now)
	defer e.Close()
	l := newTxnLedger(w)
	tp, _, err := NewTwoPhase[*ledgerTxn](ctx, e, "tx", l, &TwoPhaseOptions{TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	evs := makeEvents(50, 2, 0)
	for i := 0; i < 5; i++ {
		if _, err := tp.Checkpoint(ctx, evs[i*10:i*10+10]); err != nil {
			t.Fatal(err)
		}
	}
	for k := uint64(1); k <= 5; k++ {
		// "d/<k>" is written by recovery only.
		for _, kind := range []string{"c", "d"} {
			res, err := e.Lookup(context.Background(), idem.Request{Scope: twoPhaseScope("tx"), ID: ckptID(kind, k)})
			if err != nil {
				t.Fatal(err)
			}
			if want := k == 5 && kind == "c"; (res.Status == idem.Done) != want {
				t.Fatalf("record %s/%d: %v, kept %v", kind, k, res.Status, want)
			}
		}
	}
	clk.Advance(2 * time.Hour)
	if out, _ := tp.Checkpoint(ctx, evs[:1]); out[0].Status != Applied {
		t.Fatalf("after the TTL the event runs again: %+v", out[0])
	}
}

// lookupFailStore is an engine (with its batches) whose Lookup of one id
// fails.
type lookupFailStore struct {
	*idem.Engine
	failID atomic.Pointer[string]
}

var errLookupFailed = errors.New("test: lookup failed")

func (s *lookupFailStore) Lookup(ctx context.Context, req idem.Request) (idem.Result, error) {
	if id := s.failID.Load(); id != nil && string(req.ID) == *id {
		return idem.Result{}, errLookupFailed
	}
	return s.Engine.Lookup(ctx, req)
}

// LookupHint is the engine's lookup that TwoPhase uses (a Lookup that
// hands its read on to the Put): it fails as Lookup does.
func (s *lookupFailStore) LookupHint(ctx context.Context, req idem.Request, h *idem.PutHint) (idem.Result, error) {
	if id := s.failID.Load(); id != nil && string(req.ID) == *id {
		*h = idem.PutHint{}
		return idem.Result{}, errLookupFailed
	}
	return s.Engine.LookupHint(ctx, req, h)
}

// TestCheckpointLookupFailsAfterBegin: the checkpoint's transaction begins
// (and its opening is written) at the first new event found, while the
// rest of the batch is looked up; a lookup that fails after that aborts
// the transaction and records the abort, and the coordinator goes on:
// the next checkpoint commits the batch, each event once.
func TestCheckpointLookupFailsAfterBegin(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, tp, l := startLookupFailTwoPhase(t, ctx)
	evs := makeEvents(8, 2, 0)
	bad := string(evs[5].ID)
	st.failID.Store(&bad)
	if _, err := tp.Checkpoint(ctx, evs); !errors.Is(err, errLookupFailed) || errors.Is(err, ErrNeedsRecovery) {
		t.Fatalf("checkpoint with a failing lookup: %v, want the lookup's error", err)
	}
	l.mu.Lock()
	began := len(l.txns)
	l.mu.Unlock()
	if began != 1 || tp.LastCheckpoint() != 1 {
		t.Fatalf("%d transactions begun, checkpoint %d: want checkpoint 1 begun before the failing lookup", began, tp.LastCheckpoint())
	}
	l.check(t) // aborted, not left open
	if res, err := st.Lookup(ctx, idem.Request{Scope: twoPhaseScope("tx"), ID: ckptID("a", 1)}); err != nil || res.Status != idem.Done {
		t.Fatalf("abort of checkpoint 1 not recorded: %v %v", res.Status, err)
	}
	st.failID.Store(nil)
	checkpointAppliesAll(t, ctx, tp, l, evs, 2)
}

// TestCheckpointRepeatWithAnotherPayload: a batch that repeats an event id
// with another payload gets ErrConflict for the repeat (as a redelivery of
// a committed id with another payload would), runs the event once, and
// gives an exact repeat the first delivery's outcome.
func TestCheckpointRepeatWithAnotherPayload(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tp, l := startTwoPhase(t, ctx)
	evs := []Event{
		{ID: []byte("x"), Partition: "p", Offset: 1, Payload: []byte("amount=1")},
		{ID: []byte("x"), Partition: "p", Offset: 2, Payload: []byte("amount=2")},
		{ID: []byte("x"), Partition: "p", Offset: 3, Payload: []byte("amount=1")},
	}
	outs, err := tp.Checkpoint(ctx, evs)
	if err != nil {
		t.Fatal(err)
	}
	if outs[0].Status != Applied || outs[2].Status != Applied {
		t.Fatalf("first delivery and exact repeat: %+v, %+v; want both Applied", outs[0], outs[2])
	}
	if outs[1].Status != Failed || !errors.Is(outs[1].Err, ErrConflict) {
		t.Fatalf("repeat with another payload: %+v; want Failed with ErrConflict", outs[1])
	}
	t.Log(outs[1].Err)
	if n := l.invokes["x"]; n != 1 {
		t.Fatalf("x invoked %d times, want 1", n)
	}
	l.check(t)
}

// TestCheckpointBuffersReused: one coordinator's checkpoints reuse their
// lookup buffers (checkpointBufs); batches of changing sizes, with repeats,
// conflicts and redeliveries of earlier batches, get the outcomes each
// would get alone: nothing of a batch is seen by the next.
func TestCheckpointBuffersReused(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tp, l := startTwoPhase(t, ctx)
	ev := func(id string, off uint64, payload string) Event {
		return Event{ID: []byte(id), Partition: "p" + id[:1], Offset: off, Payload: []byte(payload)}
	}
	type step struct {
		evs  []Event
		want []Status
	}
	steps := []step{
		{[]Event{ev("a1", 1, "x"), ev("b1", 1, "x"), ev("a2", 2, "x"), ev("a1", 3, "x"), ev("c1", 1, "x")},
			[]Status{Applied, Applied, Applied, Applied, Applied}},
		// Smaller: a redelivery of the last batch's, and new ids.
		{[]Event{ev("b1", 1, "x"), ev("b2", 2, "x"), ev("a3", 4, "x")},
			[]Status{Replayed, Applied, Applied}},
		// Larger: a repeat with another payload, old and new ids mixed.
		{[]Event{ev("c2", 2, "x"), ev("c2", 3, "y"), ev("a1", 5, "x"), ev("c3", 4, "x"), ev("a2", 6, "x"), ev("b3", 3, "x"), ev("c3", 5, "x")},
			[]Status{Applied, Failed, Replayed, Applied, Replayed, Applied, Applied}},
		// Only redeliveries: nothing is written.
		{[]Event{ev("c3", 4, "x")}, []Status{Replayed}},
		{[]Event{ev("a9", 9, "x"), ev("b1", 1, "z")}, []Status{Applied, Failed}},
	}
	for n, st := range steps {
		outs, err := tp.Checkpoint(ctx, st.evs)
		if err != nil {
			t.Fatalf("checkpoint %d: %v", n, err)
		}
		for i, o := range outs {
			if o.Status != st.want[i] {
				t.Fatalf("checkpoint %d, event %d (%s): %v (%v), want %v", n, i, st.evs[i].ID, o.Status, o.Err, st.want[i])
			}
		}
	}
	for id, n := range l.invokes {
		if n != 1 {
			t.Errorf("%s invoked %d times", id, n)
		}
	}
	if off, _ := tp.Frontier("pa"); off != 9 {
		t.Errorf("frontier of pa %d, want 9", off)
	}
	if off, _ := tp.Frontier("pb"); off != 3 {
		t.Errorf("frontier of pb %d, want 3", off)
	}
	l.check(t)
}
