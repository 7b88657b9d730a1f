package index

import (
	"fmt"

	"github.com/idemdb/idem/wal"
)

// Replayer applies WAL records to the index in LSN order, as Open does with
// the records after the index's applied LSN. Entries touched since the last
// flush are kept in a write-back overlay so that a claim and its commit cost
// one Pebble write, not two, and so that keys are read from Pebble once.
type Replayer struct {
	ix      *Index
	overlay map[string]*Entry // nil value = known absent
	pending []Update
	n       int
}

// replayFlushEvery bounds the overlay (and so replay's memory).
const replayFlushEvery = 1 << 17

// NewReplayer returns a replayer writing into ix.
func (ix *Index) NewReplayer() *Replayer {
	return &Replayer{ix: ix, overlay: make(map[string]*Entry)}
}

func (r *Replayer) get(key []byte, _ byte) (*Entry, error) {
	if e, ok := r.overlay[string(key)]; ok {
		return e, nil
	}
	return r.ix.Get(key)
}

// Apply applies the record at lsn. Records at or below the index's applied
// LSN are ignored.
func (r *Replayer) Apply(lsn wal.LSN, typ byte, payload []byte) error {
	if lsn <= r.ix.Applied() && len(r.pending) == 0 {
		return nil
	}
	op, err := wal.DecodeOp(typ, payload)
	if err != nil {
		return fmt.Errorf("LSN %d: %w", lsn, err)
	}
	return r.ApplyOp(lsn, op)
}

// ApplyOp applies a decoded record.
func (r *Replayer) ApplyOp(lsn wal.LSN, op *wal.Op) error {
	if op.Type == wal.OpForget {
		if err := r.Flush(); err != nil {
			return err
		}
		return r.ix.Apply([]Update{{LSN: lsn, Forget: &Mark{Before: op.Before, LSN: lsn}, Reason: op.Reason}})
	}
	ts, err := Transitions(op, lsn, r.get)
	if err != nil {
		return fmt.Errorf("replay LSN %d: %w", lsn, err)
	}
	for _, t := range ts {
		r.overlay[string(t.Key)] = t.Next
	}
	r.pending = append(r.pending, Update{LSN: lsn, Transitions: ts})
	r.n += len(ts)
	if r.n >= replayFlushEvery {
		return r.Flush()
	}
	return nil
}

// Flush writes what the replayer holds to the index.
func (r *Replayer) Flush() error {
	if len(r.pending) == 0 {
		return nil
	}
	if err := r.ix.Apply(r.pending); err != nil {
		return err
	}
	r.pending = r.pending[:0]
	clear(r.overlay)
	r.n = 0
	return nil
}
