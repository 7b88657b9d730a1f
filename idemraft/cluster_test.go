package idemraft

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
)

// tnode is one raft server of an in-process test cluster. Its stores
// survive restarts; its FSM, raft and transport are made anew.
type tnode struct {
	id    raft.ServerID
	addr  raft.ServerAddress
	store *raft.InmemStore // log and stable store
	snaps raft.SnapshotStore
	dir   string

	mu      sync.Mutex     // guards the fields below
	trans   raft.Transport // *raft.InmemTransport, or a *raft.NetworkTransport with clusterOpts.tcp
	app     *counterFSM
	fsm     *FSM
	given   *restoreLog // what raft was given: fsm, recording its restores (nil without clusterOpts.wrap)
	r       *raft.Raft
	up      bool
	restart int // incarnations
}

type clusterOpts struct {
	wrap              bool // wrap the FSM (false: the bare application, for the benchmark)
	snapshotThreshold uint64
	trailingLogs      uint64
	timeout           time.Duration // heartbeat and election timeout (default 150 ms)
	engine            *idem.Options // dedup engine options (default: small, for tests)
	// tcp: raft's network transport over TCP on 127.0.0.1, through proxies
	// the test controls (tcpNet), instead of the in-memory transport. A
	// node stopped over TCP is not started again.
	tcp bool
	// plainApps: every node's application is the benchmarks' plain
	// counterFSM (newBenchCounter: no record of ids; by default every
	// second node's is a raft.BatchingFSM, recording ids).
	plainApps bool
}

type cluster struct {
	t     testing.TB
	o     clusterOpts
	base  string
	mu    sync.Mutex // guards nodes and the transports' connections
	nodes []*tnode
	cut   map[raft.ServerID]bool // partitioned nodes
	net   *tcpNet                // with clusterOpts.tcp
}

func raftConfig(id raft.ServerID, o clusterOpts) *raft.Config {
	c := raft.DefaultConfig()
	c.LocalID = id
	c.HeartbeatTimeout = 150 * time.Millisecond
	if o.timeout > 0 {
		c.HeartbeatTimeout = o.timeout
	}
	c.ElectionTimeout = c.HeartbeatTimeout
	c.LeaderLeaseTimeout = c.HeartbeatTimeout * 2 / 3
	c.CommitTimeout = 2 * time.Millisecond
	// Batches: the leader takes up to MaxAppendEntries waiting applies in
	// one append, and the FSM gets what was committed together in one
	// ApplyBatch.
	c.BatchApplyCh = true
	c.SnapshotInterval = 200 * time.Millisecond
	c.SnapshotThreshold = o.snapshotThreshold
	if c.SnapshotThreshold == 0 {
		c.SnapshotThreshold = 1 << 40
	}
	c.TrailingLogs = o.trailingLogs
	if c.TrailingLogs == 0 {
		c.TrailingLogs = 10240
	}
	c.Logger = hclog.New(&hclog.LoggerOptions{Name: string(id), Output: io.Discard, Level: hclog.Off})
	return c
}

// newCluster starts n voters and waits for a leader.
func newCluster(t testing.TB, n int, o clusterOpts) *cluster {
	c := &cluster{t: t, o: o, base: t.TempDir(), cut: map[raft.ServerID]bool{}}
	if o.tcp {
		c.net = newTCPNet(t)
		t.Cleanup(c.net.close) // after the nodes' shutdown (cleanups run last first)
	}
	var servers []raft.Server
	for i := 0; i < n; i++ {
		nd := c.addNode()
		servers = append(servers, raft.Server{ID: nd.id, Address: nd.addr})
	}
	for _, nd := range c.nodes {
		if err := raft.BootstrapCluster(raftConfig(nd.id, o), nd.store, nd.store, nd.snaps, nd.trans, raft.Configuration{Servers: servers}); err != nil {
			t.Fatal(err)
		}
	}
	for _, nd := range c.nodes {
		c.start(nd)
	}
	t.Cleanup(c.shutdown)
	c.waitLeader(10 * time.Second)
	return c
}

