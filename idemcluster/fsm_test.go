package idemcluster

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
	"github.com/vmihailenco/msgpack/v5"
)

// fsmEntry is a command of the log and what applying it must give.
type fsmEntry struct {
	at   time.Duration // AppendedAt after the log's start
	c    command
	want string // the status, or the error's sentinel
}

// fsmLog covers every answer of the state machine: claims, their retries,
// finishes and their retries, stale owners, takeovers after a lease,
// sequences, conflicts, and commands that are applied alone.
func fsmLog() []fsmEntry {
	a := idem.Request{ID: []byte("a")}
	b := idem.Request{ID: []byte("b")}
	c := idem.Request{ID: []byte("c"), Fingerprint: []byte("fp-1")}
	cOther := idem.Request{ID: []byte("c"), Fingerprint: []byte("fp-2")}
	d := idem.Request{ID: []byte("d")}
	s1 := idem.Request{Scope: "l", Client: "p", Seq: 1}
	s2 := idem.Request{Scope: "l", Client: "p", Seq: 2}
	s5 := idem.Request{Scope: "l", Client: "p", Seq: 5}
	q1 := idem.Request{Scope: "l", Client: "q", Seq: 1}
	begin := func(r idem.Request, owner, tok string) command {
		return command{Op: cmdBegin, Req: toWire(r), Owner: owner, Token: []byte(tok)}
	}
	fin := func(op byte, r idem.Request, tok string, adv ...idem.Advance) command {
		return command{Op: op, Key: keyOf(&r), Seq: r.Seq, Token: []byte(tok), Reply: []byte("reply-" + tok), Adv: adv}
	}
	const lease = time.Minute
	return []fsmEntry{
		{0, begin(a, "o1", "t1"), "fresh"},
		{0, begin(a, "o1", "t1"), "fresh"},     // a retry of the same Begin: its claim again
		{0, begin(a, "o2", "t2"), "in-flight"}, // another owner
		{0, fin(cmdCommit, a, "t2"), "lease-lost"},
		{0, fin(cmdCommit, a, "t1"), "ok"},
		{0, fin(cmdCommit, a, "t1"), "ok"}, // a retry after a lost answer
		{0, fin(cmdAbort, a, "t1"), "lease-lost"},
		{0, begin(a, "o1", "t1"), "done"}, // the Begin retried after its commit
		{0, begin(a, "o3", "t3"), "done"},
		{time.Millisecond, begin(b, "o1", "t4"), "fresh"},
		{time.Millisecond, fin(cmdAbort, b, "t4"), "ok"},
		{time.Millisecond, begin(b, "o2", "t5"), "fresh"}, // released by the abort
		{time.Millisecond, fin(cmdAbort, b, "t4"), "ok"},  // a retried abort
		{time.Millisecond, fin(cmdCommit, b, "t4"), "lease-lost"},
		{2 * time.Millisecond, begin(c, "o1", "t6"), "fresh"},
		{2 * time.Millisecond, begin(cOther, "o2", "t7"), "conflict"},
		{2 * time.Millisecond, fin(cmdCommit, c, "t6"), "ok"},
		{2 * time.Millisecond, begin(cOther, "o2", "t7"), "conflict"},
		{2 * time.Millisecond, begin(s1, "o1", "t8"), "fresh"},
		{2 * time.Millisecond, begin(s5, "o1", "t9"), "gap"},
		{2 * time.Millisecond, begin(q1, "o1", "t10"), "fresh"},
		{2 * time.Millisecond, fin(cmdCommit, s1, "t8", idem.Advance{Scope: "l", Client: "r", Seq: 3}), "ok"},
		{2 * time.Millisecond, begin(s1, "o2", "t11"), "done"},
		{2 * time.Millisecond, begin(s2, "o2", "t12"), "fresh"},
		{3 * time.Millisecond, begin(d, "o1", "t13"), "fresh"},
		{3 * time.Millisecond, command{Op: cmdMember, Node: "n9", Addr: "127.0.0.1:9"}, "ok"},
		{3 * time.Millisecond, command{Op: cmdAck, Key: claimKey{Scope: "x"}, IDs: [][]byte{[]byte("none")}}, "ok"},
		{3 * time.Millisecond, command{Op: 99}, "invalid"},
		// One lease later the claims of a, b... are taken over.
		{lease + 4*time.Millisecond, begin(d, "o2", "t14"), "fresh"},
		{lease + 4*time.Millisecond, fin(cmdCommit, d, "t13"), "lease-lost"}, // the first owner, too late
		{lease + 4*time.Millisecond, fin(cmdCommit, d, "t14"), "ok"},
		{lease + 4*time.Millisecond, begin(d, "o1", "t13"), "done"},
		{lease + 4*time.Millisecond, fin(cmdCommit, q1, "t10"), "ok"}, // q1's lease ran out, but nobody took it
		{lease + 4*time.Millisecond, fin(cmdCommit, s2, "t12"), "ok"},
		{lease + 5*time.Millisecond, fin(cmdAbort, b, "t4"), "lease-lost"}, // t4's outcome is older than a lease: forgotten
	}
}

