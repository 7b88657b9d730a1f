package idem

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestBatchClaimsAreTheirOwn: the claims one Run hands out (from one
// allocation) are distinct and each finishes its own request only,
// whether it is finished alone or as an item of a later batch (which
// takes the claim's slot without a lookup), and a claim finished once
// cannot be finished again.
func TestBatchClaimsAreTheirOwn(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	ctx := context.Background()
	if _, err := e.Do(ctx, Request{ID: []byte("done")}, func(context.Context) ([]byte, error) { return []byte("r-done"), nil }); err != nil {
		t.Fatal(err)
	}
	const n = 40
	id := func(i int) []byte { return fmt.Appendf(nil, "id-%d", i) }
	b := e.NewBatch()
	for i := range n {
		b.Begin(Request{ID: id(i)})
		if i%7 == 0 { // items without a claim between those with one
			b.Begin(Request{ID: id(i)})          // in flight
			b.Begin(Request{ID: []byte("done")}) // done
		}
	}
	out, err := b.Run(ctx)
	if err != nil {
		t.Fatal(err)
	}
	claims := make([]*Claim, 0, n)
	seen := map[*Claim]bool{}
	for j, r := range out {
		if r.Err != nil {
			t.Fatalf("item %d: %v", j, r.Err)
		}
		if c := r.Result.Claim; c != nil {
			if seen[c] {
				t.Fatalf("item %d: the claim of an earlier item", j)
			}
			seen[c] = true
			claims = append(claims, c)
		}
	}
	if len(claims) != n {
		t.Fatalf("%d claims, want %d", len(claims), n)
	}
	// Even claims: committed by a batch; odd: aborted alone, except the
	// last ones (i%4 == 3), committed alone.
	fin := e.NewBatch()
	for i := 0; i < n; i += 2 {
		fin.Commit(claims[i], fmt.Appendf(nil, "r-%d", i))
	}
	for i := 1; i < n; i += 2 {
		var err error
		if i%4 == 3 {
			err = claims[i].Commit(ctx, fmt.Appendf(nil, "r-%d", i))
		} else {
			err = claims[i].Abort(ctx)
		}
		if err != nil {
			t.Fatalf("finish claim %d alone: %v", i, err)
		}
	}
	fout, err := fin.Run(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for j, r := range fout {
		if r.Err != nil {
			t.Fatalf("commit of claim %d: %v", 2*j, r.Err)
		}
	}
	for i := range n {
		r, err := e.Lookup(ctx, Request{ID: id(i)})
		switch {
		case err != nil:
			t.Fatalf("lookup %d: %v", i, err)
		case i%2 == 1 && i%4 != 3:
			if r.Status != Absent {
				t.Errorf("id %d (aborted): %v %q, want absent", i, r.Status, r.Reply)
			}
		case r.Status != Done || string(r.Reply) != fmt.Sprintf("r-%d", i):
			t.Errorf("id %d: %v %q, want done r-%d", i, r.Status, r.Reply, i)
		}
	}
	again := e.NewBatch()
	again.Commit(claims[0], []byte("x"))
	again.Abort(claims[1])
	aout, err := again.Run(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for j, r := range aout {
		if !errors.Is(r.Err, ErrLeaseLost) {
			t.Errorf("finishing claim %d again: %v, want ErrLeaseLost", j, r.Err)
		}
	}
}
