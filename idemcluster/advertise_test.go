package idemcluster

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemdb/idem/idemcluster/clusterpb"
)

// everyInterface is a loopback listener that reports the address of one
// bound to every interface ("[::]:port", what a --grpc-addr ":port"
// gives), so that a test sees what the node publishes without listening
// beyond loopback.
type everyInterface struct{ net.Listener }

func (l everyInterface) Addr() net.Addr {
	return &net.TCPAddr{IP: net.IPv6unspecified, Port: l.Listener.Addr().(*net.TCPAddr).Port}
}

// A node whose gRPC listener has no host (":7071" listens as
// "[::]:7071") published that address, which no other host can dial. It
// is refused at start, before raft bootstraps, unless AdvertiseAddr names
// the address to publish; then that one is what the members table, the
// join and Status carry.
func TestAdvertiseAddr(t *testing.T) {
	dir := t.TempDir()
	rl, gl := listen(t), listen(t)
	peers := map[string]string{"n1": rl.Addr().String()}
	_, err := StartNode(&NodeOptions{ID: "n1", Dir: filepath.Join(dir, "refused"), RaftListener: rl, GRPCListener: everyInterface{gl}, Peers: peers})
	if err == nil || !strings.Contains(err.Error(), "AdvertiseAddr") || !strings.Contains(err.Error(), "[::]:") {
		t.Fatalf("start on an unspecified gRPC address without AdvertiseAddr: %v, want a refusal naming AdvertiseAddr", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "refused", "raft")); !os.IsNotExist(err) {
		t.Fatalf("the refused node created its raft directory (%v): it must refuse before raft starts", err)
	}
	for _, bad := range []string{":7071", "0.0.0.0:7071", "[::]:7071", "host", "host:0", "host:http"} {
		if err := CheckAdvertisable(bad); err == nil {
			t.Errorf("CheckAdvertisable(%q) accepted it", bad)
		}
	}
	for _, good := range []string{"127.0.0.1:7071", "[::1]:7071", "idem-1.internal:7071"} {
		if err := CheckAdvertisable(good); err != nil {
			t.Errorf("CheckAdvertisable(%q): %v", good, err)
		}
	}

	// The refusal closed the gRPC listener; raft never took its own.
	rl.Close()
	rl, gl = listen(t), listen(t)
	peers["n1"] = rl.Addr().String()
	adv1 := gl.Addr().String() // the loopback address it really listens on
	n1, err := StartNode(&NodeOptions{ID: "n1", Dir: filepath.Join(dir, "n1"), RaftListener: rl, GRPCListener: everyInterface{gl},
		AdvertiseAddr: adv1, Peers: peers, HeartbeatTimeout: 200 * time.Millisecond, ElectionTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer n1.Close()
	if n1.Addr() != adv1 || !strings.HasPrefix(n1.ListenAddr(), "[::]:") {
		t.Fatalf("n1: Addr %q ListenAddr %q, want %q and the listener's", n1.Addr(), n1.ListenAddr(), adv1)
	}
	eventually(t, 30*time.Second, "n1 leads", n1.IsLeader)
	rl2, gl2 := listen(t), listen(t)
	adv2 := gl2.Addr().String()
	n2, err := StartNode(&NodeOptions{ID: "n2", Dir: filepath.Join(dir, "n2"), RaftListener: rl2, GRPCListener: everyInterface{gl2},
		AdvertiseAddr: adv2, Join: adv1, HeartbeatTimeout: 200 * time.Millisecond, ElectionTimeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer n2.Close()
	want := map[string]string{"n1": adv1, "n2": adv2}
	eventually(t, 30*time.Second, "both members tables have the advertised addresses", func() bool {
		for _, n := range []*Node{n1, n2} {
			for id, a := range want {
				if n.fsm.member(id) != a {
					return false
				}
			}
		}
		return true
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := rawCluster(t, adv2).Status(ctx, &clusterpb.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range st.Members {
		if m.GrpcAddr != want[m.NodeId] {
			t.Errorf("Status names %s at %q, want %q", m.NodeId, m.GrpcAddr, want[m.NodeId])
		}
	}
}

// An unspecified raft address is refused too: raft advertises the address
// its listener has, and others could not dial "[::]:7000".
func TestRaftAddrNeedsAHost(t *testing.T) {
	rl, gl := listen(t), listen(t)
	_, err := StartNode(&NodeOptions{ID: "n1", Dir: filepath.Join(t.TempDir(), "n1"), RaftListener: everyInterface{rl}, GRPCListener: gl,
		Peers: map[string]string{"n1": "127.0.0.1:1"}})
	if err == nil || !strings.Contains(err.Error(), "RaftAddr") {
		t.Fatalf("start on an unspecified raft address: %v, want a refusal naming RaftAddr", err)
	}
}
