package idemraft

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"maps"
	"sync"

	"github.com/hashicorp/raft"
	"github.com/vmihailenco/msgpack/v5"
)

// counterFSM is the application of the tests: named counters, and a count
// of how often each operation id reached Apply (exactly-once means 1).
type counterFSM struct {
	mu   sync.Mutex
	vals map[string]int64
	// applied counts the operations of each id. It is the tests'
	// bookkeeping, not the application's: the benchmarks' counterFSM
	// (newBenchCounter) has none, and counts operations in ops only.
	applied  map[string]int
	ops      int // operations that reached Apply
	passed   int // entries that were not operations
	restores int
	// persisted / restored record the bytes of the last snapshot written
	// and read, to check that Restore gets exactly what Persist wrote.
	persisted, restored []byte
}

func newCounterFSM() *counterFSM {
	return &counterFSM{vals: map[string]int64{}, applied: map[string]int{}}
}

// newBenchCounter is the counterFSM of the benchmarks: the same
// application (decoding each operation, updating its counter, replying
// with the new value), without the per-id record the tests check, which
// a real application would not keep and which costs a map insert into a
// map of every id applied so far (and its rehashes as it grows).
func newBenchCounter() *counterFSM {
	return &counterFSM{vals: map[string]int64{}}
}

type counterOp struct {
	_msgpack struct{} `msgpack:",as_array"`
	ID       string
	Key      string
	Delta    int64
	Fail     bool // return an error (after counting the operation)
}

func encodeOp(op counterOp) []byte {
	b, err := msgpack.Marshal(&op)
	if err != nil {
		panic(err)
	}
	return b
}

func (c *counterFSM) Apply(l *raft.Log) any {
	var op counterOp
	if err := msgpack.Unmarshal(l.Data, &op); err != nil {
		c.mu.Lock()
		c.passed++
		c.mu.Unlock()
		return fmt.Errorf("counter: not an operation: %v", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.ops++
	if c.applied != nil {
		c.applied[op.ID]++
	}
	if op.Fail {
		return errors.New("counter: operation " + op.ID + " refused")
	}
	c.vals[op.Key] += op.Delta
	return binary.BigEndian.AppendUint64(nil, uint64(c.vals[op.Key]))
}

type counterState struct {
	Vals    map[string]int64
	Applied map[string]int
	Passed  int
}

func (c *counterFSM) state() counterState {
	c.mu.Lock()
	defer c.mu.Unlock()
	return counterState{Vals: maps.Clone(c.vals), Applied: maps.Clone(c.applied), Passed: c.passed}
}

func (c *counterFSM) Snapshot() (raft.FSMSnapshot, error) {
	return &counterSnap{c: c, st: c.state()}, nil
}

func (c *counterFSM) Restore(rc io.ReadCloser) error {
	b, err := io.ReadAll(rc)
	if err != nil {
		return err
	}
	var st counterState
	if err := msgpack.Unmarshal(b, &st); err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.vals, c.applied, c.passed = st.Vals, st.Applied, st.Passed
	if c.vals == nil {
		c.vals = map[string]int64{}
	}
	if c.applied == nil {
		c.applied = map[string]int{}
	}
	c.restores++
	c.restored = b
	return nil
}

type counterSnap struct {
	c  *counterFSM
	st counterState
}

func (s *counterSnap) Persist(sink raft.SnapshotSink) error {
	b, err := msgpack.Marshal(&s.st)
	if err != nil {
		sink.Cancel()
		return err
	}
	if _, err := sink.Write(b); err != nil {
		sink.Cancel()
		return err
	}
	s.c.mu.Lock()
	s.c.persisted = b
	s.c.mu.Unlock()
	return sink.Close()
}

func (s *counterSnap) Release() {}

// batchingCounter is counterFSM as a raft.BatchingFSM: ApplyBatch applies
// each command entry with Apply, counts configuration changes, and with
// record set keeps a copy of the entries of every call.
type batchingCounter struct {
	*counterFSM
	record bool

	bmu     sync.Mutex   // guards the fields below
	calls   [][]raft.Log // with record: the entries of each ApplyBatch call
	configs int          // configuration changes received
}

func (b *batchingCounter) ApplyBatch(logs []*raft.Log) []any {
	out := make([]any, len(logs))
	var rec []raft.Log
	b.bmu.Lock()
	defer b.bmu.Unlock()
	for i, l := range logs {
		if b.record {
			rec = append(rec, *l)
		}
		switch l.Type {
		case raft.LogCommand:
			out[i] = b.Apply(l)
		case raft.LogConfiguration:
			b.configs++
		}
	}
	if b.record {
		b.calls = append(b.calls, rec)
	}
	return out
}
