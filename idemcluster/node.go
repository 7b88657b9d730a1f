package idemcluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	raftwal "github.com/hashicorp/raft-wal"
	"github.com/hashicorp/raft-wal/metadb"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/reflection"
)

// NodeOptions configure a node of an idem cluster (what `idem serve` runs).
type NodeOptions struct {
	// ID names the node in the raft configuration (required).
	ID string
	// Dir holds the node's raft log, raft snapshots and engine (required).
	Dir string
	// RaftAddr is the address raft listens on and advertises (required
	// unless RaftListener is given). It must name a host other nodes can
	// dial: an unspecified one (":7000", "0.0.0.0:7000") is refused.
	RaftAddr string
	// GRPCAddr is the address the client protocol listens on (required
	// unless GRPCListener is given).
	GRPCAddr string
	// AdvertiseAddr is the gRPC address the node publishes (host:port):
	// the one it records in the members table, sends with its join, and
	// that NOT_LEADER answers and Status name, so other nodes and clients
	// dial it. Default: the gRPC listener's address, which must then have
	// a host: a listener on every interface (GRPCAddr ":7071",
	// "0.0.0.0:7071", "[::]:7071") is refused at start without
	// AdvertiseAddr, since no other host can dial "[::]:7071". Given, it
	// must name a host (a name or an IP that is not unspecified) and a
	// port; it is not checked against the listener (a proxy or NAT may
	// stand between).
	AdvertiseAddr string
	// RaftListener and GRPCListener, when set, are used instead of binding
	// RaftAddr and GRPCAddr (tests hand over listeners they bound).
	RaftListener net.Listener
	GRPCListener net.Listener
	// Transport, when set, carries raft's messages instead of a TCP
	// transport on RaftAddr or RaftListener (leave both empty): raft's
	// NetworkTransport over a TLS StreamLayer, or raft.InmemTransport in
	// tests that cut and heal links. Its LocalAddr is the node's raft
	// address (the one Peers and joins name). The node owns it from then on:
	// it closes it on Close when it has a Close() error method.
	Transport raft.Transport
	// Peers are the initial members, node id -> raft address: every node
	// of a new cluster starts with the same list, and the cluster is
	// bootstrapped once with it. Empty with Join set: the node joins a
	// running cluster.
	Peers map[string]string
	// Join is the gRPC address of a running member: the node asks the
	// leader to add it as a voter.
	Join string
	// Engine tunes the engine under the state machine. Lease (default 1
	// hour) must be the same on every node: leases are measured in the
	// log's time. Clock, Sync, RelaxedClaims, KeepSnapshots and FS are the
	// node's own and must be left zero; Ephemeral is set (the engine
	// writes no log: the raft log is the durable copy), so SyncInterval,
	// SegmentSize, CompactWALBytes and NoPreallocate have no effect.
	Engine idem.Options
	// HeartbeatTimeout and ElectionTimeout tune raft (defaults 500 ms and
	// 500 ms: a failover within about 1-2 s on a LAN or loopback).
	// HeartbeatTimeout must be the same on every node: a leader's lease
	// (NoLeaseReads) counts on the followers' timeout being its own.
	HeartbeatTimeout, ElectionTimeout time.Duration
	// NoLeaseReads turns leader-lease reads off: every linearizable read
	// then takes a leadership round. By default a leader whose round a
	// majority confirmed answers reads without one for 0.9 x
	// HeartbeatTimeout after the round's heartbeats left (docs/design.md,
	// "Reads"). The rules that make leases safe (a restarted node sits out
	// elections for HeartbeatTimeout, leadership transfers void the lease)
	// run on every node either way.
	NoLeaseReads bool
	// SnapshotThreshold is how many entries raft appends between
	// snapshots (default 8192); TrailingLogs how many it keeps after one
	// (default 10240).
	SnapshotThreshold, TrailingLogs uint64
	// Logger receives the node's and raft's messages (default: discard).
	Logger *slog.Logger

	// walSegmentSize is raft-wal's segment size (0: its default, 64 MiB).
	// Tests make it small so that compaction deletes whole segments:
	// raft-wal (v0.4.0, v0.4.1) still reads entries below its first index while they
	// are in a segment it keeps, and raft then never needs a snapshot.
	walSegmentSize int
	// leaseClock, when set, is the clock of a restarted node's quiet time
	// (leaseTransport; tests).
	leaseClock func() time.Time
}

