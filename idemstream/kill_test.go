package idemstream

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/idemdb/idem"
)

// The SIGKILL tests re-execute the test binary as a consumer process
// (IDEM_STREAM_CHILD=<mode>:<dir>) that moves a deterministic stream from a
// file-backed broker into a file-backed ledger, and kill it: at a chosen
// window (IDEM_STREAM_CRASH=<window>:<n>, the child kills itself with
// SIGKILL there) or at a random moment (the parent kills it).

func TestMain(m *testing.M) {
	if spec := os.Getenv("IDEM_STREAM_CHILD"); spec != "" {
		os.Exit(killChild(spec, os.Getenv("IDEM_STREAM_CRASH")))
	}
	os.Exit(m.Run())
}

// killStream is the stream of the SIGKILL tests: 240 events (10% of them
// producer duplicates), or IDEM_STREAM_EVENTS for a longer run.
func killStream() []Event {
	n := 240
	if v, err := strconv.Atoi(os.Getenv("IDEM_STREAM_EVENTS")); err == nil && v >= 20 {
		n = v
	}
	return makeEvents(n-n/10, 3, n/10)
}

// fileBroker: the stream is killStream(); acks are lines in acks.log.
type fileBroker struct {
	mu     sync.Mutex
	evs    []Event
	acked  []bool
	f      *os.File
	cursor int
}

func openFileBroker(dir string) (*fileBroker, error) {
	b := &fileBroker{evs: killStream()}
	b.acked = make([]bool, len(b.evs))
	data, err := os.ReadFile(filepath.Join(dir, "acks.log"))
	if err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if i, err := strconv.Atoi(line); err == nil && i >= 0 && i < len(b.acked) {
			b.acked[i] = true
		}
	}
	b.f, err = os.OpenFile(filepath.Join(dir, "acks.log"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	return b, err
}

func (b *fileBroker) Fetch(ctx context.Context, n int) ([]Message, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []Message
	for scanned := 0; scanned < len(b.evs) && len(out) < n; scanned++ {
		i := b.cursor
		b.cursor = (b.cursor + 1) % len(b.evs)
		if b.acked[i] {
			continue
		}
		out = append(out, Message{Event: b.evs[i], Ack: func(context.Context) error {
			b.mu.Lock()
			defer b.mu.Unlock()
			b.acked[i] = true
			_, err := fmt.Fprintf(b.f, "%d\n", i)
			return err
		}})
	}
	return out, nil
}

func (b *fileBroker) done() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, a := range b.acked {
		if !a {
			return false
		}
	}
	return true
}

// fileLedger is plan A's effect target: one line per applied event.
type fileLedger struct {
	mu      sync.Mutex
	f       *os.File
	applied map[string]int
}

