package idemcluster

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	"github.com/idemdb/idem/idemcluster/clustertest"
	"github.com/idemdb/idem/internal/proctest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// buildIdem builds cmd/idem for the process tests.
func buildIdem(t *testing.T) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("the go command is not on PATH: cannot build cmd/idem for the process tests")
	}
	bin := filepath.Join(t.TempDir(), "idem")
	cmd := exec.Command(goBin, "build", "-o", bin, "github.com/idemdb/idem/cmd/idem")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build cmd/idem: %v\n%s", err, out)
	}
	return bin
}

// upLine is the line `idem serve` prints once its node is up.
var upLine = regexp.MustCompile(`idem serve: node \S+ up: `)

// procNode is one `idem serve` process of a procCluster; as a
// proctest.Member its view is its Status RPC, asked of it alone.
type procNode struct {
	id, raft, grpc string
	clustertest.ServeNode
}

// procCluster is three `idem serve` processes on loopback, on addresses
// below the ephemeral port range (proctest.FreeAddrs: a node restarted on
// its addresses finds them free).
type procCluster struct {
	nodes   map[string]*procNode
	members []proctest.Member
}

func (pc *procCluster) start(ctx context.Context, n *procNode) { n.Start(ctx, upLine) }

func (pc *procCluster) addrs() []string {
	var out []string
	for _, id := range []string{"n1", "n2", "n3"} {
		out = append(out, pc.nodes[id].grpc)
	}
	return out
}

