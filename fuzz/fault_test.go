package fuzz

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/idemdb/idem"
)

// A fault-index sweep, the way Pebble and etcd test their I/O paths: run a
// small scenario failing the 1st operation of a kind, then the 2nd, and so
// on until a run completes without reaching the fault. Kinds: write, sync,
// create, rename, remove; errors: EIO once, ENOSPC from then on (a full
// disk stays full), and a torn ENOSPC write (half the bytes land, then the
// error). After each run:
//
//   - every step that returned success matched the model, and the step that
//     returned an error is uncertain (the state is before or after it);
//   - if the fault hit the WAL's write or fsync, the engine fail-stops: a
//     new Begin must fail;
//   - a crash image of the disk right after the run (only synced data), and
//     the disk itself reopened without faults, both recover to one of the
//     states the model allows, without ErrCorrupt.

type faultKind struct {
	name string
	ops  []errorfs.OpKind
}

var faultKinds = []faultKind{
	{"write", []errorfs.OpKind{errorfs.OpFileWrite, errorfs.OpFileWriteAt}},
	{"sync", []errorfs.OpKind{errorfs.OpFileSync, errorfs.OpFileSyncData, errorfs.OpFileSyncTo}},
	{"create", []errorfs.OpKind{errorfs.OpCreate, errorfs.OpReuseForWrite}},
	{"rename", []errorfs.OpKind{errorfs.OpRename}},
	{"remove", []errorfs.OpKind{errorfs.OpRemove, errorfs.OpRemoveAll}},
}

type faultMode int

const (
	eioOnce faultMode = iota
	enospcSticky
	enospcTorn // writes only: half the buffer is written, then ENOSPC
)

func (m faultMode) String() string {
	return [...]string{"EIO once", "ENOSPC from then on", "ENOSPC after a torn write"}[m]
}

// injector fails the n-th operation of its kind (counted from when it is
// armed) and, in sticky mode, every later one.
type injector struct {
	kind faultKind
	mode faultMode
	n    int
	// pathOK restricts which files count (nil: all).
	pathOK func(path string) bool

	onFire func(what string) // called as each fault is injected

	mu    sync.Mutex
	armed bool
	seen  int
	fired []string // "kind path" of each injected fault
}

func (in *injector) matches(op errorfs.Op) bool {
	for _, k := range in.kind.ops {
		if op.Kind == k {
			return in.pathOK == nil || in.pathOK(op.Path)
		}
	}
	return false
}

// decide says whether op fails now.
func (in *injector) decide(op errorfs.Op) bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	if !in.armed || !in.matches(op) {
		return false
	}
	in.seen++
	if in.seen == in.n || (in.mode == enospcSticky && in.seen > in.n) {
		what := fmt.Sprintf("%s %s", in.kind.name, op.Path)
		in.fired = append(in.fired, what)
		if in.onFire != nil {
			in.onFire(what)
		}
		return true
	}
	return false
}

func (in *injector) MaybeError(op errorfs.Op) error {
	if in.mode == enospcTorn {
		return nil // tornWriteFS does it
	}
	if !in.decide(op) {
		return nil
	}
	errno := syscall.EIO
	if in.mode != eioOnce {
		errno = syscall.ENOSPC
	}
	return fmt.Errorf("injected at %s op %d (%s): %w", in.kind.name, in.n, op.Path, errno)
}

func (in *injector) String() string { return fmt.Sprintf("%s #%d %v", in.kind.name, in.n, in.mode) }

func (in *injector) set(armed bool) {
	in.mu.Lock()
	in.armed = armed
	in.mu.Unlock()
}

func (in *injector) result() (seen int, fired []string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.seen, append([]string(nil), in.fired...)
}

// tornWriteFS makes a write the injector picks land half way and fail with
// ENOSPC, as a full disk does.
type tornWriteFS struct {
	vfs.FS
	in *injector
}

// Unwrap returns the wrapped FS (vfs.Root uses it).
func (fs *tornWriteFS) Unwrap() vfs.FS { return fs.FS }

func (fs *tornWriteFS) wrap(name string, f vfs.File, err error) (vfs.File, error) {
	if err != nil {
		return nil, err
	}
	return &tornWriteFile{File: f, name: name, in: fs.in}, nil
}

