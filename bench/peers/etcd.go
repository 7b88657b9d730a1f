package peers

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// ClusterMembers is the size of the cluster peers (etcd, idemcluster).
const ClusterMembers = 3

// etcdPeer is a three-member etcd cluster embedded in this process
// (go.etcd.io/etcd/server/v3/embed, each member on its own loopback ports
// with its data directory under Config.Dir, default settings: every entry
// fsynced to a member's WAL, and acknowledged once a majority has it),
// used through one go.etcd.io/etcd/client/v3 client on all three
// endpoints, as a process of a fleet would use it: etcd's client
// multiplexes every caller's requests over its gRPC connections and
// balances them round robin over the endpoints (a member that is not the
// leader forwards writes to it).
//
// Per request: a transaction that puts the claim only if the key was
// never created (If(CreateRevision(id) == 0)) and else reads it (a caller
// that lost the race, or a duplicate, gets the stored value); run; a Put
// of the reply. In the duplicate phase (Phased) a Get of the id comes
// first (linearizable, etcd's default: a read-index round to a majority),
// and the transaction only if it is absent: etcd runs every transaction
// with a write in it through raft, its Else branch too, so a duplicate
// answered by the transaction would be a raft entry.
type etcdPeer struct {
	members    []*embed.Etcd
	cli        *clientv3.Client
	addrs      []string    // every listening address (peer and client) of the members
	claimFirst atomic.Bool // Phase(true): no Get before the transaction
}

// etcdStartTimeout bounds the start of the members (an election among
// them included).
const etcdStartTimeout = 60 * time.Second

func openEtcd(ctx context.Context, cfg Config) (p Peer, err error) {
	ep := &etcdPeer{}
	defer func() {
		if err != nil {
			ep.Close()
		}
	}()
	// Ports: picked free, then handed to etcd (its embed.Config takes URLs,
	// not listeners).
	ports, err := freePorts(2 * ClusterMembers)
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", err)
	}
	var initial []string
	cfgs := make([]*embed.Config, ClusterMembers)
	for i := range cfgs {
		name := fmt.Sprintf("m%d", i+1)
		peerURL := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", ports[2*i])}
		clientURL := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", ports[2*i+1])}
		c := embed.NewConfig()
		c.Name = name
		c.Dir = filepath.Join(cfg.Dir, "etcd-"+name)
		c.ListenPeerUrls, c.AdvertisePeerUrls = []url.URL{peerURL}, []url.URL{peerURL}
		c.ListenClientUrls, c.AdvertiseClientUrls = []url.URL{clientURL}, []url.URL{clientURL}
		c.InitialClusterToken = "idem-peers"
		c.ClusterState = embed.ClusterStateFlagNew
		// Their log (errors only: closing logs a few) goes to a file.
		c.LogLevel = "error"
		c.LogOutputs = []string{filepath.Join(cfg.Dir, "etcd-"+name+".log")}
		cfgs[i] = c
		initial = append(initial, name+"="+peerURL.String())
		ep.addrs = append(ep.addrs, peerURL.Host, clientURL.Host)
	}
	var endpoints []string
	for _, c := range cfgs {
		c.InitialCluster = strings.Join(initial, ",")
		e, err := embed.StartEtcd(c)
		if err != nil {
			return nil, fmt.Errorf("etcd: member %s: %w (log: %s)", c.Name, err, c.LogOutputs[0])
		}
		ep.members = append(ep.members, e)
		endpoints = append(endpoints, c.AdvertiseClientUrls[0].String())
	}
	timer := time.NewTimer(etcdStartTimeout)
	defer timer.Stop()
	for _, e := range ep.members {
		select {
		case <-e.Server.ReadyNotify():
		case err := <-e.Err():
			return nil, fmt.Errorf("etcd: member %s: %w", e.Config().Name, err)
		case <-timer.C:
			return nil, fmt.Errorf("etcd: member %s not ready after %v", e.Config().Name, etcdStartTimeout)
		case <-ctx.Done():
			return nil, fmt.Errorf("etcd: starting: %w", ctx.Err())
		}
	}
	ep.cli, err = clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 10 * time.Second, Logger: zap.NewNop(), Context: context.Background()})
	if err != nil {
		return nil, fmt.Errorf("etcd: client: %w", err)
	}
	// One write through the client before the measurement: the
	// connections are up and a leader is elected and known.
	if _, err := ep.cli.Put(ctx, "idem-peers/ready", "1"); err != nil {
		return nil, fmt.Errorf("etcd: first write: %w", err)
	}
	return ep, nil
}

// Phase implements Phased: claim first for new ids, read first for
// duplicates.
func (p *etcdPeer) Phase(fresh bool) { p.claimFirst.Store(fresh) }

func (p *etcdPeer) Do(ctx context.Context, id []byte, fn func() []byte) ([]byte, bool, error) {
	key := string(id)
	if !p.claimFirst.Load() {
		got, err := p.cli.Get(ctx, key)
		if err != nil {
			return nil, false, err
		}
		if len(got.Kvs) > 0 {
			reply, err := decodeStored(got.Kvs[0].Value)
			return reply, false, err
		}
	}
	tx, err := p.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, string([]byte{markClaim}))).
		Else(clientv3.OpGet(key)).
		Commit()
	if err != nil {
		return nil, false, err
	}
	if !tx.Succeeded { // committed, or claimed by another caller
		kvs := tx.Responses[0].GetResponseRange().GetKvs()
		if len(kvs) == 0 {
			return nil, false, fmt.Errorf("etcd: key %x: compare failed but the key is absent", id)
		}
		reply, err := decodeStored(kvs[0].Value)
		return reply, false, err
	}
	reply := fn()
	if _, err := p.cli.Put(ctx, key, string(committedValue(reply))); err != nil {
		return nil, false, err
	}
	return reply, true, nil
}

// listening is every address the members listen on (for the tests: none
// answers after Close).
func (p *etcdPeer) listening() []string { return p.addrs }

// Close closes the client, then the members: the followers first (at
// once), then the leader. A leader that stops hands its leadership to the
// best connected follower and waits up to its request timeout (7 s) for
// the handover; with its followers gone it finds none and stops at once.
func (p *etcdPeer) Close() error {
	var errs []error
	if p.cli != nil {
		errs = append(errs, p.cli.Close())
	}
	var leaders, followers []*embed.Etcd
	for _, e := range p.members {
		if e.Server.Leader() == e.Server.MemberID() {
			leaders = append(leaders, e)
		} else {
			followers = append(followers, e)
		}
	}
	for _, group := range [][]*embed.Etcd{followers, leaders} {
		var wg sync.WaitGroup
		for _, e := range group {
			wg.Add(1)
			go func() {
				defer wg.Done()
				e.Close()
			}()
		}
		wg.Wait()
	}
	p.members = nil
	return errors.Join(errs...)
}

// freePorts returns n distinct free TCP ports on 127.0.0.1 (held together
// until all are found, so none is picked twice).
func freePorts(n int) ([]int, error) {
	var ports []int
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
