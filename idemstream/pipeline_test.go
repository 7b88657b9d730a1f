package idemstream

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idemdb/idem"
)

// pipelineBatches are checkpoints of fresh events, redeliveries of earlier
// batches, repeats inside a batch (the same payload, and another payload:
// a conflict) and an invalid event, over three partitions.
func pipelineBatches() [][]Event {
	ev := func(id string, off uint64, payload string) Event {
		return Event{ID: []byte(id), Partition: "p" + id[:1], Offset: off, Payload: []byte(payload)}
	}
	var batches [][]Event
	for b := range 4 {
		var evs []Event
		for i := range 40 {
			id := fmt.Sprintf("%c%03d", 'a'+i%3, b*40+i)
			evs = append(evs, ev(id, uint64(b*40+i+1), "x"))
			switch {
			case b > 0 && i%7 == 0: // a redelivery of the previous batch
				evs = append(evs, ev(fmt.Sprintf("%c%03d", 'a'+i%3, (b-1)*40+i), uint64((b-1)*40+i+1), "x"))
			case i%9 == 4: // a repeat in the batch
				evs = append(evs, ev(id, uint64(b*40+i+1), "x"))
			case i%11 == 5: // a repeat with another payload
				evs = append(evs, ev(id, uint64(b*40+i+1), "y"))
			case i == 13:
				evs = append(evs, Event{Partition: "pa", Offset: 1}) // no id
			}
		}
		batches = append(batches, evs)
	}
	return batches
}

// TestCheckpointPipelinedLookups: a checkpoint whose lookups run on a
// helper goroutine, handed over in chunks to the Invokes (lookupChunk 2),
// gives every event the outcome it gets with the lookups and Invokes one
// after the other (lookupChunk 0), and invokes the same events in the
// same order into each checkpoint's transaction.
func TestCheckpointPipelinedLookups(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	type run struct {
		outs   [][]Status
		errs   [][]bool
		events [][]string // per transaction, in Invoke order
	}
	consume := func(chunk int) run {
		tp, l := startTwoPhase(t, ctx)
		tp.lookupChunk = chunk
		var r run
		for n, evs := range pipelineBatches() {
			outs, err := tp.Checkpoint(ctx, evs)
			if err != nil {
				t.Fatalf("lookupChunk %d, checkpoint %d: %v", chunk, n, err)
			}
			var st []Status
			var failed []bool
			for _, o := range outs {
				st = append(st, o.Status)
				failed = append(failed, o.Err != nil)
			}
			r.outs, r.errs = append(r.outs, st), append(r.errs, failed)
		}
		l.check(t)
		for id := uint64(1); id <= l.nextID; id++ {
			r.events = append(r.events, l.txns[id].events)
		}
		for id, n := range l.invokes {
			if n != 1 {
				t.Errorf("lookupChunk %d: %s invoked %d times", chunk, id, n)
			}
		}
		return r
	}
	serial, piped := consume(0), consume(2)
	for n := range serial.outs {
		if !slices.Equal(serial.outs[n], piped.outs[n]) || !slices.Equal(serial.errs[n], piped.errs[n]) {
			t.Fatalf("checkpoint %d: outcomes %v (errors %v) pipelined, %v (errors %v) one after the other", n, piped.outs[n], piped.errs[n], serial.outs[n], serial.errs[n])
		}
	}
	if len(serial.events) != len(piped.events) {
		t.Fatalf("%d transactions pipelined, %d one after the other", len(piped.events), len(serial.events))
	}
	for n := range serial.events {
		if !slices.Equal(serial.events[n], piped.events[n]) {
			t.Fatalf("transaction %d invoked %v pipelined, %v one after the other", n+1, piped.events[n], serial.events[n])
		}
	}
	if len(serial.events[0]) == 0 || !slices.Contains(serial.outs[1], Replayed) || !slices.Contains(serial.outs[0], Failed) {
		t.Fatalf("the batches do not have new, replayed and failed events: %v", serial.outs)
	}
}