func (fs *tornWriteFS) Create(name string, c vfs.DiskWriteCategory) (vfs.File, error) {
	f, err := fs.FS.Create(name, c)
	return fs.wrap(name, f, err)
}

func (fs *tornWriteFS) OpenReadWrite(name string, c vfs.DiskWriteCategory, opts ...vfs.OpenOption) (vfs.File, error) {
	f, err := fs.FS.OpenReadWrite(name, c, opts...)
	return fs.wrap(name, f, err)
}

func (fs *tornWriteFS) ReuseForWrite(oldname, newname string, c vfs.DiskWriteCategory) (vfs.File, error) {
	f, err := fs.FS.ReuseForWrite(oldname, newname, c)
	return fs.wrap(newname, f, err)
}

type tornWriteFile struct {
	vfs.File
	name string
	in   *injector
}

func (f *tornWriteFile) torn(kind errorfs.OpKind) bool {
	return f.in.mode == enospcTorn && f.in.decide(errorfs.Op{Kind: kind, Path: f.name})
}

func (f *tornWriteFile) Write(p []byte) (int, error) {
	if f.torn(errorfs.OpFileWrite) {
		n, _ := f.File.Write(p[:len(p)/2])
		return n, fmt.Errorf("injected torn write (%s): %w", f.name, syscall.ENOSPC)
	}
	return f.File.Write(p)
}

func (f *tornWriteFile) WriteAt(p []byte, off int64) (int, error) {
	if f.torn(errorfs.OpFileWriteAt) {
		n, _ := f.File.WriteAt(p[:len(p)/2], off)
		return n, fmt.Errorf("injected torn write (%s): %w", f.name, syscall.ENOSPC)
	}
	return f.File.WriteAt(p, off)
}

// faultScenario is the small program each sweep run executes: every kind
// of record, a rotation, a compaction (snapshot, WAL truncation, index
// flush), a close and reopen with a claim in doubt, its resolution.
func faultScenario(r *runner) error {
	steps := []func() error{
		func() error { return r.openAndMatch([]*model{r.m.clone()}) },
		func() error { return r.do("", modeID, "a", 0, nil, false, 1) },
		func() error { return r.begin("s1", modeID, "b", 0, []byte("fp1"), nil) },
		func() error { return r.begin("s1", modeClient, "c1", 1, nil, nil) },
		func() error { return r.finish(1, true, 1) },
		func() error { return r.do("", modeID, "c", 0, nil, false, 2) },
		func() error { return r.ack("", []string{"a"}) },
		func() error { return r.finish(0, true, 3) },
		func() error { return r.begin("", modeID, "d", 0, nil, nil) },
		func() error { r.advance(time.Second); return r.forget(500 * time.Millisecond) },
		func() error { return r.do("s2", modeID, "a", 0, nil, false, 2) },
		func() error { return r.compact() },
		func() error { return r.do("s2", modeID, "b", 0, nil, false, 3) },
		func() error { return r.do("s2", modeID, "c", 0, nil, false, 3) },
		func() error { return r.compact() },
		func() error { return r.do("s2", modeID, "e", 0, nil, true, 0) },
		func() error { return r.do("s2", modeID, "f", 0, nil, false, 1) },
		func() error { return r.reopen() },
		func() error { return r.resolve(0, true, 1) },
		func() error { return r.do("s1", modeClient, "c1", 2, nil, false, 1) },
		func() error { return r.closeEngine(true) },
	}
	for i, step := range steps {
		if err := step(); err != nil {
			return fmt.Errorf("step %d: %w", i, err)
		}
		if r.e != nil {
			if err := r.check(); err != nil {
				return fmt.Errorf("step %d: %w", i, err)
			}
		}
	}
	return nil
}

var faultCfg = config{lease: time.Minute, segmentSize: 1 << 10, keepSnapshots: 1, ingestBytes: 1, filterBytes: 64}

