package idemcluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Options configure a Client.
type Options struct {
	// Owner is this application process's identity, stable across its
	// restarts (for example the host name and the service's name): claims
	// carry it, a retried Begin gets its own claim back, and InDoubt lists
	// the claims of this owner, which a restarted process resolves.
	// Default: random per Client (nothing to resolve after a restart).
	Owner string
	// AttemptTimeout bounds each attempt of a call (default 5 s); the
	// call's ctx bounds the whole call, retries included.
	AttemptTimeout time.Duration
	// FollowerReads lets Lookup and ClientState answer from whichever node
	// is asked, possibly stale. Default: linearizable reads from the leader.
	FollowerReads bool
	// NoBatching sends every call in an RPC of its own. By default the
	// Begin, Commit, Abort and Lookup calls that wait while earlier ones
	// are on the wire to a node go together in one Batch RPC (each still
	// answered, retried and bounded as its own call).
	NoBatching bool
	// CloseTimeout bounds how long Close waits for the claim finishes
	// still being sent after their callers stopped waiting (default 10 s:
	// several elections, which take 1-2 s; negative: Close does not wait).
	// Close then stops them and names them in its error.
	CloseTimeout time.Duration
	// DialOptions are added to the gRPC dial (default: plaintext).
	DialOptions []grpc.DialOption
	// Logger receives the client's retries (default: discard).
	Logger *slog.Logger
}

// Client is a connection to an idem cluster. It satisfies idem.Store, so
// idemhttp, idemgrpc and idemstream use it as they use an *idem.Engine, and
// a fleet of processes shares one exactly-once store. It is safe for
// concurrent use.
type Client struct {
	o     Options
	addrs []string
	log   *slog.Logger

	mu     sync.Mutex       // guards peers, leader, next, closed, idle, unfinished and moreUnfinished; and writes of leaderPeer
	peers  map[string]*peer // by gRPC address
	leader string           // the address calls go to first
	next   int              // round-robin position when no leader is known
	closed bool             // Close closed the connections: no call dials again
	// leaderPeer is peers[leader] once a call dialled it (nil when no
	// leader is known, before its first call, and after Close): every
	// call reads it without mu (pick). Written only under mu, with
	// leader, so it is never another node than leader names. Taking mu
	// twice per call (target, peer), 64 callers on 2 cores contended.
	leaderPeer atomic.Pointer[peer]

	// finishes counts the claim finishes under way whose ctx can end
	// (claimBackend.finish), on their callers' goroutines or, once their
	// callers stopped waiting, on their own: twice their number, plus
	// finishesClosing once Close began (then no finish starts). The
	// finish that brings it to finishesClosing alone closes idle, which
	// Close made before it set the bit (under mu). Close waits for idle,
	// at most Options.CloseTimeout, then ends stop: every finish left
	// ends at once. An atomic word, not mu: a finish per request took
	// the mutex twice.
	finishes atomic.Int64
	idle     chan struct{}
	stop     context.Context // ended by Close when it stops the finishes left
	stopAll  context.CancelFunc
	stopped  <-chan struct{} // stop.Done()
	// unfinished names the finishes that ended without an outcome their
	// callers saw, for Close's error (at most maxUnfinished names,
	// moreUnfinished counts the rest).
	unfinished     []string
	moreUnfinished int

	st struct{ hits, misses, conflicts, collisions, gaps, already, leaseLost atomic.Uint64 }
}

var _ idem.Store = (*Client)(nil)

// Dial connects to the cluster whose nodes' gRPC addresses are addrs (any
// subset; the client follows the leader) and returns once a node answered.
func Dial(ctx context.Context, addrs []string, opts *Options) (*Client, error) {
	if len(addrs) == 0 {
		return nil, errors.New("idemcluster: Dial: no address")
	}
	c := &Client{addrs: append([]string(nil), addrs...), peers: map[string]*peer{}}
	c.stop, c.stopAll = context.WithCancel(context.Background())
	c.stopped = c.stop.Done()
	if opts != nil {
		c.o = *opts
	}
	if c.o.AttemptTimeout <= 0 {
		c.o.AttemptTimeout = 5 * time.Second
	}
	if c.o.CloseTimeout == 0 {
		c.o.CloseTimeout = defaultCloseTimeout
	}
	if c.o.Owner == "" {
		b := make([]byte, 8)
		_, _ = rand.Read(b)
		c.o.Owner = "client-" + hex.EncodeToString(b)
	}
	c.log = c.o.Logger
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	err := c.call(ctx, false, func(ctx context.Context, p *peer) error {
		st, err := p.cluster.Status(ctx, &clusterpb.StatusRequest{})
		if err == nil && st.LeaderGrpcAddr != "" {
			c.setLeader(st.LeaderGrpcAddr)
		}
		return err
	})
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("idemcluster: Dial %v: %w", addrs, err)
	}
	return c, nil
}

// Owner is the client's owner identity.
func (c *Client) Owner() string { return c.o.Owner }

// defaultCloseTimeout is Options.CloseTimeout's default.
const defaultCloseTimeout = 10 * time.Second

// maxUnfinished bounds the finishes Close's error names one by one.
const maxUnfinished = 32

