package idemcluster

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// The members table (node id -> gRPC address) is state machine state,
// written by member entries in the log, so every node has the same one
// and a snapshot carries it. The raft configuration holds raft addresses
// only, and a node's gRPC address is known to that node alone, so each
// node tells the leader its own: a leader records its address when it
// becomes ready (watchLeadership), a joining node with its join, and
// every node that sees a leader while the table it has applied lacks its
// address (or has another: it restarted on a new one) asks the leader to
// record it (Advertise). Before, a follower of a bootstrapped cluster
// was in the table only once it had led, so a client that dialed one
// node could not find the others, and a NOT_LEADER from a follower could
// name no address for a leader that had never led before.

// advertiseEvery is how often a node checks that the members table has
// its gRPC address; after a failed Advertise it waits longer, doubling up
// to advertiseBackoff.
const (
	advertiseEvery   = 100 * time.Millisecond
	advertiseBackoff = 5 * time.Second
)

// errNothingToAdvertise is advertise's answer when there is nothing it
// can do now: no leader known, or this node leads (it records its own
// address when it becomes ready).
var errNothingToAdvertise = errors.New("idemcluster: no leader to advertise to")

// advertiseLoop keeps the node's gRPC address in the members table while
// the node runs.
func (n *Node) advertiseLoop() {
	defer n.wg.Done()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-n.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	t := time.NewTicker(advertiseEvery)
	defer t.Stop()
	var next time.Time
	backoff := advertiseEvery
	for {
		select {
		case <-n.stop:
			return
		case <-t.C:
		}
		if n.fsm.member(n.o.ID) == n.Addr() || time.Now().Before(next) {
			continue
		}
		err := n.advertise(ctx)
		switch {
		case err == nil:
			// Recorded (or already there): the entry reaches this
			// node's state machine within a round or two.
			backoff = advertiseEvery
			next = time.Now().Add(5 * advertiseEvery)
		case errors.Is(err, errNothingToAdvertise):
		default:
			n.log.Debug("idemcluster: advertising the gRPC address", "error", err)
			next = time.Now().Add(backoff)
			backoff = min(2*backoff, advertiseBackoff)
		}
	}
}

// advertise asks the leader to record this node's gRPC address in the
// members table.
func (n *Node) advertise(ctx context.Context) error {
	if n.r.State() == raft.Leader {
		return errNothingToAdvertise
	}
	leader := n.leaderAddr()
	if leader == "" {
		return errNothingToAdvertise
	}
	// Only a member asks: a node removed from the cluster (or not yet
	// joined) has no address to keep in the table. The leader checks
	// too; this saves it the calls.
	if ok, err := n.inConfiguration(n.o.ID); err != nil || !ok {
		return fmt.Errorf("idemcluster: not in the raft configuration (%v)", err)
	}
	cc, err := grpc.NewClient(leader, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(ctx, advertiseBackoff)
	defer cancel()
	_, err = clusterpb.NewClusterClient(cc).Advertise(ctx, &clusterpb.AdvertiseRequest{NodeId: n.o.ID, GrpcAddr: n.Addr()})
	return err
}

// inConfiguration reports whether node id is in the latest raft
// configuration this node has.
func (n *Node) inConfiguration(id string) (bool, error) {
	f := n.r.GetConfiguration()
	if err := f.Error(); err != nil {
		return false, err
	}
	for _, sv := range f.Configuration().Servers {
		if string(sv.ID) == id {
			return true, nil
		}
	}
	return false, nil
}

// Advertise records a member's gRPC address in the members table (see
// above). It appends nothing when the table has that address already,
// and refuses a node that is not in the configuration: it never changes
// who is a member. A removal racing with it may leave the removed node's
// address in the table; the table is read only for the members of the
// configuration, and a node that joins again records its new address.
func (s *server) Advertise(ctx context.Context, in *clusterpb.AdvertiseRequest) (*clusterpb.AdvertiseResponse, error) {
	if in.NodeId == "" || in.GrpcAddr == "" {
		return nil, toStatus(fmt.Errorf("%w: advertise needs a node id and a gRPC address", idem.ErrInvalidRequest))
	}
	if !s.n.IsLeader() {
		return nil, toStatus(&errNotLeader{leader: s.n.leaderAddr()})
	}
	if s.n.fsm.member(in.NodeId) == in.GrpcAddr {
		return &clusterpb.AdvertiseResponse{}, nil
	}
	ok, err := s.n.inConfiguration(in.NodeId)
	if err != nil {
		return nil, toStatus(fmt.Errorf("idemcluster: advertise %s: reading the configuration: %w", in.NodeId, err))
	}
	if !ok {
		return nil, status.Errorf(codes.NotFound, "idemcluster: advertise %q: no such member (a node joins with --join)", in.NodeId)
	}
	if err := s.write(ctx, &command{Op: cmdMember, Node: in.NodeId, Addr: in.GrpcAddr}); err != nil {
		return nil, err
	}
	return &clusterpb.AdvertiseResponse{}, nil
}
