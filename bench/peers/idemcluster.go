package peers

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster"
)

// idemclusterPeer is an idem cluster of three nodes started in this
// process (idemcluster.StartNode, raft and gRPC on loopback listeners,
// each node's raft log, snapshots and engine under Config.Dir), used
// through one idemcluster.Client on all three nodes' addresses, with the
// defaults: a Fresh Begin and a Commit return once a majority has fsynced
// the entry; reads are linearizable (the leader confirms its leadership
// with a majority). The nodes run in the harness's process, as etcd's
// members do, so that the CPU figure of both clusters counts the members,
// the client and the harness alike.
//
// Per request, as idem.Do does it: a Begin (Fresh: this caller claimed
// it; Done: the stored reply; InFlight: another caller runs it); run; a
// Commit of the reply. In the duplicate phase (Phased) a Lookup (a
// linearizable read) comes first, and the Begin only if the id is Absent,
// as for etcd. (A Begin of a committed id is answered as a read too since
// the cluster's batch path; before, it was a raft entry.)
type idemclusterPeer struct {
	nodes      []*idemcluster.Node
	c          *idemcluster.Client
	addrs      []string    // every listening address (raft and gRPC) of the nodes
	claimFirst atomic.Bool // Phase(true): no Lookup before the Begin
}

// clusterStartTimeout bounds the start of the nodes (an election among
// them included).
const clusterStartTimeout = 60 * time.Second

func openIdemcluster(ctx context.Context, cfg Config) (p Peer, err error) {
	cp := &idemclusterPeer{}
	defer func() {
		if err != nil {
			cp.Close()
		}
	}()
	ids := make([]string, ClusterMembers)
	raftLs := make([]net.Listener, ClusterMembers)
	grpcLs := make([]net.Listener, ClusterMembers)
	members := map[string]string{}
	var grpcAddrs []string
	closeAll := func() {
		for i := range ids {
			for _, l := range []net.Listener{raftLs[i], grpcLs[i]} {
				if l != nil {
					l.Close()
				}
			}
		}
	}
	for i := range ids {
		ids[i] = fmt.Sprintf("n%d", i+1)
		if raftLs[i], err = net.Listen("tcp", "127.0.0.1:0"); err == nil {
			grpcLs[i], err = net.Listen("tcp", "127.0.0.1:0")
		}
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("idemcluster: %w", err)
		}
		members[ids[i]] = raftLs[i].Addr().String()
		grpcAddrs = append(grpcAddrs, grpcLs[i].Addr().String())
		cp.addrs = append(cp.addrs, raftLs[i].Addr().String(), grpcLs[i].Addr().String())
	}
	for i, id := range ids {
		n, err := idemcluster.StartNode(&idemcluster.NodeOptions{
			ID: id, Dir: filepath.Join(cfg.Dir, "idemcluster-"+id),
			RaftListener: raftLs[i], GRPCListener: grpcLs[i], Peers: members,
		})
		if err != nil {
			for _, l := range append(raftLs[i:], grpcLs[i:]...) {
				l.Close() // the started nodes own the others'
			}
			return nil, fmt.Errorf("idemcluster: node %s: %w", id, err)
		}
		cp.nodes = append(cp.nodes, n)
	}
	// Wait for a ready leader, then connect.
	deadline := time.Now().Add(clusterStartTimeout)
	for !cp.hasLeader() {
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("idemcluster: no leader after %v", clusterStartTimeout)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("idemcluster: starting: %w", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	if cp.c, err = idemcluster.Dial(ctx, grpcAddrs, &idemcluster.Options{Owner: "idem-peers"}); err != nil {
		return nil, err
	}
	// One request through the client before the measurement: the
	// connections are up and the client knows the leader.
	if _, _, err := cp.Do(ctx, []byte("idem-peers/ready"), func() []byte { return nil }); err != nil {
		return nil, fmt.Errorf("idemcluster: first request: %w", err)
	}
	return cp, nil
}

func (p *idemclusterPeer) hasLeader() bool {
	for _, n := range p.nodes {
		if n.IsLeader() {
			return true
		}
	}
	return false
}

// Phase implements Phased: claim first for new ids, read first for
// duplicates.
func (p *idemclusterPeer) Phase(fresh bool) { p.claimFirst.Store(fresh) }

func (p *idemclusterPeer) Do(ctx context.Context, id []byte, fn func() []byte) ([]byte, bool, error) {
	req := idem.Request{ID: id}
	r := idem.Result{Status: idem.Absent}
	if !p.claimFirst.Load() {
		var err error
		if r, err = p.c.Lookup(ctx, req); err != nil {
			return nil, false, err
		}
	}
	if r.Status == idem.Absent {
		var err error
		if r, err = p.c.Begin(ctx, req); err != nil {
			return nil, false, err
		}
	}
	switch r.Status {
	case idem.Done:
		return r.Reply, false, nil
	case idem.InFlight:
		return nil, false, ErrInFlight
	case idem.Fresh:
		reply := fn()
		if err := r.Claim.Commit(ctx, reply); err != nil {
			return nil, false, err
		}
		return reply, true, nil
	}
	return nil, false, fmt.Errorf("idemcluster: id %x: unexpected status %v", id, r.Status)
}

// listening is every address the nodes listen on (for the tests: none
// answers after Close).
func (p *idemclusterPeer) listening() []string { return p.addrs }

// Close closes the client, then the nodes all at once.
func (p *idemclusterPeer) Close() error {
	var errs []error
	if p.c != nil {
		errs = append(errs, p.c.Close())
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, n := range p.nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := n.Close(); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	p.nodes = nil
	return errors.Join(errs...)
}
