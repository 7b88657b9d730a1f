package fuzz

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/internal/testclock"
	"github.com/idemdb/idem/internal/vfstest"
)

// config is one program's engine configuration.
type config struct {
	retention     time.Duration
	lease         time.Duration
	segmentSize   int64
	keepSnapshots int
	syncNever     bool  // SyncNever: only process crashes are survivable
	cacheSize     int64 // 0: the default
	ingestBytes   int64 // 0: the default
	filterBytes   int64 // 0: the default
	batches       bool  // opDoID2 runs a batch (Batch.Run) instead
}

func (c config) String() string {
	return fmt.Sprintf("retention=%v lease=%v segment=%d keepSnapshots=%d syncNever=%v cache=%d",
		c.retention, c.lease, c.segmentSize, c.keepSnapshots, c.syncNever, c.cacheSize) +
		fmt.Sprintf(" ingest=%d filter=%d batches=%v", c.ingestBytes, c.filterBytes, c.batches)
}

func (c config) options(fs vfs.FS, clk *testclock.Clock) *idem.Options {
	o := &idem.Options{
		FS:              fs,
		Clock:           clk.Now,
		Lease:           c.lease,
		Retention:       c.retention,
		SegmentSize:     c.segmentSize,
		KeepSnapshots:   c.keepSnapshots,
		CleanupInterval: 1000 * time.Hour, // only Compact retires, when the program says
		CompactInterval: 1000 * time.Hour,
		CacheSize:       c.cacheSize,
		// Tiny: every applied batch becomes an sstable ingested into
		// Pebble, so crashes land in the middle of ingests.
		IndexIngestBytes: c.ingestBytes,
		IndexFilterBytes: c.filterBytes,
	}
	if c.syncNever {
		o.Sync = idem.SyncNever
	}
	return o
}

// counters are the evidence the tests report.
type counters struct {
	mu           sync.Mutex
	ops          int
	crashImages  int // crash images recovered and checked
	hookImages   int // of which taken inside an fsync
	reopens      int
	restores     int
	stateChecks  int
	uncertainOps int
	// parkedIndexes counts recoveries on the same disk refused with
	// ErrLocked because Pebble parked itself after a fatal failure.
	parkedIndexes int
}

func (c *counters) add(f func(c *counters)) {
	c.mu.Lock()
	f(c)
	c.mu.Unlock()
}

// violation is an invariant the engine broke.
type violation struct{ msg string }

func (v *violation) Error() string { return v.msg }

func violationf(format string, args ...any) error {
	return &violation{fmt.Sprintf(format, args...)}
}

// uncertain is returned by a step when the engine reported an error the
// model did not predict (an injected fault): the step may or may not have
// happened, so the state is one of cands.
type uncertain struct {
	err   error
	cands []*model
}

func (u *uncertain) Error() string { return fmt.Sprintf("unexpected error: %v", u.err) }

// Unwrap lets errors.Is see the engine's error.
func (u *uncertain) Unwrap() error { return u.err }

// openClaim is a claim handle the program holds.
type openClaim struct {
	c   *idem.Claim
	k   mkey
	tok int
}

// runner executes steps against an engine and the model, checking every
// result and, after every step, the whole observable state.
type runner struct {
	cfg   config
	clk   *testclock.Clock
	mem   *vfs.MemFS
	wrap  func(*vfs.MemFS) vfs.FS // the FS the engine sees over mem
	e     *idem.Engine
	m     *model
	open  []openClaim
	trace []string
	st    *counters
	rng   *rand.Rand // guarded by hookMu: crash images' choice of unsynced blocks
	seq   int        // step counter, for replies
	hist  []histEntry

	hookMu sync.Mutex
	cands  []*model // guarded by hookMu: what a crash image taken now may hold
	armed  int      // guarded by hookMu: take an image at the armed-th sync from now; 0 = off
	armCfg int      // guarded by hookMu: unsynced percent for that image
	image  *vfs.MemFS
	imgC   []*model
	// every, if set, receives an image at every sync (TestCrashAtEverySyncPoint).
	every func(img *vfs.MemFS, cands []*model)
}

// histEntry is the state after the record at lsn: a snapshot covering
// exactly lsn must restore it.
type histEntry struct {
	lsn uint64
	m   *model
}

