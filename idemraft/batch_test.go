package idemraft

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
)

// TestApplyBatchMatchesApply is a differential test: a random log (new and
// repeated ids, acks, per-client sequences with gaps and replays,
// conflicts, forgets, TTLs, plain entries, configuration entries, times
// that stay or move) is applied entry by entry on one FSM and in random
// batches on another. Every result and the final states must be equal.
func TestApplyBatchMatchesApply(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	var logs []*raft.Log
	at := t0
	seq := map[string]uint64{}
	for i := 1; i <= 1500; i++ {
		if rng.IntN(4) == 0 {
			at = at.Add(time.Duration(rng.IntN(3000)) * time.Millisecond)
		}
		l := &raft.Log{Index: uint64(i), Term: 1, Type: raft.LogCommand, AppendedAt: at}
		opID := fmt.Sprintf("op%d", i)
		switch k := rng.IntN(20); {
		case k == 0:
			l.Data = encodeOp(counterOp{ID: opID, Key: "plain", Delta: 1})
		case k == 1:
			l.Type = raft.LogConfiguration
			l.Data = raft.EncodeConfiguration(raft.Configuration{Servers: []raft.Server{{ID: "a", Address: "a"}}})
		case k == 2:
			l.Data = ForgetCommand(at.Add(-time.Duration(rng.IntN(5)) * time.Second))
		case k < 9:
			client := fmt.Sprintf("c%d", rng.IntN(4))
			s := seq[client] + 1
			switch rng.IntN(6) {
			case 0:
				s = max(1, s-1) // a replay
			case 1:
				s += 2 // a gap
			default:
				seq[client] = s
			}
			l.Data, _ = Command(idem.Request{Scope: "s", Client: client, Seq: s}, encodeOp(counterOp{ID: opID, Key: client, Delta: 1}))
		default:
			id := []byte(fmt.Sprintf("id%d", rng.IntN(60)))
			req := idem.Request{Scope: "s", ID: id, Fingerprint: []byte{byte(rng.IntN(2))}}
			if rng.IntN(3) == 0 {
				req.Acked = [][]byte{[]byte(fmt.Sprintf("id%d", rng.IntN(60)))}
			}
			if rng.IntN(4) == 0 {
				req.TTL = time.Duration(1+rng.IntN(5)) * time.Second
			}
			l.Data, _ = Command(req, encodeOp(counterOp{ID: opID, Key: string(id), Delta: 1, Fail: rng.IntN(10) == 0}))
		}
		logs = append(logs, l)
	}

	appA, appB := newCounterFSM(), newCounterFSM()
	fa, fb := wrapT(t, appA, t.TempDir()), wrapT(t, appB, t.TempDir())
	var resA, resB []any
	for _, l := range logs {
		switch l.Type {
		case raft.LogCommand:
			resA = append(resA, fa.Apply(l))
		case raft.LogConfiguration:
			fa.StoreConfiguration(l.Index, raft.DecodeConfiguration(l.Data))
			resA = append(resA, nil)
		}
	}
	for i := 0; i < len(logs); {
		n := 1 + rng.IntN(64)
		if i+n > len(logs) {
			n = len(logs) - i
		}
		resB = append(resB, fb.ApplyBatch(logs[i:i+n])...)
		i += n
	}
	if len(resA) != len(resB) {
		t.Fatalf("%d results against %d", len(resA), len(resB))
	}
	dups := 0
	for i := range resA {
		if a, b := describe(resA[i]), describe(resB[i]); a != b {
			t.Fatalf("entry %d (%v): Apply gave %s, ApplyBatch %s", i+1, logs[i].Type, a, b)
		}
		if r, ok := resA[i].(*Response); ok && r.Duplicate {
			dups++
		}
	}
	if !reflect.DeepEqual(appA.state(), appB.state()) {
		t.Fatal("states differ")
	}
	sa, sb := fa.Stats(), fb.Stats()
	if sa.Applied != sb.Applied || sa.Duplicates != sb.Duplicates || sa.Refused != sb.Refused || sa.LastIndex != sb.LastIndex {
		t.Fatalf("stats differ: %+v / %+v", sa, sb)
	}
	if dups == 0 || sa.Refused == 0 || sa.Applied == 0 {
		t.Fatalf("the log did not exercise enough: %+v", sa)
	}
	t.Logf("%d entries: %d applied, %d duplicates, %d refused", len(logs), sa.Applied, sa.Duplicates, sa.Refused)
}

func describe(v any) string {
	switch r := v.(type) {
	case *Response:
		e := ""
		if r.Err != nil {
			e = r.Err.Error()
		}
		return fmt.Sprintf("reply %x dup %v err %q", r.Reply, r.Duplicate, e)
	case []byte:
		return fmt.Sprintf("bytes %x", r)
	case error:
		return "error " + r.Error()
	case nil:
		return "nil"
	}
	return fmt.Sprintf("%T %v", v, v)
}