// runFault runs the scenario with one fault and checks the aftermath. It
// returns whether the fault was reached.
func runFault(t *testing.T, in *injector, st *counters) (reached bool) {
	r := newRunner(faultCfg, uint64(in.n), st)
	r.wrap = func(m *vfs.MemFS) vfs.FS { return errorfs.Wrap(&tornWriteFS{FS: m, in: in}, in) }
	in.set(true)
	err := faultScenario(r)
	_, fired := in.result()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("fault %v (fired at %v): %s\ntrace:\n%s", in, fired, fmt.Sprintf(format, args...), r.traceTail(40))
	}
	var u *uncertain
	switch {
	case err == nil:
		if r.e != nil {
			fail("scenario left the engine open")
		}
		r.m.epoch++
		u = &uncertain{cands: []*model{r.m.clone()}}
	case errors.As(err, &u):
		// The step that failed is uncertain. Fail-stop: after a failed WAL
		// write or fsync nothing more may be acknowledged.
		st.add(func(c *counters) { c.uncertainOps++ })
		if r.e != nil {
			walFault := false
			for _, f := range fired {
				if strings.Contains(f, "/wal/") && !strings.Contains(f, ".prealloc") &&
					(strings.HasPrefix(f, "write") || strings.HasPrefix(f, "sync")) {
					walFault = true
				}
			}
			res, perr := r.e.Begin(context.Background(), idem.Request{Scope: "probe", ID: []byte("p")})
			if perr == nil && walFault {
				fail("after a failed WAL write/fsync (%v) the engine still acknowledged a Begin (%v)", u.err, res.Status)
			}
			// A probe that succeeded is acknowledged and must survive; one
			// that failed may or may not have reached the disk.
			lease := r.clk.Now().Add(r.cfg.lease).UnixNano()
			var with []*model
			for _, c := range u.cands {
				c = c.clone()
				c.ents[mkey{"probe", modeID, "p"}] = mentry{inflight: true, leaseUntil: lease, epoch: c.epoch, tok: -1}
				with = append(with, c)
			}
			if perr == nil {
				u.cands = with
			} else {
				u.cands = append(u.cands, with...)
			}
			_ = r.closeEngine(false)
		}
	default:
		fail("%v", err)
	}
	in.set(false)
	if len(fired) == 0 && err != nil {
		fail("the scenario failed without a fault: %v", err)
	}
	// A machine crash right now: only synced data survives.
	img := r.mem.CrashClone(vfs.CrashCloneCfg{})
	for _, fs := range []*vfs.MemFS{img, r.mem} {
		r2 := newRunner(faultCfg, 1, st)
		r2.clk = r.clk
		r2.mem = fs
		if err := r2.openAndMatch(u.cands); err != nil {
			if fs == r.mem && errors.Is(err, idem.ErrLocked) {
				// Pebble parked itself after a fatal MANIFEST failure and
				// keeps its directory lock in this process; the crash
				// image above is what a new process finds.
				st.add(func(c *counters) { c.parkedIndexes++ })
				continue
			}
			fail("recovery (crash image %v): %v", fs == img, err)
		}
		_ = r2.closeEngine(false)
		st.add(func(c *counters) { c.crashImages++ })
	}
	return len(fired) > 0
}

// notIndex excludes the Pebble store's files: Pebble treats some I/O
// errors (a failed MANIFEST write, for one) as fatal. The index stops then
// and parks Pebble's goroutine for good (index.pebbleLogger), which leaks
// it with Pebble's memory and directory lock, and a panic there (Pebble's,
// or one the index failed to prevent) would end the whole test binary. The
// index is swept separately, one child process per fault point
// (TestFaultSweepIndex).
func notIndex(path string) bool { return !strings.HasPrefix(path, dbDir+"/index") }

func TestFaultSweep(t *testing.T) {
	st := &counters{}
	total, runs := 0, 0
	modes := []faultMode{eioOnce, enospcSticky, enospcTorn}
	for _, kind := range faultKinds {
		for _, mode := range modes {
			if mode == enospcTorn && kind.name != "write" {
				continue
			}
			n := 1
			for ; ; n++ {
				in := &injector{kind: kind, mode: mode, n: n, pathOK: notIndex}
				runs++
				if !runFault(t, in, st) {
					break
				}
				if n > 2000 {
					t.Fatalf("%s %v: still reaching faults after %d runs", kind.name, mode, n)
				}
			}
			total += n - 1
			t.Logf("%-6s %-26v: %3d fault points", kind.name, mode, n-1)
		}
	}
	t.Logf("TestFaultSweep: %d fault points swept in %d runs (%d uncertain steps), %d recoveries checked, 0 violations",
		total, runs, st.uncertainOps, st.crashImages)
}