// record notes the state after the last record appended.
func (r *runner) record() {
	lsn := r.e.Stats().LastLSN
	for len(r.hist) > 0 && r.hist[len(r.hist)-1].lsn > lsn {
		r.hist = r.hist[:len(r.hist)-1] // records lost in a crash: their LSNs are used again
	}
	r.hist = append(r.hist, histEntry{lsn, r.m.clone()})
}

const dbDir = "db"

func newRunner(cfg config, seed uint64, st *counters) *runner {
	r := &runner{cfg: cfg, clk: testclock.New(), mem: vfs.NewCrashableMem(), st: st,
		rng: rand.New(rand.NewPCG(seed, 0x1de)), m: newModel(cfg.retention, cfg.lease)}
	r.wrap = func(m *vfs.MemFS) vfs.FS { return &vfstest.SyncHookFS{FS: m, Hook: r.onSync} }
	r.cands = []*model{r.m.clone()}
	return r
}

func (r *runner) logf(format string, args ...any) {
	r.trace = append(r.trace, fmt.Sprintf(format, args...))
}

func (r *runner) traceTail(n int) string {
	t := r.trace
	if len(t) > n {
		t = t[len(t)-n:]
	}
	return strings.Join(t, "\n")
}

func (r *runner) now() int64 { return r.clk.Now().UnixNano() }

// onSync runs inside a successful fsync on whatever goroutine made it.
func (r *runner) onSync() {
	r.hookMu.Lock()
	defer r.hookMu.Unlock()
	pct := r.armCfg
	if r.cfg.syncNever {
		pct = 100
	}
	if r.every != nil {
		cfg := vfs.CrashCloneCfg{}
		if pct > 0 {
			cfg = vfs.CrashCloneCfg{UnsyncedDataPercent: pct, RNG: rand.New(rand.NewPCG(r.rng.Uint64(), 1))}
		}
		r.every(r.mem.CrashClone(cfg), r.cands)
	}
	if r.armed == 0 {
		return
	}
	r.armed--
	if r.armed > 0 {
		return
	}
	cfg := vfs.CrashCloneCfg{}
	if pct > 0 {
		cfg = vfs.CrashCloneCfg{UnsyncedDataPercent: pct, RNG: rand.New(rand.NewPCG(r.rng.Uint64(), 2))}
	}
	r.image, r.imgC = r.mem.CrashClone(cfg), r.cands
}

// setCands publishes what an image taken from now on may hold. The models
// are clones: the hook may run on another goroutine at any time.
func (r *runner) setCands(ms ...*model) {
	r.hookMu.Lock()
	r.cands = ms
	r.hookMu.Unlock()
}

// settle ends a step: from now on only the model's state may be on disk.
func (r *runner) settle() { r.setCands(r.m.clone()) }

// open opens the engine on r.mem and checks it against one of cands (the
// states the disk may hold); the model becomes the one that matched.
func (r *runner) openAndMatch(cands []*model) error {
	e, err := idem.Open(dbDir, r.cfg.options(r.wrap(r.mem), r.clk))
	if err != nil {
		return &uncertain{err: fmt.Errorf("open: %w", err), cands: cands}
	}
	r.e = e
	r.open = nil
	r.st.add(func(c *counters) { c.reopens++ })
	if err := r.match(cands, true); err != nil {
		return err
	}
	r.record()
	return nil
}

// match compares the engine with every candidate state (after an open, all
// claims of the candidates are in doubt) and adopts the one that matches.
func (r *runner) match(cands []*model, opened bool) error {
	got, err := observeEngine(r.e)
	if err != nil {
		return &uncertain{err: err, cands: cands}
	}
	now := r.now()
	var diffs []string
	for i := len(cands) - 1; i >= 0; i-- {
		c := cands[i].clone()
		if opened {
			c.epoch++
		}
		d := diffObs(observeModel(c, now), got)
		if d == "" {
			r.m = c
			r.settle()
			r.st.add(func(c *counters) { c.stateChecks++ })
			return nil
		}
		diffs = append(diffs, fmt.Sprintf("candidate %d of %d:\n%s", i+1, len(cands), d))
	}
	return violationf("engine state matches none of the %d states the model allows:\n%s", len(cands), strings.Join(diffs, "\n"))
}

