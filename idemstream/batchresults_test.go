package idemstream

import (
	"context"
	"reflect"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
)

// checkResultsCleared fails unless every element of a kept results buffer,
// up to its capacity, is zero: between batches it holds no claim, reply
// or error of the last one.
func checkResultsCleared(t *testing.T, when string, res []idem.BatchResult) {
	t.Helper()
	if cap(res) == 0 {
		t.Fatalf("%s: no results buffer kept", when)
	}
	for i, r := range res[:cap(res)] {
		if !reflect.DeepEqual(r, idem.BatchResult{}) {
			t.Fatalf("%s: results buffer element %d holds %+v", when, i, r)
		}
	}
}

// TestSinkBatchResultsBuffer: a sinkBatch, reused from batch to batch as
// Consume reuses its two, runs both its engine batches (the claims, the
// commits) into one results buffer that holds nothing once each step is
// over: not the claims of the first step (the fresh events hold those),
// the stored replies of replayed events or the commits' results.
func TestSinkBatchResultsBuffer(t *testing.T) {
	ctx := context.Background()
	e := openEngine(t, vfs.NewMem(), nil)
	defer e.Close()
	s, err := NewSink(ctx, e, "s", nil)
	if err != nil {
		t.Fatal(err)
	}
	h := func(_ context.Context, ev Event) (Effect, error) {
		return Effect{Result: append([]byte("r-"), ev.ID...)}, nil
	}
	evs := makeEvents(12, 2, 0)
	var sb sinkBatch
	var first *idem.BatchResult
	for n, batch := range [][]Event{evs[:8], evs[4:]} { // the second replays 4 events of the first
		sb.evs = append(sb.evs[:0], batch...)
		s.startBatch(&sb, ctx, h, 4)
		checkResultsCleared(t, "after the claims", sb.res)
		outs, errs := sb.finish()
		checkResultsCleared(t, "after the commits", sb.res)
		for i, o := range outs {
			want := Applied
			if n == 1 && i < 4 {
				want = Replayed
			}
			if errs[i] != nil || o.Status != want || string(o.Result) != "r-"+string(batch[i].ID) {
				t.Fatalf("batch %d, event %d: %+v %v, want %v", n, i, o, errs[i], want)
			}
		}
		if n == 0 {
			first = &sb.res[:1][0]
		} else if &sb.res[:1][0] != first {
			t.Error("the second batch did not reuse the results buffer")
		}
	}
}

// TestCheckpointResultsBuffer: a coordinator's checkpoints write their
// record's batch into one results buffer, cleared after each.
func TestCheckpointResultsBuffer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tp, _ := startTwoPhase(t, ctx)
	evs := makeEvents(12, 2, 0)
	var first *idem.BatchResult
	for n, batch := range [][]Event{evs[:8], evs[4:]} {
		if _, err := tp.Checkpoint(ctx, batch); err != nil {
			t.Fatalf("checkpoint %d: %v", n, err)
		}
		checkResultsCleared(t, "after a checkpoint", tp.bufs.res)
		if n == 0 {
			first = &tp.bufs.res[:1][0]
		} else if &tp.bufs.res[:1][0] != first {
			t.Error("the second checkpoint did not reuse the results buffer")
		}
	}
}
