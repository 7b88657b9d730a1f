package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/testclock"
	"github.com/idemdb/idem/internal/vfstest"
)

func clientState(t testing.TB, e *Engine, scope, client string) uint64 {
	t.Helper()
	n, err := e.ClientState(context.Background(), scope, client)
	if err != nil {
		t.Fatalf("ClientState(%q, %q): %v", scope, client, err)
	}
	return n
}

// CommitAdvance commits the reply and raises the named clients in one
// record; numbers only go up; the raised numbers survive reopen (with and
// without the index), Forget, Ack, TTL cleanup and snapshot/restore.
func TestCommitAdvance(t *testing.T) {
	clk := testclock.New()
	fs := vfs.NewMem()
	opts := &Options{Clock: clk.Now}
	e := openMem(t, fs, opts)
	commit := func(x string, adv ...Advance) {
		t.Helper()
		res := mustBegin(t, e, Request{Scope: "events", ID: id(x), TTL: time.Minute}, Fresh)
		if err := res.Claim.CommitAdvance(bg, id("r-"+x), adv...); err != nil {
			t.Fatalf("CommitAdvance %s: %v", x, err)
		}
	}
	commit("a", Advance{Scope: "offsets", Client: "p0", Seq: 10})
	commit("b", Advance{Scope: "offsets", Client: "p0", Seq: 7}, Advance{Scope: "offsets", Client: "p1", Seq: 3})
	commit("c", Advance{Scope: "offsets", Client: "p1", Seq: 12})
	commit("d") // no advances: a plain commit
	check := func(when string) {
		t.Helper()
		if got := clientState(t, e, "offsets", "p0"); got != 10 {
			t.Fatalf("%s: p0 at %d, want 10 (an advance never lowers)", when, got)
		}
		if got := clientState(t, e, "offsets", "p1"); got != 12 {
			t.Fatalf("%s: p1 at %d, want 12", when, got)
		}
		if got := clientState(t, e, "offsets", "p2"); got != 0 {
			t.Fatalf("%s: p2 at %d", when, got)
		}
	}
	check("live")
	if d := mustBegin(t, e, Request{Scope: "events", ID: id("b")}, Done); string(d.Reply) != "r-b" {
		t.Fatalf("reply %q", d.Reply)
	}
	// The advanced client is an ordinary sequence-mode client: the next
	// number is fresh, the advanced one is committed without a reply.
	if _, err := e.Begin(bg, Request{Scope: "offsets", Client: "p0", Seq: 10}); !errors.Is(err, ErrAlreadyCommitted) {
		t.Fatalf("seq 10 after the advance: %v", err)
	}
	var gap *SequenceGapError
	if _, err := e.Begin(bg, Request{Scope: "offsets", Client: "p0", Seq: 12}); !errors.As(err, &gap) || gap.Last != 10 {
		t.Fatalf("seq 12 after the advance: %v", err)
	}
	e.Close()
	e = openMem(t, fs, opts)
	check("reopen")
	e.Close()
	if err := fs.RemoveAll("db/index"); err != nil {
		t.Fatal(err)
	}
	e = openMem(t, fs, opts)
	check("replay without the index")
	// Forget, TTL cleanup and Ack remove replies, never a client's number.
	clk.Advance(2 * time.Minute)
	if n, err := e.CleanupExpired(bg); err != nil || n != 4 {
		t.Fatalf("CleanupExpired: %d, %v", n, err)
	}
	if err := e.Ack(bg, "events", id("d")); err != nil {
		t.Fatal(err)
	}
	if err := e.Forget(bg, clk.Now()); err != nil {
		t.Fatal(err)
	}
	check("after cleanup, ack and forget")
	var snap bytes.Buffer
	if _, err := e.Snapshot(bg, &snap); err != nil {
		t.Fatal(err)
	}
	e.Close()
	e, err := Restore("db", &snap, &Options{FS: vfs.NewMem(), Clock: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	check("restored snapshot")
}

// Invalid advances are refused before anything is written, and the claim
// stays usable; a client with a claim in flight is refused with ErrInFlight.
func TestCommitAdvanceRefusals(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	res := mustBegin(t, e, Request{Scope: "s", ID: id("x")}, Fresh)
	long := string(make([]byte, e.o.MaxIDLen+1))
	for _, bad := range [][]Advance{
		{{Scope: "o", Client: "", Seq: 1}},
		{{Scope: "o", Client: "p", Seq: 0}},
		{{Scope: "o", Client: long, Seq: 1}},
		{{Scope: long, Client: "p", Seq: 1}},
		{{Scope: "o", Client: "p", Seq: 1}, {Scope: "o", Client: "p", Seq: 2}},
		make([]Advance, maxAdvances+1),
	} {
		if err := res.Claim.CommitAdvance(bg, nil, bad...); !errors.Is(err, ErrInvalidRequest) {
			t.Fatalf("advances %v: %v, want ErrInvalidRequest", len(bad), err)
		}
	}
	// A sequence-mode claim cannot advance its own client.
	own := mustBegin(t, e, Request{Scope: "o", Client: "q", Seq: 1}, Fresh)
	if err := own.Claim.CommitAdvance(bg, nil, Advance{Scope: "o", Client: "q", Seq: 5}); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("own client: %v", err)
	}
	// q's seq 1 is in flight: x cannot advance q.
	if err := res.Claim.CommitAdvance(bg, id("rx"), Advance{Scope: "o", Client: "q", Seq: 5}); !errors.Is(err, ErrInFlight) {
		t.Fatalf("advance of a client in flight: %v", err)
	}
	if l, _ := e.Lookup(context.Background(), Request{Scope: "s", ID: id("x")}); l.Status != InFlight {
		t.Fatalf("x after the refused advance: %v", l.Status)
	}
	if err := own.Claim.Commit(bg, id("q1")); err != nil {
		t.Fatal(err)
	}
	if err := res.Claim.CommitAdvance(bg, id("rx"), Advance{Scope: "o", Client: "q", Seq: 5}); err != nil {
		t.Fatal(err)
	}
	if got := clientState(t, e, "o", "q"); got != 5 {
		t.Fatalf("q at %d", got)
	}
	if err := res.Claim.CommitAdvance(bg, id("rx"), Advance{Scope: "o", Client: "q", Seq: 6}); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("second finish: %v", err)
	}
}