// maxAppendEntries bounds a raft batch: the commands of one log append
// and fsync, of one AppendEntries, and of one ApplyBatch (raft's limit is
// 1024).
const maxAppendEntries = 512

// logCacheEntries is how many of the last log entries a node keeps in
// memory (raft.LogCache) for replication and its own applies.
const logCacheEntries = 1024

// Node is a running member of an idem cluster: raft, the state machine
// over an idem engine, and the gRPC services Idem and Cluster.
type Node struct {
	o     NodeOptions
	r     *raft.Raft
	fsm   *fsm
	logs  *raftwal.WAL
	logc  raft.LogStore // logs through raft's cache (confirmLeadership reads entry types)
	meta  *metadb.BoltMetaDB
	trans raft.Transport
	grpc  *grpc.Server
	glis  net.Listener
	addr  string // the gRPC address published (NodeOptions.AdvertiseAddr, or glis's)
	log   *slog.Logger
	ready atomic.Uint64 // the term in which this node, as leader, applied a barrier
	reads readRounds    // linearizable reads' shared leadership confirmations
	// lease is the leader's lease for reads without a round (lease.go);
	// leaseLen its length, 0 when off (NodeOptions.NoLeaseReads).
	lease    leaderLease
	leaseLen time.Duration
	// raftDown is closed when raft shuts down, also by itself (a node
	// that removed itself: ShutdownOnRemove).
	raftDown chan struct{}
	// beating holds the voters a read round's heartbeat is on its way to
	// (leaderRound): one at a time each.
	beating sync.Map // raft.ServerID -> struct{}
	stop    chan struct{}
	wg      sync.WaitGroup
	closed  atomic.Bool
}

func (o *NodeOptions) check() error {
	switch {
	case o.ID == "":
		return errors.New("idemcluster: NodeOptions.ID is required")
	case o.Dir == "":
		return errors.New("idemcluster: NodeOptions.Dir is required")
	case o.RaftAddr == "" && o.RaftListener == nil && o.Transport == nil:
		return errors.New("idemcluster: NodeOptions.RaftAddr is required")
	case o.Transport != nil && (o.RaftAddr != "" || o.RaftListener != nil):
		return errors.New("idemcluster: NodeOptions: give Transport or RaftAddr/RaftListener, not both")
	case o.GRPCAddr == "" && o.GRPCListener == nil:
		return errors.New("idemcluster: NodeOptions.GRPCAddr is required")
	case o.AdvertiseAddr != "":
		if err := CheckAdvertisable(o.AdvertiseAddr); err != nil {
			return fmt.Errorf("idemcluster: NodeOptions.AdvertiseAddr: %w", err)
		}
	case len(o.Peers) == 0 && o.Join == "":
		return errors.New("idemcluster: NodeOptions: give Peers (a new cluster) or Join (a running one)")
	case o.Engine.Clock != nil || o.Engine.FS != nil || o.Engine.RelaxedClaims || o.Engine.KeepSnapshots != 0 || o.Engine.Sync != idem.SyncAlways:
		return errors.New("idemcluster: NodeOptions.Engine: Clock, FS, Sync, RelaxedClaims and KeepSnapshots are set by the node (the log's time; the raft log is the durable copy)")
	case o.Engine.MaxEntries != 0:
		return errors.New("idemcluster: NodeOptions.Engine.MaxEntries must be zero (eviction is not driven by the log, so nodes would disagree)")
	}
	if len(o.Peers) > 0 {
		if _, ok := o.Peers[o.ID]; !ok {
			return fmt.Errorf("idemcluster: NodeOptions.Peers does not name this node %q", o.ID)
		}
	}
	return nil
}

