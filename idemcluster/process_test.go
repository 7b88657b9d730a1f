package idemcluster

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
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

// freeAddr returns a loopback address that was free a moment ago (the
// node process binds it itself).
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

type procNode struct {
	id, dir, raft, grpc string
	cmd                 *exec.Cmd
}

type procCluster struct {
	t     *testing.T
	bin   string
	peers string
	nodes map[string]*procNode
}

func (pc *procCluster) start(n *procNode) {
	pc.t.Helper()
	cmd := exec.Command(pc.bin, "serve", "--node-id", n.id, "--dir", n.dir, "--raft-addr", n.raft, "--grpc-addr", n.grpc, "--peers", pc.peers)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		pc.t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		pc.t.Fatal(err)
	}
	up := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if strings.Contains(sc.Text(), " up: ") {
				up <- sc.Text()
			}
		}
	}()
	select {
	case <-up:
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		pc.t.Fatalf("node %s did not come up", n.id)
	}
	n.cmd = cmd
}

func (pc *procCluster) kill(id string, sig syscall.Signal) {
	n := pc.nodes[id]
	_ = n.cmd.Process.Signal(sig)
	if sig == syscall.SIGKILL {
		_ = n.cmd.Wait()
	}
}

func (pc *procCluster) addrs() []string {
	var out []string
	for _, id := range []string{"n1", "n2", "n3"} {
		out = append(out, pc.nodes[id].grpc)
	}
	return out
}

func newProcCluster(t *testing.T) *procCluster {
	pc := &procCluster{t: t, bin: buildIdem(t), nodes: map[string]*procNode{}}
	dir := t.TempDir()
	var peers []string
	for _, id := range []string{"n1", "n2", "n3"} {
		n := &procNode{id: id, dir: filepath.Join(dir, id), raft: freeAddr(t), grpc: freeAddr(t)}
		pc.nodes[id] = n
		peers = append(peers, id+"="+n.raft)
	}
	pc.peers = strings.Join(peers, ",")
	for _, id := range []string{"n1", "n2", "n3"} {
		pc.start(pc.nodes[id])
	}
	t.Cleanup(func() {
		for _, n := range pc.nodes {
			if n.cmd != nil && n.cmd.ProcessState == nil {
				_ = n.cmd.Process.Signal(syscall.SIGCONT)
				_ = n.cmd.Process.Kill()
				_ = n.cmd.Wait()
			}
		}
	})
	return pc
}

func leaderOf(ctx context.Context, t *testing.T, c *Client) string {
	t.Helper()
	for ctx.Err() == nil {
		st, err := c.Status(ctx)
		if err == nil && st.LeaderId != "" {
			return st.LeaderId
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatal("no leader")
	return ""
}

// TestServeProcessesSIGKILL runs three `idem serve` processes, kills the
// leader with SIGKILL twice (restarting it), and checks that every
// acknowledged commit survives with its reply and that no request ran twice.
func TestServeProcessesSIGKILL(t *testing.T) {
	if testing.Short() {
		t.Skip("builds cmd/idem and runs three processes")
	}
	pc := newProcCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
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
		pc.start(pc.nodes[l])
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
// past the election timeout, commits a new id through the new leader, and
// resumes the old one: asked directly, it must not say the id is absent.
func TestServeDeposedLeaderAnswersNothingStale(t *testing.T) {
	if testing.Short() {
		t.Skip("builds cmd/idem and runs three processes")
	}
	pc := newProcCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := Dial(ctx, pc.addrs(), &Options{Owner: "stop-test", AttemptTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := idem.Do(ctx, c, idem.Request{ID: []byte("before")}, func(context.Context) ([]byte, error) { return []byte("b"), nil }); err != nil {
		t.Fatal(err)
	}
	old := leaderOf(ctx, t, c)
	pc.kill(old, syscall.SIGSTOP)
	// A new leader among the others commits "after".
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
	pc.kill(old, syscall.SIGCONT)
	// Ask the old leader itself, with no redirect following: it must not
	// answer from its stale state.
	cc, err := grpc.NewClient(pc.nodes[old].grpc, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ic := clusterpb.NewIdemClient(cc)
	for i := range 20 {
		actx, acancel := context.WithTimeout(ctx, 2*time.Second)
		out, err := ic.Lookup(actx, &clusterpb.LookupRequest{Request: &clusterpb.Request{Id: []byte("after")}})
		acancel()
		if err == nil && out.Result.Status != clusterpb.Status_STATUS_DONE {
			t.Fatalf("attempt %d: the resumed old leader answered %v for an id committed while it was paused", i, out.Result.Status)
		}
		time.Sleep(25 * time.Millisecond)
	}
	if r, err := c.Lookup(ctx, idem.Request{ID: []byte("after")}); err != nil || r.Status != idem.Done {
		t.Fatalf("lookup through the cluster: %+v %v", r, err)
	}
}
