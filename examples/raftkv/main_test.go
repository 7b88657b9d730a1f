package main

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
)

// testNode is a raftkv node of TestCluster and its HTTP server.
type testNode struct {
	*node
	srv *http.Server
}

// kill stops the node as kill -9 would for its peers: its HTTP server and
// raft stop answering at once, without a word to anyone.
func (n *testNode) kill() {
	n.srv.Close()
	n.stop()
}

// TestCluster starts three raftkv nodes in this process (TCP transport and
// HTTP on 127.0.0.1) and drives the HTTP API as the README does: a
// follower forwards to the leader, a retry with the same Idempotency-Key
// is a replay (counted in /status), the key with another body is a
// conflict, a bad key is refused, and every node ends with the value.
// Then the leader is killed: a follower answers 503 with Retry-After
// (never a redirect to the dead leader) until a new leader answers the
// retry of the last order as a replay.
//
// Every port is bound by the test before the nodes start and handed to
// them: none is closed and bound again (another process could take it
// meanwhile).
func TestCluster(t *testing.T) {
	var peers []peer
	var rafts, webs []net.Listener
	for i := 1; i <= 3; i++ {
		rl, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		rafts = append(rafts, rl)
		wl, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		webs = append(webs, wl)
		peers = append(peers, peer{raft.ServerID(fmt.Sprintf("n%d", i)), rl.Addr().String(), wl.Addr().String()})
	}
	base := t.TempDir()
	var nodes []*testNode
	for i, p := range peers {
		n, err := start(p.id, filepath.Join(base, string(p.id)), peers, rafts[i])
		if err != nil {
			t.Fatal(err)
		}
		tn := &testNode{node: n, srv: &http.Server{Handler: n.routes()}}
		nodes = append(nodes, tn)
		go tn.srv.Serve(webs[i])
		t.Cleanup(tn.kill)
	}
	deadline := time.Now().Add(30 * time.Second)
	follower := func() *testNode {
		t.Helper()
		for {
			if time.Now().After(deadline) {
				t.Fatal("no leader")
			}
			for _, n := range nodes {
				if _, id := n.r.LeaderWithID(); id != "" && id != n.self.id {
					return n
				}
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	// Redirects are not followed: a follower must answer itself.
	hc := &http.Client{Timeout: 10 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	get := func(n *testNode, path string) map[string]any {
		t.Helper()
		res, err := hc.Get("http://" + n.self.http + path)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Body.Close()
		var body map[string]any
		if err := json.NewDecoder(res.Body).Decode(&body); err != nil {
			t.Fatal(err)
		}
		return body
	}
	// post sends the order to n until it is answered; 503 (no live leader)
	// must come with Retry-After.
	post := func(n *testNode, key, add string) (int, map[string]any) {
		t.Helper()
		for {
			req, _ := http.NewRequest(http.MethodPost, "http://"+n.self.http+"/kv/apples?add="+add, nil)
			req.Header.Set("Idempotency-Key", key)
			res, err := hc.Do(req)
			if err != nil {
				t.Fatalf("%s asked about %s: %v", n.self.id, key, err)
			}
			var body map[string]any
			if res.StatusCode == http.StatusOK {
				json.NewDecoder(res.Body).Decode(&body)
			}
			res.Body.Close()
			switch res.StatusCode {
			case http.StatusServiceUnavailable:
				if res.Header.Get("Retry-After") == "" {
					t.Fatalf("%s: 503 without Retry-After", n.self.id)
				}
				if time.Now().After(deadline) {
					t.Fatalf("%s: still 503 for %s", n.self.id, key)
				}
				time.Sleep(100 * time.Millisecond) // no live leader: retry with the same key
				continue
			case http.StatusTemporaryRedirect, http.StatusPermanentRedirect, http.StatusFound:
				t.Fatalf("%s answered %s with %s to %s: a follower forwards to a live leader or answers 503", n.self.id, key, res.Status, res.Header.Get("Location"))
			}
			return res.StatusCode, body
		}
	}
	f := follower()
	if code, b := post(f, "order-1", "5"); code != 200 || b["value"] != 5.0 || b["duplicate"] != false {
		t.Fatalf("first: %d %v", code, b)
	}
	code, b := post(f, "order-1", "5")
	if code != 200 || b["value"] != 5.0 || b["duplicate"] != true {
		t.Fatalf("retry: %d %v", code, b)
	}
	// The replay was answered by the leader from its set: /status counts it.
	for _, n := range nodes {
		if n.self.id == raft.ServerID(b["node"].(string)) {
			if st := get(n, "/status"); st["duplicates"] != 1.0 {
				t.Fatalf("%s answered a replay, /status says %v", n.self.id, st)
			}
		}
	}
	if code, _ := post(f, "order-1", "7"); code != http.StatusConflict {
		t.Fatalf("same key, other body: %d", code)
	}
	if code, _ := post(f, "bad key!", "7"); code != http.StatusBadRequest {
		t.Fatalf("bad key: %d", code)
	}
	if code, b := post(f, "order-2", "7"); code != 200 || b["value"] != 12.0 || b["duplicate"] != false {
		t.Fatalf("second order: %d %v", code, b)
	}
	for _, n := range nodes {
		for n.app.get("apples") != 12 {
			if time.Now().After(deadline) {
				t.Fatalf("%s has %d", n.self.id, n.app.get("apples"))
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// Kill the leader; at once ask a follower again about order-2 (its
	// answer was lost, say): 503 with Retry-After while there is no live
	// leader, then the replay from the new leader.
	// The leader is the node that says it leads, in the term every node is
	// in, every node naming it (f's own view may be stale, or empty during
	// an election on a loaded machine); it still says so just before the
	// kill.
	leader, term := steadyLeader(nodes)
	for leader == nil || leader.r.State() != raft.Leader || leader.r.CurrentTerm() != term {
		if time.Now().After(deadline) {
			t.Fatal("the nodes agree on no leader")
		}
		time.Sleep(20 * time.Millisecond) // polling raft's state
		leader, term = steadyLeader(nodes)
	}
	lid := leader.self.id
	leader.kill()
	for _, n := range nodes {
		if n != leader {
			f = n // it still names the dead leader (until its heartbeat timeout)
		}
	}
	code, b = post(f, "order-2", "7")
	if code != 200 || b["value"] != 12.0 || b["duplicate"] != true || b["node"] == string(lid) {
		t.Fatalf("order-2 after the leader's kill: %d %v", code, b)
	}
	// The replay came from a leader elected after the kill: a later term.
	for _, n := range nodes {
		if string(n.self.id) == b["node"] {
			if nt := n.r.CurrentTerm(); nt <= term {
				t.Fatalf("%s answered the replay in term %d, the killed leader %s led in term %d", n.self.id, nt, lid, term)
			}
			t.Logf("leader %s (term %d) killed; %s answered the replay in term %d", lid, term, n.self.id, n.r.CurrentTerm())
		}
	}
	if _, err := parsePeers("n1=a"); err == nil || !strings.Contains(err.Error(), "id=raftaddr=httpaddr") {
		t.Fatalf("parsePeers: %v", err)
	}
}

// steadyLeader is the node that says it leads when every node is in its
// term and names it, and that term; nil when not so (an election).
func steadyLeader(nodes []*testNode) (*testNode, uint64) {
	var leader *testNode
	term := nodes[0].r.CurrentTerm()
	for _, n := range nodes {
		_, id := n.r.LeaderWithID()
		if n.r.CurrentTerm() != term || id == "" || id != nodes[0].leaderID() {
			return nil, 0
		}
		if n.r.State() == raft.Leader && id == n.self.id {
			leader = n
		}
	}
	return leader, term
}

func (n *testNode) leaderID() raft.ServerID {
	_, id := n.r.LeaderWithID()
	return id
}