// TestFaultSweepIndex sweeps the faults TestFaultSweep leaves out: those in
// the Pebble store (<dir>/index). Some of them stop Pebble for good (see
// notIndex), so every fault point runs in a child process (the test binary
// re-executed as TestFaultChild). A violation, a panic or a hang fails the
// test, naming the fault that caused it; the first stack of each distinct
// panic or hang is logged. A child that has not ended after childTimeout
// (a few seconds is usual) is run again with confirmTimeout, so that a
// loaded machine cannot pass for a hang: a hang is a child that does not
// end in either (SIGABRT then, for a goroutine dump). The sweep of a fault
// kind stops at its first hang (each costs both timeouts).
//
// IDEM_FUZZ_INDEX_FAULTS=1 sweeps every fault point (a few minutes);
// IDEM_FUZZ_INDEX_FAULTS=N (N > 1) sweeps every N-th: points k, k+N,
// k+2N, ... of each kind and mode, where k = 1 + (the kind and mode's
// position in the sweep) mod N, so the subset is fixed and the kinds
// together cover every residue. CI runs IDEM_FUZZ_INDEX_FAULTS=3
// (.ci/run). Without the variable the test is skipped.
func TestFaultSweepIndex(t *testing.T) {
	env := os.Getenv("IDEM_FUZZ_INDEX_FAULTS")
	if env == "" {
		t.Skip("set IDEM_FUZZ_INDEX_FAULTS=1 to sweep faults in the index's files (one child process per fault point), =N for every N-th point")
	}
	stride, err := strconv.Atoi(env)
	if err != nil || stride < 1 {
		t.Fatalf("IDEM_FUZZ_INDEX_FAULTS=%q: want 1 (every fault point) or N > 1 (every N-th)", env)
	}
	failures := map[string][]string{} // panic or hang message -> faults
	points, runs, parked, combo := 0, 0, 0, 0
	for ki, kind := range faultKinds {
		for _, mode := range []faultMode{eioOnce, enospcSticky, enospcTorn} {
			if mode == enospcTorn && kind.name != "write" {
				continue
			}
			swept := 0
			n := 1 + combo%stride
			combo++
			for ; n < 5000; n += stride {
				runs++
				text, hung, err := faultChild(t, ki, mode, n, childTimeout)
				if hung {
					runs++
					t.Logf("%s #%d %v: no end after %v, run again with %v", kind.name, n, mode, childTimeout, confirmTimeout)
					text, hung, err = faultChild(t, ki, mode, n, confirmTimeout)
				}
				var fired []string
				for _, l := range strings.Split(text, "\n") {
					if f, ok := strings.CutPrefix(l, "FIRED "); ok {
						fired = append(fired, f)
					}
				}
				where := "?"
				if len(fired) > 0 {
					where = fired[0]
				}
				fault := fmt.Sprintf("%s #%d %v at %s", kind.name, n, mode, where)
				if hung {
					msg := "HANG (no end within " + childTimeout.String() + ", then " + confirmTimeout.String() + "): " + stuckIn(text)
					if len(failures[msg]) == 0 {
						t.Logf("first %s (%s):\n%s", msg, fault, text)
					}
					failures[msg] = append(failures[msg], fault)
					swept++
					t.Errorf("%-6s %-26v: sweep stopped at its first hang, fault point %d", kind.name, mode, n)
					break
				}
				if i := strings.Index(text, "panic: "); i >= 0 {
					msg := panicNumbers.ReplaceAllString(strings.SplitN(text[i:], "\n", 2)[0], "")
					if len(failures[msg]) == 0 { // the first one's stacks, to find where
						t.Logf("first %q (%s):\n%s", msg, fault, text[i:min(len(text), i+8000)])
					}
					failures[msg] = append(failures[msg], fault)
					swept++
					continue
				}
				if err != nil {
					t.Fatalf("%s: %v\n%s", fault, err, text)
				}
				if strings.Contains(text, "UNREACHED") {
					break
				}
				swept++
				if strings.Contains(text, "\nPARKED\n") {
					parked++
				}
			}
			points += swept
			t.Logf("%-6s %-26v: %4d fault points in the index (one in %d)", kind.name, mode, swept, stride)
		}
	}
	for msg, where := range failures {
		t.Errorf("%s at %d fault points, e.g. %v", msg, len(where), where[:min(3, len(where))])
	}
	t.Logf("TestFaultSweepIndex: %d fault points (one in %d) in %d child runs, %d distinct panics or hangs; %d runs left Pebble parked (reopen refused in-process, crash image checked)",
		points, stride, runs, len(failures), parked)
}

