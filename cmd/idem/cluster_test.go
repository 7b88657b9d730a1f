package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster"
)

// testCluster is n idem cluster nodes in this process, on loopback
// listeners the test binds.
type testCluster struct {
	t     *testing.T
	nodes map[string]*idemcluster.Node
	grpc  map[string]string // node id -> gRPC address
}

func listenLoopback(t *testing.T) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// startCluster starts nodes n1..nN as a new cluster and waits for a leader.
func startCluster(t *testing.T, n int) *testCluster {
	t.Helper()
	tc := &testCluster{t: t, nodes: map[string]*idemcluster.Node{}, grpc: map[string]string{}}
	dir := t.TempDir()
	peers := map[string]string{}
	rls, gls := map[string]net.Listener{}, map[string]net.Listener{}
	for i := range n {
		id := fmt.Sprintf("n%d", i+1)
		rls[id], gls[id] = listenLoopback(t), listenLoopback(t)
		peers[id] = rls[id].Addr().String()
		tc.grpc[id] = gls[id].Addr().String()
	}
	t.Cleanup(func() {
		for _, nd := range tc.nodes {
			nd.Close()
		}
	})
	for id := range peers {
		nd, err := idemcluster.StartNode(&idemcluster.NodeOptions{ID: id, Dir: filepath.Join(dir, id), RaftListener: rls[id], GRPCListener: gls[id],
			Peers: peers}) // raft's default timeouts: fewer elections on a loaded machine
		if err != nil {
			t.Fatalf("start %s: %v", id, err)
		}
		tc.nodes[id] = nd
	}
	tc.leader()
	return tc
}