// TestCheckpointPipelinedInvokeFails: an Invoke that fails while the
// helper goroutine still looks up the rest of the batch aborts the
// checkpoint (recorded "a/1"), invokes nothing after it, and the next
// checkpoint commits the whole batch, each event once.
func TestCheckpointPipelinedInvokeFails(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tp, l := startTwoPhase(t, ctx)
	tp.lookupChunk = 2
	evs := makeEvents(64, 2, 0)
	l.failInvoke = string(evs[5].ID)
	_, err := tp.Checkpoint(ctx, evs)
	var ee *EventError
	if !errors.As(err, &ee) || string(ee.ID) != l.failInvoke || errors.Is(err, ErrNeedsRecovery) {
		t.Fatalf("checkpoint with a failing Invoke: %v, want the EventError of %s", err, l.failInvoke)
	}
	if got := l.txns[1].events; len(got) != 5 {
		t.Fatalf("transaction 1 holds %v, want the 5 events before the failing one", got)
	}
	if len(l.invokes) != 6 {
		t.Fatalf("%d events invoked, want 6 (none after the failing one)", len(l.invokes))
	}
	l.check(t)
	if res, err := tp.st.Lookup(ctx, idem.Request{Scope: twoPhaseScope("tx"), ID: ckptID("a", 1)}); err != nil || res.Status != idem.Done {
		t.Fatalf("abort of checkpoint 1 not recorded: %v %v", res.Status, err)
	}
	l.failInvoke = ""
	checkpointAppliesAll(t, ctx, tp, l, evs, 2)
}

// TestCheckpointPipelinedLookupFails: a lookup that fails in the helper
// goroutine's part of the batch, after the transaction began and events
// were invoked, aborts the checkpoint; the next one commits the batch.
func TestCheckpointPipelinedLookupFails(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, tp, l := startLookupFailTwoPhase(t, ctx)
	tp.lookupChunk = 2
	evs := makeEvents(64, 2, 0)
	bad := string(evs[40].ID)
	st.failID.Store(&bad)
	if _, err := tp.Checkpoint(ctx, evs); !errors.Is(err, errLookupFailed) || errors.Is(err, ErrNeedsRecovery) {
		t.Fatalf("checkpoint with a failing lookup: %v, want the lookup's error", err)
	}
	if got := len(l.txns[1].events); got > 40 {
		t.Fatalf("%d events invoked, want none from the failing lookup on", got)
	}
	l.check(t)
	st.failID.Store(nil)
	checkpointAppliesAll(t, ctx, tp, l, evs, 2)
}

// prefetchSpyStore is an engine that records the requests handed to its
// Prefetch and, for each lookup, whether its request was prefetched by
// the same goroutine's last Prefetch.
type prefetchSpyStore struct {
	*idem.Engine
	mu         sync.Mutex
	prefetched map[string]bool // scope and id of the last Prefetch's requests
	calls      int
	looked     int
	missed     []string
}

func (s *prefetchSpyStore) Prefetch(reqs []idem.Request) {
	s.mu.Lock()
	s.calls++
	s.prefetched = map[string]bool{}
	for _, r := range reqs {
		s.prefetched[r.Scope+"\x00"+string(r.ID)] = true
	}
	s.mu.Unlock()
	s.Engine.Prefetch(reqs)
}

func (s *prefetchSpyStore) LookupHint(ctx context.Context, req idem.Request, h *idem.PutHint) (idem.Result, error) {
	s.mu.Lock()
	s.looked++
	if !s.prefetched[req.Scope+"\x00"+string(req.ID)] {
		s.missed = append(s.missed, string(req.ID))
	}
	s.mu.Unlock()
	return s.Engine.LookupHint(ctx, req, h)
}

// TestCheckpointPrefetchesLookups: a checkpoint on an engine hands each
// chunk of its lookups to the engine's Prefetch before making them, with
// the lookups one after the other (lookupChunk 0) and on the helper
// goroutine (lookupChunk 2), so every lookup finds its key filter block
// loaded with its chunk's; the outcomes are those of pipelineBatches.
func TestCheckpointPrefetchesLookups(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, chunk := range []int{0, 2} {
		w := newWorld()
		st := &prefetchSpyStore{Engine: openEngine(t, w.mem, nil)}
		l := newTxnLedger(w)
		tp, _, err := NewTwoPhase[*ledgerTxn](ctx, st, "tx", l, nil)
		if err != nil {
			t.Fatal(err)
		}
		tp.lookupChunk = chunk
		for n, evs := range pipelineBatches() {
			if _, err := tp.Checkpoint(ctx, evs); err != nil {
				t.Fatalf("lookupChunk %d, checkpoint %d: %v", chunk, n, err)
			}
		}
		l.check(t)
		tp.Close()
		st.Close()
		if st.looked == 0 || st.calls == 0 {
			t.Fatalf("lookupChunk %d: %d lookups, %d prefetches", chunk, st.looked, st.calls)
		}
		if len(st.missed) > 0 {
			t.Errorf("lookupChunk %d: %d of %d lookups not prefetched with their chunk, first %q", chunk, len(st.missed), st.looked, st.missed[0])
		}
	}
}
