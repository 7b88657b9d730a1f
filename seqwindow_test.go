package idem

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/testclock"
	"github.com/idemdb/idem/internal/vfstest"
)

// The reply window of per-client sequences: a retry of an older sequence
// number gets its own reply while it is inside the window the client's
// requests ask for (Request.KeepReplies, KeepRepliesFor), and
// *AlreadyCommittedError after.

func seqReq(client string, seq uint64, keep int, keepFor time.Duration) Request {
	return Request{Scope: "svc", Client: client, Seq: seq, Fingerprint: []byte(fmt.Sprint("fp-", seq)),
		KeepReplies: keep, KeepRepliesFor: keepFor}
}

func seqReply(client string, seq uint64) string { return fmt.Sprint("reply-", client, "-", seq) }

// commitSeq runs seq to its commit.
func commitSeq(t testing.TB, e *Engine, client string, seq uint64, keep int, keepFor time.Duration) {
	t.Helper()
	res := mustBegin(t, e, seqReq(client, seq, keep, keepFor), Fresh)
	if err := res.Claim.Commit(bg, []byte(seqReply(client, seq))); err != nil {
		t.Fatalf("commit %s/%d: %v", client, seq, err)
	}
}

// expectDone checks that Begin, Lookup and Wait of seq answer Done with
// its own reply.
func expectDone(t testing.TB, e *Engine, client string, seq uint64) {
	t.Helper()
	r := seqReq(client, seq, 0, 0)
	for name, f := range map[string]func() (Result, error){
		"Begin":  func() (Result, error) { return e.Begin(bg, r) },
		"Lookup": func() (Result, error) { return e.Lookup(bg, r) },
		"Wait":   func() (Result, error) { return e.Wait(bg, r) },
	} {
		res, err := f()
		if err != nil || res.Status != Done || string(res.Reply) != seqReply(client, seq) || res.Seq != seq {
			t.Fatalf("%s %s/%d: %v %q seq %d, %v; want Done %q", name, client, seq, res.Status, res.Reply, res.Seq, err, seqReply(client, seq))
		}
	}
}

// expectAlreadyCommitted checks that Begin and Lookup of seq return
// *AlreadyCommittedError naming last.
func expectAlreadyCommitted(t testing.TB, e *Engine, client string, seq, last uint64) {
	t.Helper()
	r := seqReq(client, seq, 0, 0)
	for name, f := range map[string]func() (Result, error){
		"Begin":  func() (Result, error) { return e.Begin(bg, r) },
		"Lookup": func() (Result, error) { return e.Lookup(bg, r) },
	} {
		_, err := f()
		var ac *AlreadyCommittedError
		if !errors.As(err, &ac) || ac.Seq != seq || ac.Last != last {
			t.Fatalf("%s %s/%d: %v, want *AlreadyCommittedError with Last %d", name, client, seq, err, last)
		}
	}
}

