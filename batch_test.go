package idem

import (
	"context"
	"errors"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestBatchResults: every item of a batch gets the result the single call
// would give, and items naming the same key see each other in order.
func TestBatchResults(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	ctx := context.Background()
	res, err := e.Begin(ctx, Request{ID: []byte("held")})
	if err != nil || res.Status != Fresh {
		t.Fatalf("begin held: %v %v", res.Status, err)
	}
	held := res.Claim
	if _, err := e.Do(ctx, Request{ID: []byte("done")}, func(context.Context) ([]byte, error) { return []byte("r-done"), nil }); err != nil {
		t.Fatal(err)
	}
	b := e.NewBatch()
	b.Begin(Request{ID: []byte("a")})              // 0 fresh
	b.Begin(Request{ID: []byte("a")})              // 1 in flight: item 0 holds it
	b.Put(Request{ID: []byte("p")}, []byte("r-p")) // 2 fresh, committed
	b.Put(Request{ID: []byte("p")}, []byte("x"))   // 3 done r-p
	b.Begin(Request{ID: []byte("done")})           // 4 done r-done
	b.Commit(held, []byte("r-held"))               // 5 ok
	b.Put(Request{Client: "c", Seq: 2}, nil)       // 6 gap
	b.Abort(nil)                                   // 7 invalid
	b.Advance(Advance{Client: "k", Seq: 7})        // 8 ok
	if b.Len() != 9 {
		t.Fatalf("Len %d", b.Len())
	}
	out, err := b.Run(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := []Status{Fresh, InFlight, Fresh, Done, Done}
	for i, st := range want {
		if out[i].Err != nil || out[i].Result.Status != st {
			t.Errorf("item %d: %v %v, want %v", i, out[i].Result.Status, out[i].Err, st)
		}
	}
	if out[0].Result.Claim == nil || out[2].Result.Claim != nil {
		t.Errorf("claims: Begin %v (want one), Put %v (want none)", out[0].Result.Claim, out[2].Result.Claim)
	}
	if string(out[3].Result.Reply) != "r-p" || string(out[4].Result.Reply) != "r-done" {
		t.Errorf("replies %q %q", out[3].Result.Reply, out[4].Result.Reply)
	}
	if out[5].Err != nil {
		t.Errorf("commit held: %v", out[5].Err)
	}
	var gap *SequenceGapError
	if !errors.As(out[6].Err, &gap) {
		t.Errorf("put seq 2: %v, want a gap", out[6].Err)
	}
	if !errors.Is(out[7].Err, ErrInvalidRequest) {
		t.Errorf("abort nil: %v", out[7].Err)
	}
	if n, err := e.ClientState(ctx, "", "k"); err != nil || n != 7 {
		t.Errorf("advance: %d %v", n, err)
	}
	if r, err := e.Lookup(ctx, Request{ID: []byte("held")}); err != nil || string(r.Reply) != "r-held" {
		t.Errorf("held: %v %q %v", r.Status, r.Reply, err)
	}
	if _, err := b.Run(ctx); !errors.Is(err, ErrInvalidRequest) {
		t.Errorf("second Run: %v", err)
	}
}
