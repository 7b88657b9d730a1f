package fuzz

import (
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/testclock"
)

// progReader reads a program from the fuzzer's bytes; past the end it
// reads zeros, and done says the program is over.
type progReader struct {
	b []byte
	i int
}

func (p *progReader) next() byte {
	if p.i >= len(p.b) {
		p.i++
		return 0
	}
	c := p.b[p.i]
	p.i++
	return c
}

func (p *progReader) n(k int) int { return int(p.next()) % k }
func (p *progReader) done() bool  { return p.i >= len(p.b) }

// configFrom decodes a program's first byte.
func configFrom(b byte) config {
	c := config{lease: time.Minute, keepSnapshots: 2}
	if b&1 != 0 {
		c.retention = time.Hour
	}
	if b&4 != 0 {
		c.keepSnapshots = -1
	}
	c.segmentSize = []int64{4 << 10, 16 << 10, 256 << 10, 2 << 10}[(b>>3)&3]
	if b&0xc0 == 0xc0 {
		c.syncNever = true
	}
	if b&0xc0 == 0x40 {
		// opDoID2 runs a batch of requests (runner.batch) instead.
		c.batches = true
	}
	if b&2 != 0 {
		c.cacheSize = 4 << 10 // slots are evicted and reloaded from the index all the time
		// and a 64-byte key filter (about 50 keys): false positives and
		// background rebuilds all the time under those reloads.
		c.filterBytes = 64
	}
	if b&0x20 != 0 {
		c.ingestBytes = 1 // every applied batch is ingested into Pebble at once
	}
	return c
}

const (
	maxSteps   = 160
	maxRestart = 12 // crashes and reopens per program: each costs an index open
)

// Opcodes of a program step (the byte modulo numOps).
const (
	opBeginID = iota
	opBeginIDAcked
	opBeginID2
	opCommit
	opCommit2
	opAbort
	opDoID
	opDoID2
	opBeginSeq
	opDoSeq
	opAck
	opForget
	opAdvance
	opSnapshot
	opCompact
	opReopen
	opResolve
	opCrashNow
	opArmCrash
	opCheck
	numOps
)

var fps = [][]byte{nil, nil, []byte("fp1"), []byte("fp2")}

// runProgram interprets data as a program and runs it. It returns the
// first violation (or unexpected error) with the program's trace.
func runProgram(data []byte, st *counters) error {
	_, err := runProgramWith(data, st, nil)
	return err
}

// traceAll, set by IDEM_FUZZ_TRACE=1, prints every program's trace.
var traceAll = os.Getenv("IDEM_FUZZ_TRACE") != ""

