package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/testclock"
)

// TestPutHintMatchesPut: random programs run on two engines, one looking
// each Put's request up with LookupHint before the batch (after a
// Prefetch of the batch's requests) and adding it with PutHint.Put
// (idemraft's pattern), the other with Lookup and
// Batch.Put, give the same lookups, the same results and the same state.
// The tables are small, so that many hints' slots are evicted before
// their batch runs.
func TestPutHintMatchesPut(t *testing.T) {
	for seed := uint64(1); seed <= 6; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			clkA, clkB := testclock.New(), testclock.New()
			a := openMem(t, vfs.NewMem(), &Options{Clock: clkA.Now, Lease: 10 * time.Second, CacheSize: 8 << 10})
			defer a.Close()
			b := openMem(t, vfs.NewMem(), &Options{Clock: clkB.Now, Lease: 10 * time.Second, CacheSize: 8 << 10})
			defer b.Close()
			p := newBatchProgram(seed)
			var openA, openB []*Claim
			hinted := 0
			for round := 0; round < 150; round++ {
				steps := p.batch(len(openA))
				hints := make([]PutHint, len(steps))
				reqs := make([]Request, len(steps))
				for i, s := range steps {
					reqs[i] = s.req
				}
				a.Prefetch(reqs) // as idemraft does: it decides nothing
				for i, s := range steps {
					if s.kind != bPut || len(s.adv) > 0 {
						continue
					}
					ra, erra := a.LookupHint(bg, s.req, &hints[i])
					rb, errb := b.Lookup(bg, s.req)
					if da, db := describeResult(BatchResult{ra, erra}), describeResult(BatchResult{rb, errb}); da != db {
						t.Fatalf("round %d item %d (%+v): LookupHint %s, Lookup %s", round, i, s, da, db)
					}
				}
				ba, bb := a.NewBatch(), b.NewBatch()
				for i, s := range steps {
					addStep(bb, s, openB)
					if s.kind == bPut && len(s.adv) == 0 {
						hints[i].Put(ba, s.reply)
						hinted++
						continue
					}
					addStep(ba, s, openA)
				}
				openA, openB = runBatchPair(t, round, steps, ba, bb, openA, openB, "hinted: ", "Put:    ")
				d := time.Duration(p.rng.IntN(4)) * time.Second
				clkA.Advance(d)
				clkB.Advance(d)
			}
			if hinted == 0 {
				t.Fatal("the program made no hinted Put")
			}
			if sa, sb := observeBatchState(t, a), observeBatchState(t, b); sa != sb {
				t.Fatalf("state differs:\nhinted:\n%s\nPut:\n%s", sa, sb)
			}
		})
	}
}

// addStep adds step s to batch b (runSteps' and the hint tests' step).
func addStep(b Batch, s batchStep, open []*Claim) {
	switch s.kind {
	case bBegin:
		b.Begin(s.req)
	case bPut:
		b.Put(s.req, s.reply, s.adv...)
	case bCommit:
		b.Commit(open[s.claim], s.reply, s.adv...)
	case bAbort:
		b.Abort(open[s.claim])
	case bAck:
		b.Ack(s.scope, s.ids...)
	case bAdvance:
		b.Advance(s.adv...)
	}
}

