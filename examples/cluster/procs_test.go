package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// The tests of this package run the example as its users do: `idem serve`
// nodes and replicas of the application as OS processes on loopback,
// built once (without -race, whatever the test binary is built with) into
// a directory removed when the tests end.

var build struct {
	once           sync.Once
	dir, idem, app string
	err            error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if build.dir != "" {
		os.RemoveAll(build.dir)
	}
	os.Exit(code)
}

// binaries builds cmd/idem and this example (with the crash hook of
// crashhook.go, which does nothing unless its variable is set).
func binaries(t *testing.T) (idemBin, appBin string) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds cmd/idem and the example, and runs them as processes")
	}
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("the go command is not on PATH: cannot build cmd/idem and the example")
	}
	build.once.Do(func() {
		if build.dir, build.err = os.MkdirTemp("", "idem-cluster-example-"); build.err != nil {
			return
		}
		build.idem, build.app = filepath.Join(build.dir, "idem"), filepath.Join(build.dir, "cluster")
		t0 := time.Now()
		// One go build for both: they link in parallel.
		ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
		defer cancel()
		out, err := exec.CommandContext(ctx, "go", "build", "-tags", "crashhook", "-o", build.dir+string(filepath.Separator), "github.com/idemdb/idem/cmd/idem", ".").CombinedOutput()
		if err != nil {
			build.err = fmt.Errorf("go build: %v\n%s", err, out)
			return
		}
		fmt.Fprintf(os.Stderr, "built idem and the example in %v\n", time.Since(t0).Round(time.Millisecond))
	})
	if build.err != nil {
		t.Fatal(build.err)
	}
	return build.idem, build.app
}

// proc is a process the test started (and may start again with the same
// arguments); its stderr goes to a log file kept in the test's directory
// and shown when the test fails.
type proc struct {
	t      *testing.T
	name   string
	args   []string
	env    []string
	logf   *os.File
	cmd    *exec.Cmd
	exited chan struct{} // closed when the running process has exited
}