func outcome(a any) string {
	ap, _ := a.(*applied)
	switch {
	case ap == nil:
		return "nil"
	case ap.err == nil && ap.res.Status == idem.Fresh:
		return "fresh"
	case ap.err == nil && ap.res.Status == idem.Done:
		return "done"
	case ap.err == nil && ap.res.Status == idem.InFlight:
		return "in-flight"
	case ap.err == nil:
		return "ok"
	case errors.Is(ap.err, idem.ErrLeaseLost):
		return "lease-lost"
	case errors.Is(ap.err, idem.ErrConflict):
		return "conflict"
	case errors.As(ap.err, new(*idem.SequenceGapError)):
		return "gap"
	case errors.Is(ap.err, idem.ErrInvalidRequest):
		return "invalid"
	}
	return "error: " + ap.err.Error()
}

// detail is everything an answer carries, for comparing two state machines.
func detail(a any) string {
	ap, _ := a.(*applied)
	if ap == nil {
		return "nil"
	}
	r := ap.res
	return fmt.Sprintf("%s status=%v reply=%q lease=%d committed=%d seq=%d expires=%d claim=%v token=%q owner=%q err=%v",
		outcome(a), r.Status, r.Reply, r.LeaseUntil.UnixNano(), r.CommittedAt.UnixNano(), r.Seq, r.ExpiresAt.UnixNano(), r.Claim != nil, ap.token, ap.owner, ap.err)
}

func fsmLogs(t *testing.T, entries []fsmEntry) []*raft.Log {
	t.Helper()
	t0 := time.Date(2026, 11, 26, 0, 0, 0, 0, time.UTC)
	var logs []*raft.Log
	for i, e := range entries {
		data, err := msgpack.Marshal(&e.c)
		if err != nil {
			t.Fatal(err)
		}
		logs = append(logs, &raft.Log{Index: uint64(i + 1), Term: 1, Type: raft.LogCommand, Data: data, AppendedAt: t0.Add(e.at)})
	}
	return logs
}

func testFSM(t *testing.T, name string) *fsm {
	t.Helper()
	f, err := newFSM(filepath.Join(t.TempDir(), name), idem.Options{Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.close() })
	return f
}

// A raft batch gives exactly the answers of its entries applied one at a
// time, however raft cut the log into batches (every node cuts its own):
// one entry per call, the whole log in one batch, and random cuts.
func TestApplyBatchMatchesApply(t *testing.T) {
	for _, tc := range []struct {
		name    string
		entries []fsmEntry
	}{{"short tokens", fsmLog()}, {"16-byte tokens", withLongTokens(fsmLog())}} {
		t.Run(tc.name, func(t *testing.T) { testApplyBatchMatchesApply(t, tc.entries) })
	}
}

