package idemcluster

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
)

// Leader-lease reads.
//
// A leader that had a majority of the voters (itself included) accept a
// heartbeat it sent at ts answers linearizable reads without a round until
// ts + leaseLength(HeartbeatTimeout), on its own monotonic clock; after
// that it runs a round (leaderRound) again. The argument, checked against
// hashicorp/raft v1.8.0's raft.go (docs/design.md, "Reads"):
//
//   - A follower grants no vote (requestVote) while it knows a leader,
//     unless the request says LeadershipTransfer; it forgets its leader
//     when its heartbeat timer finds its last contact HeartbeatTimeout old
//     (runFollower), on a state change (a higher term's AppendEntries or
//     InstallSnapshot: a later leader is already elected; a vote request
//     of a higher term, which it sees only when it knows no leader or with
//     LeadershipTransfer), on TimeoutNow, and on shutdown. A follower that
//     accepted the heartbeat sent at ts set its last contact after ts, so
//     the majority that accepted it grants no vote, and no later leader is
//     elected, before ts + HeartbeatTimeout (measured by each follower:
//     every node must run with the same HeartbeatTimeout).
//   - The leader itself refuses votes while it leads; a lease is used only
//     while raft says it leads in the term the lease was taken in.
//   - leaseTransport closes the holes: a restarted node knows no leader
//     and would vote (and stand) at once, so for HeartbeatTimeout after it
//     starts it grants no vote or pre-vote and sends none (other than a
//     leadership transfer's); a leader voids its lease before any
//     TimeoutNow leaves it (a transfer's candidate is voted for despite a
//     known leader) and stamps the term it leads on it; and a TimeoutNow of
//     a term below the receiver's, or without a term, is dropped (a delayed one would make its receiver forget the current
//     leader and stand with LeadershipTransfer set).

// leaseMargin is the part of HeartbeatTimeout a lease gives up for the
// clocks' rates: the leader's lease runs on its clock, the followers'
// HeartbeatTimeout on theirs. 0.1 covers rates that differ by up to 5%
// (a lease of 0.9 x HeartbeatTimeout on a clock 5% slow ends within 0.95;
// a follower's HeartbeatTimeout on a clock 5% fast ends after 0.95);
// quartz clocks drift by parts per million, and the monotonic clock is
// not stepped by NTP.
const leaseMargin = 0.1

// leaseLength is how long after sending a heartbeat that a majority
// accepted a leader may answer reads without a round.
func leaseLength(heartbeatTimeout time.Duration) time.Duration {
	return time.Duration(float64(heartbeatTimeout) * (1 - leaseMargin))
}

// leaderLease is a leader's right to answer reads without a round.
type leaderLease struct {
	grant  atomic.Pointer[leaseGrant]
	voided atomic.Uint64 // no lease for any term at or below it (a TimeoutNow left in it)
	served atomic.Uint64 // reads answered on a lease (tests count them)
}

// leaseGrant is a lease: for term, until the monotonic time until.
type leaseGrant struct {
	term  uint64
	until time.Time
}

// extend records that the node leads term until until (a round's
// heartbeats, sent before until less the lease length, were accepted by a
// majority). A lease only grows within a term, and a later term's replaces
// an earlier one's.
func (l *leaderLease) extend(term uint64, until time.Time) {
	for {
		g := l.grant.Load()
		if g != nil && (g.term > term || g.term == term && !until.After(g.until)) {
			return
		}
		if l.grant.CompareAndSwap(g, &leaseGrant{term: term, until: until}) {
			return
		}
	}
}

// void ends the leases of term and every term before it, for good.
func (l *leaderLease) void(term uint64) {
	for {
		v := l.voided.Load()
		if v >= term || l.voided.CompareAndSwap(v, term) {
			return
		}
	}
}

// closedDone is the done channel of a read served on the lease.
var closedDone = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// leaseRead is a read served on the lease, as a round that has already
// run: the commit index taken as the read arrived (before the lease was
// checked), less the entries the state machine never gets. nil: no lease
// (leases off, expired, another term, voided, not the leader); the read
// takes a round. A lease with less than half of its length left starts a
// round in the background (one at a time: readRounds), which renews it
// while reads flow.
func (n *Node) leaseRead() *readRound {
	if n.leaseLen <= 0 {
		return nil
	}
	g := n.lease.grant.Load()
	if g == nil {
		return nil
	}
	ci := n.r.CommitIndex()
	term := n.ready.Load()
	if g.term != term || term <= n.lease.voided.Load() || n.r.State() != raft.Leader || n.r.CurrentTerm() != term {
		return nil
	}
	left := time.Until(g.until)
	if left <= 0 {
		return nil
	}
	idx, err := n.fsmIndexAt(ci)
	if err != nil {
		return nil
	}
	if left < n.leaseLen/2 {
		n.reads.renew()
	}
	n.lease.served.Add(1)
	return &readRound{done: closedDone, index: idx}
}

