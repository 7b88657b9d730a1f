package idemstream

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/wal"
	"github.com/vmihailenco/msgpack/v5"
)

// oneAtATime is a Store without idem.Batcher (as an idemcluster client, or
// any store that only has the single calls): the sinks then run their
// batches one request at a time (storeBatch).
type oneAtATime struct{ idem.Store }

// spyOp is one item of a batch as a spyStore saw it.
type spyOp struct {
	kind  string // begin, put, commit, abort, ack, advance
	scope string
	id    string // id, or client/seq
	adv   []idem.Advance
}

// spyStore is the engine with its batches recorded: which items went
// into which Run (one record each with the one-record batch).
type spyStore struct {
	*idem.Engine
	mu   sync.Mutex
	runs [][]spyOp
}

func (s *spyStore) NewBatch() idem.Batch { return &spyBatch{s: s, b: s.Engine.NewBatch()} }

func (s *spyStore) takeRuns() [][]spyOp {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.runs
	s.runs = nil
	return r
}

type spyBatch struct {
	s   *spyStore
	b   idem.Batch
	ops []spyOp
}

func reqName(r idem.Request) string {
	if r.Client != "" {
		return fmt.Sprintf("%s/%d", r.Client, r.Seq)
	}
	return string(r.ID)
}

func (b *spyBatch) Begin(req idem.Request) {
	b.ops = append(b.ops, spyOp{kind: "begin", scope: req.Scope, id: reqName(req)})
	b.b.Begin(req)
}
func (b *spyBatch) Put(req idem.Request, reply []byte, adv ...idem.Advance) {
	b.ops = append(b.ops, spyOp{kind: "put", scope: req.Scope, id: reqName(req), adv: adv})
	b.b.Put(req, reply, adv...)
}
func (b *spyBatch) Commit(c *idem.Claim, reply []byte, adv ...idem.Advance) {
	b.ops = append(b.ops, spyOp{kind: "commit", adv: adv})
	b.b.Commit(c, reply, adv...)
}
func (b *spyBatch) Abort(c *idem.Claim) {
	b.ops = append(b.ops, spyOp{kind: "abort"})
	b.b.Abort(c)
}
func (b *spyBatch) Ack(scope string, ids ...[]byte) {
	b.ops = append(b.ops, spyOp{kind: "ack", scope: scope})
	b.b.Ack(scope, ids...)
}
func (b *spyBatch) Advance(adv ...idem.Advance) {
	b.ops = append(b.ops, spyOp{kind: "advance", adv: adv})
	b.b.Advance(adv...)
}
func (b *spyBatch) Len() int { return b.b.Len() }
func (b *spyBatch) Run(ctx context.Context) ([]idem.BatchResult, error) {
	b.s.mu.Lock()
	b.s.runs = append(b.s.runs, b.ops)
	b.s.mu.Unlock()
	return b.b.Run(ctx)
}

func kinds(ops []spyOp) string {
	var k []string
	for i := 0; i < len(ops); {
		j := i
		for j < len(ops) && ops[j].kind == ops[i].kind {
			j++
		}
		k = append(k, fmt.Sprintf("%s x%d", ops[i].kind, j-i))
		i = j
	}
	return strings.Join(k, ", ")
}