// TestPutHintDecidesNothing: a hint carries no verdict. A request looked
// up as absent and then written by another batch is Done at its hinted
// Put (the first reply kept, nothing written), also when its slot was
// evicted in between (the slot the hint holds is stale then: the run
// reads the key again); a fingerprint differing from the stored one is
// ErrConflict.
func TestPutHintDecidesNothing(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	for _, evict := range []bool{false, true} {
		req := Request{ID: id(fmt.Sprint("raced-", evict)), Fingerprint: []byte("fp1")}
		var h PutHint
		if r, err := e.LookupHint(bg, req, &h); err != nil || r.Status != Absent {
			t.Fatalf("evict %v: LookupHint: %v %v", evict, r.Status, err)
		}
		if evict {
			evictSlot(e, e.mustKey(t, req))
		}
		b := e.NewBatch()
		b.Put(req, []byte("first"))
		if out, err := b.Run(bg); err != nil || out[0].Err != nil || out[0].Result.Status != Fresh {
			t.Fatalf("evict %v: first Put: %+v %v", evict, out, err)
		}
		b = e.NewBatch()
		h.Put(b, []byte("second"))
		out, err := b.Run(bg)
		if err != nil || out[0].Err != nil || out[0].Result.Status != Done || string(out[0].Result.Reply) != "first" {
			t.Fatalf("evict %v: hinted Put after another Put: %s (batch err %v), want Done \"first\"", evict, describeResult(out[0]), err)
		}
		if r, err := e.Lookup(bg, req); err != nil || r.Status != Done || string(r.Reply) != "first" {
			t.Fatalf("evict %v: Lookup: %v %q %v", evict, r.Status, r.Reply, err)
		}
	}
	// Another fingerprint: the hint keeps the looked-up request's.
	other := Request{ID: id("raced-false"), Fingerprint: []byte("fp2")}
	var h PutHint
	if _, err := e.LookupHint(bg, other, &h); err == nil {
		t.Fatal("LookupHint of another fingerprint: no error")
	}
	b := e.NewBatch()
	h.Put(b, []byte("x"))
	if out, err := b.Run(bg); err != nil || !errors.Is(out[0].Err, ErrConflict) {
		t.Fatalf("hinted Put of another fingerprint: %s (batch err %v), want ErrConflict", describeResult(out[0]), err)
	}
}

// TestPutHintUsedByItsEngine: PutHint.Put adds the item with its hint to a
// batch of the engine that filled it (the run takes the key and slot from
// it), and a plain Put to any other batch; the zero PutHint adds an item
// that fails with ErrInvalidRequest.
func TestPutHintUsedByItsEngine(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	other := openMem(t, vfs.NewMem(), nil)
	defer other.Close()
	req := Request{ID: id("hinted")}
	var h PutHint
	if r, err := e.LookupHint(bg, req, &h); err != nil || r.Status != Absent || h.sl == nil {
		t.Fatalf("LookupHint: %v %v (slot %v)", r.Status, err, h.sl)
	}
	b := e.NewBatch()
	h.Put(b, []byte("r"))
	if it := b.(*engineBatch).items[0]; it.hint != &h || it.kind != bPut {
		t.Fatalf("the item has hint %p, kind %v; want the hint %p, a Put", it.hint, it.kind, &h)
	}
	bo := other.NewBatch()
	h.Put(bo, []byte("r"))
	if it := bo.(*engineBatch).items[0]; it.hint != nil {
		t.Fatal("another engine's batch took the hint")
	}
	for name, bt := range map[string]Batch{"own": b, "other": bo} {
		if out, err := bt.Run(bg); err != nil || out[0].Err != nil || out[0].Result.Status != Fresh {
			t.Fatalf("%s: %s (batch err %v), want Fresh", name, describeResult(out[0]), err)
		}
	}
	var zero PutHint
	b = e.NewBatch()
	zero.Put(b, []byte("r"))
	if out, err := b.Run(bg); err != nil || !errors.Is(out[0].Err, ErrInvalidRequest) {
		t.Fatalf("zero hint: %s (batch err %v), want ErrInvalidRequest", describeResult(out[0]), err)
	}
}