// leaseTransport is the node's raft transport: the one it was given or
// made, with the rules leases need (see the top of this file). It is used
// whether or not the node serves reads on a lease (NodeOptions.NoLeaseReads):
// it protects the other nodes' leases.
type leaseTransport struct {
	raft.Transport
	id    raft.ServerID
	lease *leaderLease
	raft  atomic.Pointer[raft.Raft] // set once raft runs
	now   func() time.Time
	// quietUntil: a restarted node takes no part in elections before it
	// (zero for a node that starts for the first time: no vote of it ever
	// counted).
	quietUntil time.Time

	out  chan raft.RPC // what raft consumes: the transport's RPCs, filtered
	hb   sync.RWMutex  // write-held while a TimeoutNow is checked and handled: no heartbeat changes the term meanwhile
	done chan struct{}
	once sync.Once
}

// leaseTransportPreVote is a leaseTransport over a transport with
// pre-votes (raft uses them only when the transport has them).
type leaseTransportPreVote struct {
	*leaseTransport
	pv raft.WithPreVote
}

// errQuiet is a vote a restarted node does not ask for or grant yet.
var errQuiet = errors.New("idemcluster: restarted less than HeartbeatTimeout ago: no votes yet (a leader's lease may count this node)")

// newLeaseTransport wraps tr. restarted: the node has raft state from
// before (it may have accepted a heartbeat that a lease counts).
func newLeaseTransport(tr raft.Transport, id string, lease *leaderLease, heartbeatTimeout time.Duration, restarted bool, now func() time.Time) raft.Transport {
	if now == nil {
		now = time.Now
	}
	t := &leaseTransport{Transport: tr, id: raft.ServerID(id), lease: lease, now: now,
		out: make(chan raft.RPC, 16), done: make(chan struct{})}
	if restarted {
		t.quietUntil = now().Add(heartbeatTimeout)
	}
	go t.filter()
	if pv, ok := tr.(raft.WithPreVote); ok {
		return &leaseTransportPreVote{leaseTransport: t, pv: pv}
	}
	return t
}

// leaseTransportOf is the leaseTransport under tr.
func leaseTransportOf(tr raft.Transport) *leaseTransport {
	switch t := tr.(type) {
	case *leaseTransport:
		return t
	case *leaseTransportPreVote:
		return t.leaseTransport
	}
	return nil
}

func (t *leaseTransport) quiet() bool { return t.now().Before(t.quietUntil) }

func (t *leaseTransport) header() raft.RPCHeader {
	return raft.RPCHeader{ProtocolVersion: raft.ProtocolVersionMax, ID: []byte(t.id), Addr: t.EncodePeer(t.id, t.LocalAddr())}
}

// Consumer is the transport's RPCs, filtered.
func (t *leaseTransport) Consumer() <-chan raft.RPC { return t.out }

// filter hands raft the transport's RPCs, in order, except the votes a
// quiet node refuses and the TimeoutNows of an earlier term.
func (t *leaseTransport) filter() {
	in := t.Transport.Consumer()
	for {
		var rpc raft.RPC
		select {
		case rpc = <-in:
		case <-t.done:
			return
		}
		switch req := rpc.Command.(type) {
		case *raft.RequestVoteRequest:
			if !req.LeadershipTransfer && t.quiet() {
				rpc.Respond(&raft.RequestVoteResponse{RPCHeader: t.header(), Term: req.Term}, nil)
				continue
			}
		case *raft.RequestPreVoteRequest:
			if t.quiet() {
				rpc.Respond(&raft.RequestPreVoteResponse{RPCHeader: t.header(), Term: req.Term}, nil)
				continue
			}
		case *raft.TimeoutNowRequest:
			if !t.timeoutNow(rpc, req) {
				return
			}
			continue
		}
		if !t.forward(rpc) {
			return
		}
	}
}

func (t *leaseTransport) forward(rpc raft.RPC) bool {
	select {
	case t.out <- rpc:
		return true
	case <-t.done:
		return false
	}
}