func openFileLedger(dir string) (*fileLedger, error) {
	l := &fileLedger{applied: map[string]int{}}
	data, err := os.ReadFile(filepath.Join(dir, "ledger.log"))
	if err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if line != "" {
			l.applied[line]++
		}
	}
	l.f, err = os.OpenFile(filepath.Join(dir, "ledger.log"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	return l, err
}

func (l *fileLedger) handler(ctx context.Context, ev Event) (Effect, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, err := l.f.WriteString(string(ev.ID) + "\n"); err != nil {
		return Effect{}, err
	}
	l.applied[string(ev.ID)]++
	return Effect{Result: []byte("posted " + string(ev.ID))}, nil
}

func (l *fileLedger) recoverFn(ctx context.Context, d InDoubtEvent) (Resolution, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.applied[string(d.ID)] > 0 {
		return Resolution{Applied: true, Result: []byte("posted " + string(d.ID))}, nil
	}
	return Resolution{}, nil
}

// fileTxnLedger is plan B's transactional target: a transaction is a file
// txn-<checkpoint>-<nonce>.<state> listing its events; pre-commit, commit
// and abort rename it (atomic). Only committed files count. Protocol
// violations are appended to violations.log.
type fileTxnLedger struct{ dir string }

// FileTxn is the handle serialized into the checkpoint.
type FileTxn struct {
	Name string
	Ckpt uint64
}

func (l *fileTxnLedger) path(t *FileTxn, state string) string {
	return filepath.Join(l.dir, "txn-"+t.Name+"."+state)
}

func (l *fileTxnLedger) violate(f string, a ...any) {
	vf, err := os.OpenFile(filepath.Join(l.dir, "violations.log"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err == nil {
		fmt.Fprintf(vf, f+"\n", a...)
		vf.Close()
	}
}

func exists(p string) bool { _, err := os.Stat(p); return err == nil }

func (l *fileTxnLedger) BeginTransaction(ctx context.Context, k uint64) (*FileTxn, error) {
	t := &FileTxn{Name: fmt.Sprintf("%d-%d", k, time.Now().UnixNano()), Ckpt: k}
	return t, os.WriteFile(l.path(t, "open"), nil, 0o644)
}

func (l *fileTxnLedger) Invoke(ctx context.Context, t *FileTxn, ev Event) error {
	f, err := os.OpenFile(l.path(t, "open"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		l.violate("invoke into %s: %v", t.Name, err)
		return err
	}
	defer f.Close()
	_, err = f.WriteString(string(ev.ID) + "\n")
	return err
}

func (l *fileTxnLedger) PreCommit(ctx context.Context, t *FileTxn) error {
	return os.Rename(l.path(t, "open"), l.path(t, "prepared"))
}

func (l *fileTxnLedger) Commit(ctx context.Context, t *FileTxn) error {
	if err := os.Rename(l.path(t, "prepared"), l.path(t, "committed")); err != nil {
		l.violate("commit of %s: %v", t.Name, err)
		return err
	}
	return nil
}

func (l *fileTxnLedger) RecoverAndCommit(ctx context.Context, t *FileTxn) error {
	if exists(l.path(t, "committed")) {
		return nil
	}
	return l.Commit(ctx, t)
}

func (l *fileTxnLedger) Abort(ctx context.Context, t *FileTxn) error {
	if exists(l.path(t, "committed")) {
		l.violate("abort of committed %s", t.Name)
		return errors.New("committed")
	}
	for _, s := range []string{"open", "prepared"} {
		if exists(l.path(t, s)) {
			return os.Rename(l.path(t, s), l.path(t, "aborted"))
		}
	}
	return nil
}

func (l *fileTxnLedger) RecoverAndAbort(ctx context.Context, t *FileTxn) error {
	return l.Abort(ctx, t)
}

func (l *fileTxnLedger) AbortCheckpoint(ctx context.Context, k uint64) error {
	m, _ := filepath.Glob(filepath.Join(l.dir, fmt.Sprintf("txn-%d-*.open", k)))
	for _, p := range m {
		if err := os.Rename(p, strings.TrimSuffix(p, ".open")+".aborted"); err != nil {
			return err
		}
	}
	return nil
}

// contents returns the committed events, and the transactions not ended.
func (l *fileTxnLedger) contents() (committed map[string]int, unended []string, violations string) {
	committed = map[string]int{}
	all, _ := filepath.Glob(filepath.Join(l.dir, "txn-*"))
	for _, p := range all {
		switch filepath.Ext(p) {
		case ".committed":
			data, _ := os.ReadFile(p)
			for _, line := range strings.Split(string(data), "\n") {
				if line != "" {
					committed[line]++
				}
			}
		case ".open", ".prepared":
			unended = append(unended, filepath.Base(p))
		}
	}
	v, _ := os.ReadFile(filepath.Join(l.dir, "violations.log"))
	return committed, unended, string(v)
}

// killChild is the consumer process. It prints "ready" once recovered and
// "done" once the whole stream is acknowledged.
func killChild(spec, crash string) int {
	mode, dir, _ := strings.Cut(spec, ":")
	var crashWin window
	crashN := 0
	if crash != "" {
		w, n, _ := strings.Cut(crash, ":")
		crashWin, crashN = window(w), atoi(n)
	}
	var hits int
	var hmu sync.Mutex
	maybeDie := func(w window) {
		hmu.Lock()
		defer hmu.Unlock()
		if w == crashWin {
			hits++
			if hits == crashN {
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				select {}
			}
		}
	}
	ctx := context.Background()
	e, err := idem.Open(filepath.Join(dir, "db"), &idem.Options{SegmentSize: 256 << 10, Lease: time.Hour})
	if err != nil {
		fmt.Fprintln(os.Stderr, "child: open:", err)
		return 3
	}
	b, err := openFileBroker(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child: broker:", err)
		return 3
	}
	stop, cancel := context.WithCancel(ctx)
	defer cancel()
	// Stop once the whole stream is acknowledged (perhaps already, by a
	// run killed before it said done).
	go func() {
		for stop.Err() == nil {
			if b.done() {
				cancel()
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	// Each batch is reported on a progress line. With
	// IDEM_STREAM_HOLD=<r>, the parent kills the process when it reads
	// the r-th: the process goes on with batch r+1 (the kill lands
	// somewhere in it, or after it) and then waits to be killed (it never
	// fetches batch r+2 nor exits), so every such run is killed mid-stream.
	hold := atoi(os.Getenv("IDEM_STREAM_HOLD"))
	batches := 0
	opts := ConsumeOptions{BatchSize: 12, Concurrency: 6, OnBatch: func(msgs []Message, _ []Outcome) {
		batches++
		fmt.Printf("batch %d %d\n", batches, len(msgs))
	}}
	var src Source = b
	if hold > 0 {
		src = &holdingSource{src: b, after: hold + 1}
	}
	switch mode {
	case "sink":
		l, err := openFileLedger(dir)
		if err != nil {
			fmt.Fprintln(os.Stderr, "child: ledger:", err)
			return 3
		}
		// What the killed process left: the frontier is exactly the
		// highest committed offset of each partition.
		if err := frontierExact(e, "ledger", b.evs); err != nil {
			fmt.Fprintln(os.Stderr, "child: frontier after the kill:", err)
			return 6
		}
		s, err := newSinkWithHook(ctx, e, "ledger", &SinkOptions{Recover: l.recoverFn}, func(w window, _ *Event) error {
			maybeDie(w)
			return nil
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, "child: sink:", err)
			return 4
		}
		fmt.Println("ready")
		err = Consume(stop, src, s, l.handler, &opts)
		if !errors.Is(err, context.Canceled) {
			fmt.Fprintln(os.Stderr, "child: consume:", err)
			return 5
		}
		for p, want := range maxOffsets(b.evs) {
			if got, _, err := s.Frontier(p); err != nil || got != want {
				fmt.Fprintf(os.Stderr, "child: frontier of %s: %d %v, want %d\n", p, got, err, want)
				return 6
			}
		}
	case "2pc":
		l := &fileTxnLedger{dir: dir}
		if err := takeName(e, "sink", "tx"); err != nil {
			return 4
		}
		tp := newTwoPhase[*FileTxn](e, "tx", l, TwoPhaseOptions{MaxHandleSize: 1 << 10, CommitRetries: 3})
		tp.hook = func(w window, k uint64) error { maybeDie(w); return nil }
		rep, err := tp.recover(ctx)
		if err != nil {
			fmt.Fprintln(os.Stderr, "child: recovery:", err)
			return 4
		}
		fmt.Printf("ready %s %d\n", rep.Action, rep.LastCheckpoint)
		err = ConsumeTwoPhase(stop, src, tp, &opts)
		if !errors.Is(err, context.Canceled) {
			fmt.Fprintln(os.Stderr, "child: consume:", err)
			return 5
		}
	default:
		return 2
	}
	if hold > 0 {
		select {} // the stream ended first: wait for the kill all the same
	}
	if err := e.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "child: close:", err)
		return 7
	}
	fmt.Println("done")
	return 0
}

// holdingSource blocks the consumer for good once it has handed out
// `after` batches (Consume may fetch a batch while the previous one is
// settled: counting the batches settled would let it run ahead).
type holdingSource struct {
	src     Source
	fetched int // batches handed out (Fetch is called by one goroutine)
	after   int
}

func (h *holdingSource) Fetch(ctx context.Context, n int) ([]Message, error) {
	if h.fetched >= h.after {
		select {}
	}
	msgs, err := h.src.Fetch(ctx, n)
	if len(msgs) > 0 {
		h.fetched++
	}
	return msgs, err
}

func atoi(s string) int { n, _ := strconv.Atoi(s); return n }

type childResult struct {
	killed  bool
	out     string // without the progress lines
	stderr  string
	batches int // progress lines read
	// killedByParent: runChild sent the SIGKILL (killed without it: the
	// child killed itself at a window).
	killedByParent bool
}

// runChild runs one consumer process; killAtBatch > 0 kills it from
// outside when it reports that many batches (it holds the process
// mid-stream until then: see IDEM_STREAM_HOLD).
func runChild(t *testing.T, mode, dir, crash string, killAtBatch int) childResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "IDEM_STREAM_CHILD="+mode+":"+dir, "IDEM_STREAM_CRASH="+crash, "IDEM_STREAM_HOLD="+strconv.Itoa(killAtBatch))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var lines []string
	sc := bufio.NewScanner(out)
	batches, sent := 0, false
	for sc.Scan() {
		if strings.HasPrefix(sc.Text(), "batch ") {
			batches++
			if batches == killAtBatch {
				sent = cmd.Process.Kill() == nil
			}
			continue
		}
		lines = append(lines, sc.Text())
	}
	err = cmd.Wait()
	if ctx.Err() != nil {
		t.Fatalf("child %s (crash %q) still running after 60 s; stderr: %s", mode, crash, stderr.String())
	}
	res := childResult{out: strings.Join(lines, "\n"), stderr: stderr.String(), batches: batches, killedByParent: sent}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
			res.killed = true
			return res
		}
	}
	if err != nil {
		t.Fatalf("child %s (crash %q): %v\nstdout: %s\nstderr: %s", mode, crash, err, res.out, res.stderr)
	}
	return res
}

func checkKillRun(t *testing.T, mode, dir string) {
	t.Helper()
	res := runChild(t, mode, dir, "", 0)
	if res.killed || !strings.HasSuffix(res.out, "done") {
		t.Fatalf("final run did not finish: %+v", res)
	}
	evs := killStream()
	switch mode {
	case "sink":
		l, err := openFileLedger(dir)
		if err != nil {
			t.Fatal(err)
		}
		l.f.Close()
		checkExactlyOnce(t, l.applied, evs)
	case "2pc":
		committed, unended, violations := (&fileTxnLedger{dir: dir}).contents()
		if violations != "" {
			t.Fatalf("protocol violations:\n%s", violations)
		}
		if len(unended) > 0 {
			t.Fatalf("transactions never ended: %v", unended)
		}
		checkExactlyOnce(t, committed, evs)
	}
}

// TestSIGKILLWindows kills a real consumer process with SIGKILL at each
// window of both protocols (and during recovery), restarts it until the
// stream is consumed, and checks the ledger: every event's effect exactly
// once, no transaction left open, no protocol violation.
func TestSIGKILLWindows(t *testing.T) {
	type tc struct {
		mode   string
		crash  []string // crash spec of each killed run, in order
		action string   // the 2PC recovery action of the run after the first kill
	}
	cases := []tc{
		{"sink", []string{"after-claim:30"}, ""},
		{"sink", []string{"after-effect:30"}, ""},
		{"sink", []string{"after-commit:30"}, ""},
		{"sink", []string{"before-ack:3"}, ""},
		{"sink", []string{"after-effect:30", "during-recovery:1"}, ""},
		{"2pc", []string{"before-pre-commit:3"}, "aborted"},
		{"2pc", []string{"after-pre-commit:3"}, "aborted"},
		{"2pc", []string{"after-checkpoint:3"}, "committed"},
		{"2pc", []string{"after-sink-commit:3"}, "committed"},
		{"2pc", []string{"before-ack:3"}, "committed"}, // the sink's commit is recorded by recovery only
		{"2pc", []string{"after-checkpoint:3", "during-recovery:1"}, "committed"},
		{"2pc", []string{"after-pre-commit:3", "during-recovery:1"}, "aborted"},
	}
	for _, c := range cases {
		t.Run(c.mode+"/"+strings.Join(c.crash, "+"), func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			for i, crash := range c.crash {
				res := runChild(t, c.mode, dir, crash, 0)
				if !res.killed {
					t.Fatalf("run %d was not killed at %s: %+v", i, crash, res)
				}
				if strings.HasPrefix(crash, "during-recovery") && strings.HasPrefix(res.out, "ready") {
					t.Fatalf("run %d was killed after its recovery, not during it", i)
				}
			}
			if c.mode == "2pc" {
				// Recovery's decision for the checkpoint the kill interrupted.
				res := runChild(t, c.mode, dir, "before-ack:1", 0)
				first := strings.SplitN(res.out, "\n", 2)[0]
				if want := "ready " + c.action + " 3"; first != want {
					t.Fatalf("recovery said %q, want %q", first, want)
				}
			}
			checkKillRun(t, c.mode, dir)
		})
	}
}

// TestSIGKILLRandom kills the consumer process at random moments, several
// times, then lets it finish and checks the ledger. Longer:
// IDEM_STREAM_KILLS=50 IDEM_STREAM_EVENTS=20000.
func TestSIGKILLRandom(t *testing.T) {
	kills := 4
	if n, err := strconv.Atoi(os.Getenv("IDEM_STREAM_KILLS")); err == nil && n > 0 {
		kills = n
	}
	for _, mode := range []string{"sink", "2pc"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			seed := uint64(time.Now().UnixNano())
			rng := rand.New(rand.NewPCG(seed, 1))
			for k := 0; k < kills; k++ {
				// Killed while it runs the batch after the r-th.
				r := 1 + rng.IntN(3)
				res := runChild(t, mode, dir, "", r)
				if !res.killed || !res.killedByParent || res.batches < r || res.batches > r+1 || strings.Contains(res.out, "done") {
					t.Fatalf("run %d (seed %d) was not killed by the test after batch %d: %+v", k, seed, r, res)
				}
			}
			checkKillRun(t, mode, dir)
			t.Logf("%d kills (seed %d)", kills, seed)
		})
	}
}
