package idemcluster

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// rawCluster is a gRPC client of one node's Cluster service: the test
// sees that node's own view.
func rawCluster(t testing.TB, addr string) clusterpb.ClusterClient {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return clusterpb.NewClusterClient(cc)
}

// memberAddrs is what a Status says of the members' gRPC addresses, as
// "id=addr" sorted ("id=" when it has none).
func memberAddrs(st *clusterpb.StatusResponse) []string {
	var out []string
	for _, m := range st.GetMembers() {
		out = append(out, m.NodeId+"="+m.GrpcAddr)
	}
	slices.Sort(out)
	return out
}

// Every member's gRPC address is in the replicated members table once
// the cluster is up, before any leadership change: each node's Status
// lists all three (a follower's used to be recorded only when it joined
// or led, so a client that dialed one node could not find the others).
// Then a leader that never led before is followed by a client that
// dialed only a follower: the follower names its address at once.
func TestEveryMemberAddressIsReplicated(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	want := map[string]string{} // node id -> gRPC address
	for id, nd := range tc.nodes {
		want[id] = nd.Addr()
	}
	var wantList []string
	for id, a := range want {
		wantList = append(wantList, id+"="+a)
	}
	slices.Sort(wantList)
	first := tc.leader(30 * time.Second)
	term := tc.nodes[first].Raft().CurrentTerm()
	for id := range tc.nodes {
		cl := rawCluster(t, want[id])
		var last []string
		for {
			st, err := cl.Status(ctx, &clusterpb.StatusRequest{})
			if err == nil {
				if last = memberAddrs(st); slices.Equal(last, wantList) {
					break
				}
			}
			if ctx.Err() != nil {
				t.Fatalf("%s's Status does not list every member's gRPC address: %v, want %v", id, last, wantList)
			}
			time.Sleep(10 * time.Millisecond) // polling the node's view
		}
	}
	if now := tc.nodes[first].Raft().CurrentTerm(); now != term {
		t.Logf("note: the term moved from %d to %d meanwhile (an election on a loaded machine)", term, now)
	}

	// A client that dialed only a follower; leadership moves to the
	// third node.
	var follower, target string
	for _, id := range []string{"n1", "n2", "n3"} {
		switch {
		case id == first:
		case follower == "":
			follower = id
		default:
			target = id
		}
	}
	c, err := Dial(ctx, []string{want[follower]}, &Options{Owner: "app", AttemptTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for {
		lead := tc.leader(30 * time.Second)
		if lead == target {
			break
		}
		err := tc.nodes[lead].Raft().LeadershipTransferToServer(raft.ServerID(target), raft.ServerAddress(tc.opts[target].Peers[target])).Error()
		if err != nil && ctx.Err() != nil {
			t.Fatalf("leadership transfer to %s: %v", target, err)
		}
	}
	// The follower names the new leader's address as soon as it knows
	// the new leader.
	fl := rawCluster(t, want[follower])
	for {
		st, err := fl.Status(ctx, &clusterpb.StatusRequest{})
		if err != nil {
			t.Fatalf("status of %s: %v", follower, err)
		}
		if st.LeaderId == target {
			if st.LeaderGrpcAddr != want[target] {
				t.Fatalf("%s follows %s but names its gRPC address %q, want %q", follower, target, st.LeaderGrpcAddr, want[target])
			}
			break
		}
		time.Sleep(time.Millisecond) // polling the follower's view
	}
	if r, err := c.Begin(ctx, idem.Request{ID: []byte("after-the-move")}); err != nil || r.Status != idem.Fresh {
		t.Fatalf("begin through a client that dialed only %s: %+v %v", follower, r, err)
	}
	st, err := c.Status(ctx)
	if err != nil || !slices.Equal(memberAddrs(st), wantList) {
		t.Fatalf("the client's view of the members: %v %v, want %v", memberAddrs(st), err, wantList)
	}
}

// A node's Status carries its raft term: the one raft has while the call
// runs, and a higher one after a leadership change.
func TestStatusReportsTerm(t *testing.T) {
	tc := newTestCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// termOf asks node id for its Status; raft's term is read before and
	// after (an election between them moves it: ask again).
	termOf := func(id string) uint64 {
		t.Helper()
		nd := tc.nodes[id]
		cl := rawCluster(t, nd.Addr())
		for {
			before := nd.Raft().CurrentTerm()
			st, err := cl.Status(ctx, &clusterpb.StatusRequest{})
			after := nd.Raft().CurrentTerm()
			if err != nil {
				t.Fatalf("status of %s: %v", id, err)
			}
			if before == after {
				if st.Term != before {
					t.Fatalf("%s's Status says term %d, raft's term is %d", id, st.Term, before)
				}
				return st.Term
			}
		}
	}
	first := tc.leader(30 * time.Second)
	for id := range tc.nodes {
		termOf(id)
	}
	was := termOf(first)
	tc.stop(first)
	next := tc.leader(30 * time.Second)
	if now := termOf(next); now <= was {
		t.Fatalf("the new leader %s's Status says term %d, the old leader %s's said %d", next, now, first, was)
	}
}
