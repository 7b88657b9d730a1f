package idem

import (
	"bytes"
	"fmt"
	"maps"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/testclock"
	"github.com/idemdb/idem/internal/vfstest"
)

// TestCrashAtEverySyncPoint runs a fixed workload (Begin with and without
// a TTL and with acked ids, Commit, Abort, Ack, Forget, TTL cleanup,
// Close/Open) one call at a time on a crashable filesystem and takes crash
// images (only what was fsynced survives):
//
//   - after every successful fsync, by any goroutine (the WAL's group
//     commit, Pebble's flushes, ingests and manifest writes); every other
//     image keeps half of the unsynced blocks at random, which tears writes;
//   - at the moment every call returns, before any further fsync can
//     happen: the WAL's fsyncs are held at a gate while a call runs and let
//     through only once the call waits for durability (see walGate), so a
//     call that returns before its record is fsynced is caught at every
//     call, whatever the scheduling.
//
// Every image is opened and its whole observable state (Lookup of every
// id, the live entry count, the claims in doubt) must be the state of
// everything acknowledged before it, or (for an image taken inside a call)
// that state with the call's single record applied: acknowledged commits
// keep their replies, acknowledged claims are in doubt (never Absent,
// which would let them run twice), acked, forgotten and expired-and-cleaned
// entries stay gone.
//
// The "batches" workload runs the Begins, Commits, Aborts and Acks as
// items of batches (Batch.Run, with Puts as well): one record per batch,
// so an image holds each batch whole or not at all, never some of its
// items.
func TestCrashAtEverySyncPoint(t *testing.T) {
	t.Run("calls", func(t *testing.T) { testCrashAtEverySyncPoint(t, false) })
	t.Run("batches", func(t *testing.T) { testCrashAtEverySyncPoint(t, true) })
}

// held is a claim the crash workload has not finished yet.
type held struct {
	c *Claim
	x string
}

func testCrashAtEverySyncPoint(t *testing.T, batches bool) {
	r := newCrashRun(t)
	rng := rand.New(rand.NewPCG(7, 7))
	var open []held
	finish := func(h held, commit bool) {
		if commit {
			reply := fmt.Sprintf("late-%s-%d", h.x, r.steps)
			r.call("commit "+h.x, func(m *crashModel) { m.commit(h.x, reply, r.clk.Now()) },
				func() error { return h.c.Commit(bg, []byte(reply)) })
		} else {
			r.call("abort "+h.x, func(m *crashModel) { delete(m.ids, h.x) },
				func() error { return h.c.Abort(bg) })
		}
	}
	for r.steps = 0; r.steps < 160; r.steps++ {
		r.clk.Advance(time.Second)
		x := fmt.Sprintf("k%02d", rng.IntN(crashIDs))
		switch op := rng.IntN(20); {
		case batches && op < 14:
			open = r.batch(rng, open)
		case op < 9: // Begin, sometimes with a TTL or acking another id
			req := Request{ID: []byte(x)}
			if rng.IntN(3) == 0 {
				req.TTL = time.Duration(5+rng.IntN(20)) * time.Second
			}
			if rng.IntN(4) == 0 {
				if a := fmt.Sprintf("k%02d", rng.IntN(crashIDs)); a != x {
					req.Acked = [][]byte{[]byte(a)}
				}
			}
			res := r.begin(req)
			if res.Status != Fresh {
				continue
			}
			if rng.IntN(3) == 0 {
				open = append(open, held{res.Claim, x})
				continue
			}
			reply := fmt.Sprintf("reply-%s-%d", x, r.steps)
			r.call("commit "+x, func(m *crashModel) { m.commit(x, reply, r.clk.Now()) },
				func() error { return res.Claim.Commit(bg, []byte(reply)) })
		case op < 12 && len(open) > 0:
			h := open[0]
			open = open[1:]
			finish(h, rng.IntN(2) == 0)
		case op < 14: // Ack two ids (one maybe unknown or in flight)
			ids := []string{x, fmt.Sprintf("k%02d", rng.IntN(crashIDs+4))}
			r.call(fmt.Sprint("ack ", ids), func(m *crashModel) { m.ack(ids...) },
				func() error { return r.e.Ack(bg, "", []byte(ids[0]), []byte(ids[1])) })
		case op < 16: // Forget what was committed more than 0-30 s ago
			before := r.clk.Now().Add(-time.Duration(rng.IntN(4)) * 10 * time.Second)
			r.call(fmt.Sprint("forget before ", before.Sub(testclock.Epoch)), func(m *crashModel) { m.forget(before) },
				func() error { return r.e.Forget(bg, before) })
		case op < 19: // let TTLs run out, and remove the expired entries
			r.clk.Advance(time.Duration(rng.IntN(15)) * time.Second)
			// CleanupExpired finds expired entries in the index: let the
			// applier catch up so that what it removes is what the model
			// says (every expired entry).
			waitApplied(t, r.e)
			now := r.clk.Now()
			r.call("cleanup expired", func(m *crashModel) { m.cleanup(now) }, func() error {
				n, err := r.e.CleanupExpired(bg)
				if want := r.expiredNow(now); err == nil && n != want {
					return fmt.Errorf("CleanupExpired removed %d entries, the model %d", n, want)
				}
				return err
			})
		default:
			if r.steps%40 == 39 { // claims are finished before a clean reopen
				for _, h := range open {
					finish(h, rng.IntN(2) == 0)
				}
				open = nil
				r.reopen()
			}
		}
	}
	r.close()
	r.checkImages()
}