// Close closes the client's connections. A claim's Commit or Abort whose
// caller's ctx ended goes on being sent (claimBackend.finish), so Close
// first waits for those, at most Options.CloseTimeout (default 10 s),
// then stops the ones left. It returns within that bound even when no
// node can be reached: the stopped finishes return at once, and nothing
// else waits for the network. Its error, then, matches idem.ErrInDoubt
// and names each claim whose finish stayed in doubt: those it stopped,
// and those whose finish ended without an outcome earlier, after their
// callers had stopped waiting (its bound ended, or a definite refusal
// such as ErrLeaseLost that no caller saw). The Owner's InDoubt lists
// such claims, after a restart too, to be finished again. A finish begun
// after Close is ErrClosed; one whose ctx never ends (its caller waits
// for the outcome) is not waited for and returns an error once the
// connections are closed.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.idle == nil {
		c.idle = make(chan struct{})
		if c.finishes.Or(finishesClosing) == 0 {
			close(c.idle) // no finish under way
		}
	}
	idle := c.idle
	c.mu.Unlock()
	if c.o.CloseTimeout > 0 {
		t := time.NewTimer(c.o.CloseTimeout)
		select {
		case <-idle:
		case <-t.C:
		}
		t.Stop()
	}
	c.stopAll()
	<-idle // the stopped finishes return at once
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	c.leaderPeer.Store(nil)
	var errs []error
	for a, p := range c.peers {
		errs = append(errs, p.cc.Close())
		delete(c.peers, a)
	}
	if n := len(c.unfinished); n > 0 {
		more := ""
		if c.moreUnfinished > 0 {
			more = fmt.Sprintf("; and %d more", c.moreUnfinished)
		}
		errs = append(errs, fmt.Errorf("%w: idemcluster: Close: %d claim finishes ended without an outcome their callers saw (the Owner's InDoubt lists the claims still held, to finish them again): %s%s",
			idem.ErrInDoubt, n+c.moreUnfinished, strings.Join(c.unfinished, "; "), more))
		c.unfinished, c.moreUnfinished = nil, 0
	}
	return errors.Join(errs...)
}

// finishesClosing is the bit of Client.finishes that Close sets; each
// finish under way counts 2.
const finishesClosing = 1

// finishBegins counts a finish in, unless Close began.
func (c *Client) finishBegins() bool {
	for {
		v := c.finishes.Load()
		if v&finishesClosing != 0 {
			return false
		}
		if c.finishes.CompareAndSwap(v, v+2) {
			return true
		}
	}
}

// finishEnds counts a finish out, and notes it for Close's error when it
// ended without an outcome its caller saw: Close stopped it (its caller
// may have seen that error too, as before), or it failed after its
// caller left (abandoned).
func (c *Client) finishEnds(item *clusterpb.BatchItem, err error, abandoned bool) {
	if err != nil && (abandoned || errors.Is(err, errFinishStopped)) {
		c.mu.Lock()
		if errors.Is(err, errFinishStopped) {
			c.noteUnfinished(describeFinish(item) + " (still being sent when Close gave up)")
		} else {
			c.noteUnfinished(fmt.Sprintf("%s (ended after its caller left: %v)", describeFinish(item), err))
		}
		c.mu.Unlock()
		if !errors.Is(err, errFinishStopped) {
			c.log.Warn("idemcluster: a claim's finish ended without an outcome after its caller stopped waiting", "finish", describeFinish(item), "error", err)
		}
	}
	if c.finishes.Add(-2) == finishesClosing {
		close(c.idle) // the last one Close waits for
	}
}

// noteUnfinished records, for Close's error, a finish that ended without
// an outcome its caller saw (under mu).
func (c *Client) noteUnfinished(what string) {
	if len(c.unfinished) < maxUnfinished {
		c.unfinished = append(c.unfinished, what)
	} else {
		c.moreUnfinished++
	}
}

// peer is a node as the client reaches it: one connection (HTTP/2: every
// call of the client to the node shares it), the service stubs, and the
// batcher that coalesces calls into Batch RPCs.
type peer struct {
	addr    string
	cc      *grpc.ClientConn
	idem    clusterpb.IdemClient
	cluster clusterpb.ClusterClient
	batch   batcher
}

func (c *Client) peer(addr string) (*peer, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if p := c.peers[addr]; p != nil {
		return p, nil
	}
	if c.closed {
		return nil, fmt.Errorf("idemcluster: %w: the client is closed", idem.ErrClosed)
	}
	dopts := append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials()), codecDialOption()}, c.o.DialOptions...)
	cc, err := grpc.NewClient(addr, dopts...)
	if err != nil {
		return nil, err
	}
	p := &peer{addr: addr, cc: cc, idem: clusterpb.NewIdemClient(cc), cluster: clusterpb.NewClusterClient(cc)}
	p.batch = batcher{idem: p.idem, off: c.o.NoBatching}
	c.peers[addr] = p
	return p, nil
}

func (c *Client) setLeader(addr string) {
	c.mu.Lock()
	c.leader = addr
	c.leaderPeer.Store(c.peers[addr]) // nil until a call dials it (pick)
	c.mu.Unlock()
}

// pick is the node to try: the leader when known, else the next one in
// turn. The leader's peer, once dialled, is read without a lock.
func (c *Client) pick() (*peer, error) {
	if p := c.leaderPeer.Load(); p != nil {
		return p, nil
	}
	addr := c.target()
	p, err := c.peer(addr)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	if c.leader == addr && !c.closed {
		c.leaderPeer.Store(p)
	}
	c.mu.Unlock()
	return p, nil
}

// target is the address to try: the leader when known, else the next one.
func (c *Client) target() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.leader != "" {
		return c.leader
	}
	a := c.addrs[c.next%len(c.addrs)]
	c.next++
	return a
}