// StartNode starts a node. A node whose Dir holds raft state rejoins its
// cluster with it (its engine is rebuilt from raft's snapshot and log).
func StartNode(opts *NodeOptions) (*Node, error) {
	if opts == nil {
		return nil, errors.New("idemcluster: StartNode: nil options")
	}
	o := *opts
	if err := o.check(); err != nil {
		return nil, err
	}
	if o.HeartbeatTimeout <= 0 {
		o.HeartbeatTimeout = 500 * time.Millisecond
	}
	if o.ElectionTimeout <= 0 {
		o.ElectionTimeout = 500 * time.Millisecond
	}
	if o.SnapshotThreshold == 0 {
		o.SnapshotThreshold = 8192
	}
	if o.TrailingLogs == 0 {
		o.TrailingLogs = 10240
	}
	lg := o.Logger
	if lg == nil {
		lg = slog.New(slog.DiscardHandler)
	}
	n := &Node{o: o, log: lg.With("node", o.ID), stop: make(chan struct{}), raftDown: make(chan struct{})}
	if !o.NoLeaseReads {
		n.leaseLen = leaseLength(o.HeartbeatTimeout)
	}
	n.reads.confirm = n.confirmLeadership
	ok := false
	defer func() {
		if !ok {
			n.teardown()
		}
	}()
	// The gRPC listener first: an address that cannot be published is
	// refused before raft starts (and bootstraps).
	var err error
	gl := o.GRPCListener
	if gl == nil {
		if gl, err = net.Listen("tcp", o.GRPCAddr); err != nil {
			return nil, fmt.Errorf("idemcluster: gRPC address: %w", err)
		}
	}
	n.glis = gl
	if n.addr = o.AdvertiseAddr; n.addr == "" {
		n.addr = gl.Addr().String()
		if err := CheckAdvertisable(n.addr); err != nil {
			return nil, fmt.Errorf("idemcluster: the gRPC listener's address cannot be published (NodeOptions.GRPCAddr %q): %w; give NodeOptions.AdvertiseAddr, the host:port other nodes and clients reach this node at", o.GRPCAddr, err)
		}
	}
	for _, d := range []string{"raft", "snapshots"} {
		if err := os.MkdirAll(filepath.Join(o.Dir, d), 0o755); err != nil {
			return nil, fmt.Errorf("idemcluster: %w", err)
		}
	}
	f, err := newFSM(filepath.Join(o.Dir, "engine"), o.Engine)
	if err != nil {
		return nil, fmt.Errorf("idemcluster: engine: %w", err)
	}
	n.fsm = f
	// The node keeps the log's metadata store (a bbolt file, locked while
	// open) to close it itself: raft-wal v0.4.1's Close closes it (v0.4.0's
	// left it open), after which the node's Close of it does nothing, but
	// Open returns its errors (a log it cannot recover) with the store left
	// open, and the node must still release it so that a node restarted in
	// the same process can open its directory again.
	n.meta = &metadb.BoltMetaDB{}
	if n.logs, err = openWAL(&o, n.meta); err != nil {
		return nil, fmt.Errorf("idemcluster: raft log: %w", err)
	}
	hl := hclog.New(&hclog.LoggerOptions{Name: "raft", Level: hclog.Warn, Output: slogWriter{n.log}})
	snaps, err := raft.NewFileSnapshotStoreWithLogger(filepath.Join(o.Dir, "snapshots"), 2, hl)
	if err != nil {
		return nil, fmt.Errorf("idemcluster: raft snapshots: %w", err)
	}
	tr, err := raftTransport(&o, hl)
	if err != nil {
		return nil, err
	}
	has, err := raft.HasExistingState(n.logs, n.logs, snaps)
	if err != nil {
		if c, ok := tr.(io.Closer); ok {
			c.Close()
		}
		return nil, fmt.Errorf("idemcluster: %w", err)
	}
	n.trans = newLeaseTransport(tr, o.ID, &n.lease, o.HeartbeatTimeout, has, o.leaseClock)
	conf := raft.DefaultConfig()
	conf.LocalID = raft.ServerID(o.ID)
	conf.HeartbeatTimeout = o.HeartbeatTimeout
	conf.ElectionTimeout = o.ElectionTimeout
	conf.LeaderLeaseTimeout = o.HeartbeatTimeout / 2
	conf.SnapshotThreshold = o.SnapshotThreshold
	conf.TrailingLogs = o.TrailingLogs
	// Group commit: the leader takes every command waiting (up to
	// MaxAppendEntries) into one StoreLogs (one raft-wal append and one
	// fsync) and one AppendEntries per follower (each follower appends and
	// fsyncs it once before it answers); the FSM gets up to
	// MaxAppendEntries committed entries per ApplyBatch. BatchApplyCh
	// buffers the apply channel so that commands arriving while the leader
	// syncs queue up for the next append instead of waiting one by one.
	conf.MaxAppendEntries = maxAppendEntries
	conf.BatchApplyCh = true
	conf.Logger = hl
	// The cache keeps the last entries appended in memory: replication to
	// the followers and the followers' own applies read them from it
	// instead of reading them back from the log's files.
	cached, err := raft.NewLogCache(logCacheEntries, n.logs)
	if err != nil {
		return nil, fmt.Errorf("idemcluster: raft log cache: %w", err)
	}
	n.logc = cached
	if n.r, err = raft.NewRaft(conf, f, cached, n.logs, snaps, n.trans); err != nil {
		return nil, fmt.Errorf("idemcluster: raft: %w", err)
	}
	leaseTransportOf(n.trans).raft.Store(n.r)
	var down sync.Once
	n.r.RegisterObserver(raft.NewObserver(nil, false, func(o *raft.Observation) bool {
		if s, ok := o.Data.(raft.RaftState); ok && s == raft.Shutdown {
			down.Do(func() { close(n.raftDown) })
		}
		return false
	}))
	if n.r.State() == raft.Shutdown {
		down.Do(func() { close(n.raftDown) })
	}
	if !has && len(o.Peers) > 0 {
		var cfg raft.Configuration
		ids := make([]string, 0, len(o.Peers))
		for id := range o.Peers {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		for _, id := range ids {
			cfg.Servers = append(cfg.Servers, raft.Server{ID: raft.ServerID(id), Address: raft.ServerAddress(o.Peers[id])})
		}
		if err := n.r.BootstrapCluster(cfg).Error(); err != nil && !errors.Is(err, raft.ErrCantBootstrap) {
			return nil, fmt.Errorf("idemcluster: bootstrap: %w", err)
		}
	}
	n.grpc = grpc.NewServer(codecServerOption())
	s := &server{n: n}
	clusterpb.RegisterIdemServer(n.grpc, s)
	clusterpb.RegisterClusterServer(n.grpc, s)
	reflection.Register(n.grpc)
	n.wg.Add(3)
	go func() {
		defer n.wg.Done()
		_ = n.grpc.Serve(gl)
	}()
	go n.watchLeadership()
	go n.advertiseLoop()
	if !has && o.Join != "" {
		if err := n.join(o.Join); err != nil {
			return nil, err
		}
	}
	ok = true
	return n, nil
}

// Addr is the node's published gRPC address (NodeOptions.AdvertiseAddr,
// or the listener's address).
func (n *Node) Addr() string { return n.addr }

// ListenAddr is the address the node's gRPC listener is bound to (the
// same as Addr unless NodeOptions.AdvertiseAddr names another).
func (n *Node) ListenAddr() string { return n.glis.Addr().String() }

// CheckAdvertisable reports why addr cannot be published as an address
// other hosts dial: it must be host:port with a host that is a name or an
// IP other than the unspecified ones (0.0.0.0, ::), and a port number
// 1-65535. A listener bound to ":7071" has the address "[::]:7071", which
// names no host.
func CheckAdvertisable(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("%q is not host:port (%v)", addr, err)
	}
	if p, err := strconv.ParseUint(port, 10, 16); err != nil || p == 0 {
		return fmt.Errorf("%q: the port must be a number 1-65535", addr)
	}
	if host == "" {
		return fmt.Errorf("%q names no host (it means every interface): other hosts cannot dial it", addr)
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		return fmt.Errorf("%q names the unspecified address %s (every interface): other hosts cannot dial it", addr, host)
	}
	return nil
}