const crashIDs = 12

// crashModel is what the crash tests know was acknowledged.
type crashModel struct {
	ids  map[string]crashEntry
	mark time.Time // newest acknowledged Forget
}

type crashEntry struct {
	inFlight   bool
	reply      string
	commitTime time.Time
	expiresAt  time.Time // zero: no TTL
	claimedAt  time.Time
	claimTTL   time.Duration
}

func newCrashModel() *crashModel { return &crashModel{ids: map[string]crashEntry{}} }

func (m *crashModel) clone() *crashModel {
	return &crashModel{ids: maps.Clone(m.ids), mark: m.mark}
}

func (m *crashModel) expired(en crashEntry, now time.Time) bool {
	return !en.inFlight && !en.expiresAt.IsZero() && en.expiresAt.Before(now)
}

// claim records a Fresh Begin of x at now.
func (m *crashModel) claim(x string, ttl time.Duration, now time.Time) {
	m.ids[x] = crashEntry{inFlight: true, claimedAt: now, claimTTL: ttl}
}

func (m *crashModel) commit(x, reply string, now time.Time) {
	en := crashEntry{reply: reply, commitTime: now}
	if c := m.ids[x]; c.claimTTL > 0 { // expires_at = created_at + TTL
		en.expiresAt = c.claimedAt.Add(c.claimTTL)
	}
	m.ids[x] = en
}

func (m *crashModel) ack(ids ...string) {
	for _, x := range ids {
		if en, ok := m.ids[x]; ok && !en.inFlight {
			delete(m.ids, x)
		}
	}
}

func (m *crashModel) forget(before time.Time) {
	if before.After(m.mark) {
		m.mark = before
	}
	for x, en := range m.ids {
		if !en.inFlight && en.commitTime.Before(m.mark) {
			delete(m.ids, x)
		}
	}
}

func (m *crashModel) cleanup(now time.Time) {
	for x, en := range m.ids {
		if m.expired(en, now) {
			delete(m.ids, x)
		}
	}
}

// observe renders what Lookup says of every id at now, the live entry
// count and the number of claims in doubt after an open.
func (m *crashModel) observe(now time.Time) string {
	var b strings.Builder
	inFlight := 0
	for i := range crashIDs + 4 {
		x := fmt.Sprintf("k%02d", i)
		en, ok := m.ids[x]
		switch {
		case !ok || m.expired(en, now):
			fmt.Fprintf(&b, "%s=absent ", x)
		case en.inFlight:
			inFlight++
			fmt.Fprintf(&b, "%s=in-flight ", x)
		default:
			fmt.Fprintf(&b, "%s=done:%s ", x, en.reply)
		}
	}
	fmt.Fprintf(&b, "live=%d in-doubt=%d", len(m.ids), inFlight)
	return b.String()
}

func observeEngine(t *testing.T, e *Engine) string {
	t.Helper()
	var b strings.Builder
	for i := range crashIDs + 4 {
		x := fmt.Sprintf("k%02d", i)
		l, err := lookupID(e, "", []byte(x))
		if err != nil {
			t.Fatalf("lookup %s: %v", x, err)
		}
		switch l.Status {
		case Done:
			fmt.Fprintf(&b, "%s=done:%s ", x, l.Reply)
		default:
			fmt.Fprintf(&b, "%s=%v ", x, l.Status)
		}
	}
	st := e.Stats()
	fmt.Fprintf(&b, "live=%d in-doubt=%d", st.LiveEntries, st.InDoubt)
	return b.String()
}

