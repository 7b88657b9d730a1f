package idemcluster

import (
	"testing"

	"github.com/hashicorp/raft"
	raftwal "github.com/hashicorp/raft-wal"
	"github.com/hashicorp/raft-wal/metadb"
)

// TestRaftLogReopensAfterTailTruncation pins the raft-wal version: a
// node killed as leader comes back with entries the new leader never
// had, raft cuts them off (DeleteRange of the tail), and the node must
// open its log again after its next restart. raft-wal v0.4.0 sealed the
// segment without its index on a tail truncation, and the next open
// failed ("sealed segment has no index block", raft-wal issue 31, fixed
// in v0.4.1); examples/cluster's TestFleet met it on a leader's second
// SIGKILL.
func TestRaftLogReopensAfterTailTruncation(t *testing.T) {
	dir := t.TempDir()
	open := func() (*raftwal.WAL, *metadb.BoltMetaDB) {
		t.Helper()
		meta := &metadb.BoltMetaDB{}
		w, err := raftwal.Open(dir, raftwal.WithMetaStore(meta))
		if err != nil {
			t.Fatalf("opening the raft log: %v", err)
		}
		return w, meta
	}
	w, meta := open()
	var logs []*raft.Log
	for i := uint64(1); i <= 10; i++ {
		logs = append(logs, &raft.Log{Index: i, Term: 1, Type: raft.LogCommand, Data: []byte("entry")})
	}
	if err := w.StoreLogs(logs); err != nil {
		t.Fatal(err)
	}
	if err := w.DeleteRange(8, 10); err != nil { // the tail a new leader never had
		t.Fatal(err)
	}
	if err := w.StoreLogs([]*raft.Log{{Index: 8, Term: 2, Type: raft.LogCommand, Data: []byte("new leader's")}}); err != nil {
		t.Fatal(err)
	}
	w.Close()
	meta.Close()
	w, meta = open()
	defer meta.Close()
	defer w.Close()
	for i := uint64(1); i <= 8; i++ {
		var l raft.Log
		if err := w.GetLog(i, &l); err != nil {
			t.Fatalf("entry %d after the reopen: %v", i, err)
		}
	}
	if last, err := w.LastIndex(); err != nil || last != 8 {
		t.Fatalf("last index %d %v, want 8", last, err)
	}
}