// TestSinkBatchRecords: Consume claims a fetched batch in one batch, and
// commits it in a second one (two engine records) where every commit
// carries its partition's frontier advance (the frontier is in the record
// of the effect, never in one of its own), the commits in reverse order,
// so that the record holds one advance per partition (the engine leaves
// out those that raise nothing); a redelivery at a higher offset adds one
// advance, a plain redelivery writes nothing.
func TestSinkBatchRecords(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	w := newWorld()
	st := &spyStore{Engine: openEngine(t, w.mem, nil)}
	defer st.Close()
	s, err := NewSink(ctx, st, "s", nil)
	if err != nil {
		t.Fatal(err)
	}
	l := newLedger(w)
	evs := makeEvents(40, 2, 0)
	lsn := st.Stats().LastLSN
	outs, errs := s.applyBatch(ctx, evs, l.handler, 8)
	if n := st.Stats().LastLSN - lsn; n != 2 {
		t.Fatalf("a batch of 40 events wrote %d records, want 2", n)
	}
	for i := range evs {
		if errs[i] != nil || outs[i].Status != Applied {
			t.Fatalf("event %s: %+v %v", evs[i].ID, outs[i], errs[i])
		}
	}
	runs := st.takeRuns()
	if len(runs) != 2 || kinds(runs[0]) != "begin x40" || kinds(runs[1]) != "commit x40" {
		t.Fatalf("batches %d: want [begin x40] [commit x40], got %v", len(runs), runKinds(runs))
	}
	for i, op := range runs[1] {
		ev := evs[len(evs)-1-i]
		if want := (idem.Advance{Scope: frontierScope("s"), Client: frontierClient(ev.Partition), Seq: ev.Offset}); len(op.adv) != 1 || op.adv[0] != want {
			t.Fatalf("commit %d (of %s) carries the advances %v, want [%v]", i, ev.ID, op.adv, want)
		}
	}
	checkFrontierExact(t, st.Engine, "s", evs)
	// The commit record: 40 commits, and the advances that raise: the
	// first commit of each partition, at its highest offset.
	var got []wal.Advance
	commits := 0
	if _, err := wal.Scan(w.mem, "db/wal", wal.LSN(lsn+1), 0, func(r wal.Record) error {
		if r.LSN != wal.LSN(lsn+2) {
			return nil
		}
		op, err := wal.DecodeOp(r.Type, r.Payload)
		if err != nil {
			return err
		}
		for _, o := range op.Ops {
			if o.Type == wal.OpCommit || o.Type == wal.OpCommitAdvance {
				commits++
			}
			got = append(got, o.Advances...)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	top := maxOffsets(evs)
	want := []wal.Advance{{Scope: frontierScope("s"), Client: "p:p1", Seq: top["p1"]}, {Scope: frontierScope("s"), Client: "p:p0", Seq: top["p0"]}}
	if commits != 40 || !slices.Equal(got, want) {
		t.Fatalf("the commit record holds %d commits and the advances %v, want 40 and %v", commits, got, want)
	}

	// Redeliveries: evs[0] published again above the frontier, evs[1] as
	// it was.
	again := evs[0]
	again.Offset = 1000
	outs, errs = s.applyBatch(ctx, []Event{again, evs[1]}, l.handler, 8)
	for i := range outs {
		if errs[i] != nil || outs[i].Status != Replayed {
			t.Fatalf("redelivery %d: %+v %v", i, outs[i], errs[i])
		}
	}
	runs = st.takeRuns()
	wantAdv := idem.Advance{Scope: frontierScope("s"), Client: frontierClient(again.Partition), Seq: 1000}
	if len(runs) != 2 || kinds(runs[1]) != "advance x1" || len(runs[1][0].adv) != 1 || runs[1][0].adv[0] != wantAdv {
		t.Fatalf("redelivery batches %v, want [begin x2] [advance x1 of %v]", runKinds(runs), wantAdv)
	}
	if _, _ = s.applyBatch(ctx, []Event{evs[2]}, l.handler, 8); len(st.takeRuns()) != 1 {
		t.Fatal("a plain redelivery wrote a record")
	}
	checkExactlyOnce(t, l.applied, evs)
}

func runKinds(runs [][]spyOp) []string {
	var out []string
	for _, r := range runs {
		out = append(out, "["+kinds(r)+"]")
	}
	return out
}

// TestCheckpointRecords: a checkpoint writes two batches (two engine
// records) whatever its size: its opening (the handle, and the previous checkpoint's records
// dropped), and the checkpoint record, whose item raises the frontier,
// followed by one Put per event, each event put once. The frontier the
// engine holds is the checkpoint's.
func TestCheckpointRecords(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	w := newWorld()
	st := &spyStore{Engine: openEngine(t, w.mem, nil)}
	defer st.Close()
	l := newTxnLedger(w)
	tp, _, err := NewTwoPhase[*ledgerTxn](ctx, st, "tx", l, nil)
	if err != nil {
		t.Fatal(err)
	}
	st.takeRuns()
	evs := makeEvents(96, 2, 0)
	put := map[string]int{}
	for k := uint64(1); k <= 3; k++ {
		batch := evs[(k-1)*32 : k*32]
		lsn := st.Stats().LastLSN
		if _, err := tp.Checkpoint(ctx, batch); err != nil {
			t.Fatalf("checkpoint %d: %v", k, err)
		}
		if n := st.Stats().LastLSN - lsn; n != 2 {
			t.Fatalf("checkpoint %d of 32 events wrote %d records, want 2", k, n)
		}
		runs := st.takeRuns()
		wantOpen := "put x1"
		if k > 1 {
			wantOpen = "put x1, ack x1"
		}
		if len(runs) != 2 || kinds(runs[0]) != wantOpen || kinds(runs[1]) != "put x33" {
			t.Fatalf("checkpoint %d: batches %v, want [%s] [put x33]", k, runKinds(runs), wantOpen)
		}
		if op := runs[0][0]; op.id != fmt.Sprintf("%s/%d", ckptClient, k) || len(op.adv) != 0 {
			t.Fatalf("checkpoint %d opens with %+v", k, op)
		}
		ck := runs[1][0]
		if ck.id != string(ckptID("c", k)) {
			t.Fatalf("checkpoint %d: first item %+v, want its record", k, ck)
		}
		top := maxOffsets(batch)
		if len(ck.adv) != len(top) {
			t.Fatalf("checkpoint %d record raises %v, want the frontier %v", k, ck.adv, top)
		}
		for _, a := range ck.adv {
			if a.Scope != frontierScope("tx") || a.Seq != top[strings.TrimPrefix(a.Client, "p:")] {
				t.Fatalf("checkpoint %d record raises %v, want the frontier %v", k, ck.adv, top)
			}
		}
		for _, op := range runs[1][1:] {
			if op.scope != sinkScope("tx") || len(op.adv) != 0 {
				t.Fatalf("checkpoint %d: event item %+v", k, op)
			}
			put[op.id]++
		}
		for p, off := range top {
			n, err := st.ClientState(ctx, frontierScope("tx"), frontierClient(p))
			if f, _ := tp.Frontier(p); err != nil || n != off || f != off {
				t.Fatalf("checkpoint %d: frontier of %s: engine %d %v, coordinator %d, want %d", k, p, n, err, f, off)
			}
		}
	}
	for _, ev := range evs {
		if put[string(ev.ID)] != 1 {
			t.Fatalf("event %s put %d times", ev.ID, put[string(ev.ID)])
		}
	}
	// A redelivered batch writes nothing.
	outs, err := tp.Checkpoint(ctx, evs[:32])
	if err != nil || outs[0].Status != Replayed || len(st.takeRuns()) != 0 {
		t.Fatalf("redelivered batch: %v %+v", err, outs[0])
	}
	l.check(t)
	checkExactlyOnce(t, l.committed, evs)
}

// splittingStore is a store without batches whose process crashes at the
// n-th claim in the event scope: a checkpoint's batch stops half way,
// after its checkpoint record and some of its events.
type splittingStore struct {
	idem.Store
	w      *world
	escope string
	n      atomic.Int32
	at     int32
}

func (s *splittingStore) Begin(ctx context.Context, req idem.Request) (idem.Result, error) {
	if req.Scope == s.escope && s.n.Add(1) == s.at {
		return idem.Result{}, s.w.crash()
	}
	return s.Store.Begin(ctx, req)
}

// TestCheckpointSplitByCrash: on a store without batches a checkpoint's
// record is written before its events; a crash among the events leaves
// some of them uncommitted (or claimed). Recovery commits the recorded
// transaction and puts every event the checkpoint lists, with its
// fingerprint: each effect is visible exactly once and the redeliveries
// of the checkpoint's events replay (a recovery that ignores the list
// runs them again).
func TestCheckpointSplitByCrash(t *testing.T) {
	for _, at := range []int32{1, 7, 20} {
		t.Run(fmt.Sprintf("at%d", at), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			w := newWorld()
			evs := makeEvents(60, 2, 6)
			b := newMemBroker(w, evs)
			l := newTxnLedger(w)
			e := openEngine(t, w.mem, nil)
			st := &splittingStore{Store: e, w: w, escope: sinkScope("tx"), at: 40 + at} // in the second checkpoint
			tp, _, err := NewTwoPhase[*ledgerTxn](ctx, st, "tx", l, nil)
			if err != nil {
				t.Fatal(err)
			}
			err = runUntilAcked(ctx, b, func(ctx context.Context, o ConsumeOptions) error {
				o.BatchSize = 40
				return ConsumeTwoPhase(ctx, b, tp, &o)
			})
			if !w.crashed || !errors.Is(err, ErrNeedsRecovery) {
				t.Fatalf("no crash in the checkpoint's events: crashed %v, %v", w.crashed, err)
			}
			e.Close()
			w.restart()
			e = openEngine(t, w.mem, nil)
			defer e.Close()
			tp, rep, err := NewTwoPhase[*ledgerTxn](ctx, &oneAtATime{e}, "tx", l, nil)
			if err != nil {
				t.Fatal(err)
			}
			if rep.Action != "committed" || rep.LastCheckpoint != 2 || rep.EventsCommitted == 0 {
				t.Fatalf("recovery %+v, want checkpoint 2 committed with events put", rep)
			}
			finishRecovered(t, ctx, e, b, tp, l, evs)
		})
	}
}

// TestEventRecordEncoder: the checkpoint's event records are what
// encodeEventRecord writes.
func TestEventRecordEncoder(t *testing.T) {
	var enc eventRecordEncoder
	var got [][]byte
	cases := []eventRecord{{}, {Partition: "p", Offset: 7, Checkpoint: 3}, {Partition: strings.Repeat("x", 31), Offset: 1 << 60, Checkpoint: 1 << 40},
		{Partition: strings.Repeat("y", 32)}, {Partition: strings.Repeat("z", 300), Offset: 5}, {Partition: strings.Repeat("w", 512), Offset: 5},
		{Result: []byte{}}, {Result: []byte("posted"), Partition: "p", Offset: 1}, {Result: make([]byte, 255)}, {Result: make([]byte, 256)},
		{Result: make([]byte, 70000), Partition: "q"}}
	for n := 0; n < 2000; n++ { // across chunks
		c := cases[n%len(cases)]
		got = append(got, enc.encode(c.Result, c.Checkpoint, c.Partition, c.Offset))
	}
	for n, b := range got {
		c := cases[n%len(cases)]
		want, err := encodeEventRecord(&c)
		if err != nil {
			t.Fatal(err)
		}
		if string(b) != string(want) {
			t.Fatalf("record %d (%+v):\n got %x\nwant %x", n, c, b, want)
		}
		var r eventRecord
		if err := msgpack.Unmarshal(b, &r); err != nil || r.Partition != c.Partition || r.Offset != c.Offset || r.Checkpoint != c.Checkpoint || string(r.Result) != string(c.Result) {
			t.Fatalf("record %d: %+v %v", n, r, err)
		}
	}
}

// TestEventRecordFormats: event records are msgpack arrays (a few bytes
// per event, not the field names); the maps that earlier versions wrote
// still decode, as written then (frozen bytes, with and without an
// outbox).
func TestEventRecordFormats(t *testing.T) {
	b, err := encodeEventRecord(&eventRecord{Result: []byte("posted"), Partition: "p", Offset: 7, Checkpoint: 3})
	if err != nil {
		t.Fatal(err)
	}
	if want := "\x96\x01\xc4\x06posted\xa1p\x07\x03\xc0"; string(b) != want {
		t.Fatalf("event record %x, want the array %x", b, want)
	}
	u64 := func(n byte) string { return "\xcf\x00\x00\x00\x00\x00\x00\x00" + string([]byte{n}) }
	old := []struct {
		name, rec string
		want      eventRecord
	}{
		{"map", "\x86\xa7Version\xcc\x01\xa6Result\xc4\x06posted\xa9Partition\xa1p\xa6Offset" + u64(7) + "\xaaCheckpoint" + u64(3) + "\xa6Outbox\xc0",
			eventRecord{Version: 1, Result: []byte("posted"), Partition: "p", Offset: 7, Checkpoint: 3}},
		{"map with outbox", "\x86\xa7Version\xcc\x01\xa6Result\xc0\xa9Partition\xa0\xa6Offset" + u64(0) + "\xaaCheckpoint" + u64(0) + "\xa6Outbox\x91\x82\xa1d\xa4dest\xa1p\xc4\x01x",
			eventRecord{Version: 1, Outbox: []OutboxMessage{{Destination: "dest", Payload: []byte("x")}}}},
	}
	for _, c := range old {
		r, err := decodeEventRecord("s", []byte("id"), []byte(c.rec))
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if r.Version != c.want.Version || string(r.Result) != string(c.want.Result) || r.Partition != c.want.Partition || r.Offset != c.want.Offset ||
			r.Checkpoint != c.want.Checkpoint || fmt.Sprint(r.Outbox) != fmt.Sprint(c.want.Outbox) {
			t.Fatalf("%s decodes to %+v, want %+v", c.name, *r, c.want)
		}
	}
	// And an array with an outbox round-trips.
	in := eventRecord{Result: []byte("r"), Partition: "q", Offset: 1 << 40, Outbox: []OutboxMessage{{Destination: "d", Payload: []byte("y")}}}
	if b, err = encodeEventRecord(&in); err != nil {
		t.Fatal(err)
	}
	r, err := decodeEventRecord("s", []byte("id"), b)
	if err != nil || b[0] != 0x96 || r.Offset != in.Offset || fmt.Sprint(r.Outbox) != fmt.Sprint(in.Outbox) {
		t.Fatalf("record with an outbox %x decodes to %+v (%v)", b, r, err)
	}
}

// TestCheckpointRecordBody: a checkpoint record's body, written without
// reflection, is msgpack.Marshal's encoding of it (byte for byte with one
// partition in the frontier; with several, their order is sorted, not
// the map's), and reads back equal.
func TestCheckpointRecordBody(t *testing.T) {
	ids := func(n, size int) [][]byte {
		l := make([][]byte, n)
		for i := range l {
			l[i] = []byte(strings.Repeat("i", 1+i%size))
		}
		return l
	}
	cases := []checkpointRecord{
		{},
		{K: 1, Handle: []byte{0x81, 0xa2}, Events: ids(1, 1), Frontier: map[string]uint64{"p": 4}},
		{K: 1 << 40, Handle: make([]byte, 300), Events: ids(20, 300), Fingerprints: ids(20, 32), Frontier: map[string]uint64{strings.Repeat("q", 40): 1 << 62}},
		{K: 7, Handle: []byte{}, Events: ids(70000, 3), Fingerprints: ids(70000, 32), Frontier: map[string]uint64{}},
		{K: 8, Events: [][]byte{}, Frontier: map[string]uint64{"a": 1, "b": 2, "c": 3, "": 9}},
	}
	for n, c := range cases {
		got := c.appendBody(nil)
		if len(c.Frontier) <= 1 {
			want, err := msgpack.Marshal(&c)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != string(want) {
				t.Fatalf("case %d: body differs from msgpack.Marshal's:\n got %.200x\nwant %.200x", n, got, want)
			}
		}
		sealed, err := seal(&c, maxSealedBytes)
		if err != nil {
			t.Fatal(err)
		}
		var r checkpointRecord
		if err := unseal(sealed, maxSealedBytes, &r); err != nil {
			t.Fatalf("case %d: %v", n, err)
		}
		if r.K != c.K || string(r.Handle) != string(c.Handle) || fmt.Sprint(r.Events) != fmt.Sprint(c.Events) ||
			fmt.Sprint(r.Fingerprints) != fmt.Sprint(c.Fingerprints) || fmt.Sprint(r.Frontier) != fmt.Sprint(c.Frontier) {
			t.Fatalf("case %d reads back as %+v", n, r)
		}
	}
}

// TestConsumeBatchBuffersReused: Consume's batches take turns with two
// sets of buffers (events, errors, claims); a batch's outcomes are its own,
// whatever the batch two before it (of another size, with a failed
// handler) left in them.
func TestConsumeBatchBuffersReused(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w := newWorld()
	e := openEngine(t, w.mem, nil)
	defer e.Close()
	s, err := NewSink(ctx, e, "s", nil)
	if err != nil {
		t.Fatal(err)
	}
	evs := makeEvents(11, 1, 0)
	br := newMemBroker(w, evs)
	l := newLedger(w)
	failed := false
	h := func(ctx context.Context, ev Event) (Effect, error) {
		if string(ev.ID) == "ev-0000" && !failed {
			failed = true // the first delivery of the first event fails
			return Effect{}, errors.New("ledger busy")
		}
		return l.handler(ctx, ev)
	}
	var mu sync.Mutex
	got := map[string][]Status{}
	var errs []string
	err = runUntilAcked(ctx, br, func(ctx context.Context, o ConsumeOptions) error {
		o.BatchSize, o.Concurrency = 4, 1
		onBatch := o.OnBatch
		o.OnBatch = func(msgs []Message, outs []Outcome) {
			mu.Lock()
			for i := range msgs {
				if errors.Is(outs[i].Err, context.Canceled) {
					continue // a redelivery fetched as runUntilAcked stops
				}
				id := string(msgs[i].Event.ID)
				got[id] = append(got[id], outs[i].Status)
				if outs[i].Err != nil {
					errs = append(errs, outs[i].Err.Error())
				}
			}
			mu.Unlock()
			onBatch(msgs, outs)
		}
		return Consume(ctx, br, s, h, &o)
	})
	if err != nil {
		t.Fatal(err)
	}
	// Each event is applied by its first delivery (ev-0000 by its
	// second: the first failed), and later deliveries of it (fetched
	// again before its ack) are busy or replayed: never failed.
	for _, ev := range evs {
		id := string(ev.ID)
		st := got[id]
		first := 0
		if id == "ev-0000" {
			if len(st) == 0 || st[0] != Failed {
				t.Fatalf("%s: outcomes %v, want failed first", id, st)
			}
			first = 1
		}
		if len(st) <= first || st[first] != Applied {
			t.Fatalf("%s: outcomes %v, want applied by delivery %d", id, st, first+1)
		}
		for _, o := range st[first+1:] {
			if o != Busy && o != Replayed {
				t.Fatalf("%s: outcomes %v: a redelivery after it was applied is %v (errors: %q)", id, st, o, errs)
			}
		}
	}
	checkExactlyOnce(t, l.applied, evs)
}