// runProgramWith is runProgram with a hook to set the runner up; it returns
// the program's clock at the end.
func runProgramWith(data []byte, st *counters, setup func(*runner)) (end time.Time, err error) {
	p := &progReader{b: data}
	cfg := configFrom(p.next())
	seed := crc32.ChecksumIEEE(data)
	r := newRunner(cfg, uint64(seed), st)
	if setup != nil {
		setup(r)
	}
	r.logf("config %v", cfg)
	defer func() {
		end = r.clk.Now()
		_ = r.closeEngine(false)
		if traceAll {
			fmt.Fprintf(os.Stderr, "---- program of %d bytes (err %v):\n%s\n", len(data), err, r.traceTail(1000))
		}
		if err != nil {
			err = fmt.Errorf("%w\nprogram trace (last steps):\n%s", err, r.traceTail(60))
		}
	}()
	if err := r.openAndMatch([]*model{r.m.clone()}); err != nil {
		return end, err
	}
	restarts := 0
	for step := 0; step < maxSteps && !p.done(); step++ {
		st.add(func(c *counters) { c.ops++ })
		op := p.n(numOps)
		scope := modelScopes[p.n(len(modelScopes))]
		var err error
		switch op {
		case opBeginID, opBeginID2:
			err = r.begin(scope, modeID, modelIDs[p.n(len(modelIDs))], 0, fps[p.n(len(fps))], nil)
		case opBeginIDAcked:
			id := modelIDs[p.n(len(modelIDs))]
			mask := p.next()
			var acked []string
			for i, a := range modelIDs {
				if mask&(1<<i) != 0 && a != id {
					acked = append(acked, a)
				}
			}
			if mask&0x80 != 0 && id != "a" {
				acked = append(acked, "unknown-id")
			}
			err = r.begin(scope, modeID, id, 0, fps[p.n(len(fps))], acked)
		case opCommit, opCommit2:
			err = r.finish(p.n(8), true, p.n(4))
		case opAbort:
			err = r.finish(p.n(8), false, 0)
		case opDoID2:
			if cfg.batches {
				err = r.batch(p)
				break
			}
			fallthrough
		case opDoID:
			id := modelIDs[p.n(len(modelIDs))]
			fp := fps[p.n(len(fps))]
			b := p.next()
			err = r.do(scope, modeID, id, 0, fp, b&7 == 7, int(b>>3)%4)
		case opBeginSeq:
			c := modelClients[p.n(len(modelClients))]
			last := r.m.clientState(scope, c)
			d := p.n(6)
			seq := max(int64(last)+[]int64{1, 1, 0, -1, 2, 1}[d], 1)
			err = r.begin(scope, modeClient, c, uint64(seq), fps[p.n(len(fps))], nil)
		case opDoSeq:
			c := modelClients[p.n(len(modelClients))]
			b := p.next()
			seq := r.m.clientState(scope, c) + 1
			if b&8 != 0 {
				seq-- // a retry of the last one (Done while its reply is kept)
			}
			if seq == 0 {
				seq = 1
			}
			err = r.do(scope, modeClient, c, seq, fps[p.n(len(fps))], b&7 == 7, int(b>>4)%4)
		case opAck:
			mask := p.next()
			var ids []string
			for i, a := range modelIDs {
				if mask&(1<<i) != 0 {
					ids = append(ids, a)
				}
			}
			if len(ids) > 0 {
				err = r.ack(scope, ids)
			}
		case opForget:
			err = r.forget([]time.Duration{0, 30 * time.Second, 2 * time.Minute, time.Hour, 2 * time.Hour, -time.Minute}[p.n(6)])
		case opAdvance:
			r.advance([]time.Duration{time.Second, time.Nanosecond, 10 * time.Second, time.Minute + time.Second, 20 * time.Minute, 61 * time.Minute}[p.n(6)])
		case opSnapshot:
			err = r.snapshotRestore()
		case opCompact:
			err = r.compact()
		case opReopen:
			if restarts++; restarts <= maxRestart {
				err = r.reopen()
			}
		case opResolve:
			b := p.next()
			err = r.resolve(int(b>>2), b&3 != 0, int(b>>4)%4)
		case opCrashNow:
			pct := []int{0, 0, 30, 70, 100}[p.n(5)]
			if restarts++; restarts <= maxRestart {
				err = r.crashNow(pct)
			}
		case opArmCrash:
			n := 1 + p.n(6)
			pct := []int{0, 0, 50, 100}[p.n(4)]
			if restarts++; restarts <= maxRestart {
				r.arm(n, pct)
			}
			continue // the next step runs armed
		case opCheck:
			err = r.wait(scope, modelIDs[p.n(len(modelIDs))])
		}
		if err == nil {
			err = r.fired()
		}
		if err == nil {
			err = r.check()
		}
		if err != nil {
			return end, err
		}
		r.record()
	}
	// The end: a clean reopen, then a crash, must both give the model.
	if err := r.reopen(); err != nil {
		return end, err
	}
	return end, r.crashNow(0)
}

// FuzzCrashRecovery runs the fuzzer's bytes as a program of idem calls
// (Begin, Commit, Abort, Do, sequence requests, Ack, Forget, Snapshot +
// Restore, Compact, Close/reopen, in-doubt resolution, time passing, crashes
// between steps and inside fsyncs) against the reference model. After every
// step, and after every crash recovery, the engine's whole observable state
// (Lookup of every id, ClientState and sequence-mode Lookup of every client, InDoubt)
// must equal the model's; inside a step it must equal the state before or
// after the step. That covers the invariants: committed replies survive
// exactly, no id is Fresh while committed or in doubt, acked / forgotten /
// expired entries stay gone, sequence state matches, Lookup matches.
func FuzzCrashRecovery(f *testing.F) {
	for _, s := range crashSeeds() {
		f.Add(s)
	}
	st := &counters{}
	f.Cleanup(func() {
		f.Logf("FuzzCrashRecovery: %d steps, %d crash images recovered and checked (%d taken inside an fsync), %d opens, %d snapshot restores, %d state checks, 0 violations",
			st.ops, st.crashImages, st.hookImages, st.reopens, st.restores, st.stateChecks)
	})
	statsPath := os.Getenv("IDEM_FUZZ_STATS")
	execs := 0
	f.Fuzz(func(t *testing.T, data []byte) {
		if err := runProgram(data, st); err != nil {
			t.Fatal(err)
		}
		if statsPath != "" {
			// Each fuzzing worker is a process of its own: it keeps its
			// totals in a file of its own (see README.md).
			execs++
			st.mu.Lock()
			line := fmt.Sprintf("execs %d steps %d crash_images %d hook_images %d opens %d restores %d state_checks %d\n",
				execs, st.ops, st.crashImages, st.hookImages, st.reopens, st.restores, st.stateChecks)
			st.mu.Unlock()
			_ = os.WriteFile(fmt.Sprintf("%s.%d", statsPath, os.Getpid()), []byte(line), 0o644)
		}
	})
}

