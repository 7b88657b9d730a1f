package idem

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// A cancelled context must never strand a claim: once a claim exists,
// Commit and Abort write their record whatever ctx says.
func TestCommitAbortIgnoreCancelledContext(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	gone, cancel := context.WithCancel(bg)
	cancel() // the client hung up while the side effect ran

	c := mustBegin(t, e, Request{Scope: "s", ID: id("commit")}, Fresh).Claim
	if err := c.Commit(gone, []byte("r")); err != nil {
		t.Fatalf("commit with a cancelled ctx: %v", err)
	}
	if r, err := e.Lookup(bg, Request{Scope: "s", ID: id("commit")}); err != nil || r.Status != Done || string(r.Reply) != "r" {
		t.Fatalf("after a commit with a cancelled ctx: %+v %v (want done)", r, err)
	}

	c = mustBegin(t, e, Request{Scope: "s", ID: id("abort")}, Fresh).Claim
	if err := c.Abort(gone); err != nil {
		t.Fatalf("abort with a cancelled ctx: %v", err)
	}
	mustBegin(t, e, Request{Scope: "s", ID: id("abort")}, Fresh) // released, not stranded

	c = mustBegin(t, e, Request{Scope: "s", Client: "c", Seq: 1}, Fresh).Claim
	if err := c.CommitAdvance(gone, []byte("x"), Advance{Scope: "s", Client: "p", Seq: 7}); err != nil {
		t.Fatalf("commit-advance with a cancelled ctx: %v", err)
	}
	if n, err := e.ClientState(bg, "s", "p"); err != nil || n != 7 {
		t.Fatalf("advance after a cancelled ctx: %d %v", n, err)
	}

	// Do: fn sees the cancellation and fails; the abort still happens.
	if _, err := e.Do(gone, Request{Scope: "s", ID: id("do")}, func(context.Context) ([]byte, error) { return nil, nil }); !errors.Is(err, context.Canceled) {
		t.Fatalf("Do with a cancelled ctx before Begin: %v", err)
	}
	ctx, cancel := context.WithCancel(bg)
	if _, err := e.Do(ctx, Request{Scope: "s", ID: id("do")}, func(context.Context) ([]byte, error) {
		cancel() // the caller's deadline passes after the side effect
		return []byte("done"), nil
	}); err != nil {
		t.Fatalf("Do whose ctx ends after fn: %v", err)
	}
	if r, _ := e.Lookup(bg, Request{Scope: "s", ID: id("do")}); r.Status != Done {
		t.Fatalf("Do's commit with an ended ctx: %v", r.Status)
	}
}

// A claim is finished once: a second Commit or Abort is ErrLeaseLost and
// writes nothing; a refused finish (too large a reply) leaves it open.
func TestClaimFinishedOnce(t *testing.T) {
	e := openMem(t, vfs.NewMem(), &Options{MaxReplySize: 8})
	defer e.Close()
	c := mustBegin(t, e, Request{ID: id("a")}, Fresh).Claim
	if err := c.Commit(bg, []byte("0123456789")); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("oversized reply: %v", err)
	}
	if err := c.Commit(bg, []byte("ok")); err != nil {
		t.Fatalf("commit after a refused one: %v", err)
	}
	for _, f := range []func() error{func() error { return c.Commit(bg, []byte("again")) }, func() error { return c.Abort(bg) }} {
		if err := f(); !errors.Is(err, ErrLeaseLost) {
			t.Fatalf("second finish: %v", err)
		}
	}
	if r, _ := e.Lookup(bg, Request{ID: id("a")}); string(r.Reply) != "ok" {
		t.Fatalf("reply %q", r.Reply)
	}
}