// lookupID is Engine.Lookup of an id-mode request.
func lookupID(e *Engine, scope string, id []byte) (Result, error) {
	return e.Lookup(bg, Request{Scope: scope, ID: id})
}

// crashImage is one crash image with the states it may hold.
type crashImage struct {
	fs    *vfs.MemFS
	now   time.Time
	what  string
	cands []*crashModel
}

// crashRun drives the workload of TestCrashAtEverySyncPoint.
type crashRun struct {
	t     *testing.T
	mem   *vfs.MemFS
	gate  *walGate
	fs    vfs.FS
	clk   *testclock.Clock
	opts  *Options
	e     *Engine
	steps int

	mu      sync.Mutex // guards the fields below; the sync hook runs on any goroutine
	m       *crashModel
	after   *crashModel // the state the call in progress leads to; nil between calls
	doing   string
	images  []crashImage
	torn    int // images taken with some unsynced data kept
	rngSeed uint64
}

func newCrashRun(t *testing.T) *crashRun {
	r := &crashRun{t: t, mem: vfs.NewCrashableMem(), clk: testclock.New(), m: newCrashModel()}
	r.gate = newWALGate(r.mem)
	r.fs = &vfstest.SyncHookFS{FS: r.gate, Hook: r.onSync}
	r.opts = &Options{Clock: r.clk.Now, SegmentSize: 8 << 10, IndexIngestBytes: 4 << 10, MemoryBudget: 32 << 20, IndexFilterBytes: 4 << 10}
	r.e = openMem(t, r.fs, r.opts)
	return r
}

// onSync takes a crash image after a successful fsync.
func (r *crashRun) onSync() {
	r.mu.Lock()
	defer r.mu.Unlock()
	cands := []*crashModel{r.m}
	if r.after != nil {
		cands = append(cands, r.after)
	}
	cfg := vfs.CrashCloneCfg{}
	if len(r.images)%2 == 1 {
		r.rngSeed++
		cfg = vfs.CrashCloneCfg{UnsyncedDataPercent: 50, RNG: rand.New(rand.NewPCG(r.rngSeed, 1))}
		r.torn++
	}
	r.images = append(r.images, crashImage{fs: r.mem.CrashClone(cfg), now: r.clk.Now(), what: "fsync during " + r.doing, cands: cands})
}

// call runs one engine call whose effect on the model is apply, with the
// WAL's fsyncs gated, and takes a crash image as soon as it returns.
func (r *crashRun) call(what string, apply func(m *crashModel), fn func() error) {
	r.t.Helper()
	r.mu.Lock()
	after := r.m.clone()
	apply(after)
	r.after, r.doing = after, fmt.Sprintf("step %d: %s", r.steps, what)
	r.mu.Unlock()
	err := r.gate.run(fn)
	r.mu.Lock()
	if err == nil {
		// The call returned and no WAL fsync happened since: an image now is
		// a crash right after the acknowledgement.
		r.images = append(r.images, crashImage{fs: r.mem.CrashClone(vfs.CrashCloneCfg{}), now: r.clk.Now(), what: "return of " + r.doing, cands: []*crashModel{after}})
		r.m = after
	}
	r.after, r.doing = nil, ""
	r.mu.Unlock()
	r.gate.open()
	if err != nil {
		r.t.Fatalf("step %d: %s: %v", r.steps, what, err)
	}
}

// begin runs a Begin and checks its answer against the model.
func (r *crashRun) begin(req Request) Result {
	r.t.Helper()
	x := string(req.ID)
	now := r.clk.Now()
	en, ok := r.m.ids[x]
	want := Fresh
	switch {
	case ok && en.inFlight:
		want = InFlight
	case ok && !r.m.expired(en, now):
		want = Done
	}
	var acked []string
	for _, a := range req.Acked {
		acked = append(acked, string(a))
	}
	var res Result
	r.call(fmt.Sprintf("begin %s ttl %v acking %v", x, req.TTL, acked), func(m *crashModel) {
		if want == Fresh { // only a claim's record carries the acks
			m.ack(acked...)
			m.claim(x, req.TTL, now)
		}
	}, func() error {
		var err error
		res, err = r.e.Begin(bg, req)
		if err == nil && res.Status != want {
			err = fmt.Errorf("status %v, the model says %v", res.Status, want)
		}
		if err == nil && want == Done && string(res.Reply) != en.reply {
			err = fmt.Errorf("reply %q, the model says %q", res.Reply, en.reply)
		}
		return err
	})
	return res
}