func TestSeqWindowTable(t *testing.T) {
	clk := testclock.New()
	e := openMem(t, vfs.NewMem(), &Options{Clock: clk.Now})
	defer e.Close()
	const keep, age = 3, 5 * time.Minute
	for s := uint64(1); s <= 5; s++ {
		clk.Advance(time.Second)
		commitSeq(t, e, "a", s, keep, age)
	}
	// seq == last, and seq < last within the window: Done, same reply.
	for s := uint64(3); s <= 5; s++ {
		expectDone(t, e, "a", s)
	}
	// The fingerprint is checked as for the latest.
	for _, s := range []uint64{4, 5} {
		r := seqReq("a", s, 0, 0)
		r.Fingerprint = []byte("other")
		if _, err := e.Begin(bg, r); !errors.Is(err, ErrConflict) {
			t.Fatalf("Begin a/%d with another fingerprint: %v, want ErrConflict", s, err)
		}
		if _, err := e.Lookup(bg, r); !errors.Is(err, ErrConflict) {
			t.Fatalf("Lookup a/%d with another fingerprint: %v, want ErrConflict", s, err)
		}
	}
	// After the count window: already committed.
	expectAlreadyCommitted(t, e, "a", 2, 5)
	expectAlreadyCommitted(t, e, "a", 1, 5)
	// seq == last+1: Fresh; while it runs, the older replies stay.
	res := mustBegin(t, e, seqReq("a", 6, keep, age), Fresh)
	expectDone(t, e, "a", 5)
	expectDone(t, e, "a", 4)
	// A gap.
	var gap *SequenceGapError
	if _, err := e.Begin(bg, seqReq("a", 8, keep, age)); !errors.As(err, &gap) || gap.Last != 5 {
		t.Fatalf("Begin a/8: %v, want *SequenceGapError with Last 5", err)
	}
	if err := res.Claim.Commit(bg, []byte(seqReply("a", 6))); err != nil {
		t.Fatal(err)
	}
	expectDone(t, e, "a", 4) // 4, 5 and 6 are the last 3
	expectAlreadyCommitted(t, e, "a", 3, 6)

	// After the age window (read time: the commit time + KeepRepliesFor
	// has passed): already committed; the latest keeps its reply.
	clk.Advance(age + time.Second)
	expectAlreadyCommitted(t, e, "a", 4, 6)
	expectAlreadyCommitted(t, e, "a", 5, 6)
	expectDone(t, e, "a", 6)
	before := e.Stats().Cleanups
	waitApplied(t, e) // the cleanup reads the index's expiry rows
	n, err := e.CleanupExpired(bg)
	if err != nil || n != 2 {
		t.Fatalf("CleanupExpired = %d, %v; want the 2 aged-out sequence replies", n, err)
	}
	if got := e.Stats().Cleanups - before; got != 2 {
		t.Fatalf("Stats.Cleanups grew by %d, want 2", got)
	}
	expectAlreadyCommitted(t, e, "a", 5, 6)

	// The engine's default (no window) is the latest reply only.
	for s := uint64(1); s <= 3; s++ {
		commitSeq(t, e, "b", s, 0, 0)
	}
	expectDone(t, e, "b", 3)
	expectAlreadyCommitted(t, e, "b", 2, 3)

	// A window belongs to sequence mode.
	for _, r := range []Request{
		{ID: []byte("x"), KeepReplies: 2},
		{ID: []byte("x"), KeepRepliesFor: time.Second},
		{Client: "c", Seq: 1, KeepReplies: -1},
		{Client: "c", Seq: 1, KeepReplies: MaxKeepReplies + 1},
		{Client: "c", Seq: 1, KeepRepliesFor: -time.Second},
	} {
		if _, err := e.Begin(bg, r); !errors.Is(err, ErrInvalidRequest) {
			t.Fatalf("Begin %+v: %v, want ErrInvalidRequest", r, err)
		}
	}
}

