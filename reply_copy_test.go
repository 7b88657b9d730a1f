package idem

import (
	"context"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestCommitCopiesReply: the caller's reply buffer is its own again once
// Commit (or a batch's Put or Commit) returns; reusing it changes nothing
// stored, in the table, in the index, or after a reopen.
func TestCommitCopiesReply(t *testing.T) {
	fs := vfs.NewMem()
	e := openMem(t, fs, nil)
	ctx := context.Background()
	buf := []byte("reply-one")
	res, err := e.Begin(ctx, Request{ID: []byte("single")})
	if err != nil || res.Status != Fresh {
		t.Fatalf("begin: %v %v", res.Status, err)
	}
	if err := res.Claim.Commit(ctx, buf); err != nil {
		t.Fatal(err)
	}
	copy(buf, "XXXXXXXXX")
	bbuf := []byte("reply-two")
	b := e.NewBatch()
	b.Put(Request{ID: []byte("put")}, bbuf)
	if _, err := b.Run(ctx); err != nil {
		t.Fatal(err)
	}
	copy(bbuf, "YYYYYYYYY")
	check := func(when string, e *Engine) {
		t.Helper()
		for id, want := range map[string]string{"single": "reply-one", "put": "reply-two"} {
			r, err := e.Lookup(ctx, Request{ID: []byte(id)})
			if err != nil || string(r.Reply) != want {
				t.Fatalf("%s: %s = %q %v, want %q", when, id, r.Reply, err, want)
			}
		}
	}
	check("live", e)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	e = openMem(t, fs, nil)
	defer e.Close()
	check("after a reopen", e)
}
