// Package proctest holds what the tests that run idem as OS processes
// share (idemcluster's `idem serve` tests, examples/cluster's fleet):
// loopback addresses for processes that bind them themselves, a process
// that is started, signalled and restarted with the same arguments, and a
// gRPC stats handler that tells when a request has been handed to its
// connection (so that a test gates on that rather than sleeping).
package proctest

import (
	"bufio"
	"context"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"google.golang.org/grpc/stats"
)

// FreeAddrs are n loopback addresses that were free a moment ago: for
// processes that bind their addresses themselves (and again after each
// restart), since a cluster's --peers must name them before any node
// starts. The ports are taken below the kernel's range of ephemeral
// ports, so that no outgoing connection nor any ":0" listener (of this
// test or another process) can take one while its process is down, and
// are held until all n are found, so that they differ.
func FreeAddrs(t testing.TB, n int) []string {
	t.Helper()
	lo := 32768 // Linux's default start of the ephemeral range
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if p, err := strconv.Atoi(f[0]); err == nil && p > 12000 {
				lo = p
			}
		}
	}
	var out []string
	for try := 0; len(out) < n; try++ {
		if try == 1000 {
			t.Fatalf("proctest: found %d free ports below %d, want %d", len(out), lo, n)
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(10000+rand.IntN(lo-10000)))
		if l, err := net.Listen("tcp", addr); err == nil {
			defer l.Close()
			out = append(out, addr)
		}
	}
	return out
}

// Proc is a process the test started (and may start again with the same
// arguments); its stderr goes to a log file in the directory given to New,
// whose end is logged when the test fails. The test's cleanup kills it.
type Proc struct {
	t      testing.TB
	name   string
	args   []string
	env    []string
	logf   *os.File
	cmd    *exec.Cmd
	exited chan struct{} // closed when the running process has exited
}

// New prepares the process name: bin with args, env added to the test's
// environment. It does not start it.
func New(t testing.TB, logDir, name string, env []string, bin string, args ...string) *Proc {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(logDir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	p := &Proc{t: t, name: name, args: append([]string{bin}, args...), env: env, logf: f}
	t.Cleanup(func() {
		p.Kill(syscall.SIGKILL)
		if t.Failed() {
			if b, err := os.ReadFile(f.Name()); err == nil && len(b) > 0 {
				if len(b) > 3000 {
					b = b[len(b)-3000:]
				}
				t.Logf("stderr of %s (the end):\n%s", name, b)
			}
		}
		f.Close()
	})
	return p
}

// Name is the name given to New.
func (p *Proc) Name() string { return p.name }

// Start starts the process and waits for the stdout line matching ready;
// it returns the line's submatches. It fails the test if the process
// exits first or ctx ends.
func (p *Proc) Start(ctx context.Context, ready *regexp.Regexp) []string {
	p.t.Helper()
	cmd := exec.Command(p.args[0], p.args[1:]...)
	cmd.Env = append(os.Environ(), p.env...)
	cmd.Stderr = p.logf
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		p.t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		p.t.Fatalf("starting %s: %v", p.name, err)
	}
	p.cmd, p.exited = cmd, make(chan struct{})
	found := make(chan []string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if m := ready.FindStringSubmatch(sc.Text()); m != nil {
				select {
				case found <- m:
				default:
				}
			}
		}
		// stdout is closed: the process exited (or closed it); reap it.
		_ = cmd.Wait()
		close(p.exited)
	}()
	select {
	case m := <-found:
		return m
	case <-p.exited:
		p.t.Fatalf("%s exited before it was ready: %v", p.name, cmd.ProcessState)
	case <-ctx.Done():
		p.t.Fatalf("%s: not ready: %v", p.name, ctx.Err())
	}
	return nil
}

// Running reports whether the process is started and has not exited.
func (p *Proc) Running() bool {
	if p.cmd == nil {
		return false
	}
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

// Signal sends sig to the running process (SIGSTOP, SIGCONT, SIGTERM...)
// and returns at once.
func (p *Proc) Signal(sig syscall.Signal) {
	if !p.Running() {
		return
	}
	_ = p.cmd.Process.Signal(sig)
}

// Kill sends sig and returns once the process has exited (a stopped
// process is continued first when sig is SIGKILL).
func (p *Proc) Kill(sig syscall.Signal) {
	if !p.Running() {
		return
	}
	if sig == syscall.SIGKILL {
		_ = p.cmd.Process.Signal(syscall.SIGCONT) // a stopped process dies only when continued
	}
	_ = p.cmd.Process.Signal(sig)
	<-p.exited
}

// WaitExit waits for the process to exit by itself.
func (p *Proc) WaitExit(ctx context.Context) *os.ProcessState {
	p.t.Helper()
	select {
	case <-p.exited:
		return p.cmd.ProcessState
	case <-ctx.Done():
		p.t.Fatalf("%s did not exit: %v", p.name, ctx.Err())
		return nil
	}
}

// SentCounter is a gRPC client stats.Handler (grpc.WithStatsHandler) that
// sends on C each time a request message has been handed to the
// connection: a test that asks a paused process (SIGSTOP) receives from C
// once per request before it continues the process, so that the requests
// are waiting in its socket and not still in the client.
type SentCounter struct{ C chan struct{} }

// NewSentCounter returns a SentCounter whose C holds up to n reports
// (more are dropped).
func NewSentCounter(n int) *SentCounter { return &SentCounter{C: make(chan struct{}, n)} }

// Drain discards the reports so far (those of requests made before the
// ones to count).
func (s *SentCounter) Drain() {
	for len(s.C) > 0 {
		<-s.C
	}
}

func (s *SentCounter) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context { return ctx }
func (s *SentCounter) HandleRPC(_ context.Context, st stats.RPCStats) {
	if p, ok := st.(*stats.OutPayload); ok && p.Client {
		select {
		case s.C <- struct{}{}:
		default:
		}
	}
}
func (s *SentCounter) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (s *SentCounter) HandleConn(context.Context, stats.ConnStats)                       {}

var _ stats.Handler = (*SentCounter)(nil)
