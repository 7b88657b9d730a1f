package idemraft

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
)

// NotLeaderError: the node asked is not the leader. Leader is the leader's
// id when the node knows it (empty during an election).
type NotLeaderError struct {
	Node, Leader raft.ServerID
}

func (e *NotLeaderError) Error() string {
	if e.Leader == "" {
		return fmt.Sprintf("idemraft: node %s is not the leader (leader unknown)", e.Node)
	}
	return fmt.Sprintf("idemraft: node %s is not the leader (leader: %s)", e.Node, e.Leader)
}

// Is makes errors.Is(err, raft.ErrNotLeader) true.
func (e *NotLeaderError) Is(target error) bool { return target == raft.ErrNotLeader }

// Submit handles one command (built by Command) on the node r whose FSM is
// f, as a leader does:
//
//   - not the leader: *NotLeaderError, nothing appended;
//   - a committed request with the same fingerprint: its stored reply from
//     f's local set (Response.Duplicate), without a log append (see the
//     package documentation, "Answering from the local set");
//   - otherwise the command is appended with raft's Apply and the Response
//     of its application is returned.
//
// Where the entry was appended and its outcome is unknown (ctx ended
// while waiting for it, raft.ErrLeadershipLost, raft.ErrRaftShutdown),
// the error matches idem.ErrInDoubt (and the cause, ctx's error or raft's):
// the entry may or may not be committed. Retry the same command, on the
// leader, until a Response comes back: a committed one is then answered
// with its stored reply, and runs once. Client does that. Other errors
// (*NotLeaderError, raft.ErrEnqueueTimeout) mean nothing was appended.
func Submit(ctx context.Context, r *raft.Raft, f *FSM, cmd []byte) (*Response, error) {
	if r == nil || f == nil {
		return nil, errors.New("idemraft: Submit: nil *raft.Raft or *FSM")
	}
	d, err := decodeCommand(cmd)
	if err != nil {
		return nil, err
	}
	if r.State() != raft.Leader {
		_, id := r.LeaderWithID()
		return nil, &NotLeaderError{Leader: id}
	}
	if d.kind == kindCommand {
		if resp, ok := f.Lookup(d.req); ok {
			return resp, nil
		}
	}
	timeout := 10 * time.Second
	if dl, ok := ctx.Deadline(); ok {
		timeout = time.Until(dl)
		if timeout <= 0 {
			return nil, context.DeadlineExceeded
		}
	}
	fut := r.Apply(cmd, timeout)
	// raft's timeout bounds only the enqueueing, and a future whose node is
	// shut down between commit and apply is never answered: wait under ctx.
	done := make(chan error, 1)
	go func() { done <- fut.Error() }()
	select {
	case err = <-done:
	case <-ctx.Done():
		return nil, fmt.Errorf("idemraft: waiting for the entry to be applied: %w: %w (retry the same command)", idem.ErrInDoubt, ctx.Err())
	}
	if err != nil {
		if errors.Is(err, raft.ErrNotLeader) {
			_, id := r.LeaderWithID()
			return nil, &NotLeaderError{Leader: id}
		}
		if errors.Is(err, raft.ErrLeadershipLost) || errors.Is(err, raft.ErrRaftShutdown) {
			return nil, fmt.Errorf("idemraft: %w: %w (retry the same command)", idem.ErrInDoubt, err)
		}
		return nil, err
	}
	switch v := fut.Response().(type) {
	case *Response:
		return v, nil
	case error:
		return nil, v
	default:
		return nil, fmt.Errorf("idemraft: unexpected apply response %T (is the FSM wrapped?)", v)
	}
}

// Node is one raft server as a Client reaches it: in this process
// (LocalNode) or over HTTP (HTTPNode).
type Node interface {
	// ID is the node's raft server id.
	ID() raft.ServerID
	// Submit handles a command as the package-level Submit does. A
	// *NotLeaderError says where to go; any other error is retried.
	Submit(ctx context.Context, cmd []byte) (*Response, error)
}

// LocalNode is a Node for a raft server in this process: r, whose FSM is
// f, with the raft server id id.
func LocalNode(id raft.ServerID, r *raft.Raft, f *FSM) (Node, error) {
	if err := checkServer("LocalNode", id, r, f); err != nil {
		return nil, err
	}
	return &localNode{id, r, f}, nil
}

// checkServer refuses a missing id, raft or FSM (for LocalNode and Handler).
func checkServer(fn string, id raft.ServerID, r *raft.Raft, f *FSM) error {
	switch {
	case id == "":
		return fmt.Errorf("idemraft: %s: empty server id", fn)
	case r == nil:
		return fmt.Errorf("idemraft: %s %s: nil *raft.Raft", fn, id)
	case f == nil:
		return fmt.Errorf("idemraft: %s %s: nil *FSM (give the *FSM that Wrap returned and raft runs)", fn, id)
	}
	return nil
}

type localNode struct {
	id raft.ServerID
	r  *raft.Raft
	f  *FSM
}

