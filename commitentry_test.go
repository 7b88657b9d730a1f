package idem

import (
	"bytes"
	"context"
	"fmt"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestCommitReplySizes: a committed reply of every size around the sizes
// that newCommitEntry allocates with its entry (64, 128, 256 bytes; 0 and
// longer ones apart) reads back whole, in the table and after a reopen,
// and a reply handed out has no spare capacity shared with the next
// reader's: appending to one never changes another.
func TestCommitReplySizes(t *testing.T) {
	fs := vfs.NewMem()
	e := openMem(t, fs, nil)
	ctx := context.Background()
	sizes := []int{0, 1, 9, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000}
	want := func(n int) []byte { return bytes.Repeat([]byte{byte('a' + n%26)}, n) }
	for _, n := range sizes {
		id := []byte(fmt.Sprintf("r%d", n))
		res, err := e.Begin(ctx, Request{ID: id})
		if err != nil || res.Status != Fresh {
			t.Fatalf("begin %d: %v %v", n, res.Status, err)
		}
		buf := want(n)
		if err := res.Claim.Commit(ctx, buf); err != nil {
			t.Fatalf("commit %d: %v", n, err)
		}
		for i := range buf {
			buf[i] = 'X' // the caller's buffer is its own again
		}
	}
	// A batch's Put stores its reply the same way (batchRun.finishOp).
	b := e.NewBatch()
	for _, n := range []int{1, 300} {
		b.Put(Request{ID: []byte(fmt.Sprintf("p%d", n))}, want(n))
	}
	if _, err := b.Run(ctx); err != nil {
		t.Fatal(err)
	}
	check := func(when string, e *Engine) {
		t.Helper()
		ids := map[string]int{"p1": 1, "p300": 300}
		for _, n := range sizes {
			ids[fmt.Sprintf("r%d", n)] = n
		}
		for sid, n := range ids {
			id := []byte(sid)
			r1, err := e.Begin(ctx, Request{ID: id})
			if err != nil || r1.Status != Done || !bytes.Equal(r1.Reply, want(n)) {
				t.Fatalf("%s: reply of %d bytes: %v %q %v", when, n, r1.Status, r1.Reply, err)
			}
			r2, err := e.Lookup(ctx, Request{ID: id})
			if err != nil || !bytes.Equal(r2.Reply, want(n)) {
				t.Fatalf("%s: lookup of %d bytes: %q %v", when, n, r2.Reply, err)
			}
			a := append(r1.Reply, '1')
			b := append(r2.Reply, '2')
			if a[n] != '1' || b[n] != '2' {
				t.Fatalf("%s: %s, reply of %d bytes: two readers' appends share memory (%q, %q)", when, sid, n, a[n], b[n])
			}
		}
	}
	check("live", e)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	e2 := openMem(t, fs, nil)
	check("reopened", e2)
}