// crashItem is one item of a batch of the crash workload.
type crashItem struct {
	kind  batchKind
	x     string
	ttl   time.Duration
	acked []string
	h     held // Commit, Abort
	reply string
	ids   []string // Ack
	want  Status   // Begin, Put: what the model says
	done  string   // the reply of a Done
}

// batch runs a batch of 1-6 random items (Begin, Put, Commit and Abort of
// held claims, Ack; items may name the same id) as one call, checks each
// item's result against the model and returns the claims still held.
func (r *crashRun) batch(rng *rand.Rand, open []held) []held {
	r.t.Helper()
	now := r.clk.Now()
	r.mu.Lock()
	m := r.m.clone() // the model as the items so far leave it
	r.mu.Unlock()
	var items []crashItem
	var what []string
	for n := 1 + rng.IntN(6); len(items) < n; {
		x := fmt.Sprintf("k%02d", rng.IntN(crashIDs))
		it := crashItem{x: x}
		switch k := rng.IntN(10); {
		case k < 6:
			it.kind = bBegin
			if k >= 3 {
				it.kind, it.reply = bPut, fmt.Sprintf("put-%s-%d", x, r.steps)
			}
			if rng.IntN(3) == 0 {
				it.ttl = time.Duration(5+rng.IntN(20)) * time.Second
			}
			if a := fmt.Sprintf("k%02d", rng.IntN(crashIDs)); rng.IntN(4) == 0 && a != x {
				it.acked = []string{a}
			}
			en, ok := m.ids[x]
			switch {
			case ok && en.inFlight:
				it.want = InFlight
			case ok && !m.expired(en, now):
				it.want, it.done = Done, en.reply
			default:
				it.want = Fresh
				m.ack(it.acked...)
				m.claim(x, it.ttl, now)
				if it.kind == bPut {
					m.commit(x, it.reply, now)
				}
			}
			what = append(what, fmt.Sprintf("%v %s ttl %v acking %v", map[batchKind]string{bBegin: "begin", bPut: "put"}[it.kind], x, it.ttl, it.acked))
		case k < 8 && len(open) > 0:
			it.h, open = open[0], open[1:]
			it.x = it.h.x
			if k == 6 {
				it.kind, it.reply = bCommit, fmt.Sprintf("late-%s-%d", it.x, r.steps)
				m.commit(it.x, it.reply, now)
				what = append(what, "commit "+it.x)
			} else {
				it.kind = bAbort
				delete(m.ids, it.x)
				what = append(what, "abort "+it.x)
			}
		default:
			it.kind = bAck
			it.ids = []string{x, fmt.Sprintf("k%02d", rng.IntN(crashIDs+4))}
			m.ack(it.ids...)
			what = append(what, fmt.Sprint("ack ", it.ids))
		}
		items = append(items, it)
	}
	after := m
	var out []BatchResult
	r.call("batch ["+strings.Join(what, "; ")+"]", func(m *crashModel) { *m = *after.clone() }, func() error {
		b := r.e.NewBatch()
		for _, it := range items {
			switch it.kind {
			case bBegin, bPut:
				req := Request{ID: []byte(it.x), TTL: it.ttl}
				for _, a := range it.acked {
					req.Acked = append(req.Acked, []byte(a))
				}
				if it.kind == bBegin {
					b.Begin(req)
				} else {
					b.Put(req, []byte(it.reply))
				}
			case bCommit:
				b.Commit(it.h.c, []byte(it.reply))
			case bAbort:
				b.Abort(it.h.c)
			case bAck:
				b.Ack("", []byte(it.ids[0]), []byte(it.ids[1]))
			}
		}
		var err error
		if out, err = b.Run(bg); err != nil {
			return err
		}
		for i, it := range items {
			res := out[i]
			if res.Err != nil {
				return fmt.Errorf("item %d (%s): %v", i, what[i], res.Err)
			}
			if (it.kind == bBegin || it.kind == bPut) && res.Result.Status != it.want {
				return fmt.Errorf("item %d (%s): status %v, the model says %v", i, what[i], res.Result.Status, it.want)
			}
			if it.want == Done && string(res.Result.Reply) != it.done {
				return fmt.Errorf("item %d (%s): reply %q, the model says %q", i, what[i], res.Result.Reply, it.done)
			}
		}
		return nil
	})
	for i, it := range items {
		if it.kind == bBegin && out[i].Result.Status == Fresh {
			open = append(open, held{out[i].Result.Claim, it.x})
		}
	}
	return open
}

