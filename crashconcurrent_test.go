package idem

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/testclock"
	"github.com/idemdb/idem/internal/vfstest"
)

// TestCrashConcurrentClaims: racers (goroutines) Begin, Commit and Abort
// the same few ids at once, while a crash image is taken after every
// fsync (every other one keeping half of the unsynced blocks). In every
// round all racers go after the same three ids (a scope per round) until
// each is committed; a racer handed a claim holds it until another racer
// was told InFlight for it (so the racers really collide, every time), then
// commits it or (one time in three) aborts it.
//
// While it runs: at most one claim of an id is held at a time (no second
// Fresh during a lease), no Commit or Abort fails, a Done reply is the
// reply of the id's one successful commit. After each round every id was
// committed exactly once. Every image, recovered, must show for every id:
// an acknowledged commit with its reply; an acknowledged claim not yet
// finished in flight (in doubt), never absent; a commit under way in
// flight or done with its reply; otherwise absent or in flight (an abort
// or a claim under way), never a reply nobody committed.
func TestCrashConcurrentClaims(t *testing.T) {
	const (
		rounds  = 40
		racers  = 4
		perID   = 3
		maxImgs = 600
	)
	c := &raceCheck{states: make([]raceSlot, rounds*perID)}
	c.cond = sync.NewCond(&c.mu)
	mem := vfs.NewCrashableMem()
	fs := &vfstest.SyncHookFS{FS: mem, Hook: func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		if len(c.images) >= maxImgs {
			return
		}
		cfg := vfs.CrashCloneCfg{}
		if len(c.images)%2 == 1 {
			cfg = vfs.CrashCloneCfg{UnsyncedDataPercent: 50, RNG: rand.New(rand.NewPCG(uint64(len(c.images)), 3))}
		}
		c.images = append(c.images, raceImage{fs: mem.CrashClone(cfg), states: slices.Clone(c.states)})
	}}
	clk := testclock.New() // it never moves: no lease ends
	opts := &Options{Clock: clk.Now, SegmentSize: 16 << 10, IndexIngestBytes: 8 << 10, MemoryBudget: 32 << 20, IndexFilterBytes: 4 << 10}
	e := openMem(t, fs, opts)
	for round := range rounds {
		scope := fmt.Sprint("round-", round)
		var wg sync.WaitGroup
		for r := range racers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c.racer(e, scope, round*perID, perID, rand.New(rand.NewPCG(uint64(round), uint64(r))), fmt.Sprintf("%d-%d", round, r))
			}()
		}
		wg.Wait()
		if err := c.failure(); err != nil {
			e.Close()
			t.Fatal(err)
		}
		for i := range perID {
			st := c.states[round*perID+i]
			l, err := lookupID(e, scope, raceID(i))
			if st.commits != 1 || err != nil || l.Status != Done || string(l.Reply) != st.committed {
				e.Close()
				t.Fatalf("round %d id %d: %d commits, committed %q; Lookup %v %q %v", round, i, st.commits, st.committed, l.Status, l.Reply, err)
			}
		}
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	c.mu.Lock()
	images := c.images
	c.mu.Unlock()
	if len(images) < 100 {
		t.Fatalf("only %d crash images", len(images))
	}
	for n, img := range images {
		re, err := Open("db", &Options{FS: img.fs, Clock: clk.Now, MemoryBudget: 32 << 20, IndexFilterBytes: 4 << 10})
		if err != nil {
			t.Fatalf("image %d: open: %v", n, err)
		}
		for k, st := range img.states {
			scope, x := fmt.Sprint("round-", k/perID), raceID(k%perID)
			l, err := lookupID(re, scope, x)
			if err != nil {
				re.Close()
				t.Fatalf("image %d: lookup %s/%s: %v", n, scope, x, err)
			}
			if msg := st.allows(l); msg != "" {
				re.Close()
				t.Fatalf("image %d: %s/%s is %v %q: %s", n, scope, x, l.Status, l.Reply, msg)
			}
		}
		if err := re.Close(); err != nil {
			t.Fatalf("image %d: close: %v", n, err)
		}
	}
	t.Logf("%d rounds of %d racers on %d ids: %d claims handed out, %d aborted; %d crash images recovered and checked", rounds, racers, perID, c.claims, c.aborts, len(images))
}

func raceID(i int) []byte { return []byte(fmt.Sprint("id-", i)) }

