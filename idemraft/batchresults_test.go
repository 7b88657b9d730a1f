package idemraft

import (
	"reflect"
	"strconv"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
)

// TestApplyBatchResultsBuffer: a batchApply runs its engine batches into
// one results buffer (idem.RunAppender), kept from call to call, which
// holds nothing between them: every element up to its capacity is zero
// after each call, and a second batch no larger than the first reuses it.
func TestApplyBatchResultsBuffer(t *testing.T) {
	f := wrapSmall(t, newCounterFSM())
	idx := uint64(0)
	batch := func(n int) []*raft.Log {
		var logs []*raft.Log
		for range n {
			idx++
			id := "id-" + strconv.FormatUint(idx, 10)
			c, err := Command(idem.Request{Scope: "s", ID: []byte(id), Fingerprint: []byte("fp")}, encodeOp(counterOp{ID: id, Key: "k", Delta: 1}))
			if err != nil {
				t.Fatal(err)
			}
			logs = append(logs, &raft.Log{Index: idx, Term: 1, Type: raft.LogCommand, Data: c, AppendedAt: t0})
		}
		return logs
	}
	a := new(batchApply)
	apply := func(logs []*raft.Log) {
		t.Helper()
		f.mu.RLock()
		out := a.apply(f, logs)
		f.mu.RUnlock()
		for i, r := range out {
			if resp, ok := r.(*Response); !ok || resp.Err != nil || resp.Duplicate {
				t.Fatalf("entry %d: %+v, want a new request's response", i, r)
			}
		}
		if cap(a.bres) < len(logs) {
			t.Fatalf("results buffer of capacity %d after a batch of %d", cap(a.bres), len(logs))
		}
		for i, r := range a.bres[:cap(a.bres)] {
			if !reflect.DeepEqual(r, idem.BatchResult{}) {
				t.Fatalf("results buffer element %d holds %+v after the call", i, r)
			}
		}
	}
	apply(batch(40))
	first := &a.bres[:1][0]
	apply(batch(25))
	if &a.bres[:1][0] != first {
		t.Error("the second batch did not reuse the results buffer")
	}
}
