// Package clustertest holds what the tests that run `idem serve`
// processes share on top of internal/proctest (which knows processes and
// raft members, not the cluster's gRPC service): a node as a
// proctest.Member whose view is its Status RPC, and connections of a
// test's own to each node, made before anything is paused.
package clustertest

import (
	"context"
	"testing"

	"github.com/idemdb/idem/idemcluster/clusterpb"
	"github.com/idemdb/idem/internal/proctest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// Probe is a connection of a test's own to one node, with a SentCounter,
// for requests the test queues to the node while it is paused.
type Probe struct {
	Conn *grpc.ClientConn
	Sent *proctest.SentCounter
}

// Probes connects to each node (name -> gRPC address) with a SentCounter
// holding n reports, before anything is paused: each connection has
// answered a Status request, whose report is drained. The test's cleanup
// closes them.
func Probes(ctx context.Context, t testing.TB, addrs map[string]string, n int) map[string]*Probe {
	t.Helper()
	out := map[string]*Probe{}
	for name, addr := range addrs {
		sent := proctest.NewSentCounter(n)
		cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithStatsHandler(sent))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cc.Close() })
		if _, err := clusterpb.NewClusterClient(cc).Status(ctx, &clusterpb.StatusRequest{}); err != nil {
			t.Fatalf("clustertest: Status of %s: %v", name, err)
		}
		sent.Drain() // the Status request's own message
		out[name] = &Probe{Conn: cc, Sent: sent}
	}
	return out
}

// ServeNode is an `idem serve` process as a proctest.Member: its view is what its
// Status RPC answers on Conn, a connection to that node alone.
type ServeNode struct {
	*proctest.Proc
	Conn grpc.ClientConnInterface
}

// View implements proctest.Member.
func (n *ServeNode) View(ctx context.Context) (proctest.View, error) {
	st, err := clusterpb.NewClusterClient(n.Conn).Status(ctx, &clusterpb.StatusRequest{})
	if err != nil {
		return proctest.View{}, err
	}
	return proctest.View{State: st.State, LeaderID: st.LeaderId, Term: st.Term}, nil
}