// withLongTokens pads every token of entries to 16 bytes (the client's
// length, which the table of finished tokens keeps apart).
func withLongTokens(entries []fsmEntry) []fsmEntry {
	for i := range entries {
		if tok := entries[i].c.Token; len(tok) > 0 {
			entries[i].c.Token = fmt.Appendf(nil, "%-16s", tok)
		}
	}
	return entries
}

func testApplyBatchMatchesApply(t *testing.T, entries []fsmEntry) {
	logs := fsmLogs(t, entries)
	one := testFSM(t, "one")
	var want []string
	for i, l := range logs {
		a := one.Apply(l)
		if got := outcome(a); got != entries[i].want {
			t.Fatalf("entry %d applied alone: %s, want %s (%s)", i+1, got, entries[i].want, detail(a))
		}
		want = append(want, detail(a))
	}
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	cuts := map[string][]int{"whole": {len(logs)}}
	for k := range 3 {
		var cut []int
		for left := len(logs); left > 0; {
			n := 1 + rng.IntN(min(left, 8))
			cut = append(cut, n)
			left -= n
		}
		cuts[fmt.Sprintf("random-%d", k)] = cut
	}
	for name, cut := range cuts {
		f := testFSM(t, name)
		var got []string
		at := 0
		for _, n := range cut {
			for _, a := range f.ApplyBatch(logs[at : at+n]) {
				got = append(got, detail(a))
			}
			at += n
		}
		for i := range want {
			if got[i] != want[i] {
				t.Errorf("%s (cut %v) entry %d:\n batch: %s\n alone: %s", name, cut, i+1, got[i], want[i])
			}
		}
		if f.index.Load() != uint64(len(logs)) || f.member("n9") != "127.0.0.1:9" {
			t.Errorf("%s: index %d, member n9 %q", name, f.index.Load(), f.member("n9"))
		}
	}
}

// A cmdBatch entry (the writes of one Batch RPC) gives each of its
// commands the answer it gets as an entry of its own.
func TestBatchEntryMatchesEntries(t *testing.T) {
	entries := fsmLog()
	logs := fsmLogs(t, entries)
	one := testFSM(t, "one")
	var want []string
	for _, l := range logs {
		want = append(want, detail(one.Apply(l)))
	}
	// Pack runs of entries appended at the same time, up to 5 a run.
	var packed []fsmEntry
	var packs [][]int // the entries of each packed entry
	for i := 0; i < len(entries); {
		j := i + 1
		for j < len(entries) && j-i < 5 && entries[j].at == entries[i].at {
			j++
		}
		b := command{Op: cmdBatch}
		var idx []int
		for k := i; k < j; k++ {
			c := entries[k].c
			b.Cmds = append(b.Cmds, &c)
			idx = append(idx, k)
		}
		packed = append(packed, fsmEntry{at: entries[i].at, c: b})
		packs = append(packs, idx)
		i = j
	}
	f := testFSM(t, "packed")
	for p, a := range f.ApplyBatch(fsmLogs(t, packed)) {
		ap := a.(*applied)
		if len(ap.subs) != len(packs[p]) {
			t.Fatalf("entry %d: %d answers for %d commands (%v)", p+1, len(ap.subs), len(packs[p]), ap.err)
		}
		for j, k := range packs[p] {
			if got := detail(ap.subs[j]); got != want[k] && !(entries[k].want == "invalid" && outcome(ap.subs[j]) == "invalid") { // the message names the entry
				t.Errorf("command %d (entry %d of the packed log):\n packed: %s\n alone:  %s", k+1, p+1, got, want[k])
			}
		}
	}
}