func (c *Client) forgetLeader(addr string) {
	c.mu.Lock()
	if c.leader == addr {
		c.leader = ""
		c.leaderPeer.Store(nil)
	}
	c.mu.Unlock()
}

// call runs one call, following the leader and retrying what can be
// retried until ctx ends. Every request the client sends is idempotent
// (a Begin carries its owner and token, a finish its claim), so a retry
// after an unknown outcome is safe. A write whose outcome stayed unknown
// when ctx ended returns ErrInDoubt: one that failed after it may have
// reached a node, or whose attempt ctx's end cut short; only a write
// known not to have left (errNotSent) returns ctx's error alone. Each
// attempt runs under ctx bounded by Options.AttemptTimeout.
func (c *Client) call(ctx context.Context, write bool, fn func(ctx context.Context, p *peer) error) error {
	return c.retry(ctx, nil, write, func(ctx context.Context, p *peer, deadline time.Time) error {
		actx, cancel := context.WithDeadline(ctx, deadline)
		defer cancel()
		return fn(actx, p)
	})
}

// batched is call for an item that goes through the node's batcher; the
// batcher bounds its attempt itself, without a context and a timer per
// call (they were 6% of a duplicate's CPU). fl is a claim finish's loop
// (nil for any other call); slot is the call's own record for its
// attempts (callSlot), allocated with item.
func (c *Client) batched(ctx context.Context, fl *finishLoop, write bool, item *clusterpb.BatchItem, slot *callSlot) (out *clusterpb.Result, err error) {
	var stop context.Context
	if fl != nil {
		stop = c.stop
	}
	err = c.retry(ctx, fl, write, func(ctx context.Context, p *peer, deadline time.Time) (err error) {
		out, err = p.batch.do(ctx, stop, deadline, item, slot)
		return err
	})
	return out, err
}

// firstBackoff is the wait before a call's first retry.
const firstBackoff = 10 * time.Millisecond

// finishLoop is what a claim finish's retry loop follows besides its ctx
// (claimBackend.finish), and the loop's state, which it carries from the
// caller's goroutine to one of its own when the caller stops waiting.
type finishLoop struct {
	stopped <-chan struct{} // Client.stopped: Close ends the finish
	// end bounds the finish (finishTimeout from its start, or its
	// caller's deadline when later). The loop checks it before each
	// attempt and bounds each attempt and backoff by it: no timer.
	end time.Time
	// handOver: the loop's ctx is the caller's, and its end returns
	// errHandOver with the state below kept for the loop to go on.
	handOver bool
	backoff  time.Duration
	doubt    bool
	last     error
}

// errHandOver ends a finish's loop on its caller's goroutine when the
// caller's ctx ended: the finish goes on on a goroutine of its own.
var errHandOver = errors.New("idemcluster: the caller stopped waiting for the claim's finish")

// errFinishStopped ends a claim finish that Close stopped.
var errFinishStopped = fmt.Errorf("%w: idemcluster: Close stopped the claim's finish", idem.ErrClosed)

// over is what ends a loop besides ctx: Close stopped the finish, or its
// bound passed (nil: neither, or not a finish).
func (fl *finishLoop) over() error {
	if fl == nil {
		return nil
	}
	select {
	case <-fl.stopped:
		return errFinishStopped
	default:
	}
	if !time.Now().Before(fl.end) {
		return fmt.Errorf("idemcluster: the claim's finish was sent for its whole bound: %w", context.DeadlineExceeded)
	}
	return nil
}

// retry is call's loop: try gets ctx and the attempt's deadline. fl, for
// a claim's finish, adds Close's stop and the finish's bound to ctx.
func (c *Client) retry(ctx context.Context, fl *finishLoop, write bool, try func(ctx context.Context, p *peer, deadline time.Time) error) error {
	backoff := firstBackoff
	doubt := false
	var last error
	var stopped <-chan struct{} // nil: never
	if fl != nil {
		backoff, doubt, last, stopped = fl.backoff, fl.doubt, fl.last, fl.stopped
	}
	for attempt := 0; ; attempt++ {
		err := ctx.Err()
		if err != nil && fl != nil && fl.handOver {
			fl.backoff, fl.doubt, fl.last = backoff, doubt, last
			return errHandOver
		}
		if err == nil {
			err = fl.over()
		}
		if err != nil {
			if write && doubt {
				return fmt.Errorf("%w: %w (last: %v)", idem.ErrInDoubt, err, last)
			}
			if last != nil {
				return fmt.Errorf("%w (last: %v)", err, last)
			}
			return err
		}
		p, err := c.pick()
		if err != nil {
			if write && doubt {
				return fmt.Errorf("%w: %w (last: %v)", idem.ErrInDoubt, err, last)
			}
			return err
		}
		deadline := time.Now().Add(c.o.AttemptTimeout)
		if fl != nil && fl.end.Before(deadline) {
			deadline = fl.end
		}
		err = try(ctx, p, deadline)
		if err == nil {
			return nil
		}
		addr := p.addr
		last = err
		e := fromStatus(err)
		var nl *errNotLeader
		switch {
		case errors.As(e, &nl):
			c.forgetLeader(addr)
			if nl.leader != "" && nl.leader != addr {
				c.setLeader(nl.leader)
				continue // straight to the leader
			}
		case errors.Is(e, idem.ErrInDoubt), errors.Is(e, idem.ErrClosed):
			doubt = true
			c.forgetLeader(addr)
		case errors.Is(err, errNotSent): // still queued when its attempt ended: retry
			if ctx.Err() != nil || fl.over() != nil {
				continue // the loop's top reports ctx's end
			}
		default:
			st, ok := status.FromError(err)
			if !ok {
				return e
			}
			switch st.Code() {
			case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled, codes.Internal, codes.Unknown:
				// The request may have reached the node, also when ctx
				// ended while its answer was on the way.
				doubt = true
				if (ctx.Err() != nil || fl.over() != nil) && st.Code() != codes.Unavailable {
					continue // ctx cut the attempt short; the loop's top reports it
				}
				c.forgetLeader(addr)
			default:
				return e // the engine's answer
			}
		}
		c.log.Debug("idemcluster: retrying", "addr", addr, "attempt", attempt, "error", err)
		wait := backoff
		if fl != nil {
			wait = min(wait, time.Until(fl.end))
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		case <-stopped:
			t.Stop()
		}
		// Capped at 100 ms: after a failover the first request waits for
		// the election, then at most one backoff (a 500 ms cap added up to
		// a second: a try just before the new leader was ready, and one at
		// a follower that did not know its address yet).
		backoff = min(backoff*2, 100*time.Millisecond)
	}
}

