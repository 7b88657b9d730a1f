package fuzz

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

// TestMain runs the child process of TestSIGKILL when IDEM_FUZZ_CHILD is
// set (the test binary re-executed), and the tests otherwise.
func TestMain(m *testing.M) {
	if dir := os.Getenv("IDEM_FUZZ_CHILD"); dir != "" {
		start, _ := strconv.Atoi(os.Getenv("IDEM_FUZZ_START"))
		os.Exit(killChild(dir, start))
	}
	os.Exit(m.Run())
}

const (
	killScope  = "k"
	killClient = "c"
	effectsLog = "effects.log" // the child's side effects, one line each
)

func killOptions() *idem.Options {
	// Small segments: the child rotates now and then, so kills land in
	// rotations too. The lease is long: in-doubt claims wait for the parent.
	return &idem.Options{SegmentSize: 64 << 10, Lease: time.Hour}
}

func idReply(id string) []byte { return []byte("reply-of-" + id) }
func seqReply(n uint64) []byte { return []byte(fmt.Sprintf("reply-of-seq-%d", n)) }
func killID(i int) string      { return fmt.Sprintf("req-%07d", i) }

// killChild is the child: it opens the engine on dir and runs Do in a loop
// (new ids, retries of old ones, a sequence-mode client), each side effect
// appended to the effects log and fsynced before its reply is returned,
// printing "ack ..." once Do returned. It runs until it is killed.
func killChild(dir string, start int) int {
	ctx := context.Background()
	e, err := idem.Open(filepath.Join(dir, "db"), killOptions())
	if err != nil {
		fmt.Fprintln(os.Stderr, "child: open:", err)
		return 3
	}
	effects, err := os.OpenFile(filepath.Join(dir, effectsLog), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 3
	}
	effect := func(line string) error {
		if _, err := effects.WriteString(line + "\n"); err != nil {
			return err
		}
		return effects.Sync()
	}
	seq, err := e.ClientState(context.Background(), killScope, killClient)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child: client state:", err)
		return 3
	}
	fmt.Println("ready")
	rng := rand.New(rand.NewPCG(uint64(start), uint64(os.Getpid())))
	for i := start; ; i++ {
		id := killID(i)
		if i > 0 && rng.IntN(4) == 0 {
			id = killID(rng.IntN(i)) // a retry: an old id must come back Done, never run again
		}
		out, err := e.Do(ctx, idem.Request{Scope: killScope, ID: []byte(id)}, func(context.Context) ([]byte, error) {
			return idReply(id), effect("i " + id)
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, "child: do", id, err)
			return 4
		}
		if !bytes.Equal(out, idReply(id)) {
			fmt.Fprintf(os.Stderr, "child: do %s: reply %q\n", id, out)
			return 5
		}
		fmt.Println("ack", id)
		if i%3 == 0 {
			n := seq + 1
			out, err := e.Do(ctx, idem.Request{Scope: killScope, Client: killClient, Seq: n}, func(context.Context) ([]byte, error) {
				return seqReply(n), effect(fmt.Sprintf("s %d", n))
			})
			if err != nil || !bytes.Equal(out, seqReply(n)) {
				fmt.Fprintln(os.Stderr, "child: seq", n, err, string(out))
				return 6
			}
			seq = n
			fmt.Println("seqack", n)
		}
	}
}

// readEffects parses the effects log, dropping a torn last line (a write
// the kill cut: the side effect did not complete).
func readEffects(t *testing.T, dir string) (ids map[string]int, seqs map[uint64]int) {
	path := filepath.Join(dir, effectsLog)
	b, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	if i := bytes.LastIndexByte(b, '\n'); i+1 != len(b) {
		b = b[:i+1]
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ids, seqs = map[string]int{}, map[uint64]int{}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		switch {
		case strings.HasPrefix(line, "i "):
			ids[line[2:]]++
		case strings.HasPrefix(line, "s "):
			n, err := strconv.ParseUint(line[2:], 10, 64)
			if err != nil {
				t.Fatalf("effects log line %q", line)
			}
			seqs[n]++
		case line == "":
		default:
			t.Fatalf("effects log line %q", line)
		}
	}
	return ids, seqs
}