// expiredNow counts the entries the model has expired at now.
func (r *crashRun) expiredNow(now time.Time) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, en := range r.m.ids {
		if r.m.expired(en, now) {
			n++
		}
	}
	return n
}

func (r *crashRun) reopen() {
	r.t.Helper()
	r.mu.Lock()
	r.doing = fmt.Sprintf("step %d: reopen", r.steps)
	r.mu.Unlock()
	if err := r.e.Close(); err != nil {
		r.t.Fatal(err)
	}
	r.e = openMem(r.t, r.fs, r.opts)
	r.mu.Lock()
	r.doing = ""
	r.mu.Unlock()
}

func (r *crashRun) close() {
	r.mu.Lock()
	r.doing = "close"
	r.mu.Unlock()
	if err := r.e.Close(); err != nil {
		r.t.Fatal(err)
	}
}

// checkImages recovers every image and matches it with its candidates.
func (r *crashRun) checkImages() {
	t := r.t
	t.Helper()
	r.mu.Lock()
	images := slices.Clone(r.images)
	r.mu.Unlock()
	returns := 0
	for i, img := range images {
		if strings.HasPrefix(img.what, "return of") {
			returns++
		}
		clk := testclock.At(img.now)
		e, err := Open("db", &Options{FS: img.fs, Clock: clk.Now, MemoryBudget: 32 << 20, IndexFilterBytes: 4 << 10})
		if err != nil {
			t.Fatalf("image %d (%s): open: %v", i, img.what, err)
		}
		got := observeEngine(t, e)
		if err := e.Close(); err != nil {
			t.Fatalf("image %d (%s): close: %v", i, img.what, err)
		}
		var wants []string
		for _, c := range img.cands {
			wants = append(wants, c.observe(img.now))
		}
		if !slices.Contains(wants, got) {
			t.Fatalf("image %d, crash at the %s:\n got  %s\n want %s", i, img.what, got, strings.Join(wants, "\n   or "))
		}
	}
	if returns < 100 || len(images)-returns < 100 {
		t.Fatalf("only %d images at returns and %d at fsyncs", returns, len(images)-returns)
	}
	t.Logf("checked %d crash images: %d at fsyncs (%d keeping some unsynced data), %d at returns", len(images), len(images)-returns, r.torn, returns)
}

// walGate is a vfs.FS whose WAL fdatasyncs (the group commit's) can be
// held. While it holds (during walGate.run), a held fsync is let through
// only once the calling goroutine waits inside the WAL for durability: so
// a call that returns before its record is fsynced returns while the
// fsync is still held, and the image taken at its return shows it.
type walGate struct {
	vfs.FS
	mu      sync.Mutex
	holding bool
	queue   []chan struct{} // fsyncs waiting, oldest first
	arrived chan struct{}   // a wake-up token: an fsync started waiting
}

func newWALGate(fs vfs.FS) *walGate {
	return &walGate{FS: fs, arrived: make(chan struct{}, 1)}
}

// Unwrap returns the wrapped FS.
func (g *walGate) Unwrap() vfs.FS { return g.FS }

func (g *walGate) wrap(name string, f vfs.File, err error) (vfs.File, error) {
	if err != nil || !strings.Contains(name, "wal") {
		return f, err
	}
	return &gatedFile{File: f, g: g}, nil
}

// Create implements vfs.FS.
func (g *walGate) Create(name string, c vfs.DiskWriteCategory) (vfs.File, error) {
	f, err := g.FS.Create(name, c)
	return g.wrap(name, f, err)
}

// OpenReadWrite implements vfs.FS.
func (g *walGate) OpenReadWrite(name string, c vfs.DiskWriteCategory, opts ...vfs.OpenOption) (vfs.File, error) {
	f, err := g.FS.OpenReadWrite(name, c, opts...)
	return g.wrap(name, f, err)
}