// TestPrefetchKeyIsLookupKey: Prefetch hashes the key that the lookup of
// each request reads (validate's), so the filter block it loads is the
// one MayContain checks; a request whose identity is invalid is skipped.
// Prefetch on a closed engine does nothing.
func TestPrefetchKeyIsLookupKey(t *testing.T) {
	e := openMem(t, vfs.NewMem(), &Options{MaxIDLen: 16})
	long := strings.Repeat("x", 17)
	reqs := []Request{
		{ID: []byte("a")},
		{Scope: "s", ID: []byte("a")},
		{Client: "c", Seq: 1},
		{Scope: "s", Client: "c", Seq: 9, Fingerprint: []byte("f"), Acked: [][]byte{[]byte("z")}},
		{Scope: "s", ID: []byte("b"), TTL: time.Hour, Acked: [][]byte{[]byte("z")}},
		{ID: []byte(strings.Repeat("i", 16))},
		{},                                 // no identity
		{ID: []byte("a"), Client: "c"},     // both
		{ID: []byte("a"), Seq: 1},          // both
		{Client: "c"},                      // no sequence number
		{Seq: 1},                           // no client
		{ID: []byte(long)},                 // too long
		{Client: long, Seq: 1},             // too long
		{Scope: long, ID: []byte("a")},     // too long
		{Scope: long, Client: "c", Seq: 1}, // too long
	}
	for _, r := range reqs {
		got := e.prefetchKey(nil, &r)
		k, err := e.validate(&r)
		switch {
		case err == nil && !bytes.Equal(got, k.key):
			t.Fatalf("%+v: prefetch key %x, lookup key %x", r, got, k.key)
		case err != nil && got != nil && (len(r.Scope) > 16 || len(r.ID) > 16 || len(r.Client) > 16 || len(r.ID) > 0 == (r.Client != "" || r.Seq != 0) || r.Client != "" && r.Seq == 0):
			t.Fatalf("%+v: invalid identity (%v), prefetch key %x", r, err, got)
		}
	}
	e.Prefetch(reqs)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	e.Prefetch(reqs)
}