// RaftAddr is the node's raft address.
func (n *Node) RaftAddr() string { return string(n.trans.LocalAddr()) }

// Raft is the node's raft (for status pages and tests).
func (n *Node) Raft() *raft.Raft { return n.r }

// IsLeader reports whether the node is the leader and ready to serve.
func (n *Node) IsLeader() bool {
	return n.r.State() == raft.Leader && n.ready.Load() == n.r.CurrentTerm()
}

// watchLeadership makes a new leader ready: a barrier (every entry of
// earlier terms applied) and its gRPC address in the members table.
func (n *Node) watchLeadership() {
	defer n.wg.Done()
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-n.stop:
			return
		case <-t.C:
		}
		if n.r.State() != raft.Leader {
			continue
		}
		term := n.r.CurrentTerm()
		if n.ready.Load() == term {
			continue
		}
		if err := n.await(n.r.Barrier(5 * time.Second)); err != nil {
			continue
		}
		if _, err := n.apply(context.Background(), &command{Op: cmdMember, Node: n.o.ID, Addr: n.Addr()}); err != nil {
			continue
		}
		n.ready.Store(term)
		n.log.Info("idemcluster: leader ready", "term", term)
	}
}

func (n *Node) join(addr string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := Dial(ctx, []string{addr}, nil)
	if err != nil {
		return err
	}
	defer c.Close()
	return c.join(ctx, &clusterpb.JoinRequest{NodeId: n.o.ID, RaftAddr: n.RaftAddr(), GrpcAddr: n.Addr()})
}