// TestFaultChild is one fault point of TestFaultSweepIndex.
func TestFaultChild(t *testing.T) {
	spec := os.Getenv("IDEM_FUZZ_FAULT")
	if spec == "" {
		t.Skip("a child of TestFaultSweepIndex")
	}
	var ki, mode, n int
	if _, err := fmt.Sscanf(spec, "%d:%d:%d", &ki, &mode, &n); err != nil {
		t.Fatal(err)
	}
	printed := 0
	in := &injector{kind: faultKinds[ki], mode: faultMode(mode), n: n,
		pathOK: func(p string) bool { return !notIndex(p) },
		onFire: func(what string) {
			if printed++; printed <= 3 {
				fmt.Printf("\nFIRED %s\n", what)
			}
		}}
	st := &counters{}
	reached := runFault(t, in, st)
	if st.parkedIndexes > 0 {
		fmt.Println("PARKED") // Pebble kept its lock: only the crash image was reopened
	}
	if reached {
		fmt.Println("REACHED")
	} else {
		fmt.Println("UNREACHED")
	}
}

// panicNumbers strips what differs between fault points from a panic
// message, so that one kind of panic is reported once.
var panicNumbers = regexp.MustCompile(` at [a-z]+ op [0-9]+ \([^)]*\)|[0-9]{6}\.(sst|log)|-[0-9]{6}| \[recovered, repanicked\]|torn write \([^)]*\)`)

// childTimeout bounds one fault point's child process; one that takes
// longer runs again, bounded by confirmTimeout.
const (
	childTimeout   = 20 * time.Second
	confirmTimeout = 120 * time.Second
)

// faultChild runs fault point n of kind ki in mode as a child process
// (TestFaultChild) and returns its output and exit error; hung says it
// had not ended after timeout and was sent SIGABRT (a goroutine dump).
func faultChild(t *testing.T, ki int, mode faultMode, n int, timeout time.Duration) (text string, hung bool, err error) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestFaultChild$", "-test.v")
	cmd.Env = append(os.Environ(), fmt.Sprintf("IDEM_FUZZ_FAULT=%d:%d:%d", ki, mode, n))
	var out headTail
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	timer := time.AfterFunc(timeout, func() { _ = cmd.Process.Signal(syscall.SIGABRT) })
	err = cmd.Wait()
	hung = !timer.Stop()
	return out.String(), hung, err
}

// headTail keeps the first and last 32 KiB written to it.
type headTail struct {
	mu         sync.Mutex
	head, tail []byte
}

func (h *headTail) Write(p []byte) (int, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := len(p)
	if room := 32<<10 - len(h.head); room > 0 {
		k := min(room, len(p))
		h.head, p = append(h.head, p[:k]...), p[k:]
	}
	h.tail = append(h.tail, p...)
	if len(h.tail) > 64<<10 {
		h.tail = append(h.tail[:0], h.tail[len(h.tail)-32<<10:]...)
	}
	return n, nil
}

func (h *headTail) String() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return string(h.head) + "\n...\n" + string(h.tail)
}

// stuckIn names the idem functions on the stack of the goroutine dump's
// goroutines that sit in idem code (what a hung child waits in).
func stuckIn(dump string) string {
	var frames []string
	seen := map[string]bool{}
	for _, l := range strings.Split(dump, "\n") {
		if strings.HasPrefix(l, "github.com/idemdb/idem") && !strings.Contains(l, "/fuzz.") {
			f := l
			if i := strings.LastIndex(f, "("); i > 0 {
				f = f[:i]
			}
			if !seen[f] {
				seen[f] = true
				frames = append(frames, strings.TrimPrefix(f, "github.com/idemdb/idem"))
			}
		}
	}
	if len(frames) > 6 {
		frames = frames[:6]
	}
	return strings.Join(frames, " <- ")
}