// TestSeqWindowPipelinedRetry is the reported case: a client pipelines 5,
// 6 and 7 and loses the reply of 5; its retry of 5 gets that reply (before
// windows: ErrAlreadyCommitted at once), also after a restart (replay) and
// in a snapshot restored elsewhere.
func TestSeqWindowPipelinedRetry(t *testing.T) {
	clk := testclock.New()
	fs := vfs.NewMem()
	opts := &Options{Clock: clk.Now}
	e := openMem(t, fs, opts)
	const keep = 10
	for s := uint64(1); s <= 7; s++ {
		clk.Advance(time.Millisecond)
		commitSeq(t, e, "p", s, keep, 5*time.Minute)
	}
	expectDone(t, e, "p", 5)

	e.Close()
	e = openMem(t, fs, opts)
	for s := uint64(1); s <= 7; s++ {
		expectDone(t, e, "p", s)
	}
	// The window goes on after replay: 8..11 push 1 out.
	for s := uint64(8); s <= 11; s++ {
		commitSeq(t, e, "p", s, keep, 5*time.Minute)
	}
	expectAlreadyCommitted(t, e, "p", 1, 11)
	expectDone(t, e, "p", 2)
	// Compaction (index made durable, WAL segments removed) keeps them.
	if _, err := e.Compact(bg); err != nil {
		t.Fatal(err)
	}
	e.Close()
	e = openMem(t, fs, opts)
	expectAlreadyCommitted(t, e, "p", 1, 11)
	for s := uint64(2); s <= 11; s++ {
		expectDone(t, e, "p", s)
	}

	var buf bytes.Buffer
	if _, err := e.Snapshot(bg, &buf); err != nil {
		t.Fatal(err)
	}
	e.Close()
	r, err := Restore("restored", &buf, &Options{FS: fs, Clock: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	expectAlreadyCommitted(t, r, "p", 1, 11)
	for s := uint64(2); s <= 11; s++ {
		expectDone(t, r, "p", s)
	}
	commitSeq(t, r, "p", 12, keep, 5*time.Minute)
	expectAlreadyCommitted(t, r, "p", 2, 12)
	expectDone(t, r, "p", 3)
}

// TestSeqWindowForgetKeepsNumber: Forget removes the older replies as it
// removes other replies; the client's number stays.
func TestSeqWindowForgetKeepsNumber(t *testing.T) {
	clk := testclock.New()
	e := openMem(t, vfs.NewMem(), &Options{Clock: clk.Now})
	defer e.Close()
	for s := uint64(1); s <= 4; s++ {
		clk.Advance(time.Second)
		commitSeq(t, e, "f", s, 4, 0)
	}
	clk.Advance(time.Second)
	if err := e.Forget(bg, clk.Now()); err != nil {
		t.Fatal(err)
	}
	for s := uint64(1); s <= 4; s++ {
		expectAlreadyCommitted(t, e, "f", s, 4)
	}
	if last, err := e.ClientState(bg, "svc", "f"); err != nil || last != 4 {
		t.Fatalf("ClientState = %d, %v; want 4", last, err)
	}
	commitSeq(t, e, "f", 5, 4, 0)
	expectDone(t, e, "f", 5)
}

// TestSeqWindowCrashAtEverySyncPoint runs a pipelined windowed workload
// of a few clients on a crashable MemFS and takes a crash image at every
// sync point: the window each recovered engine answers equals the model's
// (every acknowledged commit inside the window is Done with its reply,
// every number below it is already committed).
func TestSeqWindowCrashAtEverySyncPoint(t *testing.T) {
	const keep = 4
	clients := []string{"c0", "c1", "c2"}
	type model struct {
		last       map[string]uint64 // acknowledged last committed number
		committing map[string]uint64 // a commit in progress: the image may have it
	}
	clone := func(m model) model {
		c := model{last: map[string]uint64{}, committing: map[string]uint64{}}
		for k, v := range m.last {
			c.last[k] = v
		}
		for k, v := range m.committing {
			c.committing[k] = v
		}
		return c
	}
	mem := vfs.NewCrashableMem()
	type image struct {
		fs *vfs.MemFS
		m  model
	}
	var (
		mu     sync.Mutex
		images []image
		m      = model{last: map[string]uint64{}, committing: map[string]uint64{}}
		n      int
	)
	hfs := &vfstest.SyncHookFS{FS: mem}
	hfs.Hook = func() {
		mu.Lock()
		defer mu.Unlock()
		cfg := vfs.CrashCloneCfg{}
		if n%3 == 1 {
			cfg = vfs.CrashCloneCfg{UnsyncedDataPercent: 50, RNG: rand.New(rand.NewPCG(uint64(n), 1))}
		}
		n++
		images = append(images, image{fs: mem.CrashClone(cfg), m: clone(m)})
	}
	clk := testclock.New()
	opts := &Options{Clock: clk.Now, SegmentSize: 4 << 10}
	e := openMem(t, hfs, opts)
	rng := rand.New(rand.NewPCG(9, 9))
	for i := 0; i < 100; i++ {
		c := clients[rng.IntN(len(clients))]
		clk.Advance(time.Millisecond)
		mu.Lock()
		seq := m.last[c] + 1
		mu.Unlock()
		res := mustBegin(t, e, seqReq(c, seq, keep, time.Hour), Fresh)
		if rng.IntN(5) == 0 {
			if err := res.Claim.Abort(bg); err != nil {
				t.Fatal(err)
			}
			continue
		}
		mu.Lock()
		m.committing[c] = seq
		mu.Unlock()
		if err := res.Claim.Commit(bg, []byte(seqReply(c, seq))); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		delete(m.committing, c)
		m.last[c] = seq
		mu.Unlock()
		if i%50 == 49 {
			e.Close()
			e = openMem(t, hfs, opts)
		}
	}
	e.Close()
	if len(images) < 100 {
		t.Fatalf("only %d sync points", len(images))
	}
	for i, img := range images {
		e, err := Open("db", &Options{FS: img.fs, Clock: clk.Now})
		if err != nil {
			t.Fatalf("crash image %d: open: %v", i, err)
		}
		for _, c := range clients {
			last, err := e.ClientState(bg, "svc", c)
			if err != nil {
				t.Fatalf("image %d: ClientState %s: %v", i, c, err)
			}
			if last != img.m.last[c] && (img.m.committing[c] == 0 || last != img.m.committing[c]) {
				t.Fatalf("image %d: client %s at %d, model %d (committing %d)", i, c, last, img.m.last[c], img.m.committing[c])
			}
			for s := max(last, keep+1) - keep - 1 + 1; s <= last; s++ { // the window and the number below it
				if s+keep > last {
					expectDone(t, e, c, s)
				} else {
					expectAlreadyCommitted(t, e, c, s, last)
				}
			}
		}
		e.Close()
	}
	t.Logf("checked %d crash images", len(images))
}

// TestSeqWindowAdvanceEndsWindow: an advance is not a request of the
// client; it drops the client's kept replies, older ones included.
func TestSeqWindowAdvanceEndsWindow(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	for s := uint64(1); s <= 3; s++ {
		commitSeq(t, e, "v", s, 3, 0)
	}
	expectDone(t, e, "v", 1)
	if err := e.Advance(bg, Advance{Scope: "svc", Client: "v", Seq: 10}); err != nil {
		t.Fatal(err)
	}
	for s := uint64(1); s <= 10; s++ {
		expectAlreadyCommitted(t, e, "v", s, 10)
	}
	commitSeq(t, e, "v", 11, 3, 0)
	commitSeq(t, e, "v", 12, 3, 0)
	expectDone(t, e, "v", 11)
	expectAlreadyCommitted(t, e, "v", 10, 12)
}

// TestSeqWindowInDoubtClaimKeepsItsWindow: a claim found in flight at Open
// commits with the window its record asked for (the client entry carries
// it), moving the previous reply to its sequence key.
func TestSeqWindowInDoubtClaimKeepsItsWindow(t *testing.T) {
	fs := vfs.NewMem()
	e := openMem(t, fs, nil)
	for s := uint64(1); s <= 3; s++ {
		commitSeq(t, e, "d", s, 3, 0)
	}
	mustBegin(t, e, seqReq("d", 4, 3, 0), Fresh)
	e.Close() // the claim of 4 stays in flight
	e = openMem(t, fs, nil)
	defer e.Close()
	expectDone(t, e, "d", 3) // kept while 4 is in flight
	claims, err := e.InDoubt(bg, "")
	if err != nil || len(claims) != 1 || claims[0].Seq != 4 {
		t.Fatalf("InDoubt = %+v, %v; want the claim of d/4", claims, err)
	}
	if err := claims[0].Claim.Commit(bg, []byte(seqReply("d", 4))); err != nil {
		t.Fatal(err)
	}
	for s := uint64(2); s <= 4; s++ {
		expectDone(t, e, "d", s)
	}
	expectAlreadyCommitted(t, e, "d", 1, 4)
}
