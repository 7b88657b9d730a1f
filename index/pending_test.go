package index

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/wal"
)

// TestPendingSetAllocations: a key new to the pending set costs no
// allocation of its own in the set (its pendEntry and key bytes come out of
// the set's chunks), and every key reads back through the set and, once
// ingested, through Pebble.
func TestPendingSetAllocations(t *testing.T) {
	ix, err := Open(Options{FS: vfs.NewMem(), Dir: "ix", IngestBytes: 1 << 30, FilterBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close(false)
	const n = 10_000
	ups := make([]*Update, n)
	for i := range ups {
		lsn := wal.LSN(i + 1)
		k := EntryKey(nil, "s", ModeID, []byte(fmt.Sprintf("id-%06d", i)))
		e := &Entry{Committed: true, CommitTime: int64(lsn), CommitLSN: lsn, LSN: lsn, ReplyKept: true, Reply: []byte("reply")}
		ups[i] = &Update{LSN: lsn, Transitions: []Transition{{Key: k, Mode: ModeID, Next: e}}}
	}
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	if err := ix.Apply(ups); err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&m1)
	// Before: a pendEntry and a key string per key (2 per key). Now the
	// chunks and the map's growth: a few hundred in all. The bound leaves
	// room for whatever Pebble's idle goroutines allocate meanwhile.
	if per := float64(m1.Mallocs-m0.Mallocs) / n; per > 0.5 {
		t.Fatalf("%.2f allocations per new pending key, want < 0.5", per)
	}
	check := func(where string) {
		t.Helper()
		for _, u := range ups {
			tr := u.Transitions[0]
			got, err := ix.Get(tr.Key)
			if err != nil {
				t.Fatal(err)
			}
			if got == nil || got.CommitLSN != tr.Next.CommitLSN {
				t.Fatalf("%s: key %q: got %+v, want the entry of LSN %d", where, tr.Key, got, tr.Next.CommitLSN)
			}
		}
	}
	check("pending")
	if err := ix.Flush(); err != nil {
		t.Fatal(err)
	}
	check("ingested")
}
