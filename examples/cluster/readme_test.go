package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/idemdb/idem/internal/proctest"
)

// TestREADME runs the README's session with the commands it gives: three
// `idem serve` nodes, two replicas; a transfer through one replica and its
// retry through the other (the same bytes, Idempotent-Replayed); the key
// with another body (409); the leader killed with SIGKILL, the retry
// answered by the new leader with the same bytes, a new transfer made; the
// killed node restarted. Each transfer is in one effects log, once.
func TestREADME(t *testing.T) {
	idemBin, appBin := binaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	dir := t.TempDir()
	tc := startCluster(ctx, t, idemBin, dir)
	a := newReplica(t, appBin, dir, "replica-a", tc.addrs())
	b := newReplica(t, appBin, dir, "replica-b", tc.addrs())
	for _, r := range []*replica{a, b} {
		if c, rel := r.start(ctx); c != "0" || rel != "0" {
			t.Fatalf("%s settled %s/%s keys at its first start", r.owner, c, rel)
		}
	}
	hc := &http.Client{}
	const body = `{"from":"alice","to":"bob","amount":25}`
	first := mustPost(ctx, t, hc, a, "t-1001", body)
	again := mustPost(ctx, t, hc, b, "t-1001", body)
	if first.code != http.StatusCreated || !bytes.Equal(first.body, again.body) || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("t-1001 via a: %v; via b: %v %v", first, again, again.header)
	}
	if c := mustPost(ctx, t, hc, b, "t-1001", `{"from":"alice","to":"bob","amount":99}`); c.code != http.StatusConflict || !bytes.Contains(c.body, []byte("IDEMPOTENCY_KEY_CONFLICT")) {
		t.Fatalf("t-1001 with another body: %v", c)
	}
	if c := mustPost(ctx, t, hc, a, "", body); c.code != http.StatusBadRequest {
		t.Fatalf("a transfer without a key: %v", c)
	}

	// Who leads, as the README asks it: GET /cluster. An answer given
	// during an election (raft's timeouts on a loaded machine) names no
	// leader, or a 503 if the node asked did not answer in time: ask
	// again, as a reader of the README would.
	var lead *node
	for lead == nil {
		resp, err := hc.Get(a.url + "/cluster")
		if err != nil {
			t.Fatal(err)
		}
		var st struct {
			Leader  string
			Members []string
		}
		err = json.NewDecoder(resp.Body).Decode(&st)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK && (err != nil || len(st.Members) != 3) {
			t.Fatalf("GET /cluster: %+v %v", st, err)
		}
		for _, n := range tc.nodes {
			if n.id == st.Leader {
				lead = n
			}
		}
		if lead == nil && st.Leader != "" {
			t.Fatalf("GET /cluster names %q as leader, no node of the cluster: %+v", st.Leader, st)
		}
		if lead == nil {
			select {
			case <-ctx.Done():
				t.Fatalf("GET /cluster named no node as leader until the test's deadline (last: %d %+v): %v", resp.StatusCode, st, ctx.Err())
			case <-time.After(50 * time.Millisecond): // polling the replica's view
			}
		}
	}
	// The node named may have lost the leadership since (an election on a
	// loaded machine): the one killed is the leader, paused first
	// (proctest.PauseLeader).
	p := proctest.PauseLeader(ctx, t, tc.members)
	if p.Lead.Name() != lead.id {
		t.Logf("GET /cluster named %s; %s leads now", lead.id, p.Lead.Name())
		lead = tc.node(p.Lead)
	}
	lead.p.Kill(syscall.SIGKILL)
	// The answer to t-1001 was lost, say: retried through b, it is
	// answered (by the new leader) with the same bytes; a new transfer
	// goes through a.
	if r := mustPost(ctx, t, hc, b, "t-1001", body); !bytes.Equal(r.body, first.body) {
		t.Fatalf("t-1001 after the leader's kill: %v, first %v", r, first)
	}
	next := p.NextLeader(ctx, t, tc.members)
	t.Logf("leader %s killed; %s, its follower, elected", lead.id, next.Name())
	second := mustPost(ctx, t, hc, a, "t-1002", `{"from":"bob","to":"carol","amount":5}`)
	if second.code != http.StatusCreated || second.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("t-1002: %v", second)
	}
	lead.start(ctx)
	tc.caughtUp(ctx, lead)

	// GET /transfers lists a replica's transfers: both are a's, none b's.
	resp, err := hc.Get(a.url + "/transfers")
	if err != nil {
		t.Fatal(err)
	}
	list, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	want := "[" + string(bytes.TrimSpace(first.body)) + "," + string(bytes.TrimSpace(second.body)) + "]\n"
	if string(list) != want {
		t.Fatalf("GET /transfers of a: %s, want %s", list, want)
	}
	if got := readEffects(t, b.effects); len(got) != 0 {
		t.Fatalf("b made transfers: %+v", got)
	}
}

func mustPost(ctx context.Context, t *testing.T, hc *http.Client, r *replica, key, body string) answer {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, r.url+"/transfers", bytes.NewReader([]byte(body)))
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("POST %s to %s: %v", key, r.owner, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, b}
}