func resultFromPB(p *clusterpb.Result) idem.Result {
	if p == nil {
		return idem.Result{}
	}
	return idem.Result{Status: idem.Status(p.Status), Reply: p.Reply, LeaseUntil: tm(p.LeaseUntil), CommittedAt: tm(p.CommittedAt), Seq: p.Seq, ExpiresAt: tm(p.ExpiresAt)}
}

func (c *Client) count(r idem.Result, err error) {
	if err != nil {
		c.countErr(err)
		return
	}
	switch {
	case r.Status == idem.Done:
		c.st.hits.Add(1)
	case r.Status == idem.Fresh:
		c.st.misses.Add(1)
	case r.Status == idem.InFlight:
		c.st.collisions.Add(1)
	}
}

// countErr is count for an error (apart: errors.As's target escapes, an
// allocation on every call).
func (c *Client) countErr(err error) {
	var gap *idem.SequenceGapError
	switch {
	case errors.As(err, &gap):
		c.st.gaps.Add(1)
	case errors.Is(err, idem.ErrAlreadyCommitted):
		c.st.already.Add(1)
	case errors.Is(err, idem.ErrConflict):
		c.st.conflicts.Add(1)
	}
}

// Begin is idem.Engine.Begin on the cluster: a Fresh claim is returned
// only once it is committed by a majority. A retry after a lost answer
// (inside this call) gets the same claim back.
func (c *Client) Begin(ctx context.Context, req idem.Request) (idem.Result, error) {
	m := &beginItem{}
	_, _ = rand.Read(m.tok[:])
	fillReqPB(&m.req, req)
	m.in = clusterpb.BeginRequest{Request: &m.req, Owner: c.o.Owner, Token: m.tok[:]}
	m.call.Begin = &m.in
	m.item.Call = &m.call
	out, err := c.batched(ctx, nil, true, &m.item, &m.slot)
	if err != nil {
		err = fromStatus(err)
		var ac *idem.AlreadyCommittedError
		if errors.As(err, &ac) {
			c.count(idem.Result{}, err)
			return idem.Result{Seq: req.Seq}, err
		}
		c.count(idem.Result{}, err)
		return idem.Result{}, err
	}
	r := resultFromPB(out)
	if r.Status == idem.Fresh {
		if out.Claim == nil {
			return idem.Result{}, fmt.Errorf("idemcluster: a fresh result without its claim")
		}
		r.Claim = idem.NewClaim(&claimBackend{c: c, ref: out.Claim}, r.LeaseUntil)
	}
	c.count(r, nil)
	return r, nil
}

// beginItem, commitItem, abortItem and lookupItem hold the messages of
// one call's batch item (the item, its oneof wrapper, the request and,
// for a Begin, the token; for a finish, its loop's state) and the call's
// record in its batcher (callSlot) in one allocation instead of five or
// six: at 64 callers allocation and GC were a fifth of a duplicate's
// CPU.
type (
	beginItem struct {
		item clusterpb.BatchItem
		slot callSlot
		call clusterpb.BatchItem_Begin
		in   clusterpb.BeginRequest
		req  clusterpb.Request
		tok  [16]byte
	}
	commitItem struct {
		item clusterpb.BatchItem
		slot callSlot
		call clusterpb.BatchItem_Commit
		in   clusterpb.CommitRequest
		fl   finishLoop
	}
	abortItem struct {
		item clusterpb.BatchItem
		slot callSlot
		call clusterpb.BatchItem_Abort
		in   clusterpb.AbortRequest
		fl   finishLoop
	}
	lookupItem struct {
		item clusterpb.BatchItem
		slot callSlot
		call clusterpb.BatchItem_Lookup
		in   clusterpb.LookupRequest
		req  clusterpb.Request
	}
)

// claimBackend finishes a claim held on the cluster.
type claimBackend struct {
	c   *Client
	ref *clusterpb.ClaimRef
}

func (b *claimBackend) Commit(ctx context.Context, reply []byte, adv []idem.Advance) error {
	m := &commitItem{}
	m.in = clusterpb.CommitRequest{Claim: b.ref, Reply: reply}
	for _, a := range adv {
		m.in.Advances = append(m.in.Advances, &clusterpb.Advance{Scope: a.Scope, Client: a.Client, Seq: a.Seq})
	}
	m.call.Commit = &m.in
	m.item.Call = &m.call
	err := b.finish(ctx, &m.item, &m.fl, &m.slot)
	if errors.Is(err, idem.ErrLeaseLost) {
		b.c.st.leaseLost.Add(1)
	}
	return err
}