// The begins, commits and aborts of many clients in one raft batch
// (appended together, distinct keys) are one engine record.
func TestRaftBatchIsOneEngineRecord(t *testing.T) {
	f := testFSM(t, "f")
	var entries []fsmEntry
	for i := range 40 {
		entries = append(entries, fsmEntry{c: command{Op: cmdBegin, Req: toWire(idem.Request{ID: []byte(fmt.Sprint("k", i))}), Owner: "o", Token: []byte(fmt.Sprint("t", i))}})
	}
	for i := range 20 {
		r := idem.Request{ID: []byte(fmt.Sprint("k", i))}
		entries = append(entries, fsmEntry{at: time.Millisecond, c: command{Op: cmdCommit, Key: keyOf(&r), Token: []byte(fmt.Sprint("t", i)), Reply: []byte("r")}})
	}
	logs := fsmLogs(t, entries)
	lsn := func() uint64 {
		e, done, err := f.engine()
		if err != nil {
			t.Fatal(err)
		}
		defer done()
		return e.Stats().LastLSN
	}
	for _, step := range []struct {
		logs []*raft.Log
		want string
	}{{logs[:40], "fresh"}, {logs[40:], "ok"}} {
		before := lsn()
		for i, a := range f.ApplyBatch(step.logs) {
			if got := outcome(a); got != step.want {
				t.Fatalf("entry %d: %s (%s)", i, got, detail(a))
			}
		}
		if n := lsn() - before; n != 1 {
			t.Fatalf("a raft batch of %d entries wrote %d engine records, want 1", len(step.logs), n)
		}
	}
}

// The claims table's key names are frozen (snapshots hold the table).
func TestClaimKeyNames(t *testing.T) {
	for _, c := range []struct {
		k    claimKey
		want string
	}{
		{claimKey{Scope: "orders", ID: []byte{0x01, 0xab, 'z'}}, "i6:orders/01ab7a"},
		{claimKey{ID: []byte("x")}, "i0:/78"},
		{claimKey{Scope: "l", Client: "p/q"}, "c1:l/p/q"},
		{claimKey{Scope: "a:b/c", ID: nil}, "i5:a:b/c/"},
	} {
		if got := c.k.String(); got != c.want {
			t.Errorf("%+v: %q, want %q", c.k, got, c.want)
		}
	}
}

// applyAndSnapshot applies entries to f, checking each outcome, and
// returns a snapshot of f persisted in memory.
func applyAndSnapshot(t *testing.T, f *fsm, entries []fsmEntry) *memSink {
	t.Helper()
	for i, l := range fsmLogs(t, entries) {
		if got := outcome(f.Apply(l)); got != entries[i].want {
			t.Fatalf("entry %d: %s, want %s", i+1, got, entries[i].want)
		}
	}
	snap, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	sink := new(memSink)
	if err := snap.Persist(sink); err != nil {
		t.Fatal(err)
	}
	snap.Release()
	return sink
}

// memSink is a raft.SnapshotSink in memory.
type memSink struct{ bytes.Buffer }

func (s *memSink) ID() string    { return "mem" }
func (s *memSink) Cancel() error { return nil }
func (s *memSink) Close() error  { return nil }