// leaderAddr is the leader's gRPC address, when known.
func (n *Node) leaderAddr() string {
	_, id := n.r.LeaderWithID()
	if id == "" {
		return ""
	}
	return n.fsm.member(string(id))
}

// apply appends a command and returns what the state machine made of it.
// An error that leaves the outcome unknown (leadership lost after the
// append) is ErrInDoubt: the client retries with the same command.
func (n *Node) apply(ctx context.Context, c *command) (*applied, error) {
	if n.r.State() != raft.Leader {
		return nil, &errNotLeader{leader: n.leaderAddr()}
	}
	data, err := encodeCommand(c)
	if err != nil {
		return nil, err
	}
	timeout := 10 * time.Second
	if d, ok := ctx.Deadline(); ok {
		timeout = max(time.Until(d), time.Millisecond)
	}
	fut := n.r.Apply(data, timeout)
	if err := n.await(fut); err != nil {
		switch {
		case errors.Is(err, raft.ErrNotLeader):
			return nil, &errNotLeader{leader: n.leaderAddr()}
		case errors.Is(err, raft.ErrEnqueueTimeout):
			return nil, fmt.Errorf("idemcluster: %w", context.DeadlineExceeded)
		default: // leadership lost, shutdown: the entry may commit later
			return nil, fmt.Errorf("%w: %v", idem.ErrInDoubt, err)
		}
	}
	a, _ := fut.Response().(*applied)
	if a == nil {
		return nil, fmt.Errorf("idemcluster: entry %d applied without an answer", fut.Index())
	}
	return a, nil
}

// errStopped is a raft future the node stopped waiting for: it is
// shutting down.
var errStopped = errors.New("idemcluster: the node is shutting down")

// await is f.Error(), or errStopped once the node stops, or
// raft.ErrRaftShutdown once raft has shut down. Raft (v1.8) never answers
// a future that its apply channel took as it shut down: the channel is
// buffered (BatchApplyCh), so Apply and Barrier can hand it over after
// the loop that reads it returned, and its Error() then blocks forever.
// watchLeadership met that in a test's Close (its Barrier taken between
// the node's stop and raft's shutdown), and Close waited for it
// (TestAwaitEndsWhenTheNodeStops). Raft also shuts itself down, without
// the node stopping, when it applies a configuration that removes it
// (ShutdownOnRemove): a write handed to a leader that just removed itself
// waited for its caller's deadline (TestRemoveLeaderAnswersWritesInFlight).
// raftDown is closed by an observer of raft's state (raft calls it
// synchronously as it enters Shutdown), not a poll. Raft still answers
// the futures of the entries its FSM goroutine holds as it shuts down
// (the removal's own, which commits just before), so after raftDown await
// waits up to raftShutdownGrace more for f: an answer that comes is the
// answer (TestRemoveLeaderRetriedOnNextLeader met the removal answered
// ErrRaftShutdown without it).
func (n *Node) await(f raft.Future) error {
	ch := make(chan error, 1)
	go func() { ch <- f.Error() }()
	select {
	case err := <-ch:
		return err
	case <-n.stop:
		select {
		case err := <-ch: // answered meanwhile
			return err
		default:
			return errStopped
		}
	case <-n.raftDown:
		t := time.NewTimer(raftShutdownGrace)
		defer t.Stop()
		select {
		case err := <-ch:
			return err
		case <-t.C:
			return raft.ErrRaftShutdown
		case <-n.stop:
			return errStopped
		}
	}
}

// raftShutdownGrace is how long await waits for a future after raft shut
// itself down: raft's FSM goroutine answers the futures of the batch it
// applies, or exits and answers none.
const raftShutdownGrace = time.Second

// applyAll appends cmds as one entry (one cmdBatch, or the command itself
// when alone) and returns the state machine's answer to each.
func (n *Node) applyAll(ctx context.Context, cmds []*command) ([]*applied, error) {
	if len(cmds) == 1 {
		a, err := n.apply(ctx, cmds[0])
		return []*applied{a}, err
	}
	a, err := n.apply(ctx, &command{Op: cmdBatch, Cmds: cmds})
	if err != nil {
		return nil, err
	}
	if len(a.subs) != len(cmds) {
		if a.err != nil {
			return nil, a.err
		}
		return nil, fmt.Errorf("idemcluster: a batch entry of %d commands applied with %d answers", len(cmds), len(a.subs))
	}
	return a.subs, nil
}

