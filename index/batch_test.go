package index

import (
	"bytes"
	"errors"
	"fmt"
	"testing"

	"github.com/idemdb/idem/internal/alloctest"
	"github.com/idemdb/idem/wal"
)

// TestBatchTransitions: a batch record's operations apply in order, each
// seeing what the previous left; a key changed twice keeps its first Prev
// and its last Next; a key absent before and after is left out; claims
// take the record's LSN and a commit naming claim 0 finds the claim of
// its own record, never one of another record.
func TestBatchTransitions(t *testing.T) {
	a := EntryKey(nil, "", ModeID, []byte("a"))
	b := EntryKey(nil, "", ModeID, []byte("b"))
	c := EntryKey(nil, "", ModeClient, []byte("c"))
	old := &Entry{Committed: true, CommitLSN: 3, ReplyKept: true, Reply: []byte("old"), LSN: 3}
	stored := map[string]*Entry{string(b): old}
	get := func(k []byte, _ byte) (*Entry, error) { return stored[string(k)], nil }
	op := &wal.Op{Type: wal.OpBatch, Time: 9, Ops: []wal.Op{
		{Type: wal.OpClaim, ID: []byte("a"), Time: 9, LeaseUntil: 99, Flags: wal.ClaimFlagNew},
		{Type: wal.OpCommit, ID: []byte("a"), Time: 9, Reply: []byte("ra")}, // claim 0: the one above
		{Type: wal.OpAck, Acked: [][]byte{[]byte("b")}, Time: 9},
		{Type: wal.OpClaim, ID: []byte("b"), Time: 9, LeaseUntil: 99, Flags: wal.ClaimFlagNew},
		{Type: wal.OpClaim, Client: "c", Seq: 1, Time: 9, LeaseUntil: 99},
		{Type: wal.OpCommitAdvance, Client: "c", Seq: 1, Time: 9, Reply: []byte("rc"), Advances: []wal.Advance{{Client: "k", Seq: 4}}},
		{Type: wal.OpClaim, ID: []byte("x"), Time: 9, LeaseUntil: 99, Flags: wal.ClaimFlagNew},
		{Type: wal.OpAbort, ID: []byte("x"), Time: 9}, // x: absent before and after
	}}
	ts, err := Transitions(op, 20, get)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]Transition{}
	for _, tr := range ts {
		if _, dup := got[string(tr.Key)]; dup {
			t.Fatalf("key %q has two transitions", tr.Key)
		}
		got[string(tr.Key)] = tr
	}
	if len(ts) != 4 {
		t.Fatalf("%d transitions, want 4 (a, b, c, k): %+v", len(ts), ts)
	}
	if ta := got[string(a)]; ta.Prev != nil || !ta.Next.Committed || string(ta.Next.Reply) != "ra" || ta.Next.CommitLSN != 20 {
		t.Errorf("a: %+v -> %+v", ta.Prev, ta.Next)
	}
	if tb := got[string(b)]; tb.Prev != old || !tb.Next.InFlight || tb.Next.ClaimLSN != 20 || tb.Next.Committed {
		t.Errorf("b: first Prev and last Next: %+v -> %+v", tb.Prev, tb.Next)
	}
	if tc := got[string(c)]; tc.Prev != nil || tc.Next.Seq != 1 || tc.Next.CommitLSN != 20 {
		t.Errorf("c: %+v -> %+v", tc.Prev, tc.Next)
	}
	k := EntryKey(nil, "", ModeClient, []byte("k"))
	if tk := got[string(k)]; tk.Next == nil || tk.Next.Seq != 4 {
		t.Errorf("k: %+v", tk.Next)
	}

	// Live (LSN 0, then Stamp) computes the same entries as replay.
	live, err := Transitions(op, 0, get)
	if err != nil {
		t.Fatal(err)
	}
	Stamp(live, wal.OpBatch, 20)
	for i := range live {
		if w, g := *got[string(live[i].Key)].Next, *live[i].Next; !equalEntry(&w, &g) {
			t.Errorf("key %q: live %+v, replay %+v", live[i].Key, g, w)
		}
	}

	// A commit naming claim 0 with no claim of its own record: ErrNoClaim,
	// also when the key holds a claim of another record.
	claimed := map[string]*Entry{string(a): {InFlight: true, ClaimLSN: 7, LeaseUntil: 99, LSN: 7}}
	for _, m := range []map[string]*Entry{nil, claimed} {
		bad := &wal.Op{Type: wal.OpBatch, Ops: []wal.Op{{Type: wal.OpCommit, ID: []byte("a"), Reply: []byte("r")}}}
		if _, err := Transitions(bad, 20, func(k []byte, _ byte) (*Entry, error) { return m[string(k)], nil }); !errors.Is(err, ErrNoClaim) {
			t.Errorf("commit of claim 0 over %v: %v", m, err)
		}
	}
	// A batch cannot hold a forget.
	if _, err := Transitions(&wal.Op{Type: wal.OpBatch, Ops: []wal.Op{{Type: wal.OpForget}}}, 20, get); err == nil {
		t.Errorf("a forget inside a batch was applied")
	}
}