// The finished tokens, of the client's 16 bytes and of other lengths, are
// in a snapshot: a finish retried on a node restored from it gets the
// recorded outcome, and the snapshot's table is the one written before
// tokens were kept by length (a map by the token's bytes).
func TestFinishedTokensSurviveSnapshot(t *testing.T) {
	long, short := []byte("0123456789abcdef"), []byte("tok")
	a, b := idem.Request{ID: []byte("a")}, idem.Request{ID: []byte("b")}
	entries := []fsmEntry{
		{0, command{Op: cmdBegin, Req: toWire(a), Owner: "o", Token: long}, "fresh"},
		{0, command{Op: cmdCommit, Key: keyOf(&a), Token: long, Reply: []byte("r")}, "ok"},
		{0, command{Op: cmdBegin, Req: toWire(b), Owner: "o", Token: short}, "fresh"},
		{0, command{Op: cmdAbort, Key: keyOf(&b), Token: short}, "ok"},
	}
	src := testFSM(t, "src")
	sink := applyAndSnapshot(t, src, entries)
	var head []byte
	if err := msgpack.NewDecoder(bytes.NewReader(sink.Bytes())).Decode(&head); err != nil {
		t.Fatal(err)
	}
	var st snapshotState
	if err := msgpack.Unmarshal(head, &st); err != nil {
		t.Fatal(err)
	}
	if _, ok := st.Finished[string(long)]; !ok || len(st.Finished) != 2 {
		t.Fatalf("the snapshot's finished tokens: %v, want %q and %q", st.Finished, long, short)
	}
	dst := testFSM(t, "dst")
	if err := dst.Restore(io.NopCloser(bytes.NewReader(sink.Bytes()))); err != nil {
		t.Fatal(err)
	}
	retries := []fsmEntry{
		{0, command{Op: cmdCommit, Key: keyOf(&a), Token: long, Reply: []byte("r")}, "ok"},
		{0, command{Op: cmdAbort, Key: keyOf(&a), Token: long}, "lease-lost"},
		{0, command{Op: cmdAbort, Key: keyOf(&b), Token: short}, "ok"},
		{0, command{Op: cmdCommit, Key: keyOf(&b), Token: short}, "lease-lost"},
	}
	for i, l := range fsmLogs(t, retries) {
		l.Index += 100
		if got := outcome(dst.Apply(l)); got != retries[i].want {
			t.Errorf("retry %d after the restore: %s, want %s", i+1, got, retries[i].want)
		}
	}
}

// TestSegmentSplitsOnSharedNames: commands of one raft batch that name
// the same claim key (a Begin of a client's sequence, and an advance of
// that client in a Commit) or the same token go to the engine in separate
// segments, so each sees the other's effect as if applied alone (the
// segment's table of touched names holds hashes of the names: equal names
// must hash alike whichever command names them).
func TestSegmentSplitsOnSharedNames(t *testing.T) {
	f := testFSM(t, "f")
	lsn := func() uint64 {
		e, done, err := f.engine()
		if err != nil {
			t.Fatal(err)
		}
		defer done()
		return e.Stats().LastLSN
	}
	x := idem.Request{ID: []byte("x")}
	y := idem.Request{ID: []byte("y")}
	client := func(seq uint64) idem.Request { return idem.Request{Scope: "l", Client: "r", Seq: seq} }
	begin := func(r idem.Request, tok string) command {
		return command{Op: cmdBegin, Req: toWire(r), Owner: "o", Token: []byte(tok)}
	}
	commit := func(r idem.Request, tok string, adv ...idem.Advance) command {
		return command{Op: cmdCommit, Key: keyOf(&r), Seq: r.Seq, Token: []byte(tok), Reply: []byte("r"), Adv: adv}
	}
	logs := fsmLogs(t, []fsmEntry{
		{c: begin(x, "tx")}, {c: begin(y, "ty")},
		// One raft batch, each pair sharing a name:
		{at: time.Millisecond, c: commit(x, "tx", idem.Advance{Scope: "l", Client: "r", Seq: 1})}, // client key c1:l/r
		{at: time.Millisecond, c: begin(client(2), "t2")},                                         // client key c1:l/r
		{at: time.Millisecond, c: commit(y, "ty")},                                                // no shared name
		{at: time.Millisecond, c: commit(client(2), "t2")},                                        // token t2, key c1:l/r
	})
	for i, a := range f.ApplyBatch(logs[:2]) {
		if got := outcome(a); got != "fresh" {
			t.Fatalf("entry %d: %s (%s)", i+1, got, detail(a))
		}
	}
	before := lsn()
	for i, a := range f.ApplyBatch(logs[2:]) {
		if want := []string{"ok", "fresh", "ok", "ok"}[i]; outcome(a) != want {
			t.Fatalf("entry %d: %s, want %s (%s)", i+3, outcome(a), want, detail(a))
		}
	}
	// Segments: [commit x + advance r], [begin r/2, commit y], [commit r/2].
	if n := lsn() - before; n != 3 {
		t.Fatalf("the batch wrote %d engine records, want 3 (a segment per shared name)", n)
	}
}