func newProc(t *testing.T, logDir, name string, env []string, bin string, args ...string) *proc {
	f, err := os.OpenFile(filepath.Join(logDir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	p := &proc{t: t, name: name, args: append([]string{bin}, args...), env: env, logf: f}
	t.Cleanup(func() {
		p.kill(syscall.SIGKILL)
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

// start starts the process and waits for the stdout line matching ready;
// it returns the line's submatches.
func (p *proc) start(ctx context.Context, ready *regexp.Regexp) []string {
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

// running reports whether the process is started and has not exited.
func (p *proc) running() bool {
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

// signal sends sig; for SIGKILL it returns once the process is reaped.
func (p *proc) signal(sig syscall.Signal) {
	if !p.running() {
		return
	}
	_ = p.cmd.Process.Signal(sig)
}

func (p *proc) kill(sig syscall.Signal) {
	if !p.running() {
		return
	}
	if sig == syscall.SIGKILL {
		_ = p.cmd.Process.Signal(syscall.SIGCONT) // a stopped process dies only when continued
	}
	_ = p.cmd.Process.Signal(sig)
	<-p.exited
}

// waitExit waits for the process to exit by itself.
func (p *proc) waitExit(ctx context.Context) *os.ProcessState {
	p.t.Helper()
	select {
	case <-p.exited:
		return p.cmd.ProcessState
	case <-ctx.Done():
		p.t.Fatalf("%s did not exit: %v", p.name, ctx.Err())
		return nil
	}
}

// freeAddrs are n loopback addresses that were free a moment ago: the
// nodes bind their addresses themselves (and again after each restart),
// since --peers must name them before any node starts. The ports are
// taken below the kernel's range of ephemeral ports, so that no outgoing
// connection nor any ":0" listener (of this test or another process) can
// take one while its node is down, and are held until all n are found,
// so that they differ.
func freeAddrs(t *testing.T, n int) []string {
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
			t.Fatalf("found %d free ports below %d, want %d", len(out), lo, n)
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(10000+rand.IntN(lo-10000)))
		if l, err := net.Listen("tcp", addr); err == nil {
			defer l.Close()
			out = append(out, addr)
		}
	}
	return out
}

// node is one `idem serve` process of a testCluster.
type node struct {
	id, raft, grpc string
	p              *proc
	cc             *grpc.ClientConn // to this node only (no leader following)
}

var upLine = regexp.MustCompile(`idem serve: node \S+ up: `)

func (n *node) start(ctx context.Context) { n.p.start(ctx, upLine) }

// status is the node's own view (State, LeaderId, AppliedIndex), asked of
// it directly.
func (n *node) status(ctx context.Context) (*clusterpb.StatusResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	return clusterpb.NewClusterClient(n.cc).Status(ctx, &clusterpb.StatusRequest{})
}

// testCluster is three `idem serve` processes on loopback.
type testCluster struct {
	t     *testing.T
	nodes []*node
}

func startCluster(ctx context.Context, t *testing.T, idemBin, dir string) *testCluster {
	t.Helper()
	tc := &testCluster{t: t}
	var peers []string
	addrs := freeAddrs(t, 6)
	for i := 1; i <= 3; i++ {
		n := &node{id: fmt.Sprintf("n%d", i), raft: addrs[2*i-2], grpc: addrs[2*i-1]}
		peers = append(peers, n.id+"="+n.raft)
		tc.nodes = append(tc.nodes, n)
	}
	for _, n := range tc.nodes {
		n.p = newProc(t, dir, n.id, nil, idemBin, "serve", "--node-id", n.id, "--dir", filepath.Join(dir, n.id),
			"--raft-addr", n.raft, "--grpc-addr", n.grpc, "--peers", strings.Join(peers, ","))
		cc, err := grpc.NewClient(n.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		n.cc = cc
		t.Cleanup(func() { cc.Close() })
	}
	for _, n := range tc.nodes {
		n.start(ctx)
	}
	return tc
}

func (tc *testCluster) addrs() string {
	var a []string
	for _, n := range tc.nodes {
		a = append(a, n.grpc)
	}
	return strings.Join(a, ",")
}

// leader waits until the running nodes agree on a leader among them (it
// says it leads, and every other running node names it) and returns it.
// A paused node is left out with skip.
func (tc *testCluster) leader(ctx context.Context, skip *node) *node {
	tc.t.Helper()
	for {
		var lead *node
		agree := true
		var ids []string
		for _, n := range tc.nodes {
			if n == skip || !n.p.running() {
				continue
			}
			st, err := n.status(ctx)
			if err != nil {
				agree = false
				break
			}
			ids = append(ids, st.LeaderId)
			if st.State == "Leader" && st.LeaderId == n.id {
				lead = n
			}
		}
		if agree && lead != nil {
			for _, id := range ids {
				agree = agree && id == lead.id
			}
			if agree {
				return lead
			}
		}
		select {
		case <-ctx.Done():
			tc.t.Fatalf("the nodes agree on no leader: %v", ctx.Err())
		case <-time.After(20 * time.Millisecond): // polling the nodes' state
		}
	}
}

// caughtUp waits until the running nodes (n among them) agree on a
// leader and n has applied what that leader had applied when first asked.
func (tc *testCluster) caughtUp(ctx context.Context, n *node) {
	tc.t.Helper()
	var target uint64
	for {
		lead := tc.leader(ctx, nil)
		if target == 0 {
			if st, err := lead.status(ctx); err == nil {
				target = st.AppliedIndex
			}
		}
		if st, err := n.status(ctx); err == nil && target > 0 && st.AppliedIndex >= target {
			return
		}
		select {
		case <-ctx.Done():
			tc.t.Fatalf("%s did not catch up (index %d): %v", n.id, target, ctx.Err())
		case <-time.After(20 * time.Millisecond): // polling the nodes' state
		}
	}
}

// replica is one process of the example application.
type replica struct {
	owner, url string
	effects    string
	p          *proc
}

var servingLine = regexp.MustCompile(`serving on (http://\S+) \(keys in doubt at start: (\d+) committed, (\d+) released\)`)

func newReplica(t *testing.T, appBin, dir, owner, nodes string, env ...string) *replica {
	r := &replica{owner: owner, effects: filepath.Join(dir, owner+".jsonl")}
	r.p = newProc(t, dir, owner, env, appBin, "-addr", "127.0.0.1:0", "-owner", owner, "-effects", r.effects, "-cluster", nodes)
	return r
}

// start starts the replica and returns what it settled at start.
func (r *replica) start(ctx context.Context) (committed, released string) {
	m := r.p.start(ctx, servingLine)
	r.url = m[1]
	return m[2], m[3]
}

// answer is an HTTP response as the test keeps it.
type answer struct {
	code   int
	header http.Header
	body   []byte
}

func (a answer) String() string { return fmt.Sprintf("%d %s", a.code, bytes.TrimSpace(a.body)) }

// post sends a transfer with an Idempotency-Key to the replica.
func (r *replica) post(ctx context.Context, hc *http.Client, key, body string) (answer, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.url+"/transfers", strings.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := hc.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return answer{resp.StatusCode, resp.Header, b}, err
}

// readEffects parses a replica's effects log.
func readEffects(t *testing.T, path string) []transfer {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []transfer
	for i, line := range bytes.Split(bytes.TrimSuffix(b, []byte("\n")), []byte("\n")) {
		if len(line) == 0 {
			continue
		}
		var tr transfer
		if err := json.Unmarshal(line, &tr); err != nil {
			t.Fatalf("%s line %d: %v: %q", path, i+1, err, line)
		}
		out = append(out, tr)
	}
	return out
}
