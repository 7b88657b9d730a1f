package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/internal/alloctest"
	"github.com/idemdb/idem/internal/testclock"
	"github.com/idemdb/idem/internal/vfstest"
	"github.com/idemdb/idem/wal"
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
	b.Put(Request{ID: []byte("late")}, nil) // after Run: counted, never run
	if b.Len() != 10 {
		t.Errorf("Len after a Put after Run: %d, want 10", b.Len())
	}
	if _, err := b.Run(ctx); !errors.Is(err, ErrInvalidRequest) {
		t.Errorf("second Run: %v", err)
	}
	if r, err := e.Lookup(ctx, Request{ID: []byte("late")}); err != nil || r.Status != Absent {
		t.Errorf("late: %v %v, want absent", r.Status, err)
	}
}

// batchProgram draws random batches over a few ids and sequence-mode
// clients: Begin, Put (with advances for ids), Commit (some with
// advances) and Abort of claims from earlier batches, Ack, Advance, with
// conflicting fingerprints, gaps, reply windows, TTLs and leases that run
// out. Items refer to open claims by number, so the same program runs
// against two engines.
type batchProgram struct {
	rng  *rand.Rand
	seqs map[string]uint64 // a guess at each client's next number
}

// batchStep is one item of a program; claim indexes the open claims.
type batchStep struct {
	kind  batchKind
	req   Request
	reply []byte
	adv   []Advance
	claim int
	scope string
	ids   [][]byte
}

func newBatchProgram(seed uint64) *batchProgram {
	return &batchProgram{rng: rand.New(rand.NewPCG(seed, 7)), seqs: map[string]uint64{}}
}

func (p *batchProgram) batch(open int) []batchStep {
	rng := p.rng
	n := 1 + rng.IntN(12)
	var out []batchStep
	idReq := func() Request {
		r := Request{Scope: []string{"", "s"}[rng.IntN(2)], ID: []byte(fmt.Sprint("id", rng.IntN(12)))}
		if rng.IntN(6) == 0 {
			r.Fingerprint = []byte{byte('a' + rng.IntN(2))}
		}
		if rng.IntN(8) == 0 {
			r.TTL = time.Duration(1+rng.IntN(20)) * time.Second
		}
		if rng.IntN(8) == 0 {
			r.Acked = [][]byte{[]byte(fmt.Sprint("id", rng.IntN(12)))}
			if string(r.Acked[0]) == string(r.ID) {
				r.Acked = nil
			}
		}
		return r
	}
	client := func() string { return fmt.Sprint("c", rng.IntN(3)) }
	seqReq := func() Request {
		c := client()
		s := p.seqs[c] + 1
		switch rng.IntN(8) {
		case 0:
			s += uint64(rng.IntN(3)) // maybe a gap
		case 1:
			if s > 2 {
				s -= uint64(1 + rng.IntN(2)) // an older number
			}
		}
		p.seqs[c] = max(p.seqs[c], s)
		r := Request{Client: c, Seq: s}
		if rng.IntN(3) == 0 {
			r.KeepReplies = 3
			if rng.IntN(2) == 0 {
				r.KeepRepliesFor = 30 * time.Second
			}
		}
		return r
	}
	adv := func() []Advance {
		if rng.IntN(3) != 0 {
			return nil
		}
		c := fmt.Sprint("k", rng.IntN(2))
		return []Advance{{Client: c, Seq: uint64(1 + rng.IntN(20))}}
	}
	for i := 0; i < n; i++ {
		reply := []byte(fmt.Sprint("r", rng.IntN(1000)))
		switch k := rng.IntN(10); {
		case k < 2:
			out = append(out, batchStep{kind: bBegin, req: idReq()})
		case k < 4:
			out = append(out, batchStep{kind: bPut, req: idReq(), reply: reply, adv: adv()})
		case k == 4:
			out = append(out, batchStep{kind: bBegin, req: seqReq()})
		case k == 5:
			out = append(out, batchStep{kind: bPut, req: seqReq(), reply: reply})
		case k == 6 && open > 0:
			out = append(out, batchStep{kind: bCommit, claim: rng.IntN(open), reply: reply, adv: adv()})
		case k == 7 && open > 0:
			out = append(out, batchStep{kind: bAbort, claim: rng.IntN(open)})
		case k == 8:
			out = append(out, batchStep{kind: bAck, scope: []string{"", "s"}[rng.IntN(2)], ids: [][]byte{[]byte(fmt.Sprint("id", rng.IntN(12)))}})
		default:
			out = append(out, batchStep{kind: bAdvance, adv: []Advance{{Client: client(), Seq: uint64(1 + rng.IntN(12))}}})
		}
	}
	return out
}