// readIndex makes a read linearizable: the node must be a ready leader,
// confirm its leadership with a majority after taking the commit index,
// and have applied up to that index (the entries of it the state machine
// gets: fsmIndexAt). The confirmation is shared: one
// round (readRounds) serves every read that arrived before it started, as
// etcd batches its ReadIndex requests; each read then waits until the
// commit index its round took is applied.
func (n *Node) readIndex(ctx context.Context, followerRead bool) error {
	if followerRead {
		return nil
	}
	r, err := n.beginRead()
	if err != nil {
		return err
	}
	_, err = n.endRead(ctx, r, 0)
	return err
}

// beginRead joins the leadership round that will confirm a read arriving
// now (readIndex's first half), or says the node does not lead.
func (n *Node) beginRead() (*readRound, error) {
	if !n.IsLeader() {
		return nil, &errNotLeader{leader: n.leaderAddr()}
	}
	if r := n.leaseRead(); r != nil {
		return r, nil
	}
	return n.reads.join(), nil
}

// endRead waits for r (readIndex's second half) and reports whether a
// read made after beginRead, on the state machine at index at or later,
// is current: at covers the round's index. When it is not, endRead
// returns once the state machine has applied the round's index (read
// again).
func (n *Node) endRead(ctx context.Context, r *readRound, at uint64) (current bool, err error) {
	select {
	case <-r.done:
	case <-ctx.Done():
		return false, ctx.Err()
	}
	if r.err != nil {
		return false, r.err
	}
	if at >= r.index {
		return true, nil
	}
	return false, n.fsm.waitApplied(ctx, r.index)
}

// confirmLeadership is one read round: it takes the commit index, then
// confirms with a majority (leaderRound) that the node is still the
// leader of the term in which it became ready, so that no other leader
// can have committed anything the index does not cover.
func (n *Node) confirmLeadership() (uint64, error) {
	term := n.ready.Load()
	if n.r.State() != raft.Leader || n.r.CurrentTerm() != term {
		return 0, &errNotLeader{leader: n.leaderAddr()}
	}
	ci := n.r.CommitIndex()
	sent := time.Now() // before the round's heartbeats leave
	if err := n.leaderRound(term); err != nil || n.r.CurrentTerm() != term {
		return 0, &errNotLeader{leader: n.leaderAddr()}
	}
	if n.leaseLen > 0 {
		n.lease.extend(term, sent.Add(n.leaseLen))
	}
	return n.fsmIndexAt(ci)
}

// errNoMajority is a leader round that a majority did not confirm.
var errNoMajority = errors.New("idemcluster: no majority confirmed the leadership")

