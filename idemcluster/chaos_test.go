package idemcluster

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// chaosCluster is a testCluster whose nodes speak raft over raft's
// in-memory transport, so that a test cuts and heals links between them;
// the client protocol stays on loopback TCP (a client reaches every node,
// also one that raft cannot reach: the case a partition must handle).
type chaosCluster struct {
	*testCluster
	ids []string

	// wrap, when set, is the transport node id's raft uses around its
	// in-memory one (set before the nodes start: newChaosClusterWrapped).
	wrap func(id string, tr *raft.InmemTransport) raft.Transport

	mu     sync.Mutex // guards trans, cut and linked (faults and restarts)
	trans  map[string]*raft.InmemTransport
	cut    map[[2]string]bool // raft messages from [0] to [1] are dropped
	linked map[[2]string]bool // the links the transports have now
}

// newChaosCluster starts n nodes n1..nN. tune, when set, adjusts each
// node's options before it starts.
func newChaosCluster(t testing.TB, n int, tune func(o *NodeOptions)) *chaosCluster {
	t.Helper()
	return newChaosClusterWrapped(t, n, tune, nil)
}

// newChaosClusterWrapped is newChaosCluster whose nodes' raft uses
// wrap(id, the node's in-memory transport) as its transport.
func newChaosClusterWrapped(t testing.TB, n int, tune func(o *NodeOptions), wrap func(id string, tr *raft.InmemTransport) raft.Transport) *chaosCluster {
	t.Helper()
	cc := &chaosCluster{
		testCluster: &testCluster{t: t, dir: t.TempDir(), nodes: map[string]*Node{}, opts: map[string]*NodeOptions{}},
		trans:       map[string]*raft.InmemTransport{}, cut: map[[2]string]bool{}, linked: map[[2]string]bool{},
		wrap: wrap,
	}
	peers := map[string]string{}
	for i := range n {
		id := fmt.Sprintf("n%d", i+1)
		cc.ids = append(cc.ids, id)
		peers[id] = id // the in-memory transport's address is the node's id
	}
	t.Cleanup(func() {
		for _, id := range cc.ids {
			if cc.nodes[id] != nil {
				cc.stop(id)
			}
		}
	})
	for _, id := range cc.ids {
		gl := listen(t)
		cc.addrs = append(cc.addrs, gl.Addr().String())
		o := &NodeOptions{ID: id, Dir: filepath.Join(cc.dir, id), GRPCListener: gl, Peers: peers,
			HeartbeatTimeout: 200 * time.Millisecond, ElectionTimeout: 200 * time.Millisecond}
		if tune != nil {
			tune(o)
		}
		cc.opts[id] = o
		cc.startWith(id, false)
	}
	cc.leader(30 * time.Second)
	return cc
}

// addr is node id's gRPC address.
func (cc *chaosCluster) addr(id string) string { return cc.addrs[slices.Index(cc.ids, id)] }

// startWith starts node id on a new in-memory transport, linked to the
// running nodes as the cuts allow; rebind: bind its gRPC address again, as
// a restarted process does (else its options carry a listener).
func (cc *chaosCluster) startWith(id string, rebind bool) {
	cc.t.Helper()
	_, tr := raft.NewInmemTransport(raft.ServerAddress(id))
	o := *cc.opts[id]
	o.Transport = tr
	if cc.wrap != nil {
		o.Transport = cc.wrap(id, tr)
	}
	if rebind {
		o.GRPCListener, o.GRPCAddr = nil, cc.addr(id)
	}
	cc.mu.Lock()
	cc.trans[id] = tr
	cc.relinkLocked()
	cc.mu.Unlock()
	nd, err := StartNode(&o)
	if err != nil {
		cc.t.Fatalf("start %s: %v", id, err)
	}
	cc.nodes[id] = nd
}

// start starts node id again on its directory and gRPC address.
func (cc *chaosCluster) start(id string) { cc.startWith(id, true) }

// stop stops node id abruptly (as a crash of its process would).
func (cc *chaosCluster) stop(id string) {
	cc.testCluster.stop(id)
	cc.mu.Lock()
	delete(cc.trans, id)
	cc.relinkLocked()
	cc.mu.Unlock()
}

