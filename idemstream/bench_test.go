package idemstream

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/internal/cputime"
)

// The benchmarks move b.N events from an in-memory stream into an
// in-memory ledger, acknowledging each after its effect: without idem, through
// the idempotent sink, and through the two-phase path (one checkpoint per
// batch), with idem on disk (b.TempDir) and fsync before acknowledging
// (SyncAlways, the default). They report events/s, and the process's CPU
// time per event (cpu-us/event: on a shared machine it depends on the
// share of the cores a run gets far less than events/s does).

func benchEvents(n int) []Event {
	evs := make([]Event, n)
	for i := range evs {
		evs[i] = Event{ID: []byte(fmt.Sprintf("bench-%09d", i)), Partition: "p", Offset: uint64(i + 1), Payload: []byte("amount=100")}
	}
	return evs
}

// benchStart resets the timer and returns when the measured part starts:
// the wall clock and the process's CPU time.
func benchStart(b *testing.B) (time.Time, time.Duration) {
	b.ResetTimer()
	return time.Now(), cputime.Process()
}

func reportRate(b *testing.B, start time.Time, cpu0 time.Duration) {
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "events/s")
	b.ReportMetric(float64((cputime.Process()-cpu0).Nanoseconds())/1e3/float64(b.N), "cpu-us/event")
}

// reportRecords reports the engine records (each fsynced, shared through
// group commit) written per event, a figure that does not depend on the
// disk, and the fsyncs they took (fewer when records share one).
func reportRecords(b *testing.B, e *idem.Engine, before uint64) {
	st := e.Stats()
	b.ReportMetric(float64(st.LastLSN-before)/float64(b.N), "records/event")
	b.ReportMetric(float64(st.WALSyncs)/float64(b.N), "fsyncs/event")
}

func benchEngine(b *testing.B) *idem.Engine {
	e, err := idem.Open(b.TempDir(), nil)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { e.Close() })
	return e
}

// BenchmarkConsumeNoIdem: the same loop (fetch, run the effect, ack) with
// no idem at all: at-least-once.
func BenchmarkConsumeNoIdem(b *testing.B) {
	w := newWorld()
	br := newMemBroker(w, benchEvents(b.N))
	l := newLedger(w)
	ctx := context.Background()
	start, cpu0 := benchStart(b)
	for !br.allAcked() {
		msgs, _ := br.Fetch(ctx, 64)
		for _, m := range msgs {
			if _, err := l.handler(ctx, m.Event); err != nil {
				b.Fatal(err)
			}
		}
		for _, m := range msgs {
			_ = m.Ack(ctx)
		}
	}
	reportRate(b, start, cpu0)
}

func benchSink(b *testing.B, batch, conc int) {
	w := newWorld()
	br := newMemBroker(w, benchEvents(b.N))
	l := newLedger(w)
	e := benchEngine(b)
	ctx := context.Background()
	s, err := NewSink(ctx, e, "bench", &SinkOptions{TTL: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	start, cpu0 := benchStart(b)
	if err := runUntilAcked(ctx, br, func(ctx context.Context, o ConsumeOptions) error {
		o.BatchSize, o.Concurrency = batch, conc
		return Consume(ctx, br, s, l.handler, &o)
	}); err != nil {
		b.Fatal(err)
	}
	reportRate(b, start, cpu0)
	reportRecords(b, e, 0)
}

// BenchmarkConsumeSink: the idempotent sink, 1,024 events per fetched
// batch (as BenchmarkConsumeTwoPhase1024's checkpoints), their handlers
// run 64 at once: the batch is claimed in one record and committed in
// another, each commit carrying its partition's frontier.
func BenchmarkConsumeSink(b *testing.B) { benchSink(b, 1024, 64) }

// BenchmarkEngineDo64: the engine alone, 64 goroutines each running Do of
// fresh ids (the same two fsynced records per event): what the disk allows
// right now, to put the sink's figure in perspective.
func BenchmarkEngineDo64(b *testing.B) {
	e := benchEngine(b)
	ctx := context.Background()
	var next atomic.Int64
	start, cpu0 := benchStart(b)
	var wg sync.WaitGroup
	for g := 0; g < 64; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1)
				if i > int64(b.N) {
					return
				}
				if _, err := e.Do(ctx, idem.Request{Scope: "bench", ID: []byte(fmt.Sprintf("bench-%09d", i))}, func(context.Context) ([]byte, error) {
					return []byte("ok"), nil
				}); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	reportRate(b, start, cpu0)
	reportRecords(b, e, 0)
}

func benchTwoPhase(b *testing.B, batch int) {
	w := newWorld()
	br := newMemBroker(w, benchEvents(b.N))
	l := newTxnLedger(w)
	e := benchEngine(b)
	ctx := context.Background()
	tp, _, err := NewTwoPhase[*ledgerTxn](ctx, e, "bench", l, &TwoPhaseOptions{})
	if err != nil {
		b.Fatal(err)
	}
	start, cpu0 := benchStart(b)
	if err := runUntilAcked(ctx, br, func(ctx context.Context, o ConsumeOptions) error {
		o.BatchSize = batch
		return ConsumeTwoPhase(ctx, br, tp, &o)
	}); err != nil {
		b.Fatal(err)
	}
	reportRate(b, start, cpu0)
	reportRecords(b, e, 0)
}

// BenchmarkConsumeTwoPhase256: one checkpoint per 256 events.
func BenchmarkConsumeTwoPhase256(b *testing.B) { benchTwoPhase(b, 256) }

// BenchmarkConsumeTwoPhase1024: one checkpoint per 1024 events.
func BenchmarkConsumeTwoPhase1024(b *testing.B) { benchTwoPhase(b, 1024) }

// BenchmarkEventRecordEncoder: encoding one event record without an
// outbox (the sink's and the two-phase coordinator's per-event record),
// reused across events as a batch reuses it.
func BenchmarkEventRecordEncoder(b *testing.B) {
	var enc eventRecordEncoder
	result := []byte("posted")
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if rec := enc.encode(result, 7, "partition-3", uint64(i)); len(rec) == 0 {
			b.Fatal("empty record")
		}
	}
}

// BenchmarkCheckpointRecord1024: sealing a checkpoint record of 1024
// events (16-byte ids, fingerprints) and 8 partitions; ns/event is the
// time per op over its events.
func BenchmarkCheckpointRecord1024(b *testing.B) {
	const events = 1024
	r := checkpointRecord{K: 1 << 20, Handle: []byte("txn-handle-0001"), Frontier: map[string]uint64{}}
	for i := range events {
		r.Events = append(r.Events, []byte(fmt.Sprintf("event-%010d", i)))
		r.Fingerprints = append(r.Fingerprints, make([]byte, 32))
	}
	for p := range 8 {
		r.Frontier[fmt.Sprintf("partition-%d", p)] = uint64(p) << 30
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := seal(&r, maxSealedBytes); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/events, "ns/event")
}