func equalEntry(a, b *Entry) bool {
	return string(EncodeEntry(nil, a)) == string(EncodeEntry(nil, b)) && a.Committed == b.Committed
}

// TestBatchCommitFillsItsClaim: a commit that follows its claim at once (a
// Put) fills the claim's entry in place instead of allocating one; a claim
// that a Get returned in between is never changed (the caller may hold it).
func TestBatchCommitFillsItsClaim(t *testing.T) {
	get := func([]byte, byte) (*Entry, error) { return nil, nil }
	claim := wal.Op{Type: wal.OpClaim, ID: []byte("a"), Time: 9, LeaseUntil: 99, Flags: wal.ClaimFlagNew}
	commit := wal.Op{Type: wal.OpCommit, ID: []byte("a"), Time: 9, Reply: []byte("r")}
	for _, read := range []bool{false, true} {
		b := NewBatch(0, get, 2)
		step, err := b.Add(&claim, nil)
		if err != nil {
			t.Fatal(err)
		}
		made := step[0].Next
		var seen *Entry
		if read {
			if seen, err = b.Get(step[0].Key, ModeID); err != nil || seen != made {
				t.Fatalf("Get after the claim: %p %v, want the claim %p", seen, err, made)
			}
		}
		if _, err := b.Add(&commit, nil); err != nil {
			t.Fatal(err)
		}
		ts := b.Transitions()
		if len(ts) != 1 || !ts[0].Next.Committed || string(ts[0].Next.Reply) != "r" || ts[0].Next.InFlight {
			t.Fatalf("read=%v: transitions %+v", read, ts)
		}
		if !read && ts[0].Next != made {
			t.Errorf("the commit allocated an entry of its own instead of filling its claim's")
		}
		if read && (seen.Committed || !seen.InFlight || ts[0].Next == seen) {
			t.Errorf("the claim a Get returned was changed by the commit: %+v", seen)
		}
	}
}