// TestLookupHintsMatchesLookupHint: random programs run on two engines,
// one looking each batch's Begin and Put requests up together with
// LookupHints, the other one by one with LookupHint, give the same
// results and the same hints (request, key, fingerprint, a slot), and
// the hinted Puts that follow give the same results and the same state.
// Some of the requests are invalid (each gets its own error), some name
// one key twice (both get the same answer), and the tables are small, so
// that a lookup of the call evicts the slots of earlier ones. A cancelled
// context and a closed engine give every valid request their error.
func TestLookupHintsMatchesLookupHint(t *testing.T) {
	invalid := []Request{{}, {ID: []byte("x"), Client: "c", Seq: 1}, {Client: "c"}, {ID: []byte("x"), TTL: -1}}
	for seed := uint64(1); seed <= 6; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			clkA, clkB := testclock.New(), testclock.New()
			a := openMem(t, vfs.NewMem(), &Options{Clock: clkA.Now, Lease: 10 * time.Second, CacheSize: 8 << 10})
			defer a.Close()
			b := openMem(t, vfs.NewMem(), &Options{Clock: clkB.Now, Lease: 10 * time.Second, CacheSize: 8 << 10})
			defer b.Close()
			p := newBatchProgram(seed)
			var openA, openB []*Claim
			looked, statuses := 0, map[string]int{}
			for round := 0; round < 150; round++ {
				steps := p.batch(len(openA))
				var reqs []Request
				at := make([]int, len(steps)) // step i's position in reqs (-1: none)
				for i, s := range steps {
					at[i] = -1
					if p.rng.IntN(8) == 0 {
						reqs = append(reqs, invalid[p.rng.IntN(len(invalid))])
					}
					if s.kind == bBegin || s.kind == bPut {
						at[i] = len(reqs)
						reqs = append(reqs, s.req)
						if p.rng.IntN(8) == 0 {
							reqs = append(reqs, s.req)
						}
					}
				}
				hintsA, hintsB := make([]PutHint, len(reqs)), make([]PutHint, len(reqs))
				out := make([]BatchResult, len(reqs))
				a.LookupHints(bg, reqs, hintsA, out)
				for i, r := range reqs {
					rb, errb := b.LookupHint(bg, r, &hintsB[i])
					da, db := describeResult(out[i]), describeResult(BatchResult{rb, errb})
					if da != db {
						t.Fatalf("round %d request %d (%+v): LookupHints %s, LookupHint %s", round, i, r, da, db)
					}
					kind := out[i].Result.Status.String()
					if err := out[i].Err; err != nil {
						kind = "error"
						if errors.Is(err, ErrInvalidRequest) {
							kind = "invalid"
						}
					}
					statuses[kind]++
					ha, hb := &hintsA[i], &hintsB[i]
					if (ha.e == nil) != (hb.e == nil) || (ha.sl == nil) != (hb.sl == nil) ||
						!bytes.Equal(ha.k.key, hb.k.key) || !bytes.Equal(ha.fp, hb.fp) || fmt.Sprint(ha.req) != fmt.Sprint(hb.req) {
						t.Fatalf("round %d request %d (%+v): hints differ:\nLookupHints: %+v\nLookupHint:  %+v", round, i, r, *ha, *hb)
					}
					if ha.sl != nil && string(ha.k.key) != ha.sl.key {
						t.Fatalf("round %d request %d: the hint's slot is key %q's, want %q", round, i, ha.sl.key, ha.k.key)
					}
					looked++
				}
				ba, bb := a.NewBatch(), b.NewBatch()
				for i, s := range steps {
					if s.kind == bPut && len(s.adv) == 0 {
						hintsA[at[i]].Put(ba, s.reply)
						hintsB[at[i]].Put(bb, s.reply)
						continue
					}
					addStep(ba, s, openA)
					addStep(bb, s, openB)
				}
				openA, openB = runBatchPair(t, round, steps, ba, bb, openA, openB, "after LookupHints: ", "after LookupHint:  ")
				d := time.Duration(p.rng.IntN(4)) * time.Second
				clkA.Advance(d)
				clkB.Advance(d)
			}
			if looked == 0 || len(statuses) < 5 {
				t.Fatalf("the program looked %d requests up, answers %v: want more kinds", looked, statuses)
			}
			if sa, sb := observeBatchState(t, a), observeBatchState(t, b); sa != sb {
				t.Fatalf("state differs:\nLookupHints:\n%s\nLookupHint:\n%s", sa, sb)
			}
			// A cancelled context, then a closed engine: every valid
			// request gets their error, an invalid one its own.
			reqs := []Request{{ID: []byte("id1")}, invalid[0], {Client: "c0", Seq: 1}}
			ctx, cancel := context.WithCancel(bg)
			cancel()
			for _, c := range []struct {
				ctx  context.Context
				want error
			}{{ctx, context.Canceled}, {bg, ErrClosed}} {
				if c.want == ErrClosed {
					if err := a.Close(); err != nil {
						t.Fatal(err)
					}
				}
				hints, out := make([]PutHint, len(reqs)), make([]BatchResult, len(reqs))
				a.LookupHints(c.ctx, reqs, hints, out)
				for i, r := range out {
					want := c.want
					if i == 1 {
						want = ErrInvalidRequest
					}
					if !errors.Is(r.Err, want) || hints[i].e != nil {
						t.Fatalf("%v: request %d: %s (hint %+v), want %v and no hint", c.want, i, describeResult(r), hints[i], want)
					}
				}
			}
		})
	}
}

// runBatchPair runs ba and bb, two batches of steps on two engines, and
// fails unless each item got the same result from both (labelled la and
// lb); it returns openA and openB with the claims each batch made.
func runBatchPair(t *testing.T, round int, steps []batchStep, ba, bb Batch, openA, openB []*Claim, la, lb string) ([]*Claim, []*Claim) {
	t.Helper()
	outA, err := ba.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	outB, err := bb.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for i := range steps {
		if da, db := describeResult(outA[i]), describeResult(outB[i]); da != db {
			t.Fatalf("round %d item %d (%+v):\n%s%s\n%s%s", round, i, steps[i], la, da, lb, db)
		}
		if c := outA[i].Result.Claim; c != nil {
			openA = append(openA, c)
		}
		if c := outB[i].Result.Claim; c != nil {
			openB = append(openB, c)
		}
	}
	return openA, openB
}
