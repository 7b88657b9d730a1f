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