// addNode makes a node with empty stores, connected, not started.
func (c *cluster) addNode() *tnode {
	i := len(c.nodes) + 1
	nd := &tnode{id: raft.ServerID(fmt.Sprintf("n%d", i)), store: raft.NewInmemStore()}
	nd.dir = filepath.Join(c.base, string(nd.id), "dedup")
	snaps, err := raft.NewFileSnapshotStoreWithLogger(filepath.Join(c.base, string(nd.id), "snapshots"), 2, hclog.NewNullLogger())
	if err != nil {
		c.t.Fatal(err)
	}
	nd.snaps = snaps
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.o.tcp {
		nd.addr, nd.trans = c.net.transport(nd.id)
		c.nodes = append(c.nodes, nd)
		return nd
	}
	nd.addr = raft.ServerAddress(fmt.Sprintf("inmem-n%d", i))
	_, nd.trans = raft.NewInmemTransport(nd.addr)
	for _, o := range c.nodes {
		o.mu.Lock()
		connect(nd, o)
		o.mu.Unlock()
	}
	c.nodes = append(c.nodes, nd)
	return nd
}

// connect links the in-memory transports of a and b both ways (the
// caller holds the cluster's lock, and b's).
func connect(a, b *tnode) {
	a.trans.(*raft.InmemTransport).Connect(b.addr, b.trans)
	b.trans.(*raft.InmemTransport).Connect(a.addr, a.trans)
}

// start runs a new incarnation of nd on its stores.
func (c *cluster) start(nd *tnode) {
	nd.mu.Lock()
	defer nd.mu.Unlock()
	if c.o.tcp && nd.restart > 0 {
		c.t.Fatalf("%s: restarts are not supported over TCP (its listener closed with it)", nd.id)
	}
	app := newCounterFSM()
	if c.o.plainApps {
		app = newBenchCounter()
	}
	var fsm raft.FSM = app
	var w *FSM
	var given *restoreLog
	if c.o.wrap {
		var err error
		eo := testEngineOptions()
		if c.o.engine != nil {
			eo = *c.o.engine
		}
		// Every second node's application is a raft.BatchingFSM, so that
		// replicas applying through both paths must end equal.
		var wrapped raft.FSM = app
		if !c.o.plainApps && nd.id[len(nd.id)-1]%2 == 0 {
			wrapped = &batchingCounter{counterFSM: app}
		}
		w, err = Wrap(wrapped, &Options{Dir: nd.dir, Engine: eo})
		if err != nil {
			c.t.Fatal(err)
		}
		given = &restoreLog{FSM: w}
		fsm = given
	}
	r, err := raft.NewRaft(raftConfig(nd.id, c.o), fsm, nd.store, nd.store, nd.snaps, nd.trans)
	if err != nil {
		c.t.Fatal(err)
	}
	if given != nil {
		given.returned.Store(true)
	}
	nd.app, nd.fsm, nd.given, nd.r, nd.up = app, w, given, r, true
	nd.restart++
}

