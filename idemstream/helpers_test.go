package idemstream

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
)

// errCrashed is what every external action returns once the simulated
// process has crashed: a dead process changes nothing anywhere.
var errCrashed = errors.New("test: process crashed")

// world is the simulated process and its crash: the idem directory is on a
// crashable in-memory FS; the external systems (broker, ledger) survive
// the crash, but reject anything the dead process tries after it.
//
// mu is a RWMutex: an action holds it for reading, so that the actions on
// different systems (a handler's ledger write and another batch's broker
// ack) run at once as they would in a real deployment, where no lock
// spans two systems; crash and restart hold it for writing, so a crash
// still falls between actions, never inside one.
type world struct {
	mu      sync.RWMutex // guards the fields below
	crashed bool
	mem     *vfs.MemFS
	clone   *vfs.MemFS
	crashes int
	dead    chan struct{} // closed by crash
	// oneAtATime: the process's store hides the engine's idem.Batcher, so
	// that the sinks run their batches one request at a time.
	oneAtATime bool
}

// store is the process's store over e.
func (w *world) store(e *idem.Engine) idem.Store {
	if w.oneAtATime {
		return &oneAtATime{e}
	}
	return e
}

// storePaths are the two ways the sinks write: batches of a Batcher, and
// one request at a time.
var storePaths = []struct {
	name       string
	oneAtATime bool
}{{"batch", false}, {"one-at-a-time", true}}

func newWorld() *world { return &world{mem: vfs.NewCrashableMem(), dead: make(chan struct{})} }

// deadCh is closed when the current process crashes.
func (w *world) deadCh() chan struct{} {
	w.mu.RLock()
	defer w.mu.RUnlock()
	return w.dead
}

// do runs fn as one external action of the live process.
func (w *world) do(fn func() error) error {
	w.mu.RLock()
	defer w.mu.RUnlock()
	if w.crashed {
		return errCrashed
	}
	return fn()
}

// crash takes the crash image (what was synced) and kills the process.
func (w *world) crash() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.crashed {
		w.crashed = true
		w.clone = w.mem.CrashClone(vfs.CrashCloneCfg{})
		w.crashes++
		close(w.dead)
	}
	return errCrashed
}

// restart starts a new process on the crash image.
func (w *world) restart() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.crashed {
		w.mem, w.clone, w.crashed = w.clone, nil, false
		w.dead = make(chan struct{})
	}
}

func openEngine(t testing.TB, fs vfs.FS, clock func() time.Time) *idem.Engine {
	t.Helper()
	e, err := idem.Open("db", &idem.Options{FS: fs, Clock: clock, KeepSnapshots: -1, Lease: time.Hour})
	if err != nil {
		t.Fatalf("open engine: %v", err)
	}
	return e
}

// memBroker is an in-memory stream with at-least-once delivery: Fetch
// hands out unacknowledged messages in order, wrapping around, so every
// delivery not acknowledged comes again. An ack takes no lock of the
// broker's (atomics): the consumers ack a batch from up to 64 goroutines
// at once, which on a real broker are independent round trips, not turns
// at one mutex (they queued on it, against the next batch's fetch).
type memBroker struct {
	w          *world
	mu         sync.Mutex // guards cursor and deliveries
	events     []Event
	acked      []atomic.Bool
	cursor     int
	deliveries int
	acks       atomic.Int64
	nacked     atomic.Int64  // distinct messages acked
	done       chan struct{} // closed when every message is acked
}

func newMemBroker(w *world, events []Event) *memBroker {
	return &memBroker{w: w, events: events, acked: make([]atomic.Bool, len(events)), done: make(chan struct{})}
}

// ackedCh is closed once every message is acked.
func (b *memBroker) ackedCh() <-chan struct{} { return b.done }

