package index

import (
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
)

// fakeCompactDB has `waiting` compactions and allows `allowed` at once.
type fakeCompactDB struct {
	mu               sync.Mutex
	allowed, waiting int
	started          []pebble.CompactionGrantHandle
}

func (d *fakeCompactDB) GetAllowedWithoutPermission() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.allowed
}

func (d *fakeCompactDB) GetWaitingCompaction() (bool, pebble.WaitingCompaction) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.waiting > 0, pebble.WaitingCompaction{}
}

func (d *fakeCompactDB) Schedule(h pebble.CompactionGrantHandle) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.waiting == 0 {
		return false
	}
	d.waiting--
	d.started = append(d.started, h)
	return true
}

func (d *fakeCompactDB) nStarted() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.started)
}

// The scheduler grants nothing before opened (what keeps pebble.Open from
// waiting for a compaction), then as many as allowed, and one more each
// time one is done; Unregister stops it and may be called twice.
func TestGatedScheduler(t *testing.T) {
	db := &fakeCompactDB{allowed: 2, waiting: 5}
	s := newGatedScheduler()
	s.Register(1, db)
	if ok, _ := s.TrySchedule(); ok {
		t.Fatal("TrySchedule granted before the gate opened")
	}
	s.UpdateGetAllowedWithoutPermission()
	// What the granter goroutine does on each tick or nudge, run here so
	// that the check does not depend on when that goroutine runs (after a
	// sleep, a starved granter let a scheduler that ignores the gate pass).
	s.grant()
	if n := db.nStarted(); n != 0 {
		t.Fatalf("%d compactions started before the gate opened", n)
	}
	s.opened()
	waitFor(t, func() bool { return db.nStarted() == 2 })
	s.grant()
	if n := db.nStarted(); n != 2 {
		t.Fatalf("%d compactions running, allowed 2", n)
	}
	if ok, _ := s.TrySchedule(); ok {
		t.Fatal("TrySchedule granted past the allowed concurrency")
	}
	db.started[0].Done()
	waitFor(t, func() bool { return db.nStarted() == 3 })
	s.Unregister()
	s.Unregister()
	db.started[1].Done()
	s.grant()
	if n := db.nStarted(); n != 3 {
		t.Fatalf("a compaction started after Unregister (%d)", n)
	}
	if ok, _ := s.TrySchedule(); ok {
		t.Fatal("TrySchedule granted after Unregister")
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached in 10 s")
		}
	}
}
