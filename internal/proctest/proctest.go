// Package proctest holds what the tests that run idem as OS processes
// share (idemcluster's `idem serve` tests, examples/cluster's fleet,
// idemraft's process test): loopback addresses for processes that bind
// them themselves, a process that is started, signalled and restarted with
// the same arguments, a gRPC stats handler that tells when a request has
// been handed to its connection (so that a test gates on that rather than
// sleeping), and the leader of a cluster of such processes, paused before
// it is acted on so that a test that means to kill the leader does
// (PauseLeader).
package proctest

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

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

// Kill sends sig and returns once the process has exited. SIGKILL ends a
// stopped (SIGSTOP) process without it running again; other signals are
// followed by SIGCONT, so that a stopped process receives them.
func (p *Proc) Kill(sig syscall.Signal) {
	if !p.Running() {
		return
	}
	_ = p.cmd.Process.Signal(sig)
	if sig != syscall.SIGKILL {
		_ = p.cmd.Process.Signal(syscall.SIGCONT)
	}
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

// View is a raft node's own view, asked of the node itself (no leader
// following): its state ("Leader", "Follower", "Candidate", ...), the
// leader it follows ("" when it knows none) and its current term.
type View struct {
	State, LeaderID string
	Term            uint64
}

// Member is a node of a raft cluster run as a process, as PauseLeader and
// Leader see it. *Proc gives Name, Running, Signal and Kill (Name must be
// the node's raft id); the test adds View (idemcluster/clustertest.ServeNode does
// for `idem serve`).
type Member interface {
	Name() string
	Running() bool
	Signal(sig syscall.Signal)
	Kill(sig syscall.Signal)
	View(ctx context.Context) (View, error)
}

// views asks the running members for their views, concurrently, each
// bounded by a second. ok is false when one of them did not answer.
func views(ctx context.Context, nodes []Member) (out map[Member]View, ok bool) {
	type answer struct {
		m   Member
		v   View
		err error
	}
	ch := make(chan answer, len(nodes))
	n := 0
	for _, m := range nodes {
		if !m.Running() {
			continue
		}
		n++
		go func() {
			vctx, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			v, err := m.View(vctx)
			ch <- answer{m, v, err}
		}()
	}
	out, ok = map[Member]View{}, true
	for range n {
		a := <-ch
		out[a.m] = a.v
		ok = ok && a.err == nil
	}
	return out, ok
}

// agreed is the member every running member (but skip) agrees leads, and
// its term: it says it is the leader, and every other one names it, in the
// same term. nil when they do not agree, or one did not answer.
func agreed(ctx context.Context, nodes []Member, skip Member) (Member, uint64) {
	vs, ok := views(ctx, others(nodes, skip))
	if !ok {
		return nil, 0
	}
	var lead Member
	for m, v := range vs {
		if v.State == "Leader" && v.LeaderID == m.Name() {
			lead = m
		}
	}
	if lead == nil {
		return nil, 0
	}
	term := vs[lead].Term
	for _, v := range vs {
		if v.LeaderID != lead.Name() || v.Term != term {
			return nil, 0
		}
	}
	return lead, term
}

// Leader waits until the running members but skip (nil: all) agree on a
// leader among them (it says it leads, and every other one names it, all
// in one term) and returns it and the term. It fails the test when ctx
// ends first. What it returns led a moment ago: a test that must act on
// the leader itself pauses it with PauseLeader.
func Leader(ctx context.Context, t testing.TB, nodes []Member, skip Member) (Member, uint64) {
	t.Helper()
	for {
		if lead, term := agreed(ctx, nodes, skip); lead != nil {
			return lead, term
		}
		select {
		case <-ctx.Done():
			t.Fatalf("proctest: the nodes agree on no leader: %v", ctx.Err())
		case <-time.After(20 * time.Millisecond): // polling the nodes' views
		}
	}
}

// Paused is a leader paused by PauseLeader.
type Paused struct {
	Lead  Member
	Term  uint64 // the term it leads
	Tries int    // leaders paused until the others confirmed one
	// views are the other running members' views once Lead was paused:
	// each a follower naming Lead, in Term.
	views map[Member]View
}

// PauseLeader pauses (SIGSTOP) the node that leads and returns it, still
// paused. A node named leader a moment ago may have lost the leadership
// since (an election on a loaded machine), so the check is made once the
// node is paused: every other running member must still be a follower
// naming it as leader in the term they all agreed on before the pause. A
// term has one leader, and a later term's needs the vote of one of them
// (raft's majority), which would have moved it to that term: the paused
// node led the newest term, and its loss forces an election. When the
// others disagree, the node is continued (SIGCONT) and the leader looked
// for again. The caller kills the node (SIGKILL ends a paused process
// without it running again) or continues it, then may call NextLeader.
func PauseLeader(ctx context.Context, t testing.TB, nodes []Member) *Paused {
	t.Helper()
	for tries := 1; ; tries++ {
		lead, term := Leader(ctx, t, nodes, nil)
		lead.Signal(syscall.SIGSTOP)
		vs, ok := views(ctx, others(nodes, lead))
		still := ok && len(vs) > 0
		for _, v := range vs {
			still = still && v.State == "Follower" && v.LeaderID == lead.Name() && v.Term == term
		}
		if still {
			return &Paused{Lead: lead, Term: term, Tries: tries, views: vs}
		}
		lead.Signal(syscall.SIGCONT)
		t.Logf("proctest: %s was paused as leader of term %d, but the others then said %s: continued, looking again", lead.Name(), term, describe(vs))
		if ctx.Err() != nil {
			t.Fatalf("proctest: no leader paused: %v", ctx.Err())
		}
	}
}

// NextLeader waits until the running members but the paused one agree on
// a leader, and checks that it leads a later term than the paused node did
// and was one of its followers when it was paused: an election followed
// the leader's loss. It fails the test otherwise (the node paused did not
// lead).
func (p *Paused) NextLeader(ctx context.Context, t testing.TB, nodes []Member) Member {
	t.Helper()
	next, term := Leader(ctx, t, others(nodes, p.Lead), nil)
	if v, ok := p.views[next]; !ok || v.State != "Follower" || v.LeaderID != p.Lead.Name() || term <= p.Term {
		t.Fatalf("proctest: %s leads in term %d after %s was paused as leader of term %d, but said %q, leader %q, term %d when it was paused: %s was not the leader (the others said %s)",
			next.Name(), term, p.Lead.Name(), p.Term, v.State, v.LeaderID, v.Term, p.Lead.Name(), describe(p.views))
	}
	return next
}

func others(nodes []Member, skip Member) []Member {
	var out []Member
	for _, m := range nodes {
		if m != skip {
			out = append(out, m)
		}
	}
	return out
}

func describe(vs map[Member]View) string {
	var parts []string
	for m, v := range vs {
		parts = append(parts, fmt.Sprintf("%s: %s, leader %q, term %d", m.Name(), v.State, v.LeaderID, v.Term))
	}
	sort.Strings(parts)
	return strings.Join(parts, "; ")
}