func (b *memBroker) Fetch(ctx context.Context, n int) ([]Message, error) {
	var out []Message
	err := b.w.do(func() error {
		b.mu.Lock()
		defer b.mu.Unlock()
		// Sized once: growing it by appends cost the benchmarks' batches
		// of 1024 more per message than NoIdem's of 64.
		out = make([]Message, 0, max(0, min(n, len(b.events)-int(b.nacked.Load()))))
		for scanned := 0; scanned < len(b.events) && len(out) < n; scanned++ {
			i := b.cursor
			b.cursor = (b.cursor + 1) % len(b.events)
			if b.acked[i].Load() {
				continue
			}
			b.deliveries++
			out = append(out, Message{Event: b.events[i], Ack: func(context.Context) error {
				return b.w.do(func() error {
					if b.acked[i].CompareAndSwap(false, true) && b.nacked.Add(1) == int64(len(b.events)) {
						close(b.done)
					}
					b.acks.Add(1)
					return nil
				})
			}})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if len(out) == 0 {
		select {
		case <-time.After(time.Millisecond):
		case <-ctx.Done():
		}
	}
	return out, nil
}

func (b *memBroker) allAcked() bool { return b.nacked.Load() == int64(len(b.events)) }

// makeEvents builds n distinct events over parts partitions with offsets
// that have gaps, plus dups producer-side duplicates (same id and payload
// at a later offset).
func makeEvents(n, parts, dups int) []Event {
	var evs []Event
	next := make([]uint64, parts)
	for i := 0; i < n; i++ {
		p := i % parts
		next[p] += uint64(1 + i%3) // gaps
		evs = append(evs, Event{ID: []byte(fmt.Sprintf("ev-%04d", i)), Partition: fmt.Sprintf("p%d", p), Offset: next[p], Payload: []byte(fmt.Sprintf("amount=%d", i))})
	}
	for d := 0; d < dups; d++ {
		src := evs[(d*7)%n]
		p := int(src.Partition[1] - '0')
		next[p]++
		evs = append(evs, Event{ID: src.ID, Partition: src.Partition, Offset: next[p], Payload: src.Payload})
	}
	return evs
}

// ledger is an external system with an effect per event (plan A): it
// counts applications per id, so a double effect is visible.
type ledger struct {
	w       *world
	mu      sync.Mutex
	applied map[string]int
	results map[string]string
}

func newLedger(w *world) *ledger {
	return &ledger{w: w, applied: map[string]int{}, results: map[string]string{}}
}

func (l *ledger) handler(ctx context.Context, ev Event) (Effect, error) {
	// The benchmarks' effect too (the same for NoIdem and the sinks): the
	// id's string made once, the result appended, not formatted. What
	// does not read the ledger is made before its lock, as a database's
	// client builds its statement before the row lock: the sink runs 64
	// handlers at once.
	id := string(ev.ID)
	res := append(append(append(make([]byte, 0, len(ev.Payload)+24), "posted "...), ev.Payload...), " #"...)
	err := l.w.do(func() error {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.applied[id]++
		res = strconv.AppendInt(res, int64(len(l.applied)), 10)
		if l.results[id] == "" {
			l.results[id] = string(res)
		}
		return nil
	})
	if err != nil {
		return Effect{}, err
	}
	return Effect{Result: res}, nil
}

// recoverFn asks the ledger whether an in-doubt event was applied.
func (l *ledger) recoverFn(ctx context.Context, d InDoubtEvent) (Resolution, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.applied[string(d.ID)] > 0 {
		return Resolution{Applied: true, Result: []byte(l.results[string(d.ID)])}, nil
	}
	return Resolution{}, nil
}

func checkExactlyOnce(t *testing.T, counts map[string]int, evs []Event) {
	t.Helper()
	want := map[string]bool{}
	for _, ev := range evs {
		want[string(ev.ID)] = true
	}
	var bad []string
	for id := range want {
		if counts[id] != 1 {
			bad = append(bad, fmt.Sprintf("%s x%d", id, counts[id]))
		}
	}
	for id, n := range counts {
		if !want[id] && n > 0 {
			bad = append(bad, fmt.Sprintf("unknown %s x%d", id, n))
		}
	}
	sort.Strings(bad)
	if len(bad) > 0 {
		t.Fatalf("effects not exactly once (%d of %d ids wrong): %v", len(bad), len(want), bad)
	}
}

func maxOffsets(evs []Event) map[string]uint64 {
	m := map[string]uint64{}
	for _, ev := range evs {
		if ev.Offset > m[ev.Partition] {
			m[ev.Partition] = ev.Offset
		}
	}
	return m
}

// waitApplied waits until the index has applied every record (cleanup
// reads the index).
func waitApplied(t testing.TB, e *idem.Engine) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		st := e.Stats()
		if st.AppliedLSN >= st.LastLSN {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("index stuck at LSN %d of %d", st.AppliedLSN, st.LastLSN)
		}
		time.Sleep(time.Millisecond)
	}
}