// The advance is in the commit's record: at every sync point of a run of
// concurrent partitions, each committing its events in offset order with
// the offset as advance, a crash image holds, per partition, exactly the
// committed events up to its client's number.
func TestCommitAdvanceAtomicAtEverySyncPoint(t *testing.T) {
	mem := vfs.NewCrashableMem()
	var (
		mu     sync.Mutex
		images []*vfs.MemFS
	)
	hfs := &vfstest.SyncHookFS{FS: mem}
	hfs.Hook = func() {
		mu.Lock()
		defer mu.Unlock()
		cfg := vfs.CrashCloneCfg{}
		if len(images)%3 == 1 {
			cfg = vfs.CrashCloneCfg{UnsyncedDataPercent: 50, RNG: rand.New(rand.NewPCG(uint64(len(images)), 1))}
		}
		images = append(images, mem.CrashClone(cfg))
	}
	opts := &Options{SegmentSize: 8 << 10}
	e := openMem(t, hfs, opts)
	const parts, perPart = 4, 60
	var wg sync.WaitGroup
	errs := make(chan error, parts)
	for p := range parts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for off := 1; off <= perPart; off++ {
				if off%7 == 0 {
					continue // offsets may have gaps
				}
				res, err := e.Begin(bg, Request{Scope: "ev", ID: id(fmt.Sprintf("p%d-%d", p, off))})
				if err != nil {
					errs <- err
					return
				}
				if err := res.Claim.CommitAdvance(bg, id(strconv.Itoa(off)), Advance{Scope: "frontier", Client: fmt.Sprint("p", p), Seq: uint64(off)}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	e.Close()
	if len(images) < 50 {
		t.Fatalf("only %d sync points", len(images))
	}
	for n, img := range images {
		e, err := Open("db", &Options{FS: img})
		if err != nil {
			t.Fatalf("image %d: %v", n, err)
		}
		for p := range parts {
			f := clientState(t, e, "frontier", fmt.Sprint("p", p))
			for off := 1; off <= perPart; off++ {
				if off%7 == 0 {
					continue
				}
				l, err := e.Lookup(context.Background(), Request{Scope: "ev", ID: id(fmt.Sprintf("p%d-%d", p, off))})
				if err != nil {
					t.Fatal(err)
				}
				committed := l.Status == Done
				if committed != (uint64(off) <= f) {
					t.Fatalf("image %d: partition %d at %d, event %d committed=%v (status %v)", n, p, f, off, committed, l.Status)
				}
			}
		}
		e.Close()
	}
	t.Logf("checked %d crash images", len(images))
}

// Engine.Advance raises clients alone: max-only, durable, replayed, no
// record when nothing rises, ErrInFlight for a client with a claim running.
func TestEngineAdvance(t *testing.T) {
	fs := vfs.NewMem()
	e := openMem(t, fs, nil)
	if err := e.Advance(bg, Advance{Scope: "f", Client: "p", Seq: 4}, Advance{Scope: "f", Client: "q", Seq: 2}); err != nil {
		t.Fatal(err)
	}
	last := e.Stats().LastLSN
	if err := e.Advance(bg, Advance{Scope: "f", Client: "p", Seq: 3}); err != nil {
		t.Fatal(err)
	}
	if got := e.Stats().LastLSN; got != last {
		t.Fatalf("an advance that raises nothing wrote a record (LSN %d -> %d)", last, got)
	}
	if err := e.Advance(bg, Advance{Scope: "f", Client: "p", Seq: 0}); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("seq 0: %v", err)
	}
	res := mustBegin(t, e, Request{Scope: "f", Client: "q", Seq: 3}, Fresh)
	if err := e.Advance(bg, Advance{Scope: "f", Client: "q", Seq: 9}); !errors.Is(err, ErrInFlight) {
		t.Fatalf("client in flight: %v", err)
	}
	if err := res.Claim.Commit(bg, id("q3")); err != nil {
		t.Fatal(err)
	}
	e.Close()
	if err := fs.RemoveAll("db/index"); err != nil {
		t.Fatal(err)
	}
	e = openMem(t, fs, nil)
	defer e.Close()
	if p, q := clientState(t, e, "f", "p"), clientState(t, e, "f", "q"); p != 4 || q != 3 {
		t.Fatalf("after replay: p %d q %d, want 4 3", p, q)
	}
}