// relinkLocked makes the transports' links what cut says: every pair of
// running nodes is linked unless cut.
func (cc *chaosCluster) relinkLocked() {
	for _, a := range cc.ids {
		for _, b := range cc.ids {
			if a == b {
				continue
			}
			l := [2]string{a, b}
			want := cc.trans[a] != nil && cc.trans[b] != nil && !cc.cut[l]
			switch {
			case want && !cc.linked[l]:
				cc.trans[a].Connect(raft.ServerAddress(b), cc.trans[b])
			case !want && cc.linked[l] && cc.trans[a] != nil:
				cc.trans[a].Disconnect(raft.ServerAddress(b))
			}
			cc.linked[l] = want
		}
	}
}

// split cuts every link between nodes of different groups (both ways);
// nodes named in no group are cut from every group.
func (cc *chaosCluster) split(groups ...[]string) {
	group := map[string]int{}
	for g, ids := range groups {
		for _, id := range ids {
			group[id] = g + 1
		}
	}
	cc.mu.Lock()
	defer cc.mu.Unlock()
	for _, a := range cc.ids {
		for _, b := range cc.ids {
			cc.cut[[2]string{a, b}] = a != b && (group[a] == 0 || group[a] != group[b])
		}
	}
	cc.relinkLocked()
}

// isolate cuts node id from every other node, both ways.
func (cc *chaosCluster) isolate(id string) {
	var rest []string
	for _, o := range cc.ids {
		if o != id {
			rest = append(rest, o)
		}
	}
	cc.split([]string{id}, rest)
}

// heal links every pair of running nodes again.
func (cc *chaosCluster) heal() { cc.split(cc.ids) }

// leaderAmong waits for a ready leader among ids and returns it.
func (cc *chaosCluster) leaderAmong(ids []string, within time.Duration) string {
	cc.t.Helper()
	var found string
	eventually(cc.t, within, fmt.Sprintf("a ready leader among %v", ids), func() bool {
		for _, id := range ids {
			if nd := cc.nodes[id]; nd != nil && nd.IsLeader() {
				found = id
				return true
			}
		}
		return false
	})
	return found
}

// others are the nodes other than ids.
func (cc *chaosCluster) others(ids ...string) []string {
	var out []string
	for _, id := range cc.ids {
		if !slices.Contains(ids, id) {
			out = append(out, id)
		}
	}
	return out
}

// eventually polls cond every 10 ms until it holds, and fails the test
// if it does not within the bound.
func eventually(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: %s", within, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// untilLeaderStays runs body as a subtest until a run was not skipped
// (at most 5 runs). The tests that cut off or remove "the leader" check
// nothing when leadership moved on its own before the step (a goroutine
// starved past the election timeout: a loaded machine), and skip; a
// skipped run is run again on a new cluster instead of leaving the check
// undone, and 5 skipped runs fail.
func untilLeaderStays(t *testing.T, body func(t *testing.T)) {
	t.Helper()
	for i := 1; i <= 5; i++ {
		skipped := false
		t.Run(fmt.Sprintf("run%d", i), func(t *testing.T) {
			defer func() { skipped = t.Skipped() }()
			body(t)
		})
		if !skipped {
			return
		}
	}
	t.Fatal("the leader changed on its own in each of 5 runs: nothing was checked")
}

// rawIdem is a gRPC client of one node's Idem service: unlike Client it
// does not follow NOT_LEADER, so the test sees that node's own answers.
func rawIdem(t testing.TB, addr string) clusterpb.IdemClient {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return clusterpb.NewIdemClient(cc)
}

// writeLoad is clients claiming and committing ids from a shared, moving
// window, so that several owners race for each id.
type writeLoad struct {
	acks  atomic.Int64 // acknowledged commits
	ops   atomic.Int64 // Begins sent (the window of ids moves with it)
	stop  chan struct{}
	wg    sync.WaitGroup
	mu    sync.Mutex
	acked map[string]string   // id -> the reply of its acknowledged commit
	fresh map[string][]string // id -> the owners that got a Fresh claim of it
	done  map[string]string   // id -> a reply Begin answered Done with
	bad   []string            // a Done whose reply differs from the acknowledged one
}

// startWriteLoad starts n clients (owners w0..wn-1) on cc; halt (or the
// test's end) stops them.
func startWriteLoad(t *testing.T, cc *chaosCluster, n int) *writeLoad {
	w := &writeLoad{stop: make(chan struct{}), acked: map[string]string{}, fresh: map[string][]string{}, done: map[string]string{}}
	for i := range n {
		c := dial(t, cc.testCluster, fmt.Sprintf("w%d", i))
		w.wg.Add(1)
		go func() {
			defer w.wg.Done()
			rng := rand.New(rand.NewPCG(uint64(i), 23))
			for {
				select {
				case <-w.stop:
					return
				default:
				}
				id := fmt.Sprintf("id-%d", w.ops.Add(1)/4+rng.Int64N(4))
				w.once(c, id)
			}
		}()
	}
	t.Cleanup(w.halt)
	return w
}

// once claims id and commits it with a reply naming its owner.
func (w *writeLoad) once(c *Client, id string) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	req := idem.Request{Scope: "load", ID: []byte(id)}
	r, err := c.Begin(ctx, req)
	if err != nil {
		return // unknown or refused: nothing to record
	}
	w.mu.Lock()
	switch r.Status {
	case idem.Fresh:
		w.fresh[id] = append(w.fresh[id], c.Owner())
	case idem.Done:
		if a, ok := w.acked[id]; ok && a != string(r.Reply) {
			w.bad = append(w.bad, fmt.Sprintf("%s: Done %q, acknowledged %q", id, r.Reply, a))
		}
		w.done[id] = string(r.Reply)
	}
	w.mu.Unlock()
	if r.Status != idem.Fresh {
		return
	}
	reply := c.Owner() + ":" + id
	if err := r.Claim.Commit(ctx, []byte(reply)); err != nil {
		return
	}
	w.mu.Lock()
	if d, ok := w.done[id]; ok && d != reply {
		w.bad = append(w.bad, fmt.Sprintf("%s: Done %q before, acknowledged %q", id, d, reply))
	}
	w.acked[id] = reply
	w.mu.Unlock()
	w.acks.Add(1)
}

