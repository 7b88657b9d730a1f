package index

import (
	"sync"
	"time"

	"github.com/cockroachdb/pebble/v2"
)

// gatedScheduler is Pebble's compaction scheduler: it grants as many
// compactions as the DB allows (DBForCompaction.GetAllowedWithoutPermission),
// when asked (TrySchedule), when one finishes (Done) and every 100 ms, as
// Pebble's default ConcurrencyLimitScheduler does, but grants nothing until
// opened() is called after pebble.Open returned.
//
// Why: pebble.Open registers the scheduler, whose granter may start a
// compaction while Open is still running, and Open then waits for every
// running compaction to finish before it lists obsolete files
// (DB.scanObsoleteFiles). Right after a burst of random inserts the LSM owes
// compactions that take seconds, so a reopen took 2.4 s instead of 25 ms
// (2 million random ids, Compact, Close, Open; the goroutine dump of the
// slow Open waits in scanObsoleteFiles). With the gate, Open never waits for
// a compaction, and the owed ones start right after it.
//
// It is written here rather than wrapped around Pebble's default because
// that one's constructor with periodic granting is not exported (Open makes
// it only when Options.Experimental.CompactionScheduler is nil).
type gatedScheduler struct {
	db    pebble.DBForCompaction
	unreg sync.Once
	stop  chan struct{}
	poke  chan struct{}
	done  chan struct{}

	mu           sync.Mutex
	cond         *sync.Cond // signalled when granting ends
	open         bool
	unregistered bool
	granting     bool
	running      int
}

func newGatedScheduler() *gatedScheduler {
	s := &gatedScheduler{stop: make(chan struct{}), poke: make(chan struct{}, 1), done: make(chan struct{})}
	s.cond = sync.NewCond(&s.mu)
	return s
}

// Register implements pebble.CompactionScheduler.
func (s *gatedScheduler) Register(_ int, db pebble.DBForCompaction) {
	s.db = db
	go s.granter()
}

// Unregister implements pebble.CompactionScheduler: no call into the DB
// runs or starts once it returns. Idempotent (Open calls it too when
// pebble.Open failed after registering).
func (s *gatedScheduler) Unregister() {
	s.unreg.Do(func() {
		if s.db != nil {
			close(s.stop)
			<-s.done
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		s.unregistered = true
		for s.granting {
			s.cond.Wait()
		}
	})
}

// TrySchedule implements pebble.CompactionScheduler.
func (s *gatedScheduler) TrySchedule() (bool, pebble.CompactionGrantHandle) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.open || s.unregistered || s.db.GetAllowedWithoutPermission() <= s.running {
		return false, nil
	}
	s.running++
	return true, s
}

// UpdateGetAllowedWithoutPermission implements pebble.CompactionScheduler.
func (s *gatedScheduler) UpdateGetAllowedWithoutPermission() { s.nudge() }

func (s *gatedScheduler) nudge() {
	select {
	case s.poke <- struct{}{}:
	default:
	}
}

// opened lets compactions start (the ones owed start now).
func (s *gatedScheduler) opened() {
	s.mu.Lock()
	s.open = true
	s.mu.Unlock()
	s.nudge()
}

// The grant handle (one per granted compaction; they share the counters).
func (s *gatedScheduler) Started()                                          {}
func (s *gatedScheduler) MeasureCPU(pebble.CompactionGoroutineKind)         {}
func (s *gatedScheduler) CumulativeStats(pebble.CompactionGrantHandleStats) {}
func (s *gatedScheduler) Done() {
	s.mu.Lock()
	s.running--
	s.mu.Unlock()
	s.nudge()
}

func (s *gatedScheduler) granter() {
	defer close(s.done)
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		case <-s.poke:
		}
		s.grant()
	}
}

// grant starts waiting compactions up to the allowed concurrency.
func (s *gatedScheduler) grant() {
	s.mu.Lock()
	if !s.open || s.unregistered || s.granting {
		s.mu.Unlock()
		return
	}
	n := s.db.GetAllowedWithoutPermission() - s.running
	if n <= 0 {
		s.mu.Unlock()
		return
	}
	s.granting = true
	s.mu.Unlock()
	for ; n > 0; n-- {
		if waiting, _ := s.db.GetWaitingCompaction(); !waiting {
			break
		}
		// Count the compaction before Schedule starts it: its Done may
		// come before Schedule returns.
		s.mu.Lock()
		s.running++
		s.mu.Unlock()
		if !s.db.Schedule(s) {
			s.mu.Lock()
			s.running--
			s.mu.Unlock()
			break
		}
	}
	s.mu.Lock()
	s.granting = false
	s.cond.Broadcast()
	s.mu.Unlock()
}