// stuckFuture is a raft future that is never answered until release is
// closed, as raft leaves one its buffered apply channel took as it shut
// down.
type stuckFuture struct{ release chan struct{} }

func (f stuckFuture) Error() error {
	<-f.release
	return raft.ErrRaftShutdown
}

// TestAwaitEndsWhenTheNodeStops: a node waiting for a raft future stops
// waiting when it stops (its Close waits for its own goroutines, and
// raft never answers a future it took as it shut down: a test's Close
// hung 10 minutes in watchLeadership's Barrier).
func TestAwaitEndsWhenTheNodeStops(t *testing.T) {
	f := stuckFuture{release: make(chan struct{})}
	defer close(f.release)
	n := &Node{stop: make(chan struct{})}
	got := make(chan error, 1)
	go func() { got <- n.await(f) }()
	close(n.stop)
	select {
	case err := <-got:
		if !errors.Is(err, errStopped) {
			t.Fatalf("await after the node stopped: %v, want errStopped", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("await still waiting a minute after the node stopped")
	}
}

// The removed nodes' ids are state machine state: a snapshot carries them,
// so a node restored from one answers a retried Remove as done too.
func TestRemovedIDsSurviveSnapshot(t *testing.T) {
	src := testFSM(t, "src")
	entries := []fsmEntry{
		{0, command{Op: cmdMember, Node: "n3", Addr: "127.0.0.1:7073"}, "ok"},
		{0, command{Op: cmdRemoved, Node: "n3"}, "ok"},
		{0, command{Op: cmdMember, Node: "n3"}, "ok"},
		{0, command{Op: cmdRemoved}, "invalid"},
	}
	sink := applyAndSnapshot(t, src, entries)
	dst := testFSM(t, "dst")
	if err := dst.Restore(io.NopCloser(bytes.NewReader(sink.Bytes()))); err != nil {
		t.Fatal(err)
	}
	if !dst.wasRemoved("n3") || dst.wasRemoved("n9") || dst.member("n3") != "" {
		t.Fatalf("after the restore: n3 removed %v, n9 removed %v, n3's address %q; want true, false, none",
			dst.wasRemoved("n3"), dst.wasRemoved("n9"), dst.member("n3"))
	}
}

// TestSegmentResultsBuffer: a segment runs its engine batch into one
// results buffer, kept for the next segment and cleared after each, so it
// holds no claim, reply or error between raft batches.
func TestSegmentResultsBuffer(t *testing.T) {
	f := testFSM(t, "f")
	begin := func(id, tok string) command {
		return command{Op: cmdBegin, Req: toWire(idem.Request{ID: []byte(id)}), Owner: "o", Token: []byte(tok)}
	}
	logs := fsmLogs(t, []fsmEntry{{c: begin("a", "t1")}, {c: begin("b", "t2")}, {c: begin("a", "t3")}})
	for round, batch := range [][]*raft.Log{logs[:2], logs[2:]} {
		for i, a := range f.ApplyBatch(batch) {
			if got, want := outcome(a), []string{"fresh", "fresh", "in-flight"}[round*2+i]; got != want {
				t.Fatalf("batch %d, entry %d: %s, want %s (%s)", round, i, got, want, detail(a))
			}
		}
		res := f.seg.res
		if cap(res) == 0 {
			t.Fatalf("batch %d: no results buffer kept", round)
		}
		for i, r := range res[:cap(res)] {
			if !reflect.ValueOf(r).IsZero() {
				t.Fatalf("batch %d: the kept buffer holds %+v at %d", round, r, i)
			}
		}
	}
}