func (n *localNode) ID() raft.ServerID { return n.id }
func (n *localNode) Submit(ctx context.Context, cmd []byte) (*Response, error) {
	resp, err := Submit(ctx, n.r, n.f, cmd)
	var nl *NotLeaderError
	if errors.As(err, &nl) {
		nl.Node = n.id
	}
	return resp, err
}

// ClientOptions configure NewClient. The zero value (or nil) is the
// defaults.
type ClientOptions struct {
	// Attempt bounds one attempt at one node (default 5 s); Do as a whole
	// is bounded by its context only.
	Attempt time.Duration
	// MinBackoff and MaxBackoff bound the pause between attempts
	// (defaults 5 ms and 500 ms, or MinBackoff if that is larger; the
	// pause doubles, with jitter, while no node answers).
	MinBackoff, MaxBackoff time.Duration
}

// Client sends requests to the leader of a cluster, follows leader
// changes and retries with the same request until it gets the reply: a
// retry of a request that was applied already gets the stored reply, so
// the operation runs once however often it is sent. It is safe for
// concurrent use.
type Client struct {
	nodes                        []Node
	byID                         map[raft.ServerID]int
	attempt, minBackoff, maxBack time.Duration

	mu     sync.Mutex
	leader int
}

// NewClient returns a Client for the given nodes (at least one, each with
// its own id). opts nil means the defaults.
func NewClient(nodes []Node, opts *ClientOptions) (*Client, error) {
	var o ClientOptions
	if opts != nil {
		o = *opts
	}
	switch {
	case len(nodes) == 0:
		return nil, errors.New("idemraft: NewClient: no nodes")
	case o.Attempt < 0:
		return nil, fmt.Errorf("idemraft: NewClient: ClientOptions.Attempt = %v: must not be negative", o.Attempt)
	case o.MinBackoff < 0:
		return nil, fmt.Errorf("idemraft: NewClient: ClientOptions.MinBackoff = %v: must not be negative", o.MinBackoff)
	case o.MaxBackoff < 0:
		return nil, fmt.Errorf("idemraft: NewClient: ClientOptions.MaxBackoff = %v: must not be negative", o.MaxBackoff)
	case o.MaxBackoff > 0 && o.MinBackoff > o.MaxBackoff:
		return nil, fmt.Errorf("idemraft: NewClient: ClientOptions.MinBackoff = %v exceeds MaxBackoff = %v", o.MinBackoff, o.MaxBackoff)
	}
	if o.Attempt == 0 {
		o.Attempt = 5 * time.Second
	}
	if o.MinBackoff == 0 {
		o.MinBackoff = 5 * time.Millisecond
	}
	if o.MaxBackoff == 0 {
		o.MaxBackoff = max(500*time.Millisecond, o.MinBackoff)
	}
	c := &Client{nodes: nodes, byID: map[raft.ServerID]int{}, attempt: o.Attempt, minBackoff: o.MinBackoff, maxBack: o.MaxBackoff}
	for i, n := range nodes {
		if n == nil {
			return nil, fmt.Errorf("idemraft: NewClient: node %d is nil", i)
		}
		if j, dup := c.byID[n.ID()]; dup {
			return nil, fmt.Errorf("idemraft: NewClient: nodes %d and %d have the same id %q", j, i, n.ID())
		}
		c.byID[n.ID()] = i
	}
	return c, nil
}

// Do sends req with op and returns the Response of its (single)
// application. It retries, with the same command, until a node answers
// or ctx ends; then it returns ctx's error together with the last error
// seen. ErrInvalidCommand and idem.ErrInvalidRequest are not retried.
func (c *Client) Do(ctx context.Context, req idem.Request, op []byte) (*Response, error) {
	cmd, err := Command(req, op)
	if err != nil {
		return nil, err
	}
	return c.DoCommand(ctx, cmd)
}

// DoCommand is Do for a command built already (by Command or
// ForgetCommand).
func (c *Client) DoCommand(ctx context.Context, cmd []byte) (*Response, error) {
	attempt, minB, maxB := c.attempt, c.minBackoff, c.maxBack
	backoff := minB
	var last error
	c.mu.Lock()
	i := c.leader
	c.mu.Unlock()
	for {
		if err := ctx.Err(); err != nil {
			if last == nil {
				return nil, err
			}
			return nil, fmt.Errorf("%w (last error: %v)", err, last)
		}
		actx, cancel := context.WithTimeout(ctx, attempt)
		resp, err := c.nodes[i].Submit(actx, cmd)
		cancel()
		if err == nil {
			c.mu.Lock()
			c.leader = i
			c.mu.Unlock()
			return resp, nil
		}
		if errors.Is(err, ErrInvalidCommand) || errors.Is(err, idem.ErrInvalidRequest) {
			return nil, err
		}
		last = err
		var nl *NotLeaderError
		if errors.As(err, &nl) && nl.Leader != "" {
			if j, ok := c.byID[nl.Leader]; ok && j != i {
				i = j // go straight to the leader it names
				backoff = minB
			} else {
				i = (i + 1) % len(c.nodes)
			}
		} else {
			i = (i + 1) % len(c.nodes)
		}
		pause := backoff/2 + rand.N(backoff/2+1)
		backoff = min(backoff*2, maxB)
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
		case <-t.C:
		}
	}
}
