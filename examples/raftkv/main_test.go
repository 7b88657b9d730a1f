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

// TestCluster starts three raftkv nodes in this process (TCP transport and
// HTTP on 127.0.0.1) and drives the HTTP API as the README does: a
// follower redirects to the leader, a retry with the same Idempotency-Key
// is a replay, the key with another body is a conflict, a bad key is
// refused, and every node ends with the value.
func TestCluster(t *testing.T) {
	var peers []peer
	var webs []net.Listener
	for i := 1; i <= 3; i++ {
		rl, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		raftAddr := rl.Addr().String()
		rl.Close() // the TCP transport binds it again just below
		wl, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		webs = append(webs, wl)
		peers = append(peers, peer{raft.ServerID(fmt.Sprintf("n%d", i)), raftAddr, wl.Addr().String()})
	}
	base := t.TempDir()
	var nodes []*node
	for i, p := range peers {
		n, err := start(p.id, filepath.Join(base, string(p.id)), peers)
		if err != nil {
			t.Fatal(err)
		}
		nodes = append(nodes, n)
		srv := &http.Server{Handler: n.routes()}
		go srv.Serve(webs[i])
		t.Cleanup(func() { srv.Close(); n.stop() })
	}
	deadline := time.Now().Add(20 * time.Second)
	var follower *node
	for follower == nil {
		if time.Now().After(deadline) {
			t.Fatal("no leader")
		}
		for _, n := range nodes {
			if _, id := n.r.LeaderWithID(); id != "" && id != n.self.id {
				follower = n
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	hc := &http.Client{Timeout: 10 * time.Second}
	post := func(key, add string) (int, map[string]any) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, "http://"+follower.self.http+"/kv/apples?add="+add, nil)
		req.Header.Set("Idempotency-Key", key)
		for {
			res, err := hc.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			var body map[string]any
			if res.StatusCode == http.StatusOK {
				json.NewDecoder(res.Body).Decode(&body)
			}
			res.Body.Close()
			if res.StatusCode == http.StatusServiceUnavailable && time.Now().Before(deadline) {
				time.Sleep(100 * time.Millisecond) // no leader yet: retry with the same key
				continue
			}
			return res.StatusCode, body
		}
	}
	if code, b := post("order-1", "5"); code != 200 || b["value"] != 5.0 || b["duplicate"] != false {
		t.Fatalf("first: %d %v", code, b)
	}
	if code, b := post("order-1", "5"); code != 200 || b["value"] != 5.0 || b["duplicate"] != true {
		t.Fatalf("retry: %d %v", code, b)
	}
	if code, _ := post("order-1", "7"); code != http.StatusConflict {
		t.Fatalf("same key, other body: %d", code)
	}
	if code, _ := post("bad key!", "7"); code != http.StatusBadRequest {
		t.Fatalf("bad key: %d", code)
	}
	if code, b := post("order-2", "7"); code != 200 || b["value"] != 12.0 {
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
	if _, err := parsePeers("n1=a"); err == nil || !strings.Contains(err.Error(), "id=raftaddr=httpaddr") {
		t.Fatalf("parsePeers: %v", err)
	}
}