// leaderRound confirms that the node is still the leader of term as of
// after the call began: it sends a heartbeat of that term (raft's own:
// an AppendEntries without entries, which raft's TCP transport hands to
// the follower's heartbeat handler, off the path of its log's appends) to
// every other voter of the latest configuration,
// and returns nil once a majority of the voters, itself included,
// accepted one. A voter accepts only while it has seen no later term, and
// a leader of a later term needs a majority, which shares a voter with
// this one: so no later leader had committed anything when that majority
// answered, which was after the call began.
//
// Only the answers to the heartbeats sent here count. raft's VerifyLeader
// counts the next answer each replication goroutine receives after it
// registers, also the answer to a heartbeat or an AppendEntries that was
// on its way before it was called, which may have been given before a
// read arrived and before another leader was elected
// (TestReadRoundCountsOnlyItsOwnHeartbeats). And it goes through raft's
// main loop twice, behind the log appends and their fsyncs; this round
// does not.
//
// The round ends with errNoMajority when the voters that answered cannot
// make a majority any more, or when none came within HeartbeatTimeout
// (a follower that stopped answering: the heartbeat already sent ends on
// the transport's own timeout, its answer unread). A voter that an
// earlier round's heartbeat is still on its way to gets none from this
// round and does not count for it: a follower that stopped (SIGSTOP, a
// link that drops everything) holds one heartbeat, not one per round,
// each on a connection of its own (TestReadRoundsKeepOneHeartbeatPerVoter).
func (n *Node) leaderRound(term uint64) error {
	self := raft.ServerID(n.o.ID)
	var others []raft.Server
	voters, selfVoter := 0, false
	for _, sv := range n.r.GetConfiguration().Configuration().Servers {
		if sv.Suffrage != raft.Voter {
			continue
		}
		voters++
		if sv.ID == self {
			selfVoter = true
			continue
		}
		others = append(others, sv)
	}
	need := voters/2 + 1
	if selfVoter {
		need--
	}
	switch {
	case need <= 0:
		return nil
	case len(others) < need:
		return errNoMajority
	}
	addr := n.trans.EncodePeer(self, n.trans.LocalAddr())
	hdr := raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte(self), Addr: addr}
	acks := make(chan bool, len(others)) // buffered: a round that ended leaves its senders unblocked
	left := 0
	for _, sv := range others {
		if _, busy := n.beating.LoadOrStore(sv.ID, struct{}{}); busy {
			continue
		}
		left++
		go func() {
			req := raft.AppendEntriesRequest{RPCHeader: hdr, Term: term, Leader: addr}
			var resp raft.AppendEntriesResponse
			err := n.trans.AppendEntries(sv.ID, sv.Address, &req, &resp)
			n.beating.Delete(sv.ID) // before the answer: the next round may send again at once
			acks <- err == nil && resp.Success && resp.Term == term
		}()
	}
	if left < need {
		return errNoMajority
	}
	t := time.NewTimer(n.o.HeartbeatTimeout)
	defer t.Stop()
	for got := 0; ; {
		select {
		case ok := <-acks:
			left--
			if ok {
				if got++; got >= need {
					return nil
				}
			}
			if got+left < need {
				return errNoMajority
			}
		case <-t.C:
			return errNoMajority
		case <-n.stop:
			return errNoMajority
		}
	}
}

// fsmIndexAt is the index the state machine has applied once it reflects
// every entry up to index: the last entry at or below index that raft
// hands it. Raft (v1.8) gives a BatchingFSM only command and
// configuration entries; a no-op (a new term's first entry) or a barrier
// never reaches it, and its AppliedIndex counts entries handed to the
// FSM goroutine, not applied. So when such an entry is the last committed
// one, the state machine's index stays below the commit index until the
// next command, and a read waiting for the commit index would wait for
// that (TestReadAfterBarrierAnswers). The search stops at the state
// machine's index, or at an entry no longer in the log (compacted: a
// snapshot of the state machine, or one restored into it, covers it). It
// is short: a ready leader has applied a command of its own term (its
// member entry, watchLeadership), so it never goes below that.
func (n *Node) fsmIndexAt(index uint64) (uint64, error) {
	applied := n.fsm.index.Load()
	for ; index > applied; index-- {
		var l raft.Log
		if err := n.logc.GetLog(index, &l); err != nil {
			if errors.Is(err, raft.ErrLogNotFound) {
				return applied, nil
			}
			return 0, fmt.Errorf("idemcluster: read round: raft log entry %d: %w", index, err)
		}
		if l.Type == raft.LogCommand || l.Type == raft.LogConfiguration {
			return index, nil
		}
	}
	return index, nil
}

// readRound is one leadership confirmation shared by the reads that
// joined it.
type readRound struct {
	done  chan struct{} // closed when index and err are set
	index uint64        // what the state machine must have applied: the commit index taken before the confirmation, less the entries it never gets (fsmIndexAt)
	err   error
}

// readRounds runs one confirmation at a time. Reads that arrive while one
// runs join the next, which starts when the running one ends: a read is
// never served by a round that started before it arrived.
type readRounds struct {
	confirm func() (uint64, error)

	mu      sync.Mutex // guards next and running
	next    *readRound // the round collecting reads, not started
	running bool       // a goroutine is running rounds
}

// join returns the round that will serve a read arriving now.
func (rr *readRounds) join() *readRound {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	if rr.next == nil {
		rr.next = &readRound{done: make(chan struct{})}
	}
	r := rr.next
	if !rr.running {
		rr.running = true
		go rr.run()
	}
	return r
}

// renew starts a round for no read (it renews the leader's lease) unless
// one is running or waiting to.
func (rr *readRounds) renew() {
	rr.mu.Lock()
	defer rr.mu.Unlock()
	if rr.running {
		return
	}
	if rr.next == nil {
		rr.next = &readRound{done: make(chan struct{})}
	}
	rr.running = true
	go rr.run()
}