func newProcCluster(ctx context.Context, t *testing.T) *procCluster {
	bin := buildIdem(t)
	pc := &procCluster{nodes: map[string]*procNode{}}
	dir := t.TempDir()
	addrs := proctest.FreeAddrs(t, 6)
	var peers []string
	for i, id := range []string{"n1", "n2", "n3"} {
		n := &procNode{id: id, raft: addrs[2*i], grpc: addrs[2*i+1]}
		pc.nodes[id] = n
		peers = append(peers, id+"="+n.raft)
	}
	for _, id := range []string{"n1", "n2", "n3"} {
		n := pc.nodes[id]
		n.Proc = proctest.New(t, dir, id, nil, bin, "serve", "--node-id", id, "--dir", filepath.Join(dir, id),
			"--raft-addr", n.raft, "--grpc-addr", n.grpc, "--peers", strings.Join(peers, ","))
		cc, err := grpc.NewClient(n.grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		n.Conn = cc
		pc.members = append(pc.members, n)
	}
	for _, id := range []string{"n1", "n2", "n3"} {
		pc.start(ctx, pc.nodes[id])
	}
	return pc
}

// TestServeProcessesSIGKILL runs three `idem serve` processes, kills the
// leader with SIGKILL twice (restarting it), and checks that every
// acknowledged commit survives with its reply and that no request ran twice.
func TestServeProcessesSIGKILL(t *testing.T) {
	if testing.Short() {
		t.Skip("builds cmd/idem and runs three processes")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pc := newProcCluster(ctx, t)
	c, err := Dial(ctx, pc.addrs(), &Options{Owner: "proc-test", AttemptTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	acked := map[string]string{}
	runs := map[string]int{}
	leaderKills := 0
	for round := range 3 {
		for i := range 40 {
			id := fmt.Sprintf("k%d-%d", round, i)
			reply, err := idem.Do(ctx, c, idem.Request{Scope: "p", ID: []byte(id)}, func(context.Context) ([]byte, error) {
				runs[id]++
				return []byte("r-" + id), nil
			})
			if err != nil {
				t.Fatalf("%s: %v", id, err)
			}
			acked[id] = string(reply)
		}
		if round == 2 {
			break
		}
		// The leader itself, paused as leader, then killed: a node named
		// leader a moment ago may be a follower by now.
		p := proctest.PauseLeader(ctx, t, pc.members)
		p.Lead.Kill(syscall.SIGKILL)
		next := p.NextLeader(ctx, t, pc.members)
		leaderKills++
		t.Logf("kill %d: leader %s of term %d paused (try %d) and SIGKILLed; %s, its follower, elected in a later term", leaderKills, p.Lead.Name(), p.Term, p.Tries, next.Name())
		pc.start(ctx, pc.nodes[p.Lead.Name()])
	}
	if leaderKills != 2 {
		t.Fatalf("%d leader SIGKILLs, want 2", leaderKills)
	}
	for id, want := range acked {
		r, err := c.Begin(ctx, idem.Request{Scope: "p", ID: []byte(id)})
		if err != nil || r.Status != idem.Done || string(r.Reply) != want {
			t.Fatalf("%s after SIGKILLs: %+v %v", id, r, err)
		}
		if runs[id] != 1 {
			t.Fatalf("%s ran %d times", id, runs[id])
		}
	}
}

// TestServeDeposedLeaderAnswersNothingStale pauses the leader with SIGSTOP
// until the two others have elected a leader and committed a new id
// without it, then asks it directly (no leader following) about that id,
// and for a fresh claim on it, before continuing it: the requests wait in
// its socket (a stats handler says when each was handed to the
// connection) and are the first it reads when it runs again. It must not
// answer from its stale state (say the id is absent, or hand it out).
func TestServeDeposedLeaderAnswersNothingStale(t *testing.T) {
	if testing.Short() {
		t.Skip("builds cmd/idem and runs three processes")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pc := newProcCluster(ctx, t)
	c, err := Dial(ctx, pc.addrs(), &Options{Owner: "stop-test", AttemptTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := idem.Do(ctx, c, idem.Request{ID: []byte("before")}, func(context.Context) ([]byte, error) { return []byte("b"), nil }); err != nil {
		t.Fatal(err)
	}
	// A connection of its own to each node, made before the pause, whose
	// stats handler says when each request has been handed to the
	// connection; the one to the node paused as leader is used.
	const probes = 8
	addrs := map[string]string{}
	for id, n := range pc.nodes {
		addrs[id] = n.grpc
	}
	pr := clustertest.Probes(ctx, t, addrs, probes+1)
	p := proctest.PauseLeader(ctx, t, pc.members)
	old, cc := p.Lead.Name(), pr[p.Lead.Name()].Conn
	t.Logf("leader %s of term %d paused (try %d)", old, p.Term, p.Tries)
	// A new leader among the others commits "after" (Do returns once one
	// is elected: the old one is paused past the election timeout).
	var others []string
	for id, n := range pc.nodes {
		if id != old {
			others = append(others, n.grpc)
		}
	}
	c2, err := Dial(ctx, others, &Options{Owner: "stop-test-2", AttemptTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if _, err := idem.Do(ctx, c2, idem.Request{ID: []byte("after")}, func(context.Context) ([]byte, error) { return []byte("a"), nil }); err != nil {
		t.Fatal(err)
	}
	next := p.NextLeader(ctx, t, pc.members)
	ic := clusterpb.NewIdemClient(cc)
	answers := make(chan string, probes) // "stale: ..." is a failure
	for i := range probes {
		go func() {
			actx, acancel := context.WithTimeout(ctx, 10*time.Second)
			defer acancel()
			req := &clusterpb.Request{Id: []byte("after")}
			var st clusterpb.Status
			var err error
			what := "Lookup"
			if i == 0 { // a claim on the id committed while it was paused
				what = "Begin"
				var out *clusterpb.BeginResponse
				if out, err = ic.Begin(actx, &clusterpb.BeginRequest{Request: req, Owner: "stale-probe", Token: []byte("stale-probe-token")}); err == nil {
					st = out.Result.Status
				}
			} else {
				var out *clusterpb.LookupResponse
				if out, err = ic.Lookup(actx, &clusterpb.LookupRequest{Request: req}); err == nil {
					st = out.Result.Status
				}
			}
			switch {
			case err != nil:
				answers <- fmt.Sprintf("%s: %v", what, status.Code(err))
			case st != clusterpb.Status_STATUS_DONE:
				answers <- fmt.Sprintf("stale: %s answered %v", what, st)
			default:
				answers <- what + ": done"
			}
		}()
	}
	for range probes {
		select {
		case <-pr[old].Sent.C:
		case <-ctx.Done():
			t.Fatalf("the requests to the paused leader were not sent: %v", ctx.Err())
		}
	}
	p.Lead.Signal(syscall.SIGCONT)
	said := map[string]int{}
	for range probes {
		a := <-answers
		if strings.HasPrefix(a, "stale: ") {
			t.Errorf("the deposed leader %s, continued, answered from its stale state: %s (for an id committed while it was paused)", old, a)
			continue
		}
		said[a]++
	}
	t.Logf("asked before SIGCONT, the deposed leader %s answered %v (%s elected without it)", old, said, next.Name())
	if r, err := c.Lookup(ctx, idem.Request{ID: []byte("after")}); err != nil || r.Status != idem.Done {
		t.Fatalf("lookup through the cluster: %+v %v", r, err)
	}
}