func (b *claimBackend) Abort(ctx context.Context) error {
	m := &abortItem{}
	m.in = clusterpb.AbortRequest{Claim: b.ref}
	m.call.Abort = &m.in
	m.item.Call = &m.call
	return b.finish(ctx, &m.item, &m.fl, &m.slot)
}

// finishTimeout bounds how long a claim's finish is sent, retries
// included, when its caller's ctx ends sooner: a few failovers.
const finishTimeout = 30 * time.Second

// finish sends a claim's commit or abort (item) as idem.Claim's contract
// asks: once called, the finish is sent whatever ctx says, and ctx bounds
// only the caller's wait. It is bounded by finishTimeout from its start,
// or by ctx's deadline when that is later. It runs on the caller's
// goroutine while the caller waits; when ctx ends first, the caller gets
// an error matching idem.ErrInDoubt and the finish goes on on a goroutine
// of its own, under ctx's values without its end (an item on the wire
// then is sent again: a finish names the claim's token, so a repeat gets
// the recorded outcome, as a retry after a lost answer does). Close waits
// for the finishes under way and stops those left, see Close. The common
// case, a caller that waits for its finish, costs no goroutine, timer,
// context or lock.
// fl is the finish's loop state and slot its record, allocated with item.
func (b *claimBackend) finish(ctx context.Context, item *clusterpb.BatchItem, fl *finishLoop, slot *callSlot) error {
	c := b.c
	if ctx.Done() == nil { // ctx never ends: the caller waits for the outcome
		_, err := c.batched(ctx, nil, true, item, slot)
		return fromStatus(err)
	}
	start := time.Now()
	*fl = finishLoop{stopped: c.stopped, end: start.Add(finishTimeout), handOver: true, backoff: firstBackoff}
	if d, ok := ctx.Deadline(); ok && d.After(fl.end) {
		fl.end = d
	}
	if !c.finishBegins() {
		return fmt.Errorf("idemcluster: %w: the client is closed", idem.ErrClosed)
	}
	_, err := c.batched(ctx, fl, true, item, slot)
	if err != errHandOver {
		err = fromStatus(err)
		c.finishEnds(item, err, false)
		return err
	}
	left := ctx.Err()
	fl.handOver = false
	go func() {
		_, err := c.batched(context.WithoutCancel(ctx), fl, true, item, slot)
		c.finishEnds(item, fromStatus(err), true)
	}()
	return fmt.Errorf("%w: idemcluster: the claim's finish was still being sent when ctx ended (%w); it goes on for up to %v, or until Close gives up (Close's error names it then)",
		idem.ErrInDoubt, left, fl.end.Sub(start).Round(time.Second))
}

// describeFinish names a claim's finish ("commit of scope "s" id "x"")
// for Close's error and the log, made only when a message needs it:
// formatting it for every finish cost a Sprintf per request.
func describeFinish(item *clusterpb.BatchItem) string {
	op, ref := "commit", item.GetCommit().GetClaim()
	if a := item.GetAbort(); a != nil {
		op, ref = "abort", a.GetClaim()
	}
	if ref.GetClient() != "" {
		return fmt.Sprintf("%s of scope %q client %q seq %d", op, ref.GetScope(), ref.GetClient(), ref.GetSeq())
	}
	return fmt.Sprintf("%s of scope %q id %q", op, ref.GetScope(), ref.GetId())
}

// Lookup is idem.Engine.Lookup on the cluster (linearizable unless
// Options.FollowerReads).
func (c *Client) Lookup(ctx context.Context, req idem.Request) (idem.Result, error) {
	m := &lookupItem{}
	fillReqPB(&m.req, req)
	m.in = clusterpb.LookupRequest{Request: &m.req, FollowerRead: c.o.FollowerReads}
	m.call.Lookup = &m.in
	m.item.Call = &m.call
	out, err := c.batched(ctx, nil, false, &m.item, &m.slot)
	if err != nil {
		return idem.Result{Seq: req.Seq}, fromStatus(err)
	}
	return resultFromPB(out), nil
}

// Wait is idem.Engine.Wait on the cluster: it waits on the leader.
func (c *Client) Wait(ctx context.Context, req idem.Request) (idem.Result, error) {
	var out *clusterpb.WaitResponse
	err := c.call(ctx, false, func(actx context.Context, p *peer) (err error) {
		// A wait may last longer than one attempt: bound it by ctx only.
		out, err = p.idem.Wait(ctx, &clusterpb.WaitRequest{Request: reqToPB(req)})
		return err
	})
	if err != nil {
		return idem.Result{Seq: req.Seq}, fromStatus(err)
	}
	return resultFromPB(out.Result), nil
}

// Ack is idem.Engine.Ack on the cluster.
func (c *Client) Ack(ctx context.Context, scope string, ids ...[]byte) error {
	return fromStatus(c.call(ctx, true, func(ctx context.Context, p *peer) error {
		_, err := p.idem.Ack(ctx, &clusterpb.AckRequest{Scope: scope, Ids: ids})
		return err
	}))
}

