package idem

import (
	"context"
	"errors"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/testclock"
)

// appendRunBatch adds to a batch of e the items of TestBatchAppendRun: a
// claim, a second Begin of its id, a Put and its duplicate, a Begin of a
// committed id, a commit of held, a sequence gap, an invalid item and an
// advance.
func appendRunBatch(e *Engine, held *Claim) Batch {
	b := e.NewBatch()
	b.Begin(Request{ID: []byte("a")})
	b.Begin(Request{ID: []byte("a")})
	b.Put(Request{ID: []byte("p")}, []byte("r-p"))
	b.Put(Request{ID: []byte("p")}, []byte("x"))
	b.Begin(Request{ID: []byte("done")})
	b.Commit(held, []byte("r-held"))
	b.Put(Request{Client: "c", Seq: 2}, nil)
	b.Abort(nil)
	b.Advance(Advance{Client: "k", Seq: 7})
	return b
}

// appendRunEngine opens an engine holding a claim of "held" and a
// committed "done", on its own test clock.
func appendRunEngine(t *testing.T) (*Engine, *Claim) {
	t.Helper()
	e := openMem(t, vfs.NewMem(), &Options{Clock: testclock.New().Now})
	held := mustBegin(t, e, Request{ID: []byte("held")}, Fresh).Claim
	if _, err := e.Do(bg, Request{ID: []byte("done")}, func(context.Context) ([]byte, error) { return []byte("r-done"), nil }); err != nil {
		t.Fatal(err)
	}
	return e, held
}

// TestBatchAppendRun: AppendRun appends to dst exactly the results Run
// gives for the same batch on the same state, after dst's elements, in
// dst's spare capacity when it has the room (clearing what an earlier run
// left there) and in a new array otherwise; a batch error returns dst as
// given.
func TestBatchAppendRun(t *testing.T) {
	ref, held := appendRunEngine(t)
	defer ref.Close()
	want, err := appendRunBatch(ref, held).Run(bg)
	if err != nil {
		t.Fatal(err)
	}
	if len(want) != 9 || want[0].Result.Claim == nil || want[1].Result.Status != InFlight || want[3].Result.Status != Done || want[7].Err == nil {
		t.Fatalf("Run's results are not the mix the test needs: %+v", want)
	}
	stale := &Claim{}
	for _, c := range []struct {
		name string
		cap  int // of dst, whose length is 2
	}{{"room", 16}, {"no room", 2}, {"some room", 5}} {
		t.Run(c.name, func(t *testing.T) {
			e, held := appendRunEngine(t)
			defer e.Close()
			b := appendRunBatch(e, held)
			ra, ok := b.(RunAppender)
			if !ok {
				t.Fatal("the engine's batch does not implement RunAppender")
			}
			dst := make([]BatchResult, c.cap)
			for i := range dst { // an earlier run's results, in the spare capacity too
				dst[i] = BatchResult{Result: Result{Status: Done, Reply: []byte("old"), Claim: stale}, Err: errors.New("old")}
			}
			dst = dst[:2]
			got, err := ra.AppendRun(bg, dst)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != 2+len(want) {
				t.Fatalf("%d results after dst's 2, want %d", len(got)-2, len(want))
			}
			if same := &got[0] == &dst[0]; same != (c.cap >= 2+len(want)) {
				t.Errorf("results in dst's array: %v with cap %d for %d", same, c.cap, 2+len(want))
			}
			for i := range 2 {
				if got[i].Result.Claim != stale || string(got[i].Result.Reply) != "old" {
					t.Errorf("dst[%d] changed: %+v", i, got[i])
				}
			}
			for i := range want {
				if d, w := describeResult(got[2+i]), describeResult(want[i]); d != w {
					t.Errorf("item %d: AppendRun %s, Run %s", i, d, w)
				}
				if got[2+i].Result.Claim == stale {
					t.Errorf("item %d: kept an earlier run's claim", i)
				}
			}
			if err := got[2].Result.Claim.Commit(bg, []byte("r-a")); err != nil {
				t.Errorf("committing the appended claim: %v", err)
			}
			again, err := ra.AppendRun(bg, got[:1])
			if !errors.Is(err, ErrInvalidRequest) || len(again) != 1 || &again[0] != &got[0] {
				t.Errorf("second AppendRun: %d results, %v; want dst as given and ErrInvalidRequest", len(again), err)
			}
		})
	}
}

// TestBatchAppendRunKeepsNoDst: once AppendRun returns, the engine holds
// nothing of dst: a results buffer the caller drops is freed while the
// engine (and its pooled batch state) lives on.
func TestBatchAppendRunKeepsNoDst(t *testing.T) {
	e, held := appendRunEngine(t)
	defer e.Close()
	var freed atomic.Bool
	dst := make([]BatchResult, 0, 64)
	runtime.AddCleanup(&dst[:1][0], func(f *atomic.Bool) { f.Store(true) }, &freed)
	out, err := appendRunBatch(e, held).(RunAppender).AppendRun(bg, dst)
	if err != nil || len(out) != 9 || &out[0] != &dst[:1][0] {
		t.Fatalf("AppendRun: %d results, %v", len(out), err)
	}
	c := out[0].Result.Claim
	out, dst = nil, nil
	// One collection only: a second one would also drop the engine's
	// pooled run state (sync.Pool keeps its values through one), which
	// must not be what frees dst.
	runtime.GC()
	for i := 0; i < 500 && !freed.Load(); i++ {
		time.Sleep(time.Millisecond)
	}
	if !freed.Load() {
		t.Error("the results buffer given to AppendRun is still reachable after it returned")
	}
	if err := c.Commit(bg, []byte("r-a")); err != nil {
		t.Fatal(err)
	}
	// The engine's next batch reuses the pooled run state.
	b := e.NewBatch()
	b.Begin(Request{ID: []byte("b")})
	if _, err := b.Run(bg); err != nil {
		t.Fatal(err)
	}
}
