//go:build unix

package idemraft

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/internal/proctest"
)

// TestMain runs a cluster node of TestProcessesSIGKILL when IDEMRAFT_NODE
// is set: the test binary re-executed as a raft server.
func TestMain(m *testing.M) {
	if id := os.Getenv("IDEMRAFT_NODE"); id != "" {
		if err := nodeMain(raft.ServerID(id), os.Getenv("IDEMRAFT_DIR"), os.Getenv("IDEMRAFT_PEERS")); err != nil {
			fmt.Fprintln(os.Stderr, "node:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// tcpLayer is raft's TCP stream layer (what raft.NewTCPTransport builds)
// over a listener inherited from the parent test, so that a node killed
// with SIGKILL comes back on the same port.
type tcpLayer struct{ net.Listener }

func (l tcpLayer) Dial(a raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	return net.DialTimeout("tcp", string(a), timeout)
}

// nodeState is what a node's /state reports.
type nodeState struct {
	ID        string
	Leader    bool
	RaftState string // raft.RaftState's String: "Leader", "Follower", ...
	LeaderID  string // the leader it follows ("" when it knows none)
	Term      uint64 // its current term
	LastIndex uint64
	State     counterState
}

func nodeMain(id raft.ServerID, dir, peers string) error {
	// Exit when the parent goes away (its end of our stdin closes).
	go func() {
		io.Copy(io.Discard, os.Stdin)
		os.Exit(3)
	}()
	rl, err := net.FileListener(os.NewFile(3, "raft"))
	if err != nil {
		return err
	}
	hl, err := net.FileListener(os.NewFile(4, "http"))
	if err != nil {
		return err
	}
	logger := hclog.New(&hclog.LoggerOptions{Name: string(id), Output: os.Stderr, Level: hclog.Warn})
	conf := raft.DefaultConfig()
	conf.LocalID = id
	conf.HeartbeatTimeout = 400 * time.Millisecond
	conf.ElectionTimeout = 400 * time.Millisecond
	conf.LeaderLeaseTimeout = 300 * time.Millisecond
	conf.CommitTimeout = 5 * time.Millisecond
	conf.SnapshotThreshold = 100
	conf.SnapshotInterval = 300 * time.Millisecond
	conf.TrailingLogs = 50
	conf.BatchApplyCh = true
	conf.Logger = logger
	store, err := raftboltdb.New(raftboltdb.Options{Path: filepath.Join(dir, "raft.db")})
	if err != nil {
		return err
	}
	snaps, err := raft.NewFileSnapshotStoreWithLogger(filepath.Join(dir, "snapshots"), 2, logger)
	if err != nil {
		return err
	}
	trans := raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{Stream: tcpLayer{rl}, MaxPool: 3, Timeout: time.Second, Logger: logger})
	app := newCounterFSM()
	fsm, err := Wrap(app, &Options{Dir: filepath.Join(dir, "dedup"), Engine: testEngineOptions()})
	if err != nil {
		return err
	}
	if has, err := raft.HasExistingState(store, store, snaps); err != nil {
		return err
	} else if !has {
		var conf2 raft.Configuration
		for _, p := range strings.Split(peers, ",") {
			pid, addr, _ := strings.Cut(p, "=")
			conf2.Servers = append(conf2.Servers, raft.Server{ID: raft.ServerID(pid), Address: raft.ServerAddress(addr)})
		}
		if err := raft.BootstrapCluster(conf, store, store, snaps, trans, conf2); err != nil {
			return err
		}
	}
	r, err := raft.NewRaft(conf, fsm, store, store, snaps, trans)
	if err != nil {
		return err
	}
	h, err := Handler(id, r, fsm)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("/apply", h)
	mux.HandleFunc("/state", func(w http.ResponseWriter, _ *http.Request) {
		_, leader := r.LeaderWithID()
		json.NewEncoder(w).Encode(nodeState{ID: string(id), Leader: r.State() == raft.Leader, RaftState: r.State().String(), LeaderID: string(leader), Term: r.CurrentTerm(),
			LastIndex: fsm.Stats().LastIndex, State: app.state()})
	})
	return http.Serve(hl, mux)
}

// procNode is one node process and the listeners it inherits.
type procNode struct {
	id          raft.ServerID
	dir         string
	raftL, webL *os.File
	raftAddr    string
	url         string
	cmd         *exec.Cmd
	stdin       io.WriteCloser
	exited      chan struct{}
}

// The node as a proctest.Member (PauseLeader finds and pauses the leader).
func (n *procNode) Name() string { return string(n.id) }
func (n *procNode) Running() bool {
	if n.cmd == nil {
		return false
	}
	select {
	case <-n.exited:
		return false
	default:
		return true
	}
}
func (n *procNode) Signal(sig syscall.Signal) {
	if n.Running() {
		n.cmd.Process.Signal(sig)
	}
}

// Kill sends sig and waits for the process to exit (SIGKILL ends a
// paused process too).
func (n *procNode) Kill(sig syscall.Signal) {
	if n.Running() {
		n.cmd.Process.Signal(sig)
		<-n.exited
	}
}
func (n *procNode) View(ctx context.Context) (proctest.View, error) {
	st, err := n.state(ctx)
	return proctest.View{State: st.RaftState, LeaderID: st.LeaderID, Term: st.Term}, err
}

// state is the node's /state.
func (n *procNode) state(ctx context.Context) (nodeState, error) {
	var st nodeState
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, n.url+"/state", nil)
	if err != nil {
		return st, err
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return st, err
	}
	defer res.Body.Close()
	return st, json.NewDecoder(res.Body).Decode(&st)
}

// TestProcessesSIGKILL runs 3 nodes as OS processes (raft's network
// transport over TCP on 127.0.0.1, raft-boltdb log stores, file snapshot
// stores) and kills the leader with SIGKILL several times while clients
// send requests over HTTP with retries. Nothing acknowledged may be lost,
// nothing may run twice, the replicas must end equal and the history must
// be linearizable. IDEMRAFT_PROC_REQUESTS and IDEMRAFT_KILLS size it.
func TestProcessesSIGKILL(t *testing.T) {
	total, kills := 400, 3
	if testing.Short() {
		total, kills = 200, 2
	}
	if n, err := strconv.Atoi(os.Getenv("IDEMRAFT_PROC_REQUESTS")); err == nil && n > 0 {
		total = n
	}
	if n, err := strconv.Atoi(os.Getenv("IDEMRAFT_KILLS")); err == nil && n > 0 {
		kills = n
	}
	const clients = 8
	base := t.TempDir()
	var nodes []*procNode
	var peers []string
	for i := 1; i <= 3; i++ {
		n := &procNode{id: raft.ServerID(fmt.Sprintf("p%d", i)), dir: filepath.Join(base, fmt.Sprintf("p%d", i))}
		rl, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		wl, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		n.raftAddr, n.url = rl.Addr().String(), "http://"+wl.Addr().String()
		if n.raftL, err = rl.(*net.TCPListener).File(); err != nil {
			t.Fatal(err)
		}
		if n.webL, err = wl.(*net.TCPListener).File(); err != nil {
			t.Fatal(err)
		}
		rl.Close()
		wl.Close()
		t.Cleanup(func() { n.raftL.Close(); n.webL.Close() })
		if err := os.MkdirAll(n.dir, 0o755); err != nil {
			t.Fatal(err)
		}
		peers = append(peers, fmt.Sprintf("%s=%s", n.id, n.raftAddr))
		nodes = append(nodes, n)
	}
	start := func(n *procNode) {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), "IDEMRAFT_NODE="+string(n.id), "IDEMRAFT_DIR="+n.dir, "IDEMRAFT_PEERS="+strings.Join(peers, ","))
		cmd.ExtraFiles = []*os.File{n.raftL, n.webL}
		logf, err := os.OpenFile(filepath.Join(n.dir, "node.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		cmd.Stdout, cmd.Stderr = logf, logf
		if n.stdin, err = cmd.StdinPipe(); err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		logf.Close()
		n.cmd, n.exited = cmd, make(chan struct{})
		go func(cmd *exec.Cmd, ch chan struct{}) { cmd.Wait(); close(ch) }(cmd, n.exited)
	}
	for _, n := range nodes {
		start(n)
	}
	t.Cleanup(func() {
		for _, n := range nodes {
			n.stdin.Close()
			n.Kill(syscall.SIGKILL)
		}
	})
	var members []proctest.Member
	for _, n := range nodes {
		members = append(members, n)
	}
	state := func(n *procNode) (nodeState, error) {
		sctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		return n.state(sctx)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	proctest.Leader(ctx, t, members, nil)

	var hnodes []Node
	for _, n := range nodes {
		hn, err := HTTPNode(n.id, n.url+"/apply", &http.Client{Timeout: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		hnodes = append(hnodes, hn)
	}
	cl, err := NewClient(hnodes, &ClientOptions{Attempt: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	var (
		hmu     sync.Mutex
		history []porcupine.Operation
		done    atomic.Int64
		killed  atomic.Int64
		// leaderKills counts the kills of a node paused as leader, whose
		// follower was elected next (proctest.PauseLeader, NextLeader).
		leaderKills int
	)
	gate := func() { // in step with the kills, as in the in-process test
		for ctx.Err() == nil && done.Load() >= int64(total)*(killed.Load()+1)/int64(kills+1) {
			time.Sleep(time.Millisecond)
		}
	}
	errc := make(chan error, clients)
	var wg sync.WaitGroup
	for ci := 0; ci < clients; ci++ {
		wg.Add(1)
		go func(ci int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(ci), 7))
			for i := ci; i < total; i += clients {
				gate()
				opID := fmt.Sprintf("p%d-%d", ci, i)
				in := counterInput{key: []string{"a", "b", "c"}[rng.IntN(3)], delta: int64(rng.IntN(10))}
				req := idem.Request{Scope: "proc", ID: []byte(opID)}
				if ci%2 == 1 {
					req = idem.Request{Scope: "proc", Client: fmt.Sprintf("pc%d", ci), Seq: uint64(i/clients + 1)}
				}
				call := time.Since(began).Nanoseconds()
				resp, err := cl.Do(ctx, req, encodeOp(counterOp{ID: opID, Key: in.key, Delta: in.delta}))
				if err == nil && resp.Err != nil {
					err = resp.Err
				}
				if err != nil {
					errc <- fmt.Errorf("%s: %w", opID, err)
					cancel() // stop the others (and the kills)
					return
				}
				ret := time.Since(began).Nanoseconds()
				hmu.Lock()
				history = append(history, porcupine.Operation{ClientId: ci, Input: in, Call: call, Output: int64(binary.BigEndian.Uint64(resp.Reply)), Return: ret})
				hmu.Unlock()
				done.Add(1)
			}
		}(ci)
	}
	for k := 0; k < kills; k++ {
		target := int64(total) * int64(k+1) / int64(kills+1)
		for done.Load() < target-clients && ctx.Err() == nil && len(errc) == 0 {
			time.Sleep(time.Millisecond)
		}
		if len(errc) > 0 {
			break
		}
		// The leader itself, paused as leader, then killed: a node that
		// said it led a moment ago may be a follower by now.
		p := proctest.PauseLeader(ctx, t, members)
		l := p.Lead.(*procNode)
		l.Kill(syscall.SIGKILL)
		killed.Add(1)
		at := done.Load()
		next := p.NextLeader(ctx, t, members)
		leaderKills++
		start(l)
		t.Logf("SIGKILL %d: leader %s of term %d paused (try %d) and killed after %d requests; %s, its follower, elected in a later term; restarted (%d done by then)",
			leaderKills, l.id, p.Term, p.Tries, at, next.Name(), done.Load())
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	if leaderKills != kills {
		t.Fatalf("%d leader SIGKILLs, want %d", leaderKills, kills)
	}
	if _, err := cl.Do(ctx, idem.Request{ID: []byte("last")}, encodeOp(counterOp{ID: "last", Key: "z", Delta: 1})); err != nil {
		t.Fatal(err)
	}
	// Converge: every node reports the same last index and holds "last".
	var states []nodeState
	for ctx.Err() == nil {
		states = states[:0]
		for _, n := range nodes {
			if st, err := state(n); err == nil {
				states = append(states, st)
			}
		}
		if len(states) == 3 && states[0].LastIndex == states[1].LastIndex && states[1].LastIndex == states[2].LastIndex && states[0].State.Applied["last"] == 1 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if ctx.Err() != nil {
		t.Fatalf("nodes did not converge: %+v", states)
	}
	for _, st := range states[1:] {
		if !reflect.DeepEqual(st.State, states[0].State) {
			t.Fatalf("node %s differs from %s", st.ID, states[0].ID)
		}
	}
	applied := states[0].State.Applied
	if len(applied) != total+1 {
		t.Fatalf("%d requests applied, want %d (nothing lost)", len(applied), total+1)
	}
	for id, n := range applied {
		if n != 1 {
			t.Fatalf("request %s applied %d times", id, n)
		}
	}
	if res := porcupine.CheckOperationsTimeout(counterModel, history, 60*time.Second); res != porcupine.Ok {
		t.Fatalf("porcupine: %v", res)
	}
	t.Logf("%d requests by %d clients over HTTP, %d leader SIGKILLs, every request applied once on each of 3 replicas, linearizable; %v", total, clients, leaderKills, time.Since(began).Round(time.Millisecond))
}
