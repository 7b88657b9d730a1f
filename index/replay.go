package index

import (
	"fmt"

	"github.com/idemdb/idem/wal"
)

// Replayer applies WAL records to the index in LSN order, as Open does with
// the records after the index's applied LSN. Entries touched since the last
// flush are kept in a write-back overlay, so that replay's lookups need no
// lock and a claim and its commit reach the index as one update.
//
// Flushes are double-buffered: while one batch is handed to Index.Apply in
// the background (which merges it into the pending sets and, when a set is
// full, ingests it: see pending.go), the next is decoded and computed. The
// batch being handed over keeps its overlay readable until Apply returned,
// so every lookup sees the state as of the record being replayed.
type Replayer struct {
	ix      *Index
	start   wal.LSN           // records at or below were applied before
	overlay map[string]*Entry // nil value = known absent
	pending []*Update
	n       int

	flushing map[string]*Entry // overlay of the batch being written; read-only
	done     chan error        // result of that write; nil when none
}

// replayFlushEvery bounds the overlay (and so replay's memory).
const replayFlushEvery = 1 << 16

// replayIngestFactor: replay fills pending sets much faster than a running
// engine, and ingesting a set (writing and fsyncing the sstable, Pebble's
// compactions after it) competes with it for the CPU and the disk. Sets of
// 4 x IngestBytes (64 MiB by default) made replay on disk about 15% faster
// (0.93-0.98M to 1.07-1.12M records/s, BenchmarkReplay). The last set is
// frozen by the first Apply after Open, which uses the normal size. So
// from replay until that ingest is done the index may hold two sets of
// 4 x IngestBytes (128 MiB by default) instead of two of 1 x.
const replayIngestFactor = 4

// NewReplayer returns a replayer writing into ix.
func (ix *Index) NewReplayer() *Replayer {
	return &Replayer{ix: ix, start: ix.Applied(), overlay: make(map[string]*Entry)}
}

func (r *Replayer) get(key []byte, _ byte) (*Entry, error) {
	if e, ok := r.overlay[string(key)]; ok {
		return e, nil
	}
	if e, ok := r.flushing[string(key)]; ok {
		return e, nil
	}
	return r.ix.Get(key)
}

// Apply applies the record at lsn. Records at or below the index's applied
// LSN (when the replayer was made) are ignored.
func (r *Replayer) Apply(lsn wal.LSN, typ byte, payload []byte) error {
	if lsn <= r.start {
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
		return r.ix.Apply([]*Update{{LSN: lsn, Forget: &Mark{Before: op.Before, LSN: lsn}, Reason: op.Reason}})
	}
	ts, err := Transitions(op, lsn, r.get)
	if err != nil {
		return fmt.Errorf("replay LSN %d: %w", lsn, err)
	}
	for _, t := range ts {
		r.overlay[string(t.Key)] = t.Next
	}
	r.pending = append(r.pending, &Update{LSN: lsn, Transitions: ts})
	r.n += len(ts)
	if r.n >= replayFlushEvery {
		return r.flushAsync()
	}
	return nil
}

// flushAsync waits for the previous background write and starts writing
// what the replayer holds.
func (r *Replayer) flushAsync() error {
	if err := r.wait(); err != nil {
		return err
	}
	if len(r.pending) == 0 {
		return nil
	}
	ups := r.pending
	r.flushing, r.overlay = r.overlay, make(map[string]*Entry, len(r.overlay))
	r.pending, r.n = nil, 0
	done := make(chan error, 1)
	r.done = done
	go func() { done <- r.ix.apply(ups, replayIngestFactor*r.ix.ingestBytes) }()
	return nil
}

func (r *Replayer) wait() error {
	if r.done == nil {
		return nil
	}
	err := <-r.done
	r.done, r.flushing = nil, nil
	return err
}

// Flush writes everything the replayer holds to the index and waits for it.
func (r *Replayer) Flush() error {
	if err := r.flushAsync(); err != nil {
		return err
	}
	return r.wait()
}

// Discard waits for a background write in progress and drops what the
// replayer holds (used when replay fails half way).
func (r *Replayer) Discard() {
	_ = r.wait()
	r.pending, r.n = nil, 0
	clear(r.overlay)
}