// timeoutNow hands raft a TimeoutNow only if its term (the sender stamps
// the term it led: TimeoutNow, stampTerm) is not below the node's: raft (v1.8)
// checks none, and a delayed one would make the node forget the leader it
// follows now and stand with LeadershipTransfer set, which the others
// grant despite their leader. The node's term is read after raft has
// handled every RPC handed to it before (a probe: an AppendEntries of term
// 0, which raft answers with its term and ignores), with heartbeats held
// (raft's TCP transport hands them to raft outside the consumer channel)
// until raft has handled the TimeoutNow: nothing changes the term between
// the check and raft's handling but raft's own timers (an election the
// node starts itself). false: the transport closed.
func (t *leaseTransport) timeoutNow(rpc raft.RPC, req *raft.TimeoutNowRequest) bool {
	t.hb.Lock()
	defer t.hb.Unlock()
	r := t.raft.Load()
	if r == nil || r.CurrentTerm() == 0 {
		rpc.Respond(nil, errors.New("idemcluster: TimeoutNow before raft runs: refused"))
		return true
	}
	ans := make(chan raft.RPCResponse, 1)
	probe := raft.RPC{Command: &raft.AppendEntriesRequest{RPCHeader: t.header()}, RespChan: ans}
	if !t.forward(probe) {
		return false
	}
	var term uint64
	select {
	case a := <-ans:
		if ae, ok := a.Response.(*raft.AppendEntriesResponse); ok {
			term = ae.Term
		}
	case <-t.done:
		return false
	}
	sent, ok := stampedTerm(req)
	if !ok || sent < term {
		rpc.Respond(nil, fmt.Errorf("idemcluster: TimeoutNow of term %d refused: this node is in term %d (a delayed transfer, or a sender that does not stamp its term)", sent, term))
		return true
	}
	orig := rpc.RespChan
	rpc.RespChan = ans
	if !t.forward(rpc) {
		return false
	}
	select {
	case a := <-ans:
		orig <- a
		return true
	case <-t.done:
		return false
	}
}

// SetHeartbeatHandler passes raft's heartbeat handler to the transport,
// held while a TimeoutNow is handled.
func (t *leaseTransport) SetHeartbeatHandler(cb func(rpc raft.RPC)) {
	if cb == nil {
		t.Transport.SetHeartbeatHandler(nil)
		return
	}
	t.Transport.SetHeartbeatHandler(func(rpc raft.RPC) {
		t.hb.RLock()
		defer t.hb.RUnlock()
		cb(rpc)
	})
}

// TimeoutNow voids the node's lease before the request leaves (its
// target's vote requests carry LeadershipTransfer, which the followers
// grant despite this leader), and stamps it with the term the node leads
// (raft v1.8 sends none), which the receiver checks.
func (t *leaseTransport) TimeoutNow(id raft.ServerID, target raft.ServerAddress, args *raft.TimeoutNowRequest, resp *raft.TimeoutNowResponse) error {
	r := t.raft.Load()
	if r == nil {
		return errors.New("idemcluster: TimeoutNow before raft runs")
	}
	term := r.CurrentTerm()
	t.lease.void(term)
	// Read the term, then the state, then the term again: the node led
	// term at the moment it read the state.
	if r.State() != raft.Leader || r.CurrentTerm() != term {
		return fmt.Errorf("idemcluster: TimeoutNow to %s: no longer the leader of term %d", id, term)
	}
	stamped := *args
	stamped.ID = stampTerm(args.ID, term)
	return t.Transport.TimeoutNow(id, target, &stamped, resp)
}

// termStamp separates a TimeoutNow's sender id from the term it led, both
// in its header's ID: raft v1.8's TimeoutNowRequest has no term, and no
// field but the header's (raft reads only its ProtocolVersion on a
// TimeoutNow). A sender that does not stamp (an older node) has its
// transfers refused: safe, it keeps leading.
const termStamp = "\x00term="

// stampTerm is id with term appended.
func stampTerm(id []byte, term uint64) []byte {
	return strconv.AppendUint(append(append([]byte(nil), id...), termStamp...), term, 10)
}

// stampedTerm takes the term out of req's header ID (which it restores).
func stampedTerm(req *raft.TimeoutNowRequest) (uint64, bool) {
	i := bytes.LastIndex(req.ID, []byte(termStamp))
	if i < 0 {
		return 0, false
	}
	term, err := strconv.ParseUint(string(req.ID[i+len(termStamp):]), 10, 64)
	if err != nil {
		return 0, false
	}
	req.ID = req.ID[:i:i]
	return term, true
}

// RequestVote sends no vote request of the node's own election while it
// is quiet (a leadership transfer's is sent: its sender voided its lease).
func (t *leaseTransport) RequestVote(id raft.ServerID, target raft.ServerAddress, args *raft.RequestVoteRequest, resp *raft.RequestVoteResponse) error {
	if !args.LeadershipTransfer && t.quiet() {
		return errQuiet
	}
	return t.Transport.RequestVote(id, target, args, resp)
}

// RequestPreVote sends no pre-vote while the node is quiet.
func (t *leaseTransportPreVote) RequestPreVote(id raft.ServerID, target raft.ServerAddress, args *raft.RequestPreVoteRequest, resp *raft.RequestPreVoteResponse) error {
	if t.quiet() {
		return errQuiet
	}
	return t.pv.RequestPreVote(id, target, args, resp)
}

// Close stops the filter and closes the transport under it when it has a
// Close method.
func (t *leaseTransport) Close() error {
	t.once.Do(func() { close(t.done) })
	if c, ok := t.Transport.(io.Closer); ok {
		return c.Close()
	}
	return nil
}