// ReuseForWrite implements vfs.FS.
func (g *walGate) ReuseForWrite(oldname, newname string, c vfs.DiskWriteCategory) (vfs.File, error) {
	f, err := g.FS.ReuseForWrite(oldname, newname, c)
	return g.wrap(newname, f, err)
}

type gatedFile struct {
	vfs.File
	g *walGate
}

// SyncData is the group commit's fsync: it waits at the gate.
func (f *gatedFile) SyncData() error {
	f.g.wait()
	return f.File.SyncData()
}

func (g *walGate) wait() {
	g.mu.Lock()
	if !g.holding {
		g.mu.Unlock()
		return
	}
	ch := make(chan struct{})
	g.queue = append(g.queue, ch)
	g.mu.Unlock()
	select {
	case g.arrived <- struct{}{}:
	default: // a token is pending already
	}
	<-ch
}

func (g *walGate) queued() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.queue)
}

func (g *walGate) releaseOne() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.queue) > 0 {
		close(g.queue[0])
		g.queue = g.queue[1:]
	}
}

// open lets every fsync through until the next run.
func (g *walGate) open() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.holding = false
	for _, ch := range g.queue {
		close(ch)
	}
	g.queue = nil
}

// run calls fn on a goroutine of its own with the WAL's fsyncs held, and
// lets a held fsync through only while that goroutine is blocked in the
// WAL waiting for durability. It returns fn's error once fn returned; the
// gate still holds then (the caller opens it).
func (g *walGate) run(fn func() error) error {
	g.mu.Lock()
	g.holding = true
	g.mu.Unlock()
	done := make(chan error, 1)
	gid := make(chan string, 1)
	go func() {
		gid <- goroutineID()
		done <- fn()
	}()
	me := <-gid
	for {
		select {
		case err := <-done:
			return err
		case <-g.arrived:
		}
		for g.queued() > 0 {
			select {
			case err := <-done:
				return err
			default:
			}
			if waitsInWAL(me) {
				g.releaseOne()
				continue
			}
			runtime.Gosched()
		}
	}
}

// goroutineID returns the calling goroutine's id, as stack dumps print it.
func goroutineID() string {
	b := make([]byte, 64)
	b = b[:runtime.Stack(b, false)] // "goroutine 123 [running]:..."
	f := bytes.Fields(b)
	if len(f) < 2 {
		panic(fmt.Sprintf("unexpected stack header %q", b))
	}
	return string(f[1])
}

// waitsInWAL reports whether goroutine gid is blocked in the WAL's
// durability wait (wal.(*WAL).wait, under WaitDurable and Sync). A
// goroutine blocked anywhere else, or running, does not count: a call that
// does not wait for durability never gets its fsync through.
func waitsInWAL(gid string) bool { return blockedIn(gid, "idem/wal.(*WAL).wait(") }

// blockedIn reports whether goroutine gid is blocked (neither running nor
// runnable) with the function fn on its stack.
func blockedIn(gid, fn string) bool {
	for _, g := range goroutineStacks() {
		if bytes.HasPrefix(g, []byte("goroutine "+gid+" [")) {
			return isBlockedIn(g, fn)
		}
	}
	return false
}

// anyBlockedIn reports whether some goroutine is blocked with every one
// of the functions fns on its stack.
func anyBlockedIn(fns ...string) bool {
	for _, g := range goroutineStacks() {
		if isBlockedIn(g, fns...) {
			return true
		}
	}
	return false
}

// goroutineStacks returns the stack of every goroutine, one item each
// ("goroutine 12 [select]:\n..." as runtime.Stack prints them).
func goroutineStacks() [][]byte {
	buf := make([]byte, 256<<10)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return bytes.Split(buf[:n], []byte("\n\n"))
		}
		buf = make([]byte, 2*len(buf))
	}
}

func isBlockedIn(g []byte, fns ...string) bool {
	_, g, _ = bytes.Cut(g, []byte(" ["))
	state, _, _ := bytes.Cut(g, []byte("]"))
	if bytes.HasPrefix(state, []byte("running")) || bytes.HasPrefix(state, []byte("runnable")) {
		return false
	}
	for _, fn := range fns {
		if !bytes.Contains(g, []byte(fn)) {
			return false
		}
	}
	return true
}