// prog builds seed programs.
type prog []byte

func (p prog) op(op int, args ...byte) prog {
	return append(append(p, byte(op)), args...)
}

// crashSeeds are hand-written programs that reach the interesting corners,
// plus random ones; the corpus in testdata/fuzz/FuzzCrashRecovery holds
// more (and every crasher ever found).
func crashSeeds() [][]byte {
	var seeds [][]byte
	// Ids: begin, commit, retry, crash, conflict, ack via a request, forget.
	seeds = append(seeds, prog{0}.
		op(opBeginID, 0, 0, 2).op(opCommit, 0, 0, 1).op(opBeginID, 0, 0, 0).
		op(opBeginID, 1, 1, 0).op(opCrashNow, 0, 2).op(opBeginID, 1, 1, 0).
		op(opResolve, 0, 0x05).op(opBeginID, 0, 0, 3).
		op(opDoID, 0, 2, 0, 0x08).op(opBeginIDAcked, 0, 3, 0x05, 0).op(opCommit, 0, 0, 2).
		op(opAck, 0, 0x3f).op(opAdvance, 0, 3).op(opForget, 0, 0).op(opCheck, 0))
	// Sequence mode: gaps, already committed, abort consumes nothing, retry.
	seeds = append(seeds, prog{0}.
		op(opBeginSeq, 1, 0, 4, 0).op(opBeginSeq, 1, 0, 0, 0).op(opAbort, 1, 0).
		op(opBeginSeq, 1, 0, 0, 2).op(opCommit, 1, 0, 1).op(opBeginSeq, 1, 0, 2, 0).
		op(opDoSeq, 1, 0, 0x10, 0).op(opDoSeq, 1, 0, 0x08, 0).op(opBeginSeq, 1, 0, 3, 0).
		op(opArmCrash, 0, 1, 0).op(opDoSeq, 1, 1, 0x20, 0).op(opReopen, 0).
		op(opBeginSeq, 1, 1, 0, 0).op(opResolve, 0, 0x01))
	// Retention and leases with the fake clock, snapshot + restore, compact.
	seeds = append(seeds, prog{1}.
		op(opDoID, 0, 0, 0, 0x10).op(opDoSeq, 0, 0, 0x10, 0).op(opBeginID, 0, 1, 0).
		op(opAdvance, 0, 4).op(opSnapshot, 0).op(opAdvance, 0, 4).op(opAdvance, 0, 4).
		op(opBeginID, 0, 0, 0).op(opBeginSeq, 0, 0, 2, 0).op(opCompact, 0).
		op(opBeginID, 0, 1, 0).op(opAdvance, 0, 3).op(opBeginID, 0, 1, 0).op(opCommit, 0, 1, 2).
		op(opCrashNow, 0, 3).op(opSnapshot, 0).op(opCompact, 0).op(opReopen, 0))
	// Crashes inside fsyncs of commits, compactions and reopens, tearing
	// unsynced writes; small segments so that rotation happens.
	seeds = append(seeds, prog{0x18}.
		op(opDoID, 0, 0, 0, 0x10).op(opDoID, 1, 1, 0, 0x10).op(opArmCrash, 0, 2, 2).op(opDoID, 2, 2, 0, 0x18).
		op(opBeginID, 0, 3, 0).op(opArmCrash, 0, 1, 2).op(opCommit, 0, 0, 2).op(opArmCrash, 0, 3, 3).op(opCompact, 0).
		op(opArmCrash, 0, 2, 2).op(opReopen, 0).op(opDoID, 0, 4, 0, 0x10).op(opCrashNow, 0, 3))
	// Batches (config 0x40: opDoID2 is a batch): Begin and Put of ids and
	// sequence numbers, the same key twice in one batch, Commit and Abort
	// of held claims in a batch, Ack; crashes inside their fsyncs.
	seeds = append(seeds, prog{0x40}.
		op(opBeginID, 0, 0, 0).op(opBeginSeq, 0, 0, 0, 0).
		// 6 items: put b (fresh), begin b (done: the put before it),
		// commit a, put c1's next number (in flight), ack a, begin a
		// (fresh: acked just before).
		op(opDoID2, 0, 5, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 0, 0, 4, 0, 0, 2,
			0, 1, 3, 0, 0, 0, 0, 6, 1, 0, 0, 0, 0, 0).
		op(opArmCrash, 0, 0, 2).
		// 3 items: put s1/c (fresh), put s1/c with another fingerprint
		// (conflict), commit c1's claim.
		op(opDoID2, 0, 2, 1, 0, 1, 2, 2, 1, 1, 0, 1, 2, 3, 0, 4, 0, 0, 1).
		op(opCrashNow, 0, 3).
		// 2 items: put c1's next number twice (fresh, then done).
		op(opDoID2, 0, 1, 0, 1, 3, 0, 0, 0, 1, 0, 1, 3, 0, 2, 0))
	// Sync-never mode: process crashes only.
	seeds = append(seeds, prog{0xc0}.
		op(opDoID, 0, 0, 0, 0x10).op(opBeginSeq, 2, 1, 0, 0).op(opCrashNow, 0, 0).
		op(opResolve, 0, 0x11).op(opDoID, 0, 1, 0, 0x10).op(opArmCrash, 0, 1, 0).op(opReopen, 0))
	rng := rand.New(rand.NewPCG(42, 42))
	for i := 0; i < 8; i++ {
		b := make([]byte, 60+rng.IntN(200))
		for j := range b {
			b[j] = byte(rng.Uint32())
		}
		seeds = append(seeds, b)
	}
	return seeds
}