// Advance is idem.Engine.Advance on the cluster.
func (c *Client) Advance(ctx context.Context, adv ...idem.Advance) error {
	in := &clusterpb.AdvanceRequest{}
	for _, a := range adv {
		in.Advances = append(in.Advances, &clusterpb.Advance{Scope: a.Scope, Client: a.Client, Seq: a.Seq})
	}
	return fromStatus(c.call(ctx, true, func(ctx context.Context, p *peer) error {
		_, err := p.idem.Advance(ctx, in)
		return err
	}))
}

// Forget is idem.Engine.Forget on the cluster (an administrator's call).
func (c *Client) Forget(ctx context.Context, before time.Time) error {
	return fromStatus(c.call(ctx, true, func(ctx context.Context, p *peer) error {
		_, err := p.idem.Forget(ctx, &clusterpb.ForgetRequest{Before: timestamppb.New(before)})
		return err
	}))
}

// ClientState is idem.Engine.ClientState on the cluster.
func (c *Client) ClientState(ctx context.Context, scope, client string) (uint64, error) {
	var out *clusterpb.ClientStateResponse
	err := c.call(ctx, false, func(ctx context.Context, p *peer) (err error) {
		out, err = p.idem.ClientState(ctx, &clusterpb.ClientStateRequest{Scope: scope, Client: client, FollowerRead: c.o.FollowerReads})
		return err
	})
	if err != nil {
		return 0, fromStatus(err)
	}
	return out.LastCommittedSequence, nil
}

// InDoubt lists the unfinished claims of this client's Owner whose scope
// starts with scopePrefix: after a restart of the application process
// (same Owner), the claims its previous run left, to commit or abort.
func (c *Client) InDoubt(ctx context.Context, scopePrefix string) ([]idem.InDoubtClaim, error) {
	var out *clusterpb.InDoubtResponse
	err := c.call(ctx, false, func(ctx context.Context, p *peer) (err error) {
		out, err = p.idem.InDoubt(ctx, &clusterpb.InDoubtRequest{ScopePrefix: scopePrefix, Owner: c.o.Owner})
		return err
	})
	if err != nil {
		return nil, fromStatus(err)
	}
	var ds []idem.InDoubtClaim
	for _, d := range out.Claims {
		r := d.Claim
		ds = append(ds, idem.InDoubtClaim{Scope: r.Scope, ID: r.Id, Client: r.Client, Seq: r.Seq, Fingerprint: d.Fingerprint,
			ClaimedAt: tm(d.ClaimedAt), LeaseUntil: tm(d.LeaseUntil), Claim: idem.NewClaim(&claimBackend{c: c, ref: r}, tm(d.LeaseUntil))})
	}
	return ds, nil
}

// Now is the client's clock. The cluster decides every time by its log;
// this is what code built on the Store reads for its own decisions.
func (c *Client) Now() time.Time { return time.Now() }

// Stats are what this client saw: the results and errors of its calls
// (Hits, Misses, Conflicts, InFlightCollisions, SequenceGaps,
// AlreadyCommitted, LeaseLost). The nodes' own figures are on their
// status pages.
func (c *Client) Stats() idem.Stats {
	return idem.Stats{Hits: c.st.hits.Load(), Misses: c.st.misses.Load(), Conflicts: c.st.conflicts.Load(),
		InFlightCollisions: c.st.collisions.Load(), SequenceGaps: c.st.gaps.Load(), AlreadyCommitted: c.st.already.Load(), LeaseLost: c.st.leaseLost.Load()}
}

// Status is the view of the node the client reaches first.
func (c *Client) Status(ctx context.Context) (*clusterpb.StatusResponse, error) {
	var out *clusterpb.StatusResponse
	err := c.call(ctx, false, func(ctx context.Context, p *peer) (err error) {
		out, err = p.cluster.Status(ctx, &clusterpb.StatusRequest{})
		return err
	})
	return out, fromStatus(err)
}

func (c *Client) join(ctx context.Context, in *clusterpb.JoinRequest) error {
	return fromStatus(c.call(ctx, true, func(ctx context.Context, p *peer) error {
		_, err := p.cluster.Join(ctx, in)
		return err
	}))
}

// Remove removes a node from the cluster. It is idempotent: a node that
// was removed before (a retry after a lost answer, or a second call) is
// success too, since the cluster's log remembers the ids it removed; a
// node id that never was a member is an error (NotFound from the leader).
func (c *Client) Remove(ctx context.Context, nodeID string) error {
	return fromStatus(c.call(ctx, true, func(ctx context.Context, p *peer) error {
		_, err := p.cluster.Remove(ctx, &clusterpb.RemoveRequest{NodeId: nodeID})
		return err
	}))
}

// maxBatchesInFlight is how many Batch RPCs a client keeps on the wire to
// one node; calls arriving meanwhile wait and go in the next one. One:
// measured with 64 callers on a 2-core machine (BenchmarkClusterFresh and
// BenchmarkClusterDuplicate, 1, 2, 4 and 8 in flight), one batch on the
// wire gave the most requests per CPU second and the most lookups per
// second (76k/s against 16-20k/s with 2 or more: each batch's lookups
// share one leadership round instead of waiting for the round before).
const maxBatchesInFlight = 1

// maxBatchBytes bounds the items of one Batch RPC (encoded).
const maxBatchBytes = 1 << 20