// Lookup and Wait name a request as Begin does: the fingerprint is
// checked, and sequence numbers get Begin's errors.
func TestReadsFollowTheRequest(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	fp := func(s string) []byte { return []byte(s) }
	c := mustBegin(t, e, Request{ID: id("a"), Fingerprint: fp("1")}, Fresh).Claim
	for _, read := range []func(Request) (Result, error){
		func(r Request) (Result, error) { return e.Lookup(bg, r) },
		func(r Request) (Result, error) { return e.Wait(bg, r) },
	} {
		// In flight: a different fingerprint is a conflict, not a wait.
		if _, err := read(Request{ID: id("a"), Fingerprint: fp("2")}); !errors.Is(err, ErrConflict) {
			t.Fatalf("read of an in-flight id with another fingerprint: %v", err)
		}
	}
	if r, err := e.Lookup(bg, Request{ID: id("a"), Fingerprint: fp("1")}); err != nil || r.Status != InFlight {
		t.Fatalf("lookup in flight: %+v %v", r, err)
	}
	if err := c.Commit(bg, []byte("r")); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		fp   []byte
		want error
	}{{fp("1"), nil}, {nil, nil}, {fp("2"), ErrConflict}} {
		for _, read := range []func(Request) (Result, error){
			func(r Request) (Result, error) { return e.Lookup(bg, r) },
			func(r Request) (Result, error) { return e.Wait(bg, r) },
		} {
			r, err := read(Request{ID: id("a"), Fingerprint: tc.fp})
			if !errors.Is(err, tc.want) || (tc.want == nil && (r.Status != Done || string(r.Reply) != "r")) {
				t.Fatalf("read with fingerprint %q: %+v %v, want %v", tc.fp, r, err, tc.want)
			}
		}
	}
	// An id stored without a fingerprint never satisfies a checked read.
	mustBegin(t, e, Request{ID: id("u")}, Fresh).Claim.Commit(bg, nil)
	if _, err := e.Lookup(bg, Request{ID: id("u"), Fingerprint: fp("1")}); !errors.Is(err, ErrConflict) {
		t.Fatalf("checked read of an unchecked entry: %v", err)
	}
	// Sequence mode: Absent for the next number, Begin's errors otherwise.
	mustBegin(t, e, Request{Client: "c", Seq: 1}, Fresh).Claim.Commit(bg, []byte("one"))
	if r, err := e.Lookup(bg, Request{Client: "c", Seq: 2}); err != nil || r.Status != Absent || r.Seq != 2 {
		t.Fatalf("next number: %+v %v", r, err)
	}
	var gap *SequenceGapError
	if _, err := e.Lookup(bg, Request{Client: "c", Seq: 5}); !errors.As(err, &gap) || gap.Last != 1 {
		t.Fatalf("gap: %v", err)
	}
	mustBegin(t, e, Request{Client: "c", Seq: 2}, Fresh)
	var ac *AlreadyCommittedError
	if _, err := e.Lookup(bg, Request{Client: "c", Seq: 1}); !errors.As(err, &ac) || ac.Last != 1 {
		t.Fatalf("an older number: %v", err)
	}
	// Reads count nothing.
	if st := e.Stats(); st.Conflicts != 0 || st.SequenceGaps != 0 || st.AlreadyCommitted != 0 {
		t.Fatalf("reads were counted: %+v", st)
	}
}

func TestInDoubtByScopePrefix(t *testing.T) {
	mem := vfs.NewCrashableMem()
	e := openMem(t, mem, nil)
	for _, s := range []string{"http/a", "http/b", "stream/x"} {
		mustBegin(t, e, Request{Scope: s, ID: id("1")}, Fresh)
	}
	crashed := mem.CrashClone(vfs.CrashCloneCfg{})
	e.Close()
	e = openMem(t, crashed, nil)
	defer e.Close()
	for prefix, want := range map[string]int{"": 3, "http/": 2, "http/a": 1, "stream/": 1, "none": 0} {
		ds, err := e.InDoubt(bg, prefix)
		if err != nil || len(ds) != want {
			t.Fatalf("InDoubt(%q): %d claims, %v; want %d", prefix, len(ds), err, want)
		}
	}
}

func TestOpenRefusesUnknownSyncMode(t *testing.T) {
	if _, err := Open("db", &Options{FS: vfs.NewMem(), Sync: SyncMode(7)}); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("unknown sync mode: %v", err)
	}
	for m, s := range map[SyncMode]string{SyncAlways: "always", SyncInterval: "interval", SyncNever: "never"} {
		if m.String() != s {
			t.Fatalf("%d: %q", int(m), m.String())
		}
	}
}

// countingStore is a Store of its own (a wrapper a user could write):
// Do and NewClaim work on any Store, not only *Engine.
type countingStore struct {
	*Engine
	begins, finishes atomic.Int64
}

type countingBackend struct {
	s *countingStore
	c *Claim
}

func (b countingBackend) Commit(ctx context.Context, reply []byte, adv []Advance) error {
	b.s.finishes.Add(1)
	return b.c.CommitAdvance(ctx, reply, adv...)
}

func (b countingBackend) Abort(ctx context.Context) error {
	b.s.finishes.Add(1)
	return b.c.Abort(ctx)
}

func (s *countingStore) Begin(ctx context.Context, req Request) (Result, error) {
	s.begins.Add(1)
	r, err := s.Engine.Begin(ctx, req)
	if r.Claim != nil {
		r.Claim = NewClaim(countingBackend{s, r.Claim}, r.LeaseUntil)
	}
	return r, err
}

func TestDoOnAnyStore(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	s := &countingStore{Engine: e}
	var _ Store = s
	runs := 0
	fn := func(context.Context) ([]byte, error) { runs++; return []byte("r"), nil }
	for range 3 {
		if r, err := Do(bg, s, Request{ID: id("x")}, fn); err != nil || string(r) != "r" {
			t.Fatalf("Do: %q %v", r, err)
		}
	}
	if runs != 1 || s.begins.Load() != 3 || s.finishes.Load() != 1 {
		t.Fatalf("runs %d begins %d finishes %d", runs, s.begins.Load(), s.finishes.Load())
	}
	// The wrapper's claim keeps the one-finish rule without calling the
	// backend again.
	c := mustBegin(t, e, Request{ID: id("y")}, Fresh).Claim
	w := NewClaim(countingBackend{s, c}, c.LeaseUntil())
	_ = w.Commit(bg, nil)
	if err := w.Abort(bg); !errors.Is(err, ErrLeaseLost) || s.finishes.Load() != 2 {
		t.Fatalf("second finish through NewClaim: %v, backend calls %d", err, s.finishes.Load())
	}
	if r, _ := e.Lookup(bg, Request{ID: id("y")}); r.Status != Done || r.Reply == nil {
		t.Fatalf("nil reply through NewClaim: %+v", r)
	}
}
