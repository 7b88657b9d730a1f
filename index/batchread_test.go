package index

import (
	"testing"

	"github.com/idemdb/idem/wal"
)

// TestBatchGetAfterAdd: a key Get read through get (remembered until the
// next Add, so that its own operation's Add finds it without a lookup)
// is read through the batch once an operation changed it, whichever keys
// were changed after it; and an operation on a key read that way gets one
// transition (the key is added to the batch once).
func TestBatchGetAfterAdd(t *testing.T) {
	a := EntryKey(nil, "", ModeID, []byte("a"))
	b := EntryKey(nil, "", ModeID, []byte("b"))
	old := &Entry{Committed: true, CommitLSN: 3, ReplyKept: true, Reply: []byte("old"), LSN: 3}
	stored := map[string]*Entry{string(b): old}
	gets := 0
	get := func(k []byte, _ byte) (*Entry, error) { gets++; return stored[string(k)], nil }
	bt := NewBatch(20, get, 4)
	if en, err := bt.Get(a, ModeID); err != nil || en != nil {
		t.Fatalf("get a: %v %v", en, err)
	}
	if _, err := bt.Add(&wal.Op{Type: wal.OpClaim, ID: []byte("a"), Time: 9, LeaseUntil: 99}, a); err != nil {
		t.Fatal(err)
	}
	if gets != 1 {
		t.Errorf("a read %d times through get, want 1 (its Add finds Get's read)", gets)
	}
	if _, err := bt.Get(b, ModeID); err != nil {
		t.Fatal(err)
	}
	if _, err := bt.Add(&wal.Op{Type: wal.OpAck, Acked: [][]byte{[]byte("b")}, Time: 9}, nil); err != nil {
		t.Fatal(err)
	}
	// a was changed after its read, and b after a: Get reads a's claim.
	en, err := bt.Get(a, ModeID)
	if err != nil || en == nil || !en.InFlight || en.ClaimLSN != 20 {
		t.Fatalf("get a after its claim: %+v %v, want the claim", en, err)
	}
	if en, err := bt.Get(b, ModeID); err != nil || en != nil {
		t.Fatalf("get b after its ack: %+v %v, want absent", en, err)
	}
	if _, err := bt.Add(&wal.Op{Type: wal.OpCommit, ID: []byte("a"), Time: 9, Reply: []byte("ra")}, a); err != nil {
		t.Fatal(err)
	}
	ts := bt.Transitions()
	if len(ts) != 2 {
		t.Fatalf("%d transitions, want 2 (a, b): %+v", len(ts), ts)
	}
	for _, tr := range ts {
		switch string(tr.Key) {
		case string(a):
			if tr.Prev != nil || tr.Next == nil || !tr.Next.Committed || string(tr.Next.Reply) != "ra" {
				t.Errorf("a: %+v -> %+v", tr.Prev, tr.Next)
			}
		case string(b):
			if tr.Prev != old || tr.Next != nil {
				t.Errorf("b: %+v -> %+v", tr.Prev, tr.Next)
			}
		}
	}
}

// TestBatchGetUnchanged: a batch whose keys a caller reads with
// GetUnchanged when it knows the batch has not changed them, and with Get
// otherwise, computes what a batch read with Get alone computes; the key
// map is built only when a lookup needs it (a batch of one operation per
// key, read that way, hashes no key), and then holds every key changed
// before the lookup.
func TestBatchGetUnchanged(t *testing.T) {
	key := func(s string) []byte { return EntryKey(nil, "", ModeID, []byte(s)) }
	old := &Entry{Committed: true, CommitLSN: 3, ReplyKept: true, Reply: []byte("old"), LSN: 3}
	stored := map[string]*Entry{string(key("b")): old}
	get := func(k []byte, _ byte) (*Entry, error) { return stored[string(k)], nil }
	claim := func(id string) *wal.Op {
		return &wal.Op{Type: wal.OpClaim, ID: []byte(id), Time: 9, LeaseUntil: 99}
	}
	commit := func(id string) *wal.Op {
		return &wal.Op{Type: wal.OpCommit, ID: []byte(id), Time: 9, Reply: []byte("r" + id)}
	}
	fresh, plain := NewBatch(20, get, 4), NewBatch(20, get, 4)
	// Each key once, as a run of Puts adds them: nothing is looked up.
	for _, id := range []string{"a", "b", "c"} {
		k := key(id)
		ef, _ := fresh.GetUnchanged(k, ModeID)
		ep, _ := plain.Get(k, ModeID)
		if ef != ep {
			t.Fatalf("%s: GetUnchanged %+v, Get %+v", id, ef, ep)
		}
		for _, op := range []*wal.Op{claim(id), commit(id)} {
			if _, err := fresh.Add(op, k); err != nil {
				t.Fatal(err)
			}
			if _, err := plain.Add(op, k); err != nil {
				t.Fatal(err)
			}
		}
	}
	if len(fresh.at) != 0 {
		t.Errorf("the key map holds %d keys, want none: no lookup needed it", len(fresh.at))
	}
	// a, changed two operations ago: Get finds it through the map, built now.
	for _, bt := range []*Batch{fresh, plain} {
		en, err := bt.Get(key("a"), ModeID)
		if err != nil || en == nil || !en.Committed || string(en.Reply) != "ra" {
			t.Fatalf("get a after its Put: %+v %v", en, err)
		}
		if en, _ := bt.Get(key("b"), ModeID); en == nil || string(en.Reply) != "rb" {
			t.Fatalf("get b after its Put: %+v", en)
		}
	}
	if len(fresh.at) != 3 {
		t.Errorf("the key map holds %d keys after a lookup, want 3", len(fresh.at))
	}
	// d after the lookup: added to the map at the next one.
	d := key("d")
	fresh.GetUnchanged(d, ModeID)
	plain.Get(d, ModeID)
	for _, bt := range []*Batch{fresh, plain} {
		if _, err := bt.Add(claim("d"), d); err != nil {
			t.Fatal(err)
		}
		if _, err := bt.Add(&wal.Op{Type: wal.OpAck, Acked: [][]byte{[]byte("c")}, Time: 9}, nil); err != nil {
			t.Fatal(err)
		}
		if en, _ := bt.Get(d, ModeID); en == nil || !en.InFlight {
			t.Fatalf("get d after its claim: %+v", en)
		}
	}
	tf, tp := fresh.Transitions(), plain.Transitions()
	if len(tf) != len(tp) || len(tf) != 3 {
		t.Fatalf("%d and %d transitions, want 3 (a, b, d; c, acked, was absent before and after)", len(tf), len(tp))
	}
	for i := range tf {
		if string(tf[i].Key) != string(tp[i].Key) || tf[i].Prev != tp[i].Prev || !equalEntry(tf[i].Next, tp[i].Next) {
			t.Errorf("transition %d: %q %+v -> %+v, with Get %q %+v -> %+v", i, tf[i].Key, tf[i].Prev, tf[i].Next, tp[i].Key, tp[i].Prev, tp[i].Next)
		}
	}
}