// raceSlot is what the racers acknowledged for one id.
type raceSlot struct {
	committed  string // reply of the commit that returned ("" none yet)
	committing string // reply of a Commit called and not returned
	claimed    bool   // a Fresh claim handed out, its Commit or Abort not called yet
	aborting   bool   // an Abort called and not returned
	commits    int    // successful commits
	holders    int    // claims held right now (at most 1)
	gen        int    // claims handed out
	seen       int    // the newest claim another racer was told InFlight for
}

// allows says what is wrong with a recovered id's Lookup, or "".
func (s raceSlot) allows(l Result) string {
	switch {
	case s.committed != "":
		if l.Status != Done || string(l.Reply) != s.committed {
			return fmt.Sprintf("the acknowledged commit %q is lost", s.committed)
		}
	case s.committing != "":
		if !(l.Status == InFlight || l.Status == Done && string(l.Reply) == s.committing) {
			return fmt.Sprintf("want in flight or done %q (a claim acknowledged, its commit under way)", s.committing)
		}
	case s.claimed:
		if l.Status != InFlight {
			return "an acknowledged claim is not in flight (it could run twice)"
		}
	default:
		if l.Status == Done {
			return "a reply nobody committed"
		}
	}
	return ""
}

type raceImage struct {
	fs     *vfs.MemFS
	states []raceSlot
}

type raceCheck struct {
	mu      sync.Mutex
	cond    *sync.Cond // signalled whenever a slot changes
	states  []raceSlot
	version int // bumped with every change
	images  []raceImage
	err     error
	claims  int
	aborts  int
}

func (c *raceCheck) failure() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// failLocked records the first violation and wakes every racer to stop.
func (c *raceCheck) failLocked(format string, args ...any) {
	if c.err == nil {
		c.err = fmt.Errorf(format, args...)
	}
	c.cond.Broadcast()
}

func (c *raceCheck) changedLocked() {
	c.version++
	c.cond.Broadcast()
}

// racer goes after ids base..base+n-1 of scope, in its own order, until
// each is committed.
func (c *raceCheck) racer(e *Engine, scope string, base, n int, rng *rand.Rand, name string) {
	order := rng.Perm(n)
	for _, i := range order {
		x := raceID(i)
		s := &c.states[base+i]
		for attempt := 0; ; attempt++ {
			c.mu.Lock()
			if c.err != nil {
				c.mu.Unlock()
				return
			}
			v := c.version
			c.mu.Unlock()
			res, err := e.Begin(bg, Request{Scope: scope, ID: x})
			if err != nil {
				c.mu.Lock()
				c.failLocked("racer %s: begin %s/%s: %v", name, scope, x, err)
				c.mu.Unlock()
				return
			}
			switch res.Status {
			case Done:
				c.mu.Lock()
				if string(res.Reply) != s.committed && string(res.Reply) != s.committing {
					c.failLocked("racer %s: %s/%s is done with %q; committed %q, committing %q", name, scope, x, res.Reply, s.committed, s.committing)
				}
				c.mu.Unlock()
			case InFlight:
				// Tell the holder it was seen, and wait for the id to change
				// (the holder recorded, finished or aborted it) before asking
				// again.
				c.mu.Lock()
				s.seen = max(s.seen, s.gen)
				c.cond.Broadcast()
				for c.version == v && c.err == nil {
					c.cond.Wait()
				}
				c.mu.Unlock()
				continue
			case Fresh:
				c.mu.Lock()
				c.claims++
				s.holders++
				if s.holders > 1 {
					c.failLocked("racer %s: a second Fresh for %s/%s while another claim is held (lease not over)", name, scope, x)
					c.mu.Unlock()
					return
				}
				s.gen++
				g := s.gen
				s.claimed = true
				c.changedLocked()
				for s.seen < g && c.err == nil {
					c.cond.Wait()
				}
				commit := rng.IntN(3) != 0
				reply := fmt.Sprintf("racer %s attempt %d", name, attempt)
				s.holders--
				s.claimed = false
				if commit {
					s.committing = reply
				} else {
					s.aborting = true
					c.aborts++
				}
				c.mu.Unlock()
				if commit {
					err = res.Claim.Commit(bg, []byte(reply))
				} else {
					err = res.Claim.Abort(bg)
				}
				c.mu.Lock()
				if err != nil {
					c.failLocked("racer %s: finish %s/%s (commit %v): %v", name, scope, x, commit, err)
				} else if commit {
					s.committed, s.committing = reply, ""
					s.commits++
				} else {
					s.aborting = false
				}
				c.changedLocked()
				c.mu.Unlock()
				if !commit {
					continue
				}
			}
			break
		}
	}
}
