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

// procNode is one `idem serve` process of a procCluster.
type procNode struct {
	id, raft, grpc string
	p              *proctest.Proc
}

// procCluster is three `idem serve` processes on loopback, on addresses
// below the ephemeral port range (proctest.FreeAddrs: a node restarted on
// its addresses finds them free).
type procCluster struct {
	nodes map[string]*procNode
}

func (pc *procCluster) start(ctx context.Context, n *procNode) { n.p.Start(ctx, upLine) }

// kill sends sig to node id; for SIGKILL it returns once the process exited.
func (pc *procCluster) kill(id string, sig syscall.Signal) {
	if sig == syscall.SIGKILL {
		pc.nodes[id].p.Kill(sig)
		return
	}
	pc.nodes[id].p.Signal(sig)
}

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
		n.p = proctest.New(t, dir, id, nil, bin, "serve", "--node-id", id, "--dir", filepath.Join(dir, id),
			"--raft-addr", n.raft, "--grpc-addr", n.grpc, "--peers", strings.Join(peers, ","))
	}
	for _, id := range []string{"n1", "n2", "n3"} {
		pc.start(ctx, pc.nodes[id])
	}
	return pc
}

// leaderOf is the leader the node c reaches names (polled until one does).
func leaderOf(ctx context.Context, t *testing.T, c *Client) string {
	t.Helper()
	for {
		st, err := c.Status(ctx)
		if err == nil && st.LeaderId != "" {
			return st.LeaderId
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no leader: %v", ctx.Err())
		case <-time.After(20 * time.Millisecond): // polling the node's state
		}
	}
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
		l := leaderOf(ctx, t, c)
		pc.kill(l, syscall.SIGKILL)
		pc.start(ctx, pc.nodes[l])
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
	old := leaderOf(ctx, t, c)
	// A connection of its own to the old leader, made before the pause.
	const probes = 8
	sent := proctest.NewSentCounter(probes + 1)
	cc, err := grpc.NewClient(pc.nodes[old].grpc, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithStatsHandler(sent))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	if _, err := clusterpb.NewClusterClient(cc).Status(ctx, &clusterpb.StatusRequest{}); err != nil {
		t.Fatal(err)
	}
	sent.Drain() // the Status request's own message
	pc.kill(old, syscall.SIGSTOP)
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
		case <-sent.C:
		case <-ctx.Done():
			t.Fatalf("the requests to the paused leader were not sent: %v", ctx.Err())
		}
	}
	pc.kill(old, syscall.SIGCONT)
	said := map[string]int{}
	for range probes {
		a := <-answers
		if strings.HasPrefix(a, "stale: ") {
			t.Errorf("the deposed leader %s, continued, answered from its stale state: %s (for an id committed while it was paused)", old, a)
			continue
		}
		said[a]++
	}
	t.Logf("asked before SIGCONT, the deposed leader %s answered %v", old, said)
	if r, err := c.Lookup(ctx, idem.Request{ID: []byte("after")}); err != nil || r.Status != idem.Done {
		t.Fatalf("lookup through the cluster: %+v %v", r, err)
	}
}