// stop shuts nd down (its stores stay) and gives it a fresh transport,
// connected, for its next start.
func (c *cluster) stop(nd *tnode) {
	nd.mu.Lock()
	if !nd.up {
		nd.mu.Unlock()
		return
	}
	nd.up = false
	r, w := nd.r, nd.fsm
	nd.mu.Unlock()
	if err := r.Shutdown().Error(); err != nil {
		c.t.Errorf("shutdown %s: %v", nd.id, err)
	}
	if w != nil {
		if err := w.Close(); err != nil {
			c.t.Errorf("close %s: %v", nd.id, err)
		}
	}
	if c.o.tcp {
		return // raft's shutdown closed the transport and its listener
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	nd.mu.Lock()
	nd.trans.(*raft.InmemTransport).Close()
	_, nd.trans = raft.NewInmemTransport(nd.addr)
	nd.mu.Unlock()
	for _, o := range c.nodes {
		if o == nd {
			continue
		}
		o.mu.Lock()
		if !c.cut[o.id] && !c.cut[nd.id] {
			connect(nd, o)
		}
		o.mu.Unlock()
	}
}

// partition cuts nd off from every other node (both directions), or heals it.
func (c *cluster) partition(nd *tnode, cut bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.cut[nd.id] = cut
	if c.o.tcp {
		c.net.partition(nd.addr, cut)
		return
	}
	for _, o := range c.nodes {
		if o == nd {
			continue
		}
		nd.mu.Lock()
		o.mu.Lock()
		if cut {
			nd.trans.(*raft.InmemTransport).Disconnect(o.addr)
			o.trans.(*raft.InmemTransport).Disconnect(nd.addr)
		} else if !c.cut[o.id] {
			connect(nd, o)
		}
		o.mu.Unlock()
		nd.mu.Unlock()
	}
}

func (c *cluster) shutdown() {
	c.mu.Lock()
	nodes := append([]*tnode(nil), c.nodes...)
	c.mu.Unlock()
	for _, nd := range nodes {
		c.stop(nd)
	}
}

// restoreLog is the FSM a test node gives raft: its *FSM (every method
// promoted, so raft still sees a raft.BatchingFSM), with a record of every
// snapshot it restored, in order. A restore that ends before NewRaft
// returned is NewRaft's own, from the node's newest snapshot; any later one
// is an InstallSnapshot from the leader (or a user restore), which a node
// may receive at any moment after it started.
type restoreLog struct {
	*FSM
	returned atomic.Bool // NewRaft returned

	mu       sync.Mutex // guards restores
	restores []restored
}

// restored is one snapshot restored by a restoreLog.
type restored struct {
	index   uint64 // the snapshot's last index (the FSM's LastIndex after the restore)
	atStart bool   // it began before NewRaft returned
}

// Restore implements raft.FSM. raft calls it from one goroutine at a time
// (NewRaft's, then its FSM goroutine, which also applies), so LastIndex
// read afterwards is the index of the snapshot just restored.
func (r *restoreLog) Restore(rc io.ReadCloser) error {
	atStart := !r.returned.Load()
	if err := r.FSM.Restore(rc); err != nil {
		return err
	}
	r.mu.Lock()
	r.restores = append(r.restores, restored{index: r.FSM.Stats().LastIndex, atStart: atStart})
	r.mu.Unlock()
	return nil
}

// first returns the first snapshot this incarnation restored, if any.
func (r *restoreLog) first() (restored, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.restores) == 0 {
		return restored{}, false
	}
	return r.restores[0], true
}

func (nd *tnode) current() (*raft.Raft, *FSM, *counterFSM, bool) {
	nd.mu.Lock()
	defer nd.mu.Unlock()
	return nd.r, nd.fsm, nd.app, nd.up
}

// leader returns the node that is leader now, or nil.
func (c *cluster) leader() *tnode {
	c.mu.Lock()
	nodes := append([]*tnode(nil), c.nodes...)
	c.mu.Unlock()
	for _, nd := range nodes {
		if r, _, _, up := nd.current(); up && r.State() == raft.Leader && !c.isCut(nd) {
			return nd
		}
	}
	return nil
}

func (c *cluster) isCut(nd *tnode) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cut[nd.id]
}

func (c *cluster) waitLeader(d time.Duration) *tnode {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if l := c.leader(); l != nil {
			return l
		}
		time.Sleep(10 * time.Millisecond)
	}
	c.t.Fatalf("no leader within %v", d)
	return nil
}

// clusterNode is the Client's view of a test node: the incarnation that
// runs now, or an error while it is down.
type clusterNode struct{ nd *tnode }

var errNodeDown = errors.New("node is down")

func (n clusterNode) ID() raft.ServerID { return n.nd.id }
func (n clusterNode) Submit(ctx context.Context, cmd []byte) (*Response, error) {
	r, f, _, up := n.nd.current()
	if !up {
		return nil, errNodeDown
	}
	ln, err := LocalNode(n.nd.id, r, f)
	if err != nil {
		return nil, err
	}
	return ln.Submit(ctx, cmd)
}

func (c *cluster) client() *Client {
	var nodes []Node
	for _, nd := range c.nodes {
		nodes = append(nodes, clusterNode{nd})
	}
	cl, err := NewClient(nodes, &ClientOptions{Attempt: 2 * time.Second})
	if err != nil {
		c.t.Fatal(err)
	}
	return cl
}