// TestCrashAtEverySyncPoint runs fixed random programs and takes a crash
// image at every fsync (alternately with no unsynced data kept and with
// some kept, which tears writes); every image is recovered and must hold
// one of the states the model allows at that moment. Every one: none is
// skipped however many fsyncs a program makes (their number varies by a
// few with the engine's goroutines), and the test fails if an fsync's
// image was not checked.
func TestCrashAtEverySyncPoint(t *testing.T) {
	st := &counters{}
	checked := 0
	// Config bytes (see configFrom): plain; retention with a tiny cache and
	// 16 KiB segments; no snapshots and 2 KiB segments; SyncNever (process
	// crashes only); retention with 256 KiB segments; a tiny cache with
	// 2 KiB segments; then the first two again with every applied batch
	// ingested into the index as an sstable; then batches (opDoID2 runs a
	// Batch), plain and with retention, a tiny cache and every applied
	// batch ingested. Odd seeds keep half of the unsynced blocks.
	configs := []byte{0x00, 0x0b, 0x1c, 0xc0, 0x11, 0x1a, 0x20, 0x2b, 0x40, 0x6b}
	for seed := uint64(1); seed <= 2*uint64(len(configs)); seed++ {
		type image struct {
			fs    *vfs.MemFS
			cands []*model
		}
		var (
			mu     sync.Mutex
			images []image
		)
		rng := rand.New(rand.NewPCG(seed, 9))
		data := make([]byte, 500)
		for i := range data {
			data[i] = byte(rng.Uint32())
		}
		// No crashes or reopens inside the program: the images are the crashes.
		data[0] = configs[(seed-1)%uint64(len(configs))]
		for i := 1; i < len(data); i++ {
			switch int(data[i]) % numOps {
			case opCrashNow, opArmCrash, opReopen:
				data[i] = opCheck
			}
		}
		n := 0
		every := func(img *vfs.MemFS, cands []*model) {
			mu.Lock()
			defer mu.Unlock()
			n++
			images = append(images, image{img, cands})
		}
		end, err := runProgramWith(data, st, func(r *runner) {
			r.hookMu.Lock()
			r.every = every
			r.armCfg = int(seed%2) * 50
			r.hookMu.Unlock()
		})
		if err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		imgs, syncs := images, n
		mu.Unlock()
		if len(imgs) != syncs || syncs == 0 {
			t.Fatalf("seed %d: %d fsyncs, %d images kept: every fsync's image must be checked", seed, syncs, len(imgs))
		}
		cfg := configFrom(data[0])
		for i, img := range imgs {
			r := newRunner(cfg, seed, st)
			r.mem = img.fs
			r.clk.Advance(end.Sub(testclock.Epoch)) // model and engine answer at the same time
			if err := r.openAndMatch(img.cands); err != nil {
				t.Fatalf("seed %d image %d of %d: %v", seed, i, len(imgs), err)
			}
			_ = r.closeEngine(false)
			imgs[i] = image{} // its memory can go
			checked++
		}
		t.Logf("seed %d: %d fsyncs, %d images checked", seed, syncs, len(imgs))
	}
	t.Logf("TestCrashAtEverySyncPoint: %d crash images recovered and checked, 0 violations", checked)
}