// TestBatchAdvanceFillsItsEntry: an advance of a client that an earlier
// operation of the record raised (a sink advancing the same partitions
// item after item) reuses that transition's key and fills the entry the
// record made in place; each client keeps its own entry, an entry the
// record did not make (the stored state, which others hold) is never
// changed, an operation whose advances cannot all apply changes nothing,
// and the record ends as the same operations one record each leave it.
func TestBatchAdvanceFillsItsEntry(t *testing.T) {
	key := func(c string) []byte { return EntryKey(nil, "s", ModeClient, []byte(c)) }
	base := &Entry{Committed: true, Seq: 1, CommitTime: 1, CommitLSN: 1, LSN: 1}
	claimed := &Entry{InFlight: true, ClaimLSN: 2, ClaimSeq: 1, LeaseUntil: 99, LSN: 2}
	stored := map[string]*Entry{string(key("d")): base, string(key("c")): claimed}
	get := func(k []byte, _ byte) (*Entry, error) { return stored[string(k)], nil }
	adv := func(seqs ...any) wal.Op {
		op := wal.Op{Type: wal.OpAdvance, Time: 9}
		for i := 0; i < len(seqs); i += 2 {
			op.Advances = append(op.Advances, wal.Advance{Scope: "s", Client: seqs[i].(string), Seq: uint64(seqs[i+1].(int))})
		}
		return op
	}
	ops := []wal.Op{
		adv("p0", 1), adv("p1", 1), adv("p0", 2, "p1", 2), adv("p0", 3),
		adv("p1", 5, "d", 2), adv("d", 4), adv("p1", 4), // p1: 4 < 5, no change
	}
	b := NewBatch(0, get, 4)
	made := map[string]*Entry{}
	keys := map[string][]byte{}
	for i := range ops {
		step, err := b.Add(&ops[i], nil)
		if err != nil {
			t.Fatalf("op %d: %v", i, err)
		}
		for _, tr := range step {
			c := string(tr.Key[len(tr.Key)-2:])
			if c == "\x01d" {
				c = "d"
			}
			if made[c] == nil {
				made[c], keys[c] = tr.Next, tr.Key
				continue
			}
			if tr.Next != made[c] {
				t.Errorf("op %d: advance of %q allocated an entry instead of filling the record's", i, c)
			}
			if !sameBytes(tr.Key, keys[c]) {
				t.Errorf("op %d: advance of %q built its key again", i, c)
			}
		}
	}
	// A claim in flight: the whole operation fails, p0 stays at 3.
	bad := adv("p0", 9, "c", 1)
	if _, err := b.Add(&bad, nil); !errors.Is(err, ErrBadAdvance) {
		t.Fatalf("advance of a client in flight: %v", err)
	}
	want := map[string]uint64{"p0": 3, "p1": 5, "d": 4}
	for c, seq := range want {
		en, err := b.Get(key(c), ModeClient)
		if err != nil || en == nil || en.Seq != seq || !en.Committed {
			t.Errorf("client %q: %+v %v, want sequence number %d", c, en, err, seq)
		}
	}
	if base.Seq != 1 || base.LSN != 1 {
		t.Errorf("the stored entry was changed in place: %+v", base)
	}
	ts := b.Transitions()

	// The same operations one record each, over a copy of the state.
	ref := map[string]*Entry{}
	for k, v := range stored {
		ref[k] = v
	}
	for i := range ops {
		rts, err := Transitions(&ops[i], 0, func(k []byte, _ byte) (*Entry, error) { return ref[string(k)], nil })
		if err != nil {
			t.Fatal(err)
		}
		for _, tr := range rts {
			ref[string(tr.Key)] = tr.Next
		}
	}
	if len(ts) != len(want) {
		t.Fatalf("%d transitions, want %d: %+v", len(ts), len(want), ts)
	}
	for _, tr := range ts {
		if w := ref[string(tr.Key)]; !equalEntry(w, tr.Next) {
			t.Errorf("key %q: batch %+v, one record each %+v", tr.Key, tr.Next, w)
		}
		if tr.Prev != stored[string(tr.Key)] {
			t.Errorf("key %q: Prev %+v, want the stored state %+v", tr.Key, tr.Prev, stored[string(tr.Key)])
		}
	}
}