// check compares the engine with the model.
func (r *runner) check() error { return r.match([]*model{r.m}, false) }

// closeEngine closes the engine; an error is returned only if clean says
// the close must succeed.
func (r *runner) closeEngine(clean bool) error {
	if r.e == nil {
		return nil
	}
	err := r.e.Close()
	r.e = nil
	r.open = nil
	if clean && err != nil {
		return &uncertain{err: fmt.Errorf("close: %w", err), cands: []*model{r.m.clone()}}
	}
	return nil
}

// crashTo abandons the running engine, as a crash would, and continues on
// img, which may hold any of cands.
func (r *runner) crashTo(img *vfs.MemFS, cands []*model) error {
	_ = r.closeEngine(false) // the old engine writes to the old filesystem only
	r.mem = img
	r.st.add(func(c *counters) { c.crashImages++ })
	return r.openAndMatch(cands)
}

// ---- steps ----

var ctxTimeout = 20 * time.Second

func stepCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), ctxTimeout)
}

// checkResult compares a Begin/Lookup result and error with the prediction.
func checkResult(what string, x expect, res idem.Result, err error) error {
	if x.err != nil {
		if !errors.Is(err, x.err) {
			if err != nil && !semanticErr(err) {
				return err // an I/O failure: the caller decides
			}
			return violationf("%s: want %v, got %v (status %v)", what, x, err, res.Status)
		}
		if errors.Is(x.err, idem.ErrSequenceGap) {
			var g *idem.SequenceGapError
			if !errors.As(err, &g) || g.Last != x.gapLast {
				return violationf("%s: want gap with last %d, got %v", what, x.gapLast, err)
			}
		}
		return nil
	}
	if err != nil {
		return err // unexpected: the caller decides (fault or violation)
	}
	if x.status == idem.Fresh {
		if res.Status != idem.Fresh || res.Claim == nil || res.LeaseUntil.UnixNano() != x.leaseUntil || res.Seq != x.seq {
			return violationf("%s: want %v, got %s (claim %v)", what, x, resObs(res), res.Claim != nil)
		}
		return nil
	}
	if got := resObs(res); got != x.obs() {
		return violationf("%s: want %s, got %s", what, x.obs(), got)
	}
	return nil
}