// batcher coalesces a client's concurrent calls to one node into Batch
// RPCs. A call that finds fewer than maxBatchesInFlight batches on the
// wire goes at once (alone, when nothing else waits: no timer delays it);
// otherwise it waits for the next batch, which leaves as soon as one
// returns and the callers it answered have had a chance to send their
// next calls (gather). Each call keeps its own context: it stops waiting when ctx
// ends (its item may still run, as a call whose answer was lost). Its
// attempt's deadline bounds the Batch RPC that carries it (each RPC is
// bounded by its calls' earliest), and a call still queued when its
// attempt ended is not sent; since calls queue in the order of their
// deadlines, the RPC on the wire ends before the attempts of the calls
// queued behind it, and no call needs a timer of its own.
type batcher struct {
	idem  clusterpb.IdemClient
	off   bool        // Options.NoBatching
	unary atomic.Bool // the node has no Batch RPC (an older node): one call per RPC

	mu       sync.Mutex   // guards queue and inflight
	queue    []*batchCall // calls waiting for the next batch
	inflight int          // batches on the wire
}

// batchCall is a call waiting in a batcher.
type batchCall struct {
	item     *clusterpb.BatchItem
	size     int           // the item's encoded size
	deadline time.Time     // the end of the call's attempt
	done     chan struct{} // buffered (1): signalled once, when res or err is set (takeDone)
	res      *clusterpb.BatchResult
	err      error // the Batch RPC's own error
}

// callSlot is a call's batchCall, allocated with its item, for its
// attempts to use one after the other. An attempt that stops waiting
// while its batch is on the wire leaves the record to that batch, which
// still writes its answer there: lost is set, and every later attempt of
// the call (a claim's finish goes on after its caller left) allocates a
// record of its own (TestRetryAfterLeftAttemptGetsItsOwnRecord). lost is
// only read and written by the call's attempts, which run one at a time.
type callSlot struct {
	bc   batchCall
	lost bool
}

// take is the record for the next attempt: the slot's own unless an
// earlier attempt left it to its batch (or slot is nil).
func (s *callSlot) take() *batchCall {
	if s == nil || s.lost {
		return &batchCall{}
	}
	return &s.bc
}

// lose marks the slot's record as left to its batch when bc is it.
func (s *callSlot) lose(bc *batchCall) {
	if s != nil && bc == &s.bc {
		s.lost = true
	}
}

// donePool holds the done channels of answered calls: a channel whose
// one signal was received is empty and is reused; one that an attempt
// stopped waiting on is left to the garbage collector (its batch may
// still signal it).
var donePool = sync.Pool{New: func() any { return make(chan struct{}, 1) }}

// takeDone is an empty done channel for a batchCall.
func takeDone() chan struct{} { return donePool.Get().(chan struct{}) }

// do runs item in an attempt that ends at deadline (or when ctx or stop
// ends; stop: nil, or a claim finish's Client.stop) and returns its
// result, or its error as a gRPC status error, as the item's own RPC
// would. slot is the call's record (nil: one is allocated).
func (b *batcher) do(ctx, stop context.Context, deadline time.Time, item *clusterpb.BatchItem, slot *callSlot) (*clusterpb.Result, error) {
	if b.off || b.unary.Load() {
		return b.single(ctx, stop, deadline, item)
	}
	var stopped <-chan struct{} // nil: never
	if stop != nil {
		stopped = stop.Done()
	}
	bc := slot.take()
	*bc = batchCall{item: item, size: item.SizeVT(), deadline: deadline, done: takeDone()}
	b.mu.Lock()
	b.queue = append(b.queue, bc)
	if b.inflight < maxBatchesInFlight {
		b.inflight++
		q := b.takeLocked()
		b.mu.Unlock()
		go b.send(q)
	} else {
		b.mu.Unlock()
	}
	if done := ctx.Done(); done == nil && stopped == nil {
		<-bc.done // nothing else ends the wait: a receive, not a select
	} else {
		select {
		case <-bc.done:
		case <-done:
			if b.unqueue(bc) {
				return nil, fmt.Errorf("%w: %w", errNotSent, status.FromContextError(ctx.Err()).Err())
			}
			slot.lose(bc)
			return nil, status.FromContextError(ctx.Err()).Err()
		case <-stopped:
			if b.unqueue(bc) {
				return nil, fmt.Errorf("%w: %w", errNotSent, errStoppedStatus)
			}
			slot.lose(bc)
			return nil, errStoppedStatus
		}
	}
	donePool.Put(bc.done) // answered: its one signal was received
	if bc.err != nil {
		if status.Code(bc.err) == codes.Unimplemented {
			b.unary.Store(true)
			return b.single(ctx, stop, deadline, item)
		}
		return nil, bc.err
	}
	if st := bc.res.Status; st != nil {
		return nil, status.ErrorProto(toProto(st))
	}
	return bc.res.Result, nil
}

// errStoppedStatus answers a claim finish's call that Close stopped.
var errStoppedStatus = status.Error(codes.Canceled, "idemcluster: Close stopped the claim's finish")

// errNotSent is a call taken out of its batcher's queue when its ctx
// ended: it never left, so a write has no outcome to doubt.
var errNotSent = errors.New("idemcluster: not sent (the call was still queued for the next batch)")

// unqueue takes bc out of the queue and reports whether it was there: a
// call whose ctx ends while it waits for the next batch is not sent
// (TestQueuedBeginWithEndedContextIsNotSent). Left there, a Begin would be
// sent later and claim its key with a token nobody holds.
func (b *batcher) unqueue(bc *batchCall) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	i := slices.Index(b.queue, bc)
	if i < 0 {
		return false
	}
	b.queue = slices.Delete(b.queue, i, i+1)
	return true
}