// TestBatchAddIntoAllocations: an entry handed to AddInto is the one a
// claim or a commit fills, so that the batch allocates none: a Put's claim
// given its entry (which the commit right after it then fills in place),
// and a commit of a claim of an earlier record given its own. The entry
// given wins over the claim's own, and nothing else is allocated with room
// in the batch. Before AddInto, each of them allocated its entry (1 a
// request).
func TestBatchAddIntoAllocations(t *testing.T) {
	const runs = 100
	n := alloctest.Runs * (runs + 1)
	keys := make([][]byte, n)
	for i := range keys {
		keys[i] = EntryKey(nil, "s", ModeID, fmt.Appendf(nil, "id-%04d", i))
	}
	// Each key's claim of an earlier record (LSN 5), for the commits.
	claimed := &Entry{InFlight: true, ClaimLSN: 5, ClaimFP: []byte("fp"), LSN: 5}
	// The operations are made once (the engine's are its run's too).
	claim := &wal.Op{Type: wal.OpClaim, Scope: "s", Time: 9, Flags: wal.ClaimFlagNew}
	commit := &wal.Op{Type: wal.OpCommit, Scope: "s", Time: 9, Reply: []byte("r")}
	id := func(i int) []byte { return keys[i][len(keys[i])-7:] }
	for _, c := range []struct {
		name string
		get  func([]byte, byte) (*Entry, error)
		add  func(b *Batch, i int, into *Entry) error
	}{
		{"Put", func([]byte, byte) (*Entry, error) { return nil, nil }, func(b *Batch, i int, into *Entry) error {
			claim.ID, commit.ID, commit.ClaimLSN = id(i), id(i), 0
			if _, err := b.AddInto(claim, keys[i], into); err != nil {
				return err
			}
			step, err := b.AddInto(commit, keys[i], nil)
			if err == nil && (step[0].Next != into || !into.Committed || string(into.Reply) != "r") {
				err = fmt.Errorf("the commit did not fill the claim's given entry: %+v", step)
			}
			return err
		}},
		{"Commit", func([]byte, byte) (*Entry, error) { return claimed, nil }, func(b *Batch, i int, into *Entry) error {
			commit.ID, commit.ClaimLSN = id(i), 5
			step, err := b.AddInto(commit, keys[i], into)
			if err == nil && (step[0].Next != into || !into.Committed || string(into.Fingerprint) != "fp") {
				err = fmt.Errorf("the commit did not fill its given entry: %+v", step)
			}
			return err
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			b := NewBatch(7, c.get, n)
			entries := make([]Entry, n)
			next := 0
			var err error
			alloctest.CheckAllocs(t, c.name+" with its entry given", 0, runs, func() {
				if next < n && err == nil {
					err = c.add(b, next, &entries[next])
					next++
				}
			})
			if err != nil {
				t.Fatal(err)
			}
			if ts := b.Transitions(); len(ts) != next || ts[0].Next != &entries[0] {
				t.Fatalf("%d transitions for %d requests (first %+v)", len(ts), next, ts[0])
			}
		})
	}
}

// TestBatchTransitionsSizedToRecord: a Batch reused for record after
// record (the engine's run keeps one) gives each record a transitions
// slice of its own size, allocated once, whatever the largest record it
// built before: the slice lives until the record is applied. It used to
// reallocate its working slice at the capacity of the largest record at
// every Reset and hand that out (old: the first record's cap 682, and
// after it a record of one key allocated 32 KiB: 'Reset, a Put and
// Transitions allocated more than its limit of 256 bytes in each of 5
// runs: [32768 ...]'). The transitions handed out before stay as they
// were.
func TestBatchTransitionsSizedToRecord(t *testing.T) {
	const big = 512
	keys := make([][]byte, big+alloctest.Runs)
	for i := range keys {
		keys[i] = EntryKey(nil, "s", ModeID, fmt.Appendf(nil, "id-%04d", i))
	}
	claim := &wal.Op{Type: wal.OpClaim, Scope: "s", Time: 9, Flags: wal.ClaimFlagNew}
	commit := &wal.Op{Type: wal.OpCommit, Scope: "s", Time: 9, Reply: []byte("r")}
	put := func(b *Batch, i int, into *Entry) {
		t.Helper()
		id := keys[i][len(keys[i])-7:]
		claim.ID, commit.ID = id, id
		if _, err := b.AddInto(claim, keys[i], into); err != nil {
			t.Fatal(err)
		}
		if _, err := b.AddInto(commit, keys[i], nil); err != nil {
			t.Fatal(err)
		}
	}
	b := NewBatch(0, func([]byte, byte) (*Entry, error) { return nil, nil }, 0)
	for i := range big {
		put(b, i, nil)
	}
	first := b.Transitions()
	if len(first) != big || cap(first) != big {
		t.Errorf("the first record's transitions: len %d cap %d, want %d", len(first), cap(first), big)
	}
	entries := make([]Entry, alloctest.Runs)
	next := big
	var ts []Transition
	alloctest.Check(t, "Reset, a Put and Transitions", 256, func() {
		b.Reset(0)
		put(b, next, &entries[next-big])
		ts = b.Transitions()
		next++
	})
	if len(ts) != 1 || cap(ts) != 1 || !bytes.Equal(ts[0].Key, keys[next-1]) || ts[0].Next != &entries[next-1-big] {
		t.Fatalf("the small record's transitions: len %d cap %d %+v", len(ts), cap(ts), ts)
	}
	for i, tr := range first {
		if !bytes.Equal(tr.Key, keys[i]) || tr.Next == nil || !tr.Next.Committed {
			t.Fatalf("the first record's transition %d changed after the batch was reused: %+v", i, tr)
		}
	}
}