// run runs rounds while reads are waiting, then exits.
func (rr *readRounds) run() {
	for {
		rr.mu.Lock()
		r := rr.next
		rr.next = nil
		if r == nil {
			rr.running = false
			rr.mu.Unlock()
			return
		}
		rr.mu.Unlock()
		r.index, r.err = rr.confirm()
		close(r.done)
	}
}

// Close shuts the node down cleanly: a leader hands leadership over first
// (raft bounds the transfer by ElectionTimeout). Close does not wait for
// the gRPC handlers still running: the server's Stop (not GracefulStop:
// a drain would wait for each RPC, a Wait for its caller's deadline)
// closes every connection and cancels the handlers' contexts, and a
// handler waiting for its entry to commit stops waiting when the node
// stops (Node.await): it answers ErrInDoubt, as the entry may commit
// through another node, or its connection is gone first (Unavailable);
// the client retries the same request elsewhere either way. So a handler
// caught mid-apply does not delay Close (TestCloseWithHandlerMidApply);
// what Close waits for is raft's shutdown, whose replication to a
// follower that stopped answering ends at the transport's timeout (5 s
// on TCP). A handler that runs on after Close finds the engine closed
// (ErrClosed) and raft shut down.
func (n *Node) Close() error {
	if n.closed.Swap(true) {
		return nil
	}
	if n.r != nil && n.r.State() == raft.Leader {
		_ = n.r.LeadershipTransfer().Error()
	}
	return n.teardown()
}

func (n *Node) teardown() error {
	select {
	case <-n.stop:
	default:
		close(n.stop)
	}
	var errs []error
	if n.grpc != nil {
		n.grpc.Stop() // closes glis
	} else if n.glis != nil {
		n.glis.Close()
	}
	if n.r != nil {
		errs = append(errs, n.r.Shutdown().Error())
	}
	if c, ok := n.trans.(io.Closer); ok {
		errs = append(errs, c.Close())
	}
	n.wg.Wait()
	if n.logs != nil {
		errs = append(errs, n.logs.Close())
	}
	if n.meta != nil {
		errs = append(errs, n.meta.Close())
	}
	if n.fsm != nil {
		errs = append(errs, n.fsm.close())
	}
	return errors.Join(errs...)
}

// openWAL opens the node's raft log (raft-wal in Dir/raft).
func openWAL(o *NodeOptions, meta *metadb.BoltMetaDB) (*raftwal.WAL, error) {
	dir := filepath.Join(o.Dir, "raft")
	if o.walSegmentSize > 0 {
		return raftwal.Open(dir, raftwal.WithMetaStore(meta), raftwal.WithSegmentSize(o.walSegmentSize))
	}
	return raftwal.Open(dir, raftwal.WithMetaStore(meta))
}

// raftTransport is o.Transport, or raft's TCP transport on o.RaftListener
// or a listener bound to o.RaftAddr.
func raftTransport(o *NodeOptions, hl hclog.Logger) (raft.Transport, error) {
	if o.Transport != nil {
		return o.Transport, nil
	}
	rl := o.RaftListener
	if rl == nil {
		var err error
		if rl, err = net.Listen("tcp", o.RaftAddr); err != nil {
			return nil, fmt.Errorf("idemcluster: raft address: %w", err)
		}
	}
	// Raft advertises the address its listener has (as raft's own
	// NewTCPTransport, which refuses it too).
	if err := CheckAdvertisable(rl.Addr().String()); err != nil {
		rl.Close()
		return nil, fmt.Errorf("idemcluster: the raft listener's address cannot be advertised (NodeOptions.RaftAddr %q): %w; give RaftAddr the host other nodes reach this node at", o.RaftAddr, err)
	}
	return raft.NewNetworkTransportWithLogger(&tcpLayer{Listener: rl}, 5, 5*time.Second, hl), nil
}

// tcpLayer is raft's StreamLayer over a listener the node was given.
type tcpLayer struct{ net.Listener }

func (t *tcpLayer) Dial(addr raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	return net.DialTimeout("tcp", string(addr), timeout)
}

// slogWriter sends hclog's lines to slog.
type slogWriter struct{ l *slog.Logger }

func (w slogWriter) Write(p []byte) (int, error) {
	w.l.Warn(strings.TrimSpace(string(p)))
	return len(p), nil
}

var _ io.Writer = slogWriter{}