// takeLocked takes the next batch from the queue: the calls in order, up
// to maxBatchBytes (at least one call), so that a batch of large replies
// stays far below gRPC's 4 MiB message limit, which each call alone meets.
func (b *batcher) takeLocked() []*batchCall {
	n, size := 1, b.queue[0].size
	for n < len(b.queue) && size+b.queue[n].size <= maxBatchBytes {
		size += b.queue[n].size
		n++
	}
	q := b.queue[:n:n]
	if n == len(b.queue) {
		b.queue = nil
	} else {
		b.queue = b.queue[n:]
	}
	return q
}

// errAttemptEnded answers a call whose attempt ended before its batch
// left.
var errAttemptEnded = fmt.Errorf("%w: %w", errNotSent, status.Error(codes.DeadlineExceeded, "idemcluster: the attempt ended while the call waited for the next batch"))

// send sends q, then whatever queued meanwhile, until nothing waits.
func (b *batcher) send(q []*batchCall) {
	for {
		// The calls whose attempt ended while they waited stay unsent;
		// the batch is bounded by the earliest end of the others'.
		now := time.Now()
		var deadline time.Time
		live := q[:0]
		for _, bc := range q {
			if !now.Before(bc.deadline) {
				bc.err = errAttemptEnded
				bc.done <- struct{}{}
				continue
			}
			if deadline.IsZero() || bc.deadline.Before(deadline) {
				deadline = bc.deadline
			}
			live = append(live, bc)
		}
		if q = live; len(q) > 0 {
			b.sendOne(q, deadline)
			b.gather(len(q))
		}
		b.mu.Lock()
		if len(b.queue) == 0 {
			b.inflight--
			b.mu.Unlock()
			return
		}
		q = b.takeLocked()
		b.mu.Unlock()
	}
}

// sendOne sends q as one Batch RPC, bounded by deadline, and answers its
// calls.
func (b *batcher) sendOne(q []*batchCall, deadline time.Time) {
	in := &clusterpb.BatchRequest{Items: make([]*clusterpb.BatchItem, len(q))}
	for i, bc := range q {
		in.Items[i] = bc.item
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	out, err := b.idem.Batch(ctx, in)
	cancel()
	if err == nil && len(out.Results) != len(q) {
		err = status.Errorf(codes.Internal, "idemcluster: a batch of %d calls answered with %d results", len(q), len(out.Results))
	}
	for i, bc := range q {
		if err != nil {
			bc.err = err
		} else {
			bc.res = out.Results[i]
		}
		bc.done <- struct{}{}
	}
}

// single runs item in an RPC of its own, bounded by deadline (and stop,
// when not nil).
func (b *batcher) single(ctx, stop context.Context, deadline time.Time, item *clusterpb.BatchItem) (*clusterpb.Result, error) {
	ctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	if stop != nil {
		defer context.AfterFunc(stop, cancel)()
	}
	switch c := item.GetCall().(type) {
	case *clusterpb.BatchItem_Begin:
		r, err := b.idem.Begin(ctx, c.Begin)
		return r.GetResult(), err
	case *clusterpb.BatchItem_Commit:
		_, err := b.idem.Commit(ctx, c.Commit)
		return nil, err
	case *clusterpb.BatchItem_Abort:
		_, err := b.idem.Abort(ctx, c.Abort)
		return nil, err
	case *clusterpb.BatchItem_Lookup:
		r, err := b.idem.Lookup(ctx, c.Lookup)
		return r.GetResult(), err
	}
	return nil, status.Error(codes.InvalidArgument, "idemcluster: a batch item without a call")
}

// toProto is an item's status as the google.rpc.Status it is laid out as.
func toProto(st *clusterpb.ItemStatus) *spb.Status {
	return &spb.Status{Code: st.Code, Message: st.Message, Details: st.Details}
}

// gatherYields bounds how many times a batcher yields after answering a
// batch, before it takes the next one from the queue (gather).
const gatherYields = 16

// gather lets the callers a batch just answered run before the next batch
// is taken: it yields the processor while the queue grows, and while it
// holds fewer calls than the batch answered (answered), at most
// gatherYields times in all (a few microseconds, no timer). Each of those
// callers usually sends its next call at once (the Commit after its
// Begin, the next request's Begin after a Commit), and without the yield
// it would miss the next batch and wait a whole round for the one after:
// with 64 callers and one batch on the wire, the callers split into two
// halves that took turns, about 32 calls per batch. Gathered, the batch
// carries about 58 of the 64 (bench/peers, 3 runs interleaved: fresh
// 104-130 -> 82-106 µs of CPU per request, 3.2-11.1k -> 5.3-14.7k
// requests/s), and every round's fixed cost (an RPC, an entry, three
// fsyncs) is shared by twice the calls. Stopping at the first yield that
// saw no growth left behind the callers still on their way on the other
// processor (a batch of 48 of 64 on a quiet machine): they now hold the
// gather until the queue has as many calls as the batch answered
// (TestGatherWaitsForAnsweredCallers). Callers that send nothing more
// cost at most gatherYields yields, as a queue that kept growing did
// before; a lone caller loses a yield or two.
func (b *batcher) gather(answered int) {
	prev := -1
	for range gatherYields {
		b.mu.Lock()
		n := len(b.queue)
		b.mu.Unlock()
		if n == prev && n >= answered {
			return
		}
		prev = n
		runtime.Gosched()
	}
}