// semanticErr says whether err is one of the answers the model predicts
// (as opposed to an I/O failure).
func semanticErr(err error) bool {
	for _, s := range []error{idem.ErrConflict, idem.ErrSequenceGap, idem.ErrAlreadyCommitted, idem.ErrLeaseLost, idem.ErrInvalidRequest} {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// fault turns an unexpected engine error into an uncertain outcome.
func fault(err error, cands ...*model) error {
	var v *violation
	if errors.As(err, &v) {
		return err
	}
	return &uncertain{err: err, cands: cands}
}

func (r *runner) begin(scope string, mode byte, ident string, seq uint64, fp []byte, acked []string) error {
	req := idem.Request{Scope: scope, Fingerprint: fp}
	if mode == modeID {
		req.ID = []byte(ident)
	} else {
		req.Client, req.Seq = ident, seq
	}
	for _, a := range acked {
		req.Acked = append(req.Acked, []byte(a))
	}
	m0 := r.m.clone()
	x := r.m.begin(scope, mode, ident, seq, fp, acked, r.now())
	r.logf("begin %v seq %d fp %q acked %v -> want %v", mkey{scope, mode, ident}, seq, fp, acked, x)
	r.setCands(m0, r.m.clone())
	ctx, cancel := stepCtx()
	res, err := r.e.Begin(ctx, req)
	cancel()
	if err := checkResult("begin", x, res, err); err != nil {
		return fault(err, m0, r.m.clone())
	}
	if x.status == idem.Fresh {
		r.open = append(r.open, openClaim{c: res.Claim, k: mkey{scope, mode, ident}, tok: x.tok})
	}
	r.settle()
	return nil
}

func (r *runner) reply(kind int) []byte {
	r.seq++
	switch kind {
	case 0:
		return nil
	case 1:
		return []byte(fmt.Sprintf("reply-%d", r.seq))
	case 2: // compressible, over the WAL's compression threshold
		return bytes.Repeat([]byte(fmt.Sprintf("big-%d|", r.seq)), 300)
	default:
		b := make([]byte, 200+r.seq%100)
		for i := range b {
			b[i] = byte(r.seq*31 + i*7)
		}
		return b
	}
}

func (r *runner) finish(i int, commit bool, replyKind int) error {
	if len(r.open) == 0 {
		return nil
	}
	i %= len(r.open)
	oc := r.open[i]
	r.open = append(r.open[:i], r.open[i+1:]...)
	return r.finishClaim(oc.c, oc.k, oc.tok, commit, replyKind)
}

func (r *runner) finishClaim(c *idem.Claim, k mkey, tok int, commit bool, replyKind int) error {
	m0 := r.m.clone()
	var x expect
	var reply []byte
	if commit {
		reply = r.reply(replyKind)
		x = r.m.commit(tok, reply, r.now())
		r.logf("commit %v tok %d reply %s -> want %v", k, tok, showReply(reply), x)
	} else {
		x = r.m.abort(tok)
		r.logf("abort %v tok %d -> want %v", k, tok, x)
	}
	r.setCands(m0, r.m.clone())
	ctx, cancel := stepCtx()
	var err error
	if commit {
		err = c.Commit(ctx, reply)
	} else {
		err = c.Abort(ctx)
	}
	cancel()
	if x.err != nil {
		if !errors.Is(err, x.err) {
			if err == nil || semanticErr(err) {
				return violationf("finish %v: want %v, got %v", k, x, err)
			}
			return fault(err, m0, r.m.clone())
		}
	} else if err != nil {
		if semanticErr(err) {
			return violationf("finish %v: want success, got %v", k, err)
		}
		return fault(err, m0, r.m.clone())
	}
	r.settle()
	return nil
}

// do runs Engine.Do; fn fails when fail is set (the claim is aborted).
func (r *runner) do(scope string, mode byte, ident string, seq uint64, fp []byte, fail bool, replyKind int) error {
	now := r.now()
	probe := r.m.clone()
	x := probe.begin(scope, mode, ident, seq, fp, nil, now)
	if x.err == nil && x.status == idem.InFlight {
		return nil // Do would wait for the lease: not a step a single-threaded program can take
	}
	req := idem.Request{Scope: scope, Fingerprint: fp}
	if mode == modeID {
		req.ID = []byte(ident)
	} else {
		req.Client, req.Seq = ident, seq
	}
	m0 := r.m.clone()
	r.m = probe
	var mid *model
	var reply []byte
	want := x
	if x.err == nil && x.status == idem.Fresh {
		mid = r.m.clone()
		if fail {
			want = r.m.abort(x.tok)
			want.err = errFn
		} else {
			reply = r.reply(replyKind)
			want = r.m.commit(x.tok, reply, now)
			if reply == nil {
				reply = []byte{}
			}
			want.reply = reply
		}
	} else if x.err == nil {
		want.reply = x.reply
	}
	r.logf("do %v seq %d fp %q fail %v -> begin %v, want %v", mkey{scope, mode, ident}, seq, fp, fail, x, want)
	if mid != nil {
		r.setCands(m0, mid, r.m.clone())
	} else {
		r.setCands(m0)
	}
	ran := 0
	ctx, cancel := stepCtx()
	out, err := r.e.Do(ctx, req, func(context.Context) ([]byte, error) {
		ran++
		if fail {
			return nil, errFn
		}
		return reply, nil
	})
	cancel()
	if wantRun := mid != nil; (ran == 1) != wantRun || ran > 1 {
		if err != nil && ran == 0 && wantRun && !semanticErr(err) {
			return fault(err, m0, mid) // the claim failed
		}
		return violationf("do %v: fn ran %d times, model says fresh=%v (err %v)", mkey{scope, mode, ident}, ran, wantRun, err)
	}
	if want.err != nil {
		if !errors.Is(err, want.err) {
			if mid != nil {
				return fault(err, m0, mid, r.m.clone())
			}
			return fault(fmt.Errorf("do: want %v, got %v", want, err), m0)
		}
		if errors.Is(want.err, errFn) && err != errFn {
			return fault(err, m0, mid, r.m.clone()) // the abort failed too
		}
	} else if err != nil {
		if semanticErr(err) {
			return violationf("do %v: want %v, got %v", mkey{scope, mode, ident}, want, err)
		}
		if mid != nil {
			return fault(err, m0, mid, r.m.clone())
		}
		return fault(err, m0)
	} else if !bytes.Equal(out, want.reply) {
		return violationf("do %v: want reply %s, got %s", mkey{scope, mode, ident}, showReply(want.reply), showReply(out))
	}
	if mid != nil {
		// The claim was the record before the last one.
		r.hist = append(r.hist, histEntry{r.e.Stats().LastLSN - 1, mid})
	}
	r.settle()
	return nil
}

var errFn = errors.New("fn failed (the program's side effect did not happen)")

func (r *runner) ack(scope string, ids []string) error {
	m0 := r.m.clone()
	r.m.ackIDs(scope, ids)
	r.logf("ack %q %v", scope, ids)
	r.setCands(m0, r.m.clone())
	var bs [][]byte
	for _, id := range ids {
		bs = append(bs, []byte(id))
	}
	ctx, cancel := stepCtx()
	err := r.e.Ack(ctx, scope, bs...)
	cancel()
	if err != nil {
		return fault(err, m0, r.m.clone())
	}
	r.settle()
	return nil
}

func (r *runner) forget(back time.Duration) error {
	m0 := r.m.clone()
	before := r.clk.Now().Add(-back)
	r.m.forget(before.UnixNano())
	r.logf("forget before now-%v", back)
	r.setCands(m0, r.m.clone())
	ctx, cancel := stepCtx()
	err := r.e.Forget(ctx, before)
	cancel()
	if err != nil {
		return fault(err, m0, r.m.clone())
	}
	r.settle()
	return nil
}

func (r *runner) compact() error {
	m0 := r.m.clone()
	r.m.compact(r.now())
	r.logf("compact")
	r.setCands(m0, r.m.clone())
	ctx, cancel := stepCtx()
	_, err := r.e.Compact(ctx)
	cancel()
	if err != nil {
		return fault(err, m0, r.m.clone())
	}
	r.settle()
	return nil
}

func (r *runner) advance(d time.Duration) {
	r.logf("advance %v", d)
	r.clk.Advance(d)
}

// reopen closes the engine cleanly and opens it again.
func (r *runner) reopen() error {
	r.logf("close and reopen")
	if err := r.closeEngine(true); err != nil {
		return err
	}
	return r.openAndMatch([]*model{r.m.clone()})
}

// crashNow takes a crash image between steps (everything acknowledged is
// synced) and continues on it.
func (r *runner) crashNow(pct int) error {
	if r.cfg.syncNever {
		pct = 100
	}
	r.logf("crash now (unsynced kept %d%%)", pct)
	cfg := vfs.CrashCloneCfg{}
	if pct > 0 {
		r.hookMu.Lock()
		seed := r.rng.Uint64()
		r.hookMu.Unlock()
		cfg = vfs.CrashCloneCfg{UnsyncedDataPercent: pct, RNG: rand.New(rand.NewPCG(seed, 3))}
	}
	img := r.mem.CrashClone(cfg)
	return r.crashTo(img, []*model{r.m.clone()})
}

// arm makes the next step take a crash image at its n-th fsync.
func (r *runner) arm(n, pct int) {
	r.logf("arm crash at sync %d of the next step (unsynced kept %d%%)", n, pct)
	r.hookMu.Lock()
	r.armed, r.armCfg, r.image, r.imgC = n, pct, nil, nil
	r.hookMu.Unlock()
}

// fired continues on the armed image if the last step took one.
func (r *runner) fired() error {
	r.hookMu.Lock()
	img, cands := r.image, r.imgC
	r.armed, r.image, r.imgC = 0, nil, nil
	r.hookMu.Unlock()
	if img == nil {
		return nil
	}
	r.logf("crash image taken inside an fsync: recover from it (%d candidate states)", len(cands))
	r.st.add(func(c *counters) { c.hookImages++ })
	return r.crashTo(img, cands)
}

// resolve finishes the i-th claim InDoubt lists (recover-and-commit or
// recover-and-abort).
func (r *runner) resolve(i int, commit bool, replyKind int) error {
	ds, err := r.e.InDoubt(context.Background(), "")
	if err != nil {
		return fault(err, r.m.clone())
	}
	if len(ds) == 0 {
		return nil
	}
	d := ds[i%len(ds)]
	k := mkey{d.Scope, modeID, string(d.ID)}
	if d.Client != "" {
		k = mkey{d.Scope, modeClient, d.Client}
	}
	tok := 0
	if e, ok := r.m.ents[k]; ok && e.inflight && e.epoch < r.m.epoch {
		tok = e.tok
	}
	r.logf("resolve in-doubt %v (model tok %d)", k, tok)
	return r.finishClaim(d.Claim, k, tok, commit, replyKind)
}

// snapshotRestore streams a snapshot, restores it into a new directory and
// checks that the copy answers as the model does.
func (r *runner) snapshotRestore() error {
	var buf bytes.Buffer
	ctx, cancel := stepCtx()
	info, err := r.e.Snapshot(ctx, &buf)
	cancel()
	if err != nil {
		return fault(err, r.m.clone())
	}
	// The snapshot holds the index as applied: every record up to info.LSN.
	var at *model
	for i := len(r.hist) - 1; i >= 0 && at == nil; i-- {
		if r.hist[i].lsn == info.LSN {
			at = r.hist[i].m
		}
	}
	r.logf("snapshot at LSN %d (last %d) and restore", info.LSN, r.e.Stats().LastLSN)
	if at == nil {
		return violationf("snapshot LSN %d is no state the program went through", info.LSN)
	}
	dst, err := idem.Restore("restored", bytes.NewReader(buf.Bytes()), r.cfg.options(vfs.NewMem(), r.clk))
	if err != nil {
		return violationf("restore of a good snapshot: %v", err)
	}
	defer dst.Close()
	got, err := observeEngine(dst)
	if err != nil {
		return violationf("restored engine: %v", err)
	}
	c := at.clone()
	c.epoch++
	if d := diffObs(observeModel(c, r.now()), got); d != "" {
		return violationf("restored snapshot (LSN %d) differs from the model:\n%s", info.LSN, d)
	}
	r.st.add(func(c *counters) { c.restores++ })
	return nil
}

// wait calls Engine.Wait on an id that is not in flight (Wait on one in
// flight would block until its lease ends): it must answer as Lookup does.
func (r *runner) wait(scope, id string) error {
	x := r.m.lookup(mkey{scope, modeID, id}, 0, r.now())
	if x.status == idem.InFlight {
		return nil
	}
	r.logf("wait %v -> want %v", mkey{scope, modeID, id}, x.obs())
	ctx, cancel := stepCtx()
	res, err := r.e.Wait(ctx, idem.Request{Scope: scope, ID: []byte(id)})
	cancel()
	if err != nil {
		return fault(err, r.m.clone())
	}
	if got := resObs(res); got != x.obs() {
		return violationf("wait %v: want %s, got %s", mkey{scope, modeID, id}, x.obs(), got)
	}
	return nil
}

// batchItem is one item of a batch step, with what the model predicts.
type batchItem struct {
	kind  string // begin, put, commit, abort, ack
	k     mkey
	seq   uint64
	fp    []byte
	oc    openClaim // commit, abort
	reply []byte
	ids   []string // ack
	x     expect
}

// batch reads a batch of 1-6 items from p (Begin and Put of ids and of
// sequence numbers, Commit and Abort of held claims, Ack; items may name
// the same key and see each other in order), runs it with one Batch.Run
// and checks every item's result. The model applies the items in order;
// a crash inside the step may leave the state before the batch or after
// all of it, nothing in between (one record).
func (r *runner) batch(p *progReader) error {
	n := 1 + p.n(6)
	m0 := r.m.clone()
	now := r.now()
	var items []batchItem
	for i := 0; i < n; i++ {
		it := batchItem{k: mkey{scope: modelScopes[p.n(len(modelScopes))]}}
		switch p.n(7) {
		case 0, 1, 2, 3: // Begin or Put, of an id or of a client's number
			kb := p.next()
			it.kind = []string{"begin", "put"}[kb&1]
			if kb&2 == 0 {
				it.k.mode, it.k.ident = modeID, modelIDs[p.n(len(modelIDs))]
			} else {
				it.k.mode, it.k.ident = modeClient, modelClients[p.n(len(modelClients))]
				last := r.m.clientState(it.k.scope, it.k.ident)
				it.seq = uint64(max(int64(last)+[]int64{1, 1, 0, -1, 2, 1}[p.n(6)], 1))
			}
			it.fp = fps[p.n(len(fps))]
			it.x = r.m.begin(it.k.scope, it.k.mode, it.k.ident, it.seq, it.fp, nil, now)
			if it.kind == "put" && it.x.err == nil && it.x.status == idem.Fresh {
				it.reply = r.reply(p.n(4))
				r.m.commit(it.x.tok, it.reply, now)
			}
		case 4, 5: // Commit or Abort of a held claim
			if len(r.open) == 0 {
				continue
			}
			j := p.n(8) % len(r.open)
			it.oc = r.open[j]
			r.open = append(r.open[:j], r.open[j+1:]...)
			it.k = it.oc.k
			if p.next()&1 == 0 {
				it.kind, it.reply = "commit", r.reply(p.n(4))
				it.x = r.m.commit(it.oc.tok, it.reply, now)
			} else {
				it.kind = "abort"
				it.x = r.m.abort(it.oc.tok)
			}
		default:
			mask := p.next()
			for j, a := range modelIDs {
				if mask&(1<<j) != 0 {
					it.ids = append(it.ids, a)
				}
			}
			if len(it.ids) == 0 {
				continue
			}
			it.kind = "ack"
			r.m.ackIDs(it.k.scope, it.ids)
		}
		items = append(items, it)
	}
	var what []string
	b := r.e.NewBatch()
	for _, it := range items {
		what = append(what, fmt.Sprintf("%s %v seq %d fp %q -> want %v", it.kind, it.k, it.seq, it.fp, it.x))
		req := idem.Request{Scope: it.k.scope, Fingerprint: it.fp}
		if it.k.mode == modeID {
			req.ID = []byte(it.k.ident)
		} else {
			req.Client, req.Seq = it.k.ident, it.seq
		}
		switch it.kind {
		case "begin":
			b.Begin(req)
		case "put":
			b.Put(req, it.reply)
		case "commit":
			b.Commit(it.oc.c, it.reply)
		case "abort":
			b.Abort(it.oc.c)
		case "ack":
			var ids [][]byte
			for _, id := range it.ids {
				ids = append(ids, []byte(id))
			}
			b.Ack(it.k.scope, ids...)
		}
	}
	r.logf("batch [%s]", strings.Join(what, "; "))
	r.setCands(m0, r.m.clone())
	ctx, cancel := stepCtx()
	out, err := b.Run(ctx)
	cancel()
	if err != nil {
		return fault(err, m0)
	}
	for i, it := range items {
		res, err := out[i].Result, out[i].Err
		what := fmt.Sprintf("batch item %d (%s)", i, what[i])
		switch {
		case it.kind == "put" && it.x.err == nil && it.x.status == idem.Fresh:
			if err != nil {
				if semanticErr(err) {
					return violationf("%s: got %v", what, err)
				}
				return fault(err, m0, r.m.clone())
			}
			if res.Status != idem.Fresh || res.Claim != nil || res.LeaseUntil.UnixNano() != it.x.leaseUntil || res.Seq != it.x.seq {
				return violationf("%s: got %s (claim %v)", what, resObs(res), res.Claim != nil)
			}
		case it.kind == "begin" || it.kind == "put":
			if err := checkResult(what, it.x, res, err); err != nil {
				return fault(err, m0, r.m.clone())
			}
			if it.kind == "begin" && it.x.err == nil && it.x.status == idem.Fresh {
				r.open = append(r.open, openClaim{c: res.Claim, k: it.k, tok: it.x.tok})
			}
		case it.kind == "commit" || it.kind == "abort":
			if it.x.err != nil {
				if !errors.Is(err, it.x.err) {
					if err == nil || semanticErr(err) {
						return violationf("%s: got %v", what, err)
					}
					return fault(err, m0, r.m.clone())
				}
			} else if err != nil {
				if semanticErr(err) {
					return violationf("%s: got %v", what, err)
				}
				return fault(err, m0, r.m.clone())
			}
		default: // ack
			if err != nil {
				return fault(err, m0, r.m.clone())
			}
		}
	}
	r.settle()
	return nil
}