// TestSIGKILL starts the child, kills it with SIGKILL at a random moment
// (during its recovery and start-up, or 10-200 ms into its loop), and
// checks on reopen: every id the child saw acknowledged is Done with its
// reply; every side effect ran at most once, and exactly once for every
// acknowledged id; in-doubt claims are resolved from the effects log
// (present: Commit, absent: Abort), after which every id whose effect ran
// is Done and every other is absent; the sequence client's state is the
// last number whose effect ran.
func TestSIGKILL(t *testing.T) {
	kills := 50
	if testing.Short() {
		kills = 10
	}
	if n, err := strconv.Atoi(os.Getenv("IDEM_FUZZ_KILLS")); err == nil && n > 0 {
		kills = n
	}
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	acked := map[string]bool{}
	var ackedSeq, lastMaxSeq uint64
	seqReplyGone := false // an aborted claim of the next number dropped the last reply
	start := 0
	var totalAcks, inDoubt, tornTails, duringStartup int
	ctx := context.Background()
	for k := 0; k < kills; k++ {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "IDEM_FUZZ_CHILD="+dir, "IDEM_FUZZ_START="+strconv.Itoa(start))
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		var (
			mu    sync.Mutex
			lines []string
		)
		ready := make(chan struct{})
		done := make(chan struct{})
		go func() {
			defer close(done)
			sc := bufio.NewScanner(out)
			once := sync.Once{}
			for sc.Scan() {
				if sc.Text() == "ready" {
					once.Do(func() { close(ready) })
					continue
				}
				mu.Lock()
				lines = append(lines, sc.Text())
				mu.Unlock()
			}
		}()
		early := rng.IntN(4) == 0
		if early {
			// Kill while the child is still recovering or starting.
			time.Sleep(time.Duration(rng.IntN(60)) * time.Millisecond)
		} else {
			select {
			case <-ready:
			case <-done:
			case <-time.After(30 * time.Second):
				t.Fatal("child never became ready")
			}
			time.Sleep(time.Duration(10+rng.IntN(191)) * time.Millisecond)
		}
		_ = cmd.Process.Signal(syscall.SIGKILL)
		<-done
		werr := cmd.Wait()
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() {
			t.Fatalf("kill %d: the child exited by itself (%v): %s", k, werr, stderr.String())
		}
		select {
		case <-ready:
		default:
			duringStartup++
		}
		mu.Lock()
		for _, l := range lines {
			switch {
			case strings.HasPrefix(l, "ack "):
				acked[l[4:]] = true
				totalAcks++
			case strings.HasPrefix(l, "seqack "):
				n, _ := strconv.ParseUint(l[7:], 10, 64)
				ackedSeq = max(ackedSeq, n)
				totalAcks++
			}
		}
		mu.Unlock()

		// Recover and check.
		e, err := idem.Open(filepath.Join(dir, "db"), killOptions())
		if err != nil {
			t.Fatalf("kill %d: reopen: %v", k, err)
		}
		tornTails += e.Stats().TornTailsCut
		ids, seqs := readEffects(t, dir)
		for id, n := range ids {
			if n > 1 {
				t.Fatalf("kill %d: the side effect of %s ran %d times", k, id, n)
			}
		}
		for n, c := range seqs {
			if c > 1 {
				t.Fatalf("kill %d: the side effect of seq %d ran %d times", k, n, c)
			}
		}
		for id := range acked {
			if ids[id] != 1 {
				t.Fatalf("kill %d: acknowledged %s ran %d times", k, id, ids[id])
			}
			l, err := e.Lookup(context.Background(), idem.Request{Scope: killScope, ID: []byte(id)})
			if err != nil || l.Status != idem.Done || !bytes.Equal(l.Reply, idReply(id)) {
				t.Fatalf("kill %d: acknowledged %s: %v %q %v", k, id, l.Status, l.Reply, err)
			}
		}
		ds, err := e.InDoubt(context.Background(), "")
		if err != nil {
			t.Fatal(err)
		}
		inDoubt += len(ds)
		seqAborted := false
		for _, d := range ds {
			switch {
			case d.Client != "" && seqs[d.Seq] == 1:
				err = d.Claim.Commit(ctx, seqReply(d.Seq))
			case d.Client != "":
				err = d.Claim.Abort(ctx)
				seqAborted = true
			case d.Client == "" && ids[string(d.ID)] == 1:
				err = d.Claim.Commit(ctx, idReply(string(d.ID)))
			default:
				err = d.Claim.Abort(ctx)
			}
			if err != nil {
				t.Fatalf("kill %d: resolving %s/%d: %v", k, d.ID, d.Seq, err)
			}
		}
		last := -1
		for id := range ids {
			i, _ := strconv.Atoi(strings.TrimPrefix(id, "req-"))
			last = max(last, i)
		}
		for i := 0; i <= last+1; i++ {
			id := killID(i)
			l, err := e.Lookup(context.Background(), idem.Request{Scope: killScope, ID: []byte(id)})
			if err != nil {
				t.Fatal(err)
			}
			if want := ids[id] == 1; (l.Status == idem.Done) != want || (want && !bytes.Equal(l.Reply, idReply(id))) {
				t.Fatalf("kill %d: %s: %v %q, side effect ran: %v", k, id, l.Status, l.Reply, want)
			}
		}
		var maxSeq uint64
		for n := range seqs {
			maxSeq = max(maxSeq, n)
		}
		if n, err := e.ClientState(context.Background(), killScope, killClient); err != nil || n != maxSeq || n < ackedSeq {
			t.Fatalf("kill %d: client state %d (%v), last effect %d, last acknowledged %d", k, n, err, maxSeq, ackedSeq)
		}
		// Starting seq n+1 drops the reply of n (it is never retried), even
		// if that claim is then aborted.
		if maxSeq > lastMaxSeq {
			seqReplyGone = false
		}
		lastMaxSeq = maxSeq
		seqReplyGone = seqReplyGone || seqAborted
		if maxSeq > 0 {
			l, err := e.Lookup(context.Background(), idem.Request{Scope: killScope, Client: killClient, Seq: maxSeq})
			want, wantErr := idem.Done, error(nil)
			if seqReplyGone {
				// Lookup answers as Begin: the number ran, its reply went.
				want, wantErr = idem.Absent, idem.ErrAlreadyCommitted
			}
			if !errors.Is(err, wantErr) || l.Status != want || (want == idem.Done && !bytes.Equal(l.Reply, seqReply(maxSeq))) {
				t.Fatalf("kill %d: seq %d: %v %q %v, want %v", k, maxSeq, l.Status, l.Reply, err, want)
			}
		}
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
		start = last + 2
	}
	t.Logf("TestSIGKILL: %d kills (%d during recovery/start-up), %d acknowledged requests checked, %d claims found in doubt and resolved, %d torn WAL tails cut, 0 violations",
		kills, duringStartup, totalAcks, inDoubt, tornTails)
}