// leader waits (at most 30 s) for a ready leader and returns its id.
func (tc *testCluster) leader() string {
	tc.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		for id, nd := range tc.nodes {
			if nd.IsLeader() {
				return id
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	tc.t.Fatal("no leader within 30s")
	return ""
}

// steady is the leader and its term when every node is in one term and
// names one leader, which leads in it ("" when not so).
func (tc *testCluster) steady() (string, uint64) {
	var leader string
	var term uint64
	first := true
	for _, nd := range tc.nodes {
		_, id := nd.Raft().LeaderWithID()
		t := nd.Raft().CurrentTerm()
		if first {
			leader, term, first = string(id), t, false
		}
		if id == "" || string(id) != leader || t != term {
			return "", 0
		}
	}
	if nd := tc.nodes[leader]; nd == nil || !nd.IsLeader() {
		return "", 0
	}
	return leader, term
}

// whileSteady runs idem with args until one run began and ended with the
// cluster steady (see steady) in one term with one leader, and returns
// that leader and the run's exit code and output. No node changed its
// term in between, so none became a candidate and the followers followed
// that leader throughout. A run during an election (raft's timeouts on a
// loaded machine) finds no leader, or a node that knows none, and exits
// 1 or names fewer nodes: that is not what the callers check.
func (tc *testCluster) whileSteady(args ...string) (leader string, code int, stdout, stderr string) {
	tc.t.Helper()
	leader, _, code, stdout, stderr = tc.whileSteadyTerm(args...)
	return leader, code, stdout, stderr
}

// whileSteadyTerm is whileSteady that also returns the leader's term.
func (tc *testCluster) whileSteadyTerm(args ...string) (leader string, term uint64, code int, stdout, stderr string) {
	tc.t.Helper()
	for deadline := time.Now().Add(60 * time.Second); ; {
		if time.Now().After(deadline) {
			tc.t.Fatalf("no run of idem %s within 60s began and ended with one leader in one term", strings.Join(args, " "))
		}
		leader, term = tc.steady()
		if leader == "" {
			time.Sleep(20 * time.Millisecond) // polling raft's state
			continue
		}
		code, stdout, stderr = runCmd(tc.t, args...)
		if l, t := tc.steady(); l == leader && t == term {
			return leader, term, code, stdout, stderr
		}
	}
}

// addrs is the --addr value for the nodes named (all when none).
func (tc *testCluster) addrs(ids ...string) string {
	if len(ids) == 0 {
		for id := range tc.nodes {
			ids = append(ids, id)
		}
	}
	var out []string
	for _, id := range ids {
		out = append(out, tc.grpc[id])
	}
	return strings.Join(out, ",")
}

// stop closes node id.
func (tc *testCluster) stop(id string) {
	tc.t.Helper()
	if err := tc.nodes[id].Close(); err != nil {
		tc.t.Logf("close %s: %v", id, err)
	}
	delete(tc.nodes, id)
}

// write runs one new request through a client of the nodes named.
func (tc *testCluster) write(ctx context.Context, key string, ids ...string) error {
	c, err := idemcluster.Dial(ctx, strings.Split(tc.addrs(ids...), ","), &idemcluster.Options{AttemptTimeout: time.Second})
	if err != nil {
		return err
	}
	defer c.Close()
	r, err := idem.Do(ctx, c, idem.Request{Scope: "cli-test", ID: []byte(key)}, func(context.Context) ([]byte, error) { return []byte("reply-" + key), nil })
	if err == nil && string(r) != "reply-"+key {
		err = fmt.Errorf("reply %q", r)
	}
	return err
}

// statusJSON runs idem cluster status --json with the cluster steady (see
// whileSteady) and expects exit 0.
func statusJSON(t *testing.T, tc *testCluster, addr string) clusterStatus {
	t.Helper()
	args := []string{"cluster", "status", "--addr", addr, "--json"}
	_, code, out, errs := tc.whileSteady(args...)
	var st clusterStatus
	if err := json.Unmarshal([]byte(out), &st); code != 0 || err != nil {
		t.Fatalf("idem %s: exit %d, want 0 (%v)\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), code, err, out, errs)
	}
	return st
}

func TestClusterStatus(t *testing.T) {
	tc := startCluster(t, 3)
	// Run while one node leads and the others follow it throughout: an
	// election in between, on a loaded machine, would leave the command
	// no leader to name (exit 1).
	args := []string{"cluster", "status", "--addr", tc.addrs()}
	leader, term, code, out, errs := tc.whileSteadyTerm(args...)
	if code != 0 {
		t.Fatalf("idem %s: exit %d, want 0\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), code, out, errs)
	}
	if !strings.Contains(out, fmt.Sprintf("leader:  %s (grpc %s), term %d\n", leader, tc.grpc[leader], term)) {
		t.Fatalf("status does not name the leader %s and its term %d:\n%s", leader, term, out)
	}
	for id, addr := range tc.grpc {
		// Steady throughout the run: every node was in the leader's term.
		if !regexp.MustCompile(`(?m)^` + id + `\s+voter\s+(Leader|Follower)\s+` + fmt.Sprint(term) + `\s+127\.0\.0\.1:\d+\s+` + regexp.QuoteMeta(addr) + `\s+\d+\s+\d+$`).MatchString(out) {
			t.Errorf("status has no line for %s at %s:\n%s", id, addr, out)
		}
	}
	if !strings.Contains(out, "members: 3 voters, a majority is 2") {
		t.Errorf("status:\n%s", out)
	}
	t.Logf("idem cluster status:\n%s", out)

	// One address is enough: every member's gRPC address is in the
	// cluster's members table (each node records its own once it sees a
	// leader), so the others are asked too. (Run while one node leads and
	// the others follow it, as above: a follower's election timeout
	// during the run made n2 a candidate that knows no leader, and the
	// run exited 1.) Right after the start a node may not have recorded
	// its address yet: it is named with what to do, and asked again.
	args = []string{"cluster", "status", "--addr", tc.addrs("n2"), "--json"}
	for deadline := time.Now().Add(30 * time.Second); ; {
		_, term, code, out, errs := tc.whileSteadyTerm(args...)
		var st clusterStatus
		if err := json.Unmarshal([]byte(out), &st); code != 0 || err != nil {
			t.Fatalf("idem %s: exit %d, want 0 (%v)\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), code, err, out, errs)
		}
		if st.Leader == "" || st.Voters != 3 || len(st.Nodes) != 3 {
			t.Fatalf("status --json from n2: %+v", st)
		}
		asked := 0
		for _, v := range st.Nodes {
			switch {
			case v.State == "" && !strings.Contains(v.Error, "add it to --addr"):
				t.Errorf("%s: no state and no reason: %+v", v.NodeID, v)
			case v.NodeID == "n2" && v.State == "":
				t.Errorf("n2 was asked but has no state: %+v", v)
			case v.State != "" && v.Term != term:
				t.Errorf("%s: term %d, want %d: %+v", v.NodeID, v.Term, term, v)
			case v.State != "":
				asked++
			}
		}
		if asked == 3 {
			if st.Term != term || st.LeaderGRPC != tc.grpc[st.Leader] {
				t.Fatalf("status --json from n2: leader %s at %q in term %d, want the leader's term %d and address %s", st.Leader, st.LeaderGRPC, st.Term, term, tc.grpc[st.Leader])
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("status --json from n2 asked %d of the 3 nodes (the others' gRPC addresses not known):\n%s", asked, out)
		}
		time.Sleep(20 * time.Millisecond) // until every node recorded its address
	}
}

func TestClusterRemove(t *testing.T) {
	tc := startCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := tc.write(ctx, "before"); err != nil {
		t.Fatal(err)
	}
	victim := "n1"
	if tc.leader() == victim {
		victim = "n2"
	}
	out, errs := wantCode(t, 0, "cluster", "remove", victim, "--addr", tc.addrs())
	if !strings.Contains(out, "removed "+victim+" from the cluster; members now: ") || strings.Contains(out, victim+" (leader)") ||
		!strings.Contains(errs, "two members left") {
		t.Fatalf("remove %s:\nstdout:\n%s\nstderr:\n%s", victim, out, errs)
	}
	tc.stop(victim)
	// The two left serve writes, and status lists only them.
	if err := tc.write(ctx, "after"); err != nil {
		t.Fatalf("a write with two nodes left: %v", err)
	}
	// (Run while one node leads and the other follows it: an election
	// during the run, on a loaded machine, exits 1 with no leader.)
	st := statusJSON(t, tc, tc.addrs())
	if st.Voters != 2 || len(st.Nodes) != 2 || st.Leader == "" || st.Leader == victim {
		t.Fatalf("status after removing %s: %+v", victim, st)
	}
	for _, v := range st.Nodes {
		if v.NodeID == victim {
			t.Fatalf("status still lists %s: %+v", victim, st)
		}
	}
	// Removing it again (the user runs the command again after the first
	// run's answer was lost: a timeout, a dropped connection): what was
	// asked for is done, and the command says so. It used to fail with
	// "no node in the cluster".
	out, errs = wantCode(t, 0, "cluster", "remove", victim, "--addr", tc.addrs())
	if !strings.Contains(out, victim+" was removed from the cluster before: nothing to do") {
		t.Fatalf("remove %s again:\nstdout:\n%s\nstderr:\n%s", victim, out, errs)
	}
}

func TestClusterRemoveErrors(t *testing.T) {
	tc := startCluster(t, 2)
	_, errs := wantCode(t, 1, "cluster", "remove", "n9", "--addr", tc.addrs())
	if !strings.Contains(errs, `no node "n9" in the cluster, and none by that name was removed (members: n1, n2): nothing removed`) {
		t.Errorf("unknown node: %s", errs)
	}
	// Usage errors: exit 2, before anything is asked.
	for _, args := range [][]string{
		{"cluster", "status"},                                   // no --addr
		{"cluster", "--addr", tc.addrs()},                       // no action
		{"cluster", "remove", "--addr", tc.addrs()},             // no node id
		{"cluster", "remove", "n1", "n2", "--addr", tc.addrs()}, // two
		{"cluster", "join", "--addr", tc.addrs()},               // not an action
		{"cluster", "forget", "--addr", tc.addrs()},             // no --before
		{"cluster", "forget", "--addr", tc.addrs(), "--before", "yesterday"},
		{"cluster", "remove", "n1", "--addr", tc.addrs(), "--json"},
		{"cluster", "status", "--addr", tc.addrs(), "--before", "1h"},
	} {
		if _, errs := wantCode(t, 2, args...); !strings.Contains(errs, "run 'idem help cluster'") {
			t.Errorf("idem %v: %s", args, errs)
		}
	}

	// Nothing listening: no node answers.
	l := listenLoopback(t)
	dead := l.Addr().String()
	l.Close()
	_, errs = wantCode(t, 1, "cluster", "status", "--addr", dead, "--timeout", "2s")
	if !strings.Contains(errs, "no node answered at "+dead) || !strings.Contains(errs, "is --addr their --grpc-addr?") {
		t.Errorf("status of a dead address: %s", errs)
	}
	_, errs = wantCode(t, 1, "cluster", "remove", "n1", "--addr", dead, "--timeout", "2s")
	if !strings.Contains(errs, "no node answered at "+dead) {
		t.Errorf("remove at a dead address: %s", errs)
	}

	// One of two nodes down: no leader, so nothing can be removed. The
	// leader is the one stopped, so that n1 starts out naming a leader
	// that is gone (the case that once failed by chance).
	// A transfer fails by chance on a loaded machine ("leadership transfer
	// timeout" when n2 is not elected within raft's election timeout, "not
	// the leader" when n1 was deposed meanwhile): try again while n1 leads.
	for deadline := time.Now().Add(30 * time.Second); !tc.nodes["n2"].IsLeader(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("n2 does not lead within 30s")
		}
		if tc.nodes["n1"].IsLeader() {
			if err := tc.nodes["n1"].Raft().LeadershipTransfer().Error(); err != nil {
				t.Logf("handing leadership to n2: %v (trying again)", err)
			}
		}
	}
	tc.stop("n2")
	lone := tc.addrs("n1")
	// Wait until n1 knows no leader: if it led, it steps down once its
	// lease lapses; if n2 led, n1 forgets it at its heartbeat timeout.
	// (Waiting only for n1 not to lead let the removal below start while
	// n1 still named n2 as its leader: a chance failure in CI.)
	knowsLeader := func() bool { _, id := tc.nodes["n1"].Raft().LeaderWithID(); return id != "" }
	for deadline := time.Now().Add(30 * time.Second); tc.nodes["n1"].IsLeader() || knowsLeader(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("n1 still knows a leader 30s after n2 stopped")
		}
	}
	_, errs = wantCode(t, 1, "cluster", "remove", "n2", "--addr", lone, "--timeout", "3s")
	if !strings.Contains(errs, "no leader answered within 3s") || !strings.Contains(errs, "a majority of the 2 voters up") {
		t.Errorf("remove without a leader: %s", errs)
	}
	out, errs := wantCode(t, 1, "cluster", "status", "--addr", lone)
	if !strings.Contains(out, "leader:  none known") || !strings.Contains(errs, "no node knows a leader") {
		t.Errorf("status without a leader:\n%s\n%s", out, errs)
	}
}

// The last voter cannot be removed: raft would refuse it, and the client
// would retry that refusal until --timeout.
func TestClusterRemoveLastVoter(t *testing.T) {
	tc := startCluster(t, 1)
	_, errs := wantCode(t, 1, "cluster", "remove", "n1", "--addr", tc.addrs())
	if !strings.Contains(errs, "n1 is the cluster's last voter") {
		t.Fatalf("remove the last voter: %s", errs)
	}
}

func TestClusterForget(t *testing.T) {
	tc := startCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := tc.write(ctx, "old"); err != nil {
		t.Fatal(err)
	}
	c, err := idemcluster.Dial(ctx, strings.Split(tc.addrs(), ","), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	req := idem.Request{Scope: "cli-test", ID: []byte("old")}
	if r, err := c.Lookup(ctx, req); err != nil || r.Status != idem.Done {
		t.Fatalf("before the forget: %+v %v", r, err)
	}
	// A time after the commit (the log's time is the leader's clock).
	before := time.Now().Add(time.Hour).UTC().Format(time.RFC3339)
	out, errs := wantCode(t, 0, "cluster", "forget", "--addr", tc.addrs(), "--before", before)
	if !strings.Contains(out, "forget appended to the cluster's log") || !strings.Contains(errs, "is in the future") {
		t.Fatalf("forget:\n%s\n%s", out, errs)
	}
	if r, err := c.Lookup(ctx, req); err != nil || r.Status != idem.Absent {
		t.Fatalf("after the forget: %+v %v", r, err)
	}
}

// TestClusterREADMECommands: every idem command in idemcluster/README.md
// parses with the command's own flags and arguments (the README's
// grpcurl session needs grpcurl and a cluster; this needs neither).
func TestClusterREADMECommands(t *testing.T) {
	b, err := os.ReadFile("../../idemcluster/README.md")
	if err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{"$PEERS": "n1=127.0.0.1:7001,n2=127.0.0.1:7002,n3=127.0.0.1:7003"}
	// The command lines: in a block of a session, the lines after a "$ "
	// prompt (the others are output); in a block without prompts, every line.
	var lines []string
	for i, block := range strings.Split(string(b), "```") {
		if i%2 == 0 {
			continue // between blocks
		}
		session := strings.Contains(block, "\n$ ")
		for _, line := range strings.Split(block, "\n") {
			if l, ok := strings.CutPrefix(line, "$ "); ok || !session {
				lines = append(lines, l)
			}
		}
	}
	checked := map[string]int{}
	for _, line := range lines {
		line, _, _ = strings.Cut(line, "#")
		words := strings.Fields(line) // idem ..., /tmp/idem ...
		if len(words) < 2 || filepath.Base(words[0]) != "idem" {
			continue
		}
		words = words[1:]
		if n := len(words); n > 0 && words[n-1] == "&" {
			words = words[:n-1]
		}
		cmd := lookupCommand(words[0])
		if cmd == nil {
			t.Errorf("README: %q: no idem command %q", line, words[0])
			continue
		}
		for j := range words {
			for k, v := range vars {
				words[j] = strings.ReplaceAll(words[j], k, v)
			}
		}
		fs := flag.NewFlagSet(cmd.name, flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		cmd.setup(fs)
		pos, err := parseInterspersed(fs, words[1:])
		if err != nil {
			t.Errorf("README: %q: %v", line, err)
			continue
		}
		if err := checkPositional(cmd.name, pos); err != nil {
			t.Errorf("README: %q: %v", line, err)
		}
		checked[cmd.name]++
	}
	if checked["serve"] < 3 || checked["cluster"] < 2 {
		t.Fatalf("README: only %v idem commands found: the parsing is broken", checked)
	}
}

// checkPositional checks the positional arguments of the commands the
// README uses.
func checkPositional(name string, pos []string) error {
	switch name {
	case "serve":
		if len(pos) > 0 {
			return fmt.Errorf("serve takes no arguments, got %q", pos)
		}
	case "cluster":
		want := map[string]int{"status": 0, "remove": 1, "forget": 0}
		if len(pos) == 0 {
			return fmt.Errorf("cluster: no action")
		}
		if n, ok := want[pos[0]]; !ok || len(pos)-1 != n {
			return fmt.Errorf("cluster: bad arguments %q", pos)
		}
	}
	return nil
}