// runSteps adds steps to a batch of e (claims from open) and runs it, or
// (singly) runs each step through the single calls, as the first Run did.
// It returns the results and the open claims afterwards.
func runSteps(t *testing.T, e *Engine, steps []batchStep, open []*Claim, singly bool) ([]BatchResult, []*Claim) {
	t.Helper()
	b := e.NewBatch()
	for _, s := range steps {
		addStep(b, s, open)
	}
	var out []BatchResult
	if singly {
		bi := b.(*engineBatch)
		calls := make([]batchCall, len(bi.items))
		for i := range bi.items {
			calls[i] = bi.items[i].batchCall
		}
		bi.release()
		out = runSingly(e, calls)
	} else {
		var err error
		if out, err = b.Run(bg); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range out {
		if r.Result.Claim != nil {
			open = append(open, r.Result.Claim)
		}
	}
	return out, open
}

// runSingly runs items one at a time through the single calls.
func runSingly(e *Engine, items []batchCall) []BatchResult {
	out := make([]BatchResult, len(items))
	for i := range items {
		it := &items[i]
		r := &out[i]
		switch it.kind {
		case bBegin:
			r.Result, r.Err = e.Begin(bg, it.req)
		case bPut:
			r.Result, r.Err = e.Begin(bg, it.req)
			if r.Err == nil && r.Result.Status == Fresh {
				c := r.Result.Claim
				r.Result.Claim = nil
				r.Err = c.CommitAdvance(bg, it.reply, it.adv...)
				if r.Err != nil {
					_ = c.Abort(bg)
				}
			}
		case bCommit, bAbort:
			if it.kind == bAbort {
				r.Err = it.claim.Abort(bg)
			} else {
				r.Err = it.claim.CommitAdvance(bg, it.reply, it.adv...)
			}
		case bAck:
			r.Err = e.Ack(bg, it.scope, it.ids...)
		case bAdvance:
			r.Err = e.Advance(bg, it.adv...)
		}
	}
	return out
}

// describeResult renders what a caller sees of one result.
func describeResult(r BatchResult) string {
	s := fmt.Sprintf("%v reply=%q seq=%d lease=%d at=%d exp=%d claim=%v", r.Result.Status, r.Result.Reply, r.Result.Seq,
		r.Result.LeaseUntil.UnixNano(), r.Result.CommittedAt.UnixNano(), r.Result.ExpiresAt.UnixNano(), r.Result.Claim != nil)
	if r.Err != nil {
		s += " err=" + r.Err.Error()
	}
	return s
}

// observeBatchState is every answer a caller can get about the keys
// batchProgram uses.
func observeBatchState(t *testing.T, e *Engine) string {
	t.Helper()
	var b strings.Builder
	for _, scope := range []string{"", "s"} {
		for i := 0; i < 12; i++ {
			r, err := e.Lookup(bg, Request{Scope: scope, ID: []byte(fmt.Sprint("id", i))})
			fmt.Fprintf(&b, "%s/id%d %v %q %d %d %v\n", scope, i, r.Status, r.Reply, r.CommittedAt.UnixNano(), r.ExpiresAt.UnixNano(), err)
		}
	}
	for _, c := range []string{"c0", "c1", "c2", "k0", "k1"} {
		last, err := e.ClientState(bg, "", c)
		fmt.Fprintf(&b, "%s last %d %v\n", c, last, err)
		for s := uint64(1); s <= last+1; s++ {
			r, err := e.Lookup(bg, Request{Client: c, Seq: s})
			fmt.Fprintf(&b, "  %d %v %q %v\n", s, r.Status, r.Reply, err)
		}
	}
	return b.String()
}

// indexEntries is every entry of the engine's index, encoded.
func indexEntries(t *testing.T, e *Engine) map[string]string {
	t.Helper()
	waitApplied(t, e)
	out := map[string]string{}
	if err := e.ix.Entries(nil, func(k []byte, en *index.Entry) error {
		out[string(k)] = fmt.Sprintf("%+v", *en)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestBatchMatchesSingleCalls: random batches run as one record each give
// every item exactly the result the single calls give it one at a time,
// and leave the same state and counters. Each seed runs as drawn, with
// repeats (withRepeats: items naming the key of an earlier item of their
// batch again, one to three items later, up to three times: two Puts of
// an id, a Put and then a Begin, an Ack and then a Put, the Commit or
// Abort of a claim and then a Begin of its request), so that a run reads
// keys its record changed and keys it did not (batchRun.unchanged tells
// them apart from the table), and with repeats over a table of a few
// slots per shard, whose slots are evicted between batches (keys then
// only in the index) and within a run, between two items of one key.
func TestBatchMatchesSingleCalls(t *testing.T) {
	for _, c := range []struct {
		name    string
		repeats bool
		cache   int64
	}{{"drawn", false, 0}, {"repeats", true, 0}, {"repeats-evicting", true, 8 << 10}} {
		for seed := uint64(1); seed <= 6; seed++ {
			t.Run(fmt.Sprintf("%s/seed%d", c.name, seed), func(t *testing.T) {
				testBatchMatchesSingleCalls(t, seed, c.repeats, c.cache)
			})
		}
	}
}

func testBatchMatchesSingleCalls(t *testing.T, seed uint64, repeats bool, cache int64) {
	clkA, clkB := testclock.New(), testclock.New()
	a := openMem(t, vfs.NewMem(), &Options{Clock: clkA.Now, Lease: 10 * time.Second, CacheSize: cache})
	defer a.Close()
	b := openMem(t, vfs.NewMem(), &Options{Clock: clkB.Now, Lease: 10 * time.Second, CacheSize: cache})
	defer b.Close()
	p := newBatchProgram(seed)
	var openA, openB []*Claim
	for round := 0; round < 150; round++ {
		steps := p.batch(len(openA))
		if repeats {
			steps = withRepeats(p.rng, steps, openA)
		}
		var outA, outB []BatchResult
		outA, openA = runSteps(t, a, steps, openA, false)
		outB, openB = runSteps(t, b, steps, openB, true)
		for i := range steps {
			if da, db := describeResult(outA[i]), describeResult(outB[i]); da != db {
				t.Fatalf("round %d item %d (%+v):\nbatch:  %s\nsingly: %s", round, i, steps[i], da, db)
			}
		}
		d := time.Duration(p.rng.IntN(4)) * time.Second
		clkA.Advance(d)
		clkB.Advance(d)
	}
	if sa, sb := observeBatchState(t, a), observeBatchState(t, b); sa != sb {
		t.Fatalf("state differs:\nbatch:\n%s\nsingly:\n%s", sa, sb)
	}
	sa, sb := a.Stats(), b.Stats()
	for _, c := range []struct {
		name string
		a, b uint64
	}{
		{"hits", sa.Hits, sb.Hits}, {"misses", sa.Misses, sb.Misses}, {"conflicts", sa.Conflicts, sb.Conflicts},
		{"collisions", sa.InFlightCollisions, sb.InFlightCollisions}, {"acked", sa.Acked, sb.Acked},
		{"cleanups", sa.Cleanups, sb.Cleanups}, {"expired", sa.Expired, sb.Expired}, {"gaps", sa.SequenceGaps, sb.SequenceGaps},
		{"already", sa.AlreadyCommitted, sb.AlreadyCommitted}, {"leaseLost", sa.LeaseLost, sb.LeaseLost}, {"takeovers", sa.Takeovers, sb.Takeovers},
	} {
		if c.a != c.b {
			t.Errorf("Stats %s: %d in batches, %d singly", c.name, c.a, c.b)
		}
	}
	if sa.LastLSN >= sb.LastLSN {
		t.Errorf("batches wrote %d records, the single calls %d", sa.LastLSN, sb.LastLSN)
	}
}

// withRepeats returns steps with items added that name the key of an
// earlier item of the batch again (a Begin's or Put's request, an open
// claim's, an acked id), each 1 to 3 items after the item it repeats (or
// at the batch's end), up to twice per item: a Begin, a Put, or an Ack of
// the id. open are the claims that steps' Commits and Aborts name.
func withRepeats(rng *rand.Rand, steps []batchStep, open []*Claim) []batchStep {
	type later struct {
		at int // the step it goes before (len(steps) or more: at the end)
		s  batchStep
	}
	var adds []later
	for i, s := range steps {
		var req Request
		switch s.kind {
		case bBegin, bPut:
			req = s.req
		case bCommit, bAbort:
			k := open[s.claim].ec.k
			req.Scope = k.scope
			if k.mode == index.ModeID {
				req.ID = k.ident
			} else {
				req.Client, req.Seq = string(k.ident), k.seq
			}
		case bAck:
			req = Request{Scope: s.scope, ID: s.ids[0]}
		default:
			continue
		}
		for n := rng.IntN(3); n > 0; n-- {
			r := batchStep{kind: bBegin, req: req}
			switch rng.IntN(3) {
			case 0:
				r = batchStep{kind: bPut, req: req, reply: []byte(fmt.Sprint("r", rng.IntN(1000)))}
			case 1:
				if req.ID != nil {
					r = batchStep{kind: bAck, scope: req.Scope, ids: [][]byte{req.ID}}
				}
			}
			adds = append(adds, later{i + 1 + rng.IntN(3), r})
		}
	}
	out := make([]batchStep, 0, len(steps)+len(adds))
	for i := 0; i <= len(steps); i++ {
		for _, a := range adds {
			if a.at == i || i == len(steps) && a.at > i {
				out = append(out, a.s)
			}
		}
		if i < len(steps) {
			out = append(out, steps[i])
		}
	}
	return out
}

// TestBatchReplayEqualsLive: after random batches, the index the engine
// applied, the index after a clean reopen and the index rebuilt by
// replaying the whole WAL hold the same entries, byte for byte: the live
// engine and replay compute a batch record with the same transitions
// (claims inside a batch take the record's LSN, a commit naming claim 0
// finds the claim of its own record).
func TestBatchReplayEqualsLive(t *testing.T) {
	fs := vfs.NewMem()
	clk := testclock.New()
	opts := &Options{Clock: clk.Now, Lease: 10 * time.Second, SegmentSize: 16 << 10}
	e := openMem(t, fs, opts)
	p := newBatchProgram(42)
	var open []*Claim
	for round := 0; round < 300; round++ {
		_, open = runSteps(t, e, p.batch(len(open)), open, false)
		clk.Advance(time.Duration(p.rng.IntN(4)) * time.Second)
	}
	live, state := indexEntries(t, e), observeBatchState(t, e)
	if len(live) < 20 {
		t.Fatalf("only %d entries: the program did little", len(live))
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	e = openMem(t, fs, opts)
	if got := indexEntries(t, e); !equalMaps(got, live) {
		t.Fatalf("entries differ after reopen:\n%s", diffMaps(live, got))
	}
	e.Close()
	if err := fs.RemoveAll("db/index"); err != nil {
		t.Fatal(err)
	}
	e = openMem(t, fs, opts)
	defer e.Close()
	if got := indexEntries(t, e); !equalMaps(got, live) {
		t.Fatalf("entries differ after replaying the whole WAL:\n%s", diffMaps(live, got))
	}
	if got := observeBatchState(t, e); got != state {
		t.Fatalf("state differs after replay:\nlive:\n%s\nreplayed:\n%s", state, got)
	}
}

// diffMaps lists the keys whose values differ (at most 5).
func diffMaps(want, got map[string]string) string {
	var b strings.Builder
	n := 0
	for k, w := range want {
		if g := got[k]; g != w && n < 5 {
			fmt.Fprintf(&b, "key %x:\n  live     %s\n  replayed %s\n", k, w, g)
			n++
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok && n < 5 {
			fmt.Fprintf(&b, "key %x only replayed: %s\n", k, g)
			n++
		}
	}
	return b.String()
}

// TestBatchEdges: a batch of items that change nothing writes no record;
// a claim of another store is ErrInvalidRequest and stays open; a claim
// finished before (or by an earlier item) is ErrLeaseLost; a batch larger
// than one record's bound is written as several records holding whole
// items, and replays to the same state.
func TestBatchEdges(t *testing.T) {
	fs := vfs.NewMem()
	e := openMem(t, fs, nil)
	commitID(t, e, Request{ID: id("d")}, "rd")
	last := e.Stats().LastLSN
	b := e.NewBatch()
	b.Begin(Request{ID: id("d")})
	b.Ack("", id("unknown"))
	b.Ack("")
	b.Advance()
	out, err := b.Run(bg)
	if err != nil || out[0].Result.Status != Done || out[1].Err != nil {
		t.Fatalf("no-op batch: %+v %v", out, err)
	}
	if got := e.Stats().LastLSN; got != last {
		t.Fatalf("a batch that changes nothing wrote records %d..%d", last+1, got)
	}

	foreign := NewClaim(claimBackendFunc(func(abort bool) error { t.Error("foreign backend called"); return nil }), time.Now().Add(time.Hour))
	res := mustBegin(t, e, Request{ID: id("f")}, Fresh)
	done := mustBegin(t, e, Request{ID: id("g")}, Fresh)
	if err := done.Claim.Commit(bg, nil); err != nil {
		t.Fatal(err)
	}
	b = e.NewBatch()
	b.Commit(foreign, []byte("x"))
	b.Commit(done.Claim, []byte("again"))
	b.Commit(res.Claim, []byte("rf"))
	b.Abort(res.Claim)
	out, err = b.Run(bg)
	if err != nil {
		t.Fatal(err)
	}
	if !errors.Is(out[0].Err, ErrInvalidRequest) || !errors.Is(out[1].Err, ErrLeaseLost) || out[2].Err != nil || !errors.Is(out[3].Err, ErrLeaseLost) {
		t.Fatalf("claims: %v / %v / %v / %v", out[0].Err, out[1].Err, out[2].Err, out[3].Err)
	}
	if foreign.finished.Load() {
		t.Fatalf("the foreign claim was marked finished")
	}

	// 12 Puts of 1 MiB incompressible replies: four records of 3 (4 with
	// their keys would exceed batchRecordBytes).
	before := e.Stats().LastLSN
	b = e.NewBatch()
	rng := rand.New(rand.NewPCG(3, 4))
	replies := make([][]byte, 12)
	for i := range replies {
		replies[i] = make([]byte, 1<<20)
		for j := range replies[i] {
			replies[i][j] = byte(rng.Uint32())
		}
		b.Put(Request{ID: []byte(fmt.Sprint("big", i))}, replies[i])
	}
	out, err = b.Run(bg)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range out {
		if r.Err != nil || r.Result.Status != Fresh {
			t.Fatalf("put %d: %v %v", i, r.Result.Status, r.Err)
		}
	}
	if n := e.Stats().LastLSN - before; n != 4 {
		t.Fatalf("12 MiB of replies in %d records, want 4", n)
	}
	e.Close()
	if err := fs.RemoveAll("db/index"); err != nil {
		t.Fatal(err)
	}
	e = openMem(t, fs, nil)
	defer e.Close()
	for i := range replies {
		r, err := e.Lookup(bg, Request{ID: []byte(fmt.Sprint("big", i))})
		if err != nil || r.Status != Done || !bytes.Equal(r.Reply, replies[i]) {
			t.Fatalf("big%d after replay: %v %v", i, r.Status, err)
		}
	}
}

// claimBackendFunc is a ClaimBackend of another store.
type claimBackendFunc func(abort bool) error

func (f claimBackendFunc) Commit(ctx context.Context, reply []byte, adv []Advance) error {
	return f(false)
}
func (f claimBackendFunc) Abort(ctx context.Context) error { return f(true) }

// TestTornBatchRecordLeavesNoItem: a batch record cut anywhere (a torn
// tail: the crash came while it was written) leaves none of its items;
// the records before it are all there.
func TestTornBatchRecordLeavesNoItem(t *testing.T) {
	fs := vfs.NewMem()
	e := openMem(t, fs, nil)
	for i := 0; i < 5; i++ {
		commitID(t, e, Request{ID: []byte(fmt.Sprint("before", i))}, "r")
	}
	b := e.NewBatch()
	for i := 0; i < 20; i++ {
		b.Put(Request{ID: []byte(fmt.Sprint("in", i))}, []byte("reply"))
	}
	if _, err := b.Run(bg); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	segs := segmentFiles(t, fs, "db")
	last := segs[len(segs)-1]
	var batchAt int64 = -1
	var batchLSN wal.LSN
	if _, err := wal.Scan(fs, filepath.Join("db", "wal"), 0, 0, func(r wal.Record) error {
		if r.Type == wal.OpBatch && batchAt < 0 {
			batchAt, batchLSN = r.Offset, r.LSN
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	full := vfstest.ReadFile(t, fs, last)
	if batchAt < 0 || batchLSN != 11 {
		t.Fatalf("batch record at offset %d LSN %d (want LSN 11, after 10 records)", batchAt, batchLSN)
	}
	end := int64(len(full))
	for _, cut := range []int64{batchAt + 1, batchAt + 20, (batchAt + end) / 2, end - 9, end - 1} {
		// A copy: Pebble's MemFS scribbles over what it was given to
		// write in race builds (invariants), to catch callers keeping it.
		vfstest.WriteFile(t, fs, last, bytes.Clone(full[:cut]))
		for _, p := range []string{"db/index", "db/wal/close.hint", "db/wal/positions.hint"} {
			if err := fs.RemoveAll(p); err != nil {
				t.Fatal(err)
			}
		}
		e := openMem(t, fs, nil)
		for i := 0; i < 5; i++ {
			if r, err := lookupID(e, "", []byte(fmt.Sprint("before", i))); err != nil || r.Status != Done {
				t.Fatalf("cut at %d: before%d %v %v", cut, i, r.Status, err)
			}
		}
		for i := 0; i < 20; i++ {
			if r, err := lookupID(e, "", []byte(fmt.Sprint("in", i))); err != nil || r.Status != Absent {
				t.Fatalf("cut at %d (batch frame %d..%d): in%d %v %v, want absent: the batch was kept in part", cut, batchAt, end, i, r.Status, err)
			}
		}
		if st := e.Stats(); st.TornTailsCut != 1 || st.LastLSN != 10 {
			t.Fatalf("cut at %d: torn tails cut %d, last LSN %d (want 1 and 10)", cut, st.TornTailsCut, st.LastLSN)
		}
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestBatchConcurrent: batches and single calls on the same ids from
// several goroutines: every id is claimed exactly once (Fresh once, by a
// Begin, a Put or a Do), a batch's Begin whose claim another goroutine
// holds is InFlight, and nothing deadlocks (batches lock many shards, the
// single calls one or two, the applier each in turn).
func TestBatchConcurrent(t *testing.T) {
	e := openMem(t, vfs.NewMem(), &Options{CacheSize: 64 << 10})
	defer e.Close()
	const ids, rounds = 200, 40
	var fresh [ids]atomic.Int32
	ctx, cancel := context.WithTimeout(bg, time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	errc := make(chan error, 8)
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 1))
			var held []*Claim
			for r := 0; r < rounds && ctx.Err() == nil; r++ {
				b := e.NewBatch()
				var which []int
				for i := 0; i < 16; i++ {
					x := rng.IntN(ids)
					which = append(which, x)
					if rng.IntN(2) == 0 {
						b.Put(Request{ID: []byte(fmt.Sprint("id", x))}, []byte("p"))
					} else {
						b.Begin(Request{ID: []byte(fmt.Sprint("id", x))})
					}
				}
				for _, c := range held {
					b.Commit(c, []byte("c"))
				}
				held = held[:0]
				out, err := b.Run(ctx)
				if err != nil {
					errc <- err
					return
				}
				for i, x := range which {
					if out[i].Err != nil {
						errc <- fmt.Errorf("item %d: %v", i, out[i].Err)
						return
					}
					if out[i].Result.Status == Fresh {
						fresh[x].Add(1)
						if c := out[i].Result.Claim; c != nil {
							held = append(held, c)
						}
					}
				}
				for i := len(which); i < len(out); i++ {
					if out[i].Err != nil {
						errc <- fmt.Errorf("commit item %d: %v", i, out[i].Err)
						return
					}
				}
			}
			for _, c := range held {
				if err := c.Commit(bg, []byte("c")); err != nil {
					errc <- err
					return
				}
			}
		}(g)
	}
	for g := 0; g < 2; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 2))
			for r := 0; r < rounds*8 && ctx.Err() == nil; r++ {
				x := rng.IntN(ids)
				res, err := e.Begin(ctx, Request{ID: []byte(fmt.Sprint("id", x))})
				if err != nil {
					errc <- err
					return
				}
				if res.Status == Fresh {
					fresh[x].Add(1)
					if err := res.Claim.Commit(bg, []byte("s")); err != nil {
						errc <- err
						return
					}
				}
			}
		}(g)
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	if ctx.Err() != nil {
		t.Fatalf("did not finish within a minute: %v", ctx.Err())
	}
	claimed := 0
	for x := range fresh {
		switch n := fresh[x].Load(); n {
		case 0:
		case 1:
			claimed++
		default:
			t.Fatalf("id%d was Fresh %d times", x, n)
		}
	}
	if claimed < ids/2 {
		t.Fatalf("only %d of %d ids claimed: the workload did little", claimed, ids)
	}
}

// TestBatchAppliedSlotsUnpinned: once the index has applied every batch
// record, no slot is left pinned (dirty). A batch hands the applier the
// slot of each key it changed; with a table too small for one slot per
// shard, a run evicts the slots of its own earlier items and installs new
// ones when it publishes, and the applier must then look those keys up
// instead of unpinning the evicted slot (else the live slot stays pinned
// for good).
func TestBatchAppliedSlotsUnpinned(t *testing.T) {
	e := openMem(t, vfs.NewMem(), &Options{CacheSize: 32 << 10})
	defer e.Close()
	var held []*Claim
	for r := 0; r < 40; r++ {
		b := e.NewBatch()
		for i := 0; i < 64; i++ {
			id := []byte(fmt.Sprintf("r%d-%d", r, i))
			switch i % 4 {
			case 0:
				b.Begin(Request{ID: id})
			case 1:
				b.Put(Request{ID: id}, []byte("x"), Advance{Client: fmt.Sprint("p", i%8), Seq: uint64(r*64 + i + 1)})
			default:
				b.Put(Request{ID: id}, []byte("x"))
			}
		}
		for _, c := range held {
			b.Commit(c, []byte("c"))
		}
		held = held[:0]
		out, err := b.Run(bg)
		if err != nil {
			t.Fatal(err)
		}
		for i, o := range out {
			if o.Err != nil {
				t.Fatalf("round %d item %d: %v", r, i, o.Err)
			}
			if o.Result.Claim != nil {
				held = append(held, o.Result.Claim)
			}
		}
		// Every item is visible as the run left it (a slot published
		// after it was evicted would be invisible: Lookup would read the
		// index, which has not applied the record yet).
		for i := 0; i < 64; i++ {
			want := Done
			if i%4 == 0 {
				want = InFlight
			}
			res, err := e.Lookup(bg, Request{ID: []byte(fmt.Sprintf("r%d-%d", r, i))})
			if err != nil || res.Status != want {
				t.Fatalf("round %d: Lookup of item %d: %v %v, want %v", r, i, res.Status, err, want)
			}
		}
	}
	waitUnpinned(t, e)
}

// waitUnpinned waits until every record is applied and the applier has
// unpinned their slots: it unpins a record's slots after it publishes
// the record as applied, so this polls (bounded) rather than look once.
func waitUnpinned(t *testing.T, e *Engine) {
	t.Helper()
	waitApplied(t, e)
	deadline := time.Now().Add(10 * time.Second)
	for {
		pinned := pinnedSlots(e)
		if len(pinned) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d slots still pinned 10 s after every record was applied, e.g. %s", len(pinned), pinned[0])
		}
		time.Sleep(time.Millisecond)
	}
}

// pinnedSlots describes the table's slots that a record not yet applied
// still pins.
func pinnedSlots(e *Engine) []string {
	var out []string
	for i := range e.shards {
		sh := &e.shards[i]
		sh.mu.Lock()
		for _, sl := range sh.slab {
			if sl != nil && sl.dirty != 0 {
				out = append(out, fmt.Sprintf("shard %d key %q pinned by LSN %d", i, sl.key, sl.dirty))
			}
		}
		sh.mu.Unlock()
	}
	return out
}

// TestBatchItemAllocations pins what a Put and a Commit item allocate
// while the run classifies them (batchRun.item, on the test's goroutine,
// so that no other goroutine's allocation is counted; alloctest takes the
// least of up to alloctest.Runs measurements): the committed entry and its
// reply's copy, in one allocation (newCommitEntry), and nothing else when
// the key's slot is in the table already. Before, the reply's copy
// (cloneExact) was an allocation of its own: 2 per item; and a Put's
// fingerprint's copy (bytes.Clone) too.
func TestBatchItemAllocations(t *testing.T) {
	e := openMem(t, vfs.NewMem(), &Options{RelaxedClaims: true})
	defer e.Close()
	const runs = 50
	n := alloctest.Runs * (runs + 1) // testing.AllocsPerRun calls f runs+1 times
	reply := []byte("reply-of-24-bytes-------")
	for _, c := range []struct {
		name string
		add  func(b Batch, req Request, cl *Claim)
	}{
		// Every id's slot is in the table (claimed and aborted before):
		// the Put finds it in its shard's map.
		{"Put", func(b Batch, req Request, cl *Claim) { b.Put(req, reply) }},
		// The fingerprint's copy, which the committed entry keeps, is
		// made in the same allocation (2 allocations before).
		{"PutFingerprint", func(b Batch, req Request, cl *Claim) {
			req.Fingerprint = []byte("fingerprint-of-32-bytes---------")
			b.Put(req, reply)
		}},
		{"Commit", func(b Batch, req Request, cl *Claim) { b.Commit(cl, reply) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			ids := make([][]byte, n)
			for i := range ids {
				ids[i] = []byte(fmt.Sprintf("%s-%04d", c.name, i))
			}
			begin := e.NewBatch()
			for _, id := range ids {
				begin.Begin(Request{ID: id})
			}
			bout, err := begin.Run(bg)
			if err != nil {
				t.Fatal(err)
			}
			cs := make([]*Claim, n)
			for i, r := range bout {
				if r.Err != nil || r.Result.Status != Fresh {
					t.Fatalf("begin %d: %v %v", i, r.Result.Status, r.Err)
				}
				cs[i] = r.Result.Claim
			}
			if c.name != "Commit" {
				ab := e.NewBatch()
				for _, cl := range cs {
					ab.Abort(cl)
				}
				if _, err := ab.Run(bg); err != nil {
					t.Fatal(err)
				}
			}
			b := e.NewBatch().(*engineBatch)
			for i, id := range ids {
				c.add(b, Request{ID: id}, cs[i])
			}
			out := runItemsMeasured(t, b, runs, 1)
			for i, r := range out {
				if r.Err != nil || (c.name != "Commit" && r.Result.Status != Fresh) {
					t.Fatalf("item %d: %v %v", i, r.Result.Status, r.Err)
				}
				got, err := e.Lookup(bg, Request{ID: ids[i]})
				if err != nil || got.Status != Done || !bytes.Equal(got.Reply, reply) || cap(got.Reply) != len(reply) {
					t.Fatalf("id %d after the run: %v %q (cap %d) %v", i, got.Status, got.Reply, cap(got.Reply), err)
				}
			}
		})
	}
}

// runItemsMeasured runs b as Run does, classifying its items one at a time
// under alloctest.AllocsPerRun (runs items a measurement), fails t unless
// an item allocates want times, and returns the results. b needs
// alloctest.Runs*(runs+1) items: testing.AllocsPerRun calls f runs+1 times
// a measurement.
func runItemsMeasured(t *testing.T, b *engineBatch, runs int, want float64) []BatchResult {
	t.Helper()
	e := b.e
	b.ran = true
	defer b.release()
	out := make([]BatchResult, len(b.items))
	var set shardSet
	for i := range b.items {
		if err := b.check(i, &set); err != nil {
			t.Fatalf("item %d: %v", i, err)
		}
	}
	if err := e.enter(); err != nil {
		t.Fatal(err)
	}
	defer e.leave()
	r := e.getBatchRun(len(b.items))
	r.b, r.out, r.now = b, out, e.o.Clock()
	defer e.putBatchRun(r)
	// Room for the whole record, so that no buffer grows while measured.
	r.buf = slices.Grow(r.buf, 1<<20)
	r.items = slices.Grow(r.items, len(b.items))
	unlock := e.lockShards(&set)
	// Nothing fails the test until the shards are unlocked and the run
	// finished, so that a failure leaves the engine usable.
	next := 0
	var ierr error
	got := alloctest.AllocsPerRun(want, runs, func() {
		if next < len(b.items) && ierr == nil {
			ierr = r.item(next)
			next++
		}
	})
	for ; next < len(b.items) && ierr == nil; next++ {
		ierr = r.item(next)
	}
	if ierr == nil {
		ierr = r.flush(len(b.items))
	}
	if ierr != nil {
		r.abandon(ierr)
	}
	unlock()
	r.finish()
	if ierr != nil {
		t.Fatal(ierr)
	}
	if got != want {
		t.Fatalf("an item of the batch: %v allocations (the least of up to %d measurements of %d items), want %v", got, alloctest.Runs, runs, want)
	}
	r.finish()
	return out
}
