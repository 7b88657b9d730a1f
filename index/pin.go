package index

import (
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2"
)

// Pebble deletes the tables a compaction made obsolete on the goroutine
// that drops the last reference to the last version holding them. With
// readers about, that is usually a lookup closing its iterator, and the
// deletion evicts each table's blocks from the block cache, yielding the
// processor (runtime.Gosched) after every five blocks so that other
// readers get the cache shard's lock. Under load every yield waits behind
// every runnable goroutine: right after a write burst (idem bench, 64
// callers on 2 cores) one duplicate Begin in each run stalled 750-850 ms
// evicting a compaction's inputs, every other request being fast.
//
// The read pin keeps the lookups off that path. Its goroutine holds an
// iterator (a reference to Pebble's read state, so to its version) opened
// when a compaction begins, ends, or a flush ends, and again pinDelay
// later; a newer pin replaces the older ones once they are pinDelay old.
// A compaction's inputs are in the version of every pin opened while it
// runs, so the last reference to them is a pin, closed on the pin's
// goroutine: that goroutine deletes the files and evicts their blocks, and
// a lookup only ever drops a reference that is not the last. Lookups outliving pinDelay (or a compaction that began and
// ended before its begin event reached the pin) are the exception: they
// still do the deletion, as every lookup could before.
//
// The cost: obsolete tables and flushed memtables are released pinDelay
// later than they would be, and the newest pin holds its version while the
// index is idle (no file becomes obsolete without an event, so nothing more
// is held).
type readPin struct {
	ix     *Index
	delay  atomic.Int64  // time.Duration (tests change it)
	events chan struct{} // a compaction began or ended, a flush ended
	stop   chan struct{}
	done   chan struct{}
}

// pinDelay is how long an older pin outlives the newest: long enough for
// the lookups that loaded its version (microseconds each) to finish.
const pinDelay = 20 * time.Millisecond

func newReadPin(ix *Index) *readPin {
	p := &readPin{ix: ix, events: make(chan struct{}, 1),
		stop: make(chan struct{}), done: make(chan struct{})}
	p.delay.Store(int64(pinDelay))
	return p
}

// signal tells the pin that a version may have changed. It never blocks:
// Pebble calls it from its event listener, holding its mutex.
func (p *readPin) signal() {
	select {
	case p.events <- struct{}{}:
	default:
	}
}

type pin struct {
	it     *pebble.Iterator
	opened time.Time
}

// start starts the pin's goroutine, once Pebble is open. The goroutine is
// counted among the calls in Pebble (Index.inPebble) until it has closed
// its pins, so that Close after a failure never closes Pebble under a pin.
func (p *readPin) start() {
	p.ix.inPebble.Add(1)
	go p.run()
}

func (p *readPin) run() {
	defer p.ix.inPebble.Add(-1)
	defer close(p.done)
	var (
		pins  []pin // oldest first
		timer = time.NewTimer(time.Hour)
	)
	timer.Stop()
	var due time.Time // when the timer fires; zero: not armed
	arm := func(d time.Duration) {
		if at := time.Now().Add(d); due.IsZero() || at.Before(due) {
			timer.Reset(d)
			due = at
		}
	}
	// add opens a pin on the current read state.
	add := func() bool {
		if p.ix.failure() != nil {
			return false // Pebble may hold its locks for good: open nothing
		}
		it, ok := p.open()
		if ok {
			pins = append(pins, pin{it: it, opened: time.Now()})
		}
		return ok
	}
	for {
		select {
		case <-p.events:
			if add() {
				arm(time.Duration(p.delay.Load()))
			}
		case <-timer.C:
			due = time.Time{}
			// A fresh pin on the current version first: the pin an event
			// opened may hold the version from before the change (Pebble
			// reports a compaction's end before it installs the result),
			// and the newest pin is the one kept.
			if !add() {
				continue
			}
			// Then every older pin that has outlived the delay.
			now, delay := time.Now(), time.Duration(p.delay.Load())
			keep := pins[:0]
			for i, q := range pins {
				if i < len(pins)-1 && now.Sub(q.opened) >= delay {
					p.close(q.it)
					continue
				}
				keep = append(keep, q)
			}
			clear(pins[len(keep):])
			pins = keep
			if len(pins) > 1 {
				arm(delay - now.Sub(pins[0].opened))
			}
		case <-p.stop:
			for _, q := range pins {
				p.close(q.it)
			}
			return
		}
	}
}

// open opens a pin: an iterator on the current read state, never
// positioned (it opens no table).
func (p *readPin) open() (*pebble.Iterator, bool) {
	it, err := p.ix.db.NewIter(&pebble.IterOptions{LowerBound: []byte{0}, UpperBound: []byte{0}})
	if err != nil {
		return nil, false
	}
	return it, true
}

// close closes a pin, deleting what it alone still held. After a
// background failure it may block for good on Pebble's mutex (a goroutine
// parked by Fatalf holding it); the goroutine then stays counted among the
// calls in Pebble, and Index.Close leaves Pebble open.
func (p *readPin) close(it *pebble.Iterator) { _ = it.Close() }

// shutdown closes every pin and ends the goroutine. It returns when that
// is done, or when the index has failed (the pins' closing may then never
// return: see close).
func (p *readPin) shutdown() {
	select {
	case <-p.stop:
	default:
		close(p.stop)
	}
	select {
	case <-p.done:
	case <-p.ix.bgFired:
	}
}