// progress waits for n more acknowledged commits.
func (w *writeLoad) progress(t testing.TB, n int, within time.Duration, during string) {
	t.Helper()
	want := w.acks.Load() + int64(n)
	eventually(t, within, fmt.Sprintf("%d acknowledged commits %s", n, during), func() bool { return w.acks.Load() >= want })
}

func (w *writeLoad) halt() {
	select {
	case <-w.stop:
	default:
		close(w.stop)
	}
	w.wg.Wait()
}

// ackedIDs is a copy of the acknowledged ids and replies so far.
func (w *writeLoad) ackedIDs() map[string]string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return maps.Clone(w.acked)
}

// check stops the load and checks what it saw and what the cluster holds:
// no id was claimed Fresh twice (the lease is an hour of log time, so no
// claim can have been taken over), every Done answer carried the
// acknowledged reply, and every acknowledged commit is on every running
// node (FollowerReads on each, once each applied the leader's log) and in
// a linearizable read.
func (w *writeLoad) check(t *testing.T, cc *chaosCluster) {
	t.Helper()
	w.halt()
	for id, owners := range w.fresh {
		if len(owners) > 1 {
			t.Errorf("%s claimed Fresh %d times, by %v, within one lease", id, len(owners), owners)
		}
	}
	for _, b := range w.bad {
		t.Errorf("a Done answer differs from the acknowledged reply: %s", b)
	}
	if len(w.acked) == 0 {
		t.Fatal("no commit was acknowledged")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := dial(t, cc.testCluster, "checker")
	for id, reply := range w.acked {
		r, err := c.Lookup(ctx, idem.Request{Scope: "load", ID: []byte(id)})
		if err != nil || r.Status != idem.Done || string(r.Reply) != reply {
			t.Errorf("acknowledged %s=%q lost: %+v %v", id, reply, r, err)
		}
	}
	cc.sameOnEveryNode(t, ctx, "load", w.universe())
}

// universe is every id the load touched.
func (w *writeLoad) universe() []string {
	var ids []string
	for id := range w.fresh {
		ids = append(ids, id)
	}
	for id := range w.done {
		if _, ok := w.fresh[id]; !ok {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	return ids
}

// sameOnEveryNode waits until every running node applied the leader's
// log (up to a commit made now), then compares what each answers
// (FollowerReads on it) for ids.
func (cc *chaosCluster) sameOnEveryNode(t *testing.T, ctx context.Context, scope string, ids []string) {
	t.Helper()
	c := dial(t, cc.testCluster, "marker")
	if _, err := idem.Do(ctx, c, idem.Request{Scope: "marker", ID: []byte(t.Name())}, func(context.Context) ([]byte, error) { return nil, nil }); err != nil {
		t.Fatalf("marker: %v", err)
	}
	// The leader applied the marker's commit, and every entry before it.
	var last uint64
	for _, nd := range cc.nodes {
		last = max(last, nd.fsm.index.Load())
	}
	var want []string
	for _, id := range cc.ids {
		nd := cc.nodes[id]
		if nd == nil {
			continue
		}
		eventually(t, 30*time.Second, fmt.Sprintf("%s applied up to %d", id, last), func() bool { return nd.fsm.index.Load() >= last })
		fc, err := Dial(ctx, []string{cc.addr(id)}, &Options{FollowerReads: true, AttemptTimeout: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, k := range ids {
			r, err := fc.Lookup(ctx, idem.Request{Scope: scope, ID: []byte(k)})
			got = append(got, fmt.Sprintf("%s=%v/%q/%v/%v", k, r.Status, r.Reply, r.LeaseUntil.UnixNano(), err))
		}
		fc.Close()
		if want == nil {
			want = got
			continue
		}
		for i := range got {
			if got[i] != want[i] {
				t.Errorf("%s answers %s, %s answers %s", id, got[i], cc.ids[0], want[i])
			}
		}
	}
}

// probeIsolated asks node id (cut off from the majority) to claim a new id
// and to read the acknowledged ids: it must not hand out a claim (any
// answer to Begin but an error), nor answer a read from stale state (a
// read may only fail, redirect, or say what was acknowledged).
func probeIsolated(t *testing.T, cc *chaosCluster, id, probe string, acked map[string]string) {
	t.Helper()
	ic := rawIdem(t, cc.addr(id))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	br, err := ic.Begin(ctx, &clusterpb.BeginRequest{Request: reqToPB(idem.Request{Scope: "load", ID: []byte(probe)}), Owner: "prober", Token: []byte(probe)})
	if err == nil {
		t.Errorf("isolated %s handed out %s: %v", id, probe, resultFromPB(br.Result).Status)
	} else {
		t.Logf("isolated %s (%v), Begin: %v", id, cc.nodes[id].Raft().State(), fromStatus(err))
	}
	for k, reply := range acked {
		lr, err := ic.Lookup(ctx, &clusterpb.LookupRequest{Request: reqToPB(idem.Request{Scope: "load", ID: []byte(k)})})
		if err != nil {
			var nl *errNotLeader
			if e := fromStatus(err); !errors.As(e, &nl) && !errors.Is(e, context.DeadlineExceeded) && ctx.Err() == nil {
				t.Logf("isolated %s, Lookup %s: %v", id, k, e)
			}
			continue
		}
		if r := resultFromPB(lr.Result); r.Status != idem.Done || string(r.Reply) != reply {
			t.Errorf("isolated %s answered a linearizable read of %s from stale state: %v %q (acknowledged %q)", id, k, r.Status, r.Reply, reply)
			return
		}
	}
}

// TestChaosLeaderIsolated cuts the leader off (both ways) while clients
// write: the other two elect a leader and serve; the old leader hands out
// no claim and answers no read from stale state; once healed it steps
// down and catches up, nothing acknowledged is lost, no id was claimed
// twice, and a Begin the isolated leader appended but could not commit is
// gone.
func TestChaosLeaderIsolated(t *testing.T) {
	cc := newChaosCluster(t, 3, nil)
	w := startWriteLoad(t, cc, 3)
	w.progress(t, 20, 30*time.Second, "before the partition")
	// The leader and the term it leads in: read again when an election
	// came between the two looks (the term read would be the next
	// leader's, and the check of the new leader's term below would fail).
	var old string
	var oldTerm uint64
	for {
		old = cc.leader(30 * time.Second)
		oldTerm = cc.nodes[old].Raft().CurrentTerm()
		if cc.nodes[old].IsLeader() && cc.nodes[old].Raft().CurrentTerm() == oldTerm {
			break
		}
	}
	cc.isolate(old)
	// At once, while it may still think it leads: a Begin it can append
	// but never commit.
	early := make(chan error, 1)
	oc := rawIdem(t, cc.addr(old))
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := oc.Begin(ctx, &clusterpb.BeginRequest{Request: reqToPB(idem.Request{Scope: "load", ID: []byte("probe-early")}), Owner: "prober", Token: []byte("t")})
		early <- err
	}()
	nl := cc.leaderAmong(cc.others(old), 30*time.Second)
	if term := cc.nodes[nl].Raft().CurrentTerm(); term <= oldTerm {
		t.Fatalf("new leader %s in term %d, the old one's was %d", nl, term, oldTerm)
	}
	before := w.ackedIDs()
	w.progress(t, 20, 30*time.Second, "with the leader cut off")
	after := w.ackedIDs()
	for k := range before {
		delete(after, k) // keep those acknowledged by the new leader
	}
	probeIsolated(t, cc, old, "probe-late", after)
	if err := <-early; err == nil {
		t.Errorf("the isolated leader handed out a claim of probe-early")
	} else {
		t.Logf("the isolated leader's early Begin: %v", fromStatus(err))
	}
	cc.heal()
	eventually(t, 30*time.Second, old+" follows the new term", func() bool {
		r := cc.nodes[old].Raft()
		return r.State() == raft.Follower && r.CurrentTerm() >= cc.nodes[nl].Raft().CurrentTerm()
	})
	w.progress(t, 10, 30*time.Second, "after healing")
	w.check(t, cc)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := dial(t, cc.testCluster, "checker-2")
	for _, p := range []string{"probe-early", "probe-late"} {
		if r, err := c.Lookup(ctx, idem.Request{Scope: "load", ID: []byte(p)}); err != nil || r.Status != idem.Absent {
			t.Errorf("%s, which only the isolated leader appended: %+v %v", p, r, err)
		}
	}
	t.Logf("%d commits acknowledged; leader %s isolated, %s elected", w.acks.Load(), old, nl)
}

// TestChaosMinorityMajority splits five nodes into the leader with one
// follower and the other three: the three elect a leader and serve, the
// two refuse claims and linearizable reads, and after healing every node
// holds the same state with nothing acknowledged lost.
func TestChaosMinorityMajority(t *testing.T) {
	cc := newChaosCluster(t, 5, nil)
	w := startWriteLoad(t, cc, 3)
	w.progress(t, 20, 30*time.Second, "before the split")
	old := cc.leader(30 * time.Second)
	minority := []string{old, cc.others(old)[0]}
	majority := cc.others(minority...)
	cc.split(minority, majority)
	nl := cc.leaderAmong(majority, 30*time.Second)
	before := w.ackedIDs()
	w.progress(t, 20, 30*time.Second, "with the majority only")
	after := w.ackedIDs()
	for k := range before {
		delete(after, k)
	}
	for i, id := range minority {
		probeIsolated(t, cc, id, fmt.Sprintf("probe-minority-%d", i), after)
	}
	cc.heal()
	w.progress(t, 10, 30*time.Second, "after healing")
	w.check(t, cc)
	t.Logf("%d commits acknowledged; %v cut from %v (leader %s)", w.acks.Load(), minority, majority, nl)
}

// TestChaosFlappingPartition cuts one node off and heals, six times in a
// row (the leader, then a follower, alternately), each cut lasting until
// the rest elected a leader and served, while clients write.
func TestChaosFlappingPartition(t *testing.T) {
	cc := newChaosCluster(t, 3, nil)
	w := startWriteLoad(t, cc, 3)
	w.progress(t, 10, 30*time.Second, "before the partitions")
	for round := range 6 {
		victim := cc.leader(30 * time.Second)
		if round%2 == 1 {
			victim = cc.others(victim)[round%2]
		}
		cc.isolate(victim)
		cc.leaderAmong(cc.others(victim), 30*time.Second)
		w.progress(t, 5, 30*time.Second, fmt.Sprintf("with %s cut off (round %d)", victim, round))
		cc.heal()
		w.progress(t, 3, 30*time.Second, fmt.Sprintf("healed (round %d)", round))
	}
	w.check(t, cc)
	t.Logf("%d commits acknowledged across 6 partitions", w.acks.Load())
}

// TestChaosWipedNodeRejoinsBySnapshot removes a follower's directory
// while the others write and compact their logs past what it had, and
// starts it again empty: it must catch up through an InstallSnapshot (its
// state machine restored from the leader's snapshot, then the log after
// it), not by replaying the log from the start, and then answer as the
// others do, its claims table included. The logs are cut into 16 KiB
// raft-wal segments so that compaction deletes the early entries: with
// raft-wal's 64 MiB segments they stay readable and raft would send them
// instead of a snapshot.
func TestChaosWipedNodeRejoinsBySnapshot(t *testing.T) {
	cc := newChaosCluster(t, 3, func(o *NodeOptions) {
		o.walSegmentSize = 16 << 10
		o.SnapshotThreshold, o.TrailingLogs = 64, 16
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c := dial(t, cc.testCluster, "app")
	var ids []string
	write := func(from, to int) {
		t.Helper()
		var g errgroup.Group
		g.SetLimit(8)
		for i := from; i < to; i++ {
			id := fmt.Sprintf("k%03d", i)
			ids = append(ids, id)
			g.Go(func() error {
				reply := fmt.Appendf(make([]byte, 0, 512), "%s:%0500d", id, i)
				_, err := idem.Do(ctx, c, idem.Request{Scope: "w", ID: []byte(id)}, func(context.Context) ([]byte, error) { return reply, nil })
				return err
			})
		}
		if err := g.Wait(); err != nil {
			t.Fatal(err)
		}
	}
	write(0, 20)
	// A claim left open and one aborted travel in the snapshot too.
	open, err := c.Begin(ctx, idem.Request{Scope: "w", ID: []byte("open"), Fingerprint: []byte("fp")})
	if err != nil || open.Status != idem.Fresh {
		t.Fatal(open, err)
	}
	ab, err := c.Begin(ctx, idem.Request{Scope: "w", ID: []byte("aborted")})
	if err != nil || ab.Status != idem.Fresh {
		t.Fatal(ab, err)
	}
	if err := ab.Claim.Abort(ctx); err != nil {
		t.Fatal(err)
	}
	ids = append(ids, "open", "aborted")

	victim := cc.others(cc.leader(30 * time.Second))[0]
	cc.stop(victim)
	if err := os.RemoveAll(cc.opts[victim].Dir); err != nil {
		t.Fatal(err)
	}
	write(20, 200)
	for _, id := range cc.others(victim) {
		nd := cc.nodes[id]
		if err := nd.Raft().Snapshot().Error(); err != nil {
			t.Fatalf("snapshot on %s: %v", id, err)
		}
		var l raft.Log
		if err := nd.logs.GetLog(1, &l); err == nil {
			first, _ := nd.logs.FirstIndex()
			t.Fatalf("%s still reads entry 1 (first index %d): a log replay could catch the wiped node up", id, first)
		}
	}
	cc.start(victim)
	write(200, 210) // after the snapshot: the log on top of it
	cc.sameOnEveryNode(t, ctx, "w", ids)
	nd := cc.nodes[victim]
	nd.fsm.mu.RLock()
	restores := nd.fsm.gen
	nd.fsm.mu.RUnlock()
	if restores == 0 {
		t.Fatalf("%s caught up by log replay only (no snapshot restored; last_snapshot_index %s)", victim, nd.Raft().Stats()["last_snapshot_index"])
	}
	for _, id := range cc.others(victim) {
		if got, want := nd.fsm.inDoubt("", ""), cc.nodes[id].fsm.inDoubt("", ""); !reflect.DeepEqual(heldKeys(got), heldKeys(want)) {
			t.Errorf("claims on %s: %v, on %s: %v", victim, heldKeys(got), id, heldKeys(want))
		}
	}
	if len(heldKeys(nd.fsm.inDoubt("", ""))) != 1 {
		t.Errorf("the open claim is not in %s's claims table: %v", victim, heldKeys(nd.fsm.inDoubt("", "")))
	}
	// The restored claims table is live: the owner commits its open claim.
	if err := open.Claim.Commit(ctx, []byte("done")); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s restored %d snapshot(s) (last_snapshot_index %s) and applied the log after it", victim, restores, nd.Raft().Stats()["last_snapshot_index"])
}

// heldKeys names claims by key, owner, token and lease.
func heldKeys(hs []held) []string {
	var out []string
	for _, h := range hs {
		out = append(out, fmt.Sprintf("%s/%s/%x/%d", h.Key, h.Owner, h.Token, h.LeaseUntil))
	}
	return out
}
