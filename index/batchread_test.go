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
