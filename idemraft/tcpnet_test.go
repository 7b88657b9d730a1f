package idemraft

import (
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// tcpNet carries raft's traffic between the nodes of a test cluster over
// real TCP on 127.0.0.1, through proxies the test controls: every node
// listens on its own port (its raft address), and every connection from
// node a to node b goes through the proxy of the pair (a, b), a listener
// on 127.0.0.1 that relays the bytes to b's port. Cutting a node off makes
// every proxy it is on drop its traffic both ways: the bytes already in
// flight and all later ones are discarded (the connections stay open and
// silent, as across a partition, so raft's timeouts decide); healing
// closes the connections that lost bytes, and new ones relay again.
type tcpNet struct {
	t       testing.TB
	mu      sync.Mutex
	proxies map[[2]raft.ServerAddress]*tcpProxy
	cut     map[raft.ServerAddress]bool
	closed  bool
}

func newTCPNet(t testing.TB) *tcpNet {
	return &tcpNet{t: t, proxies: map[[2]raft.ServerAddress]*tcpProxy{}, cut: map[raft.ServerAddress]bool{}}
}

// transport returns a node's raft transport: a listener on 127.0.0.1:0
// (its address is the node's raft address) and dials through the proxies.
func (tn *tcpNet) transport(id raft.ServerID) (raft.ServerAddress, *raft.NetworkTransport) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tn.t.Fatal(err)
	}
	addr := raft.ServerAddress(l.Addr().String())
	logger := raftConfig(id, clusterOpts{}).Logger
	trans := raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream: &proxiedLayer{Listener: l, from: addr, net: tn}, MaxPool: 3, Timeout: time.Second, Logger: logger,
	})
	return addr, trans
}

// proxiedLayer is raft's TCP stream layer whose dials go through the
// proxy of the pair.
type proxiedLayer struct {
	net.Listener
	from raft.ServerAddress
	net  *tcpNet
}

func (l *proxiedLayer) Dial(to raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	p, err := l.net.proxy(l.from, to)
	if err != nil {
		return nil, err
	}
	return net.DialTimeout("tcp", p.l.Addr().String(), timeout)
}

// proxy returns the proxy of the pair, started on first use.
func (tn *tcpNet) proxy(from, to raft.ServerAddress) (*tcpProxy, error) {
	tn.mu.Lock()
	defer tn.mu.Unlock()
	if tn.closed {
		return nil, errors.New("test network closed")
	}
	k := [2]raft.ServerAddress{from, to}
	if p := tn.proxies[k]; p != nil {
		return p, nil
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &tcpProxy{l: l, target: string(to), conns: map[*proxyConn]struct{}{}, drop: tn.cut[from] || tn.cut[to]}
	tn.proxies[k] = p
	p.wg.Add(1)
	go p.serve()
	return p, nil
}

// partition cuts the node at addr off (both directions) or heals it.
func (tn *tcpNet) partition(addr raft.ServerAddress, cut bool) {
	tn.mu.Lock()
	defer tn.mu.Unlock()
	tn.cut[addr] = cut
	for k, p := range tn.proxies {
		if k[0] == addr || k[1] == addr {
			p.setDrop(tn.cut[k[0]] || tn.cut[k[1]])
		}
	}
}

// close stops every proxy and closes every connection through them.
func (tn *tcpNet) close() {
	tn.mu.Lock()
	tn.closed = true
	ps := tn.proxies
	tn.proxies = nil
	tn.mu.Unlock()
	for _, p := range ps {
		p.close()
	}
}

// tcpProxy relays the connections accepted on l to target.
type tcpProxy struct {
	l      net.Listener
	target string
	wg     sync.WaitGroup

	mu     sync.Mutex
	drop   bool
	closed bool
	conns  map[*proxyConn]struct{}
}

// proxyConn is one relayed connection: the accepted end and the dialed one
// (nil if it was accepted while dropping).
type proxyConn struct {
	in, out net.Conn
	tainted bool // bytes were dropped: the streams are broken, close at heal
}

func (pc *proxyConn) close() {
	pc.in.Close()
	if pc.out != nil {
		pc.out.Close()
	}
}

func (p *tcpProxy) serve() {
	defer p.wg.Done()
	for {
		in, err := p.l.Accept()
		if err != nil {
			return
		}
		pc := &proxyConn{in: in}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			in.Close()
			return
		}
		p.conns[pc] = struct{}{}
		drop := p.drop
		pc.tainted = drop
		p.mu.Unlock()
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			if drop { // a partition: accepted, never answered
				io.Copy(io.Discard, in)
				p.forget(pc)
				return
			}
			out, err := net.DialTimeout("tcp", p.target, time.Second)
			if err != nil {
				p.forget(pc)
				in.Close()
				return
			}
			p.mu.Lock()
			pc.out = out
			closed := p.closed || pc.tainted && !p.drop // cut and healed meanwhile
			p.mu.Unlock()
			if closed {
				p.forget(pc)
				pc.close()
				return
			}
			var relays sync.WaitGroup
			relays.Add(2)
			go func() { defer relays.Done(); p.relay(pc, out, in) }()
			go func() { defer relays.Done(); p.relay(pc, in, out) }()
			relays.Wait()
			p.forget(pc)
		}()
	}
}

// relay copies src to dst, discarding what it reads while the proxy drops;
// it ends (closing both ends) when either end fails.
func (p *tcpProxy) relay(pc *proxyConn, dst, src net.Conn) {
	defer pc.close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			drop := p.drop
			p.mu.Unlock()
			if !drop {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

func (p *tcpProxy) forget(pc *proxyConn) {
	p.mu.Lock()
	delete(p.conns, pc)
	p.mu.Unlock()
}

// setDrop starts or stops dropping. Starting taints every open connection;
// stopping closes the tainted ones.
func (p *tcpProxy) setDrop(drop bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.drop == drop {
		return
	}
	p.drop = drop
	for pc := range p.conns {
		if drop {
			pc.tainted = true
		} else if pc.tainted {
			pc.close()
		}
	}
}

func (p *tcpProxy) close() {
	p.mu.Lock()
	p.closed = true
	for pc := range p.conns {
		pc.close()
	}
	p.mu.Unlock()
	p.l.Close()
	p.wg.Wait()
}