// TestBatchFindsAgainBySlice: a batch of commits of in-flight ids, each
// reading, as the engine's batchRun.raising does, the client key it
// advances (one slice for the whole batch) before its Add, in falling
// order of the advances (a stream sink's frontier: only the first
// raises), looks that key up in its key map once: the later reads take
// it by the slice (found), and the key map holds the few keys added
// before that lookup, not every commit's (on the code before, the map
// was brought up to date at each read: one key per commit). The
// transitions are those of the same batch read with a copy of the key
// at every read (no slice to recognize).
func TestBatchFindsAgainBySlice(t *testing.T) {
	const n = 64
	key := func(i int) []byte { return EntryKey(nil, "s", ModeID, []byte{'e', byte(i)}) }
	stored := map[string]*Entry{}
	for i := range n {
		stored[string(key(i))] = &Entry{InFlight: true, ClaimLSN: 5, ClaimTime: 1, LeaseUntil: 99, LSN: 5}
	}
	get := func(k []byte, _ byte) (*Entry, error) { return stored[string(k)], nil }
	client := EntryKey(nil, "f", ModeClient, []byte("p:0"))
	run := func(sameSlice bool) (mapped int, ts []Transition) {
		bt := NewBatch(20, get, n)
		for i := range n {
			k := key(i)
			if _, err := bt.GetUnchanged(k, ModeID); err != nil {
				t.Fatal(err)
			}
			ck := client
			if !sameSlice {
				ck = append([]byte(nil), client...)
			}
			cur, err := bt.Get(ck, ModeClient)
			if err != nil {
				t.Fatal(err)
			}
			seq := uint64(n - i)
			op := &wal.Op{Type: wal.OpCommit, Scope: "s", ID: []byte{'e', byte(i)}, ClaimLSN: 5, Time: 9, Reply: []byte("r")}
			if cur == nil || cur.Seq < seq { // as raising: only an advance that raises
				op.Type, op.Advances = wal.OpCommitAdvance, []wal.Advance{{Scope: "f", Client: "p:0", Seq: seq}}
			}
			if _, err := bt.Add(op, k); err != nil {
				t.Fatal(err)
			}
		}
		return len(bt.at), bt.Transitions()
	}
	mapped, got := run(true)
	if mapped > 3 {
		t.Errorf("the key map held %d keys, want at most 3: the client key is found again by its slice", mapped)
	}
	_, want := run(false)
	if len(got) != n+1 || len(got) != len(want) {
		t.Fatalf("%d and %d transitions, want %d (every id, the client once)", len(got), len(want), n+1)
	}
	for i := range got {
		if string(got[i].Key) != string(want[i].Key) || !sameEntry(got[i].Prev, want[i].Prev) || !sameEntry(got[i].Next, want[i].Next) {
			t.Errorf("transition %d: %q %+v -> %+v, read with copies %q %+v -> %+v", i, got[i].Key, got[i].Prev, got[i].Next, want[i].Key, want[i].Prev, want[i].Next)
		}
		if string(got[i].Key) == string(client) && (got[i].Next == nil || got[i].Next.Seq != n) {
			t.Errorf("client after the batch: %+v, want seq %d", got[i].Next, n)
		}
	}
}

// sameEntry is equalEntry for entries that may be nil (absent).
func sameEntry(a, b *Entry) bool {
	return a == nil && b == nil || a != nil && b != nil && equalEntry(a, b)
}
