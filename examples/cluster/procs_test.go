package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemdb/idem/idemcluster/clusterpb"
	"github.com/idemdb/idem/idemcluster/clustertest"
	"github.com/idemdb/idem/internal/proctest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// The tests of this package run the example as its users do: `idem serve`
// nodes and replicas of the application as OS processes on loopback
// (internal/proctest: their addresses, the processes, the stats handler),
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

// node is one `idem serve` process of a testCluster.
type node struct {
	id, raft, grpc string
	p              *proctest.Proc
	cc             *grpc.ClientConn       // to this node only (no leader following)
	m              *clustertest.ServeNode // p and cc as a proctest.Member
}

var upLine = regexp.MustCompile(`idem serve: node \S+ up: `)

func (n *node) start(ctx context.Context) { n.p.Start(ctx, upLine) }

// status is the node's own view (State, LeaderId, AppliedIndex), asked of
// it directly.
func (n *node) status(ctx context.Context) (*clusterpb.StatusResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	return clusterpb.NewClusterClient(n.cc).Status(ctx, &clusterpb.StatusRequest{})
}

// testCluster is three `idem serve` processes on loopback.
type testCluster struct {
	t       *testing.T
	nodes   []*node
	members []proctest.Member // the nodes' m, in the same order
}

// node is the node of m.
func (tc *testCluster) node(m proctest.Member) *node {
	for _, n := range tc.nodes {
		if n.id == m.Name() {
			return n
		}
	}
	tc.t.Fatalf("no node %s", m.Name())
	return nil
}

func startCluster(ctx context.Context, t *testing.T, idemBin, dir string) *testCluster {
	t.Helper()
	tc := &testCluster{t: t}
	var peers []string
	addrs := proctest.FreeAddrs(t, 6)
	for i := 1; i <= 3; i++ {
		n := &node{id: fmt.Sprintf("n%d", i), raft: addrs[2*i-2], grpc: addrs[2*i-1]}
		peers = append(peers, n.id+"="+n.raft)
		tc.nodes = append(tc.nodes, n)
	}
	for _, n := range tc.nodes {
		n.p = proctest.New(t, dir, n.id, nil, idemBin, "serve", "--node-id", n.id, "--dir", filepath.Join(dir, n.id),
			"--raft-addr", n.raft, "--grpc-addr", n.grpc, "--peers", strings.Join(peers, ","))
		cc, err := grpc.NewClient(n.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		n.cc = cc
		n.m = &clustertest.ServeNode{Proc: n.p, Conn: cc}
		tc.members = append(tc.members, n.m)
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
// A paused node is left out with skip. What it returns led a moment ago;
// killLeader and pauseLeader act on the leader itself (proctest.PauseLeader).
func (tc *testCluster) leader(ctx context.Context, skip *node) *node {
	tc.t.Helper()
	var s proctest.Member
	if skip != nil {
		s = skip.m
	}
	lead, _ := proctest.Leader(ctx, tc.t, tc.members, s)
	return tc.node(lead)
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
	p          *proctest.Proc
}

var servingLine = regexp.MustCompile(`serving on (http://\S+) \(keys in doubt at start: (\d+) committed, (\d+) released\)`)

func newReplica(t *testing.T, appBin, dir, owner, nodes string, env ...string) *replica {
	r := &replica{owner: owner, effects: filepath.Join(dir, owner+".jsonl")}
	r.p = proctest.New(t, dir, owner, env, appBin, "-addr", "127.0.0.1:0", "-owner", owner, "-effects", r.effects, "-cluster", nodes)
	return r
}

// start starts the replica and returns what it settled at start.
func (r *replica) start(ctx context.Context) (committed, released string) {
	m := r.p.Start(ctx, servingLine)
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
