package main

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	"github.com/idemdb/idem/idemcluster/clustertest"
	"github.com/idemdb/idem/idemhttp"
	"github.com/idemdb/idem/internal/proctest"
	"google.golang.org/grpc/status"
)

// TestFleet is the proof of the idem cluster with real OS processes on
// loopback: three `idem serve` nodes and two replicas of this example
// (each the idemhttp middleware over its own idemcluster.Client).
//
// 10,000 transfers with Idempotency-Keys come from 24 concurrent callers,
// each through a replica picked at random; a fifth of the replies are
// dropped (the caller throws the response away) and the request is
// retried through the other replica. Meanwhile the leader is killed with
// SIGKILL and restarted five times (a probe request sent right after each
// kill measures the failover gap), and once paused with SIGSTOP until the
// two others elected a leader and committed transfers without it: asked
// directly before it is continued (SIGCONT), it must not answer a read or
// hand out a claim from its stale state. Then replica a kills itself
// (SIGKILL) after a transfer's effect and before its Commit (crashhook.go):
// the key is in flight (409 through b) until a restarts with the same
// owner and settles it from its effects log; then both replicas answer
// the transfer's reply.
//
// At the end: every key's transfer is in the effects logs exactly once,
// and it is the reply the first caller got; every retry got the first
// response byte for byte; every acknowledged reply is stored in the
// cluster (read back with linearizable Lookups). Every answer but a 201
// (or the 409 expected while a's key is in doubt) fails the test.
//
// The failover gaps are logged (t.Logf), never asserted: the test bounds
// only its own time. It is here, with the example, rather than in
// idemcluster: it needs an application process with a visible side effect
// and its own in-doubt resolution, which is what this example is, and a
// library's tests should not build an example.
func TestFleet(t *testing.T) {
	idemBin, appBin := binaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), 170*time.Second)
	defer cancel()
	dir := t.TempDir()
	tc := startCluster(ctx, t, idemBin, dir)
	const crashKey = "crash-1"
	reps := []*replica{
		newReplica(t, appBin, dir, "replica-a", tc.addrs(), "CLUSTER_CRASH_AFTER_EFFECT="+crashKey),
		newReplica(t, appBin, dir, "replica-b", tc.addrs()),
	}
	for _, r := range reps {
		r.start(ctx)
	}

	const (
		total   = 10000
		callers = 24
	)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	via, drop := make([]int, total), make([]bool, total)
	for k := range total {
		via[k], drop[k] = rng.IntN(2), rng.IntN(5) == 0
	}
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2 * callers}}
	defer hc.CloseIdleConnections()

	var (
		mu       sync.Mutex
		first    = map[string]answer{} // every key's first 201
		failures []string
		failed   atomic.Int64
		retried  atomic.Int64
	)
	fail := func(format string, args ...any) {
		failed.Add(1)
		mu.Lock()
		if len(failures) < 20 {
			failures = append(failures, fmt.Sprintf(format, args...))
		}
		mu.Unlock()
	}
	body := func(k int) string {
		return fmt.Sprintf(`{"from":"acct-%d","to":"acct-%d","amount":%d}`, k%97, (k+1)%97, k%500+1)
	}
	// send sends key through r; anything but a 201 is a failure. The
	// replica waits for the cluster (a failover) itself.
	send := func(r *replica, key, body string) (answer, bool) {
		a, err := r.post(ctx, hc, key, body)
		if err != nil || a.code != http.StatusCreated {
			fail("%s via %s: %v %v", key, r.owner, a, err)
			return a, false
		}
		return a, true
	}
	// once is a first request, and its retry through the other replica
	// when its reply is dropped.
	once := func(key, body string, r, other *replica, dropped bool) {
		a, ok := send(r, key, body)
		if !ok {
			return
		}
		mu.Lock()
		first[key] = a
		mu.Unlock()
		if !dropped {
			return
		}
		retried.Add(1)
		b, ok := send(other, key, body)
		if ok && (!bytes.Equal(b.body, a.body) || b.header.Get("Idempotent-Replayed") != "true") {
			fail("%s retried via %s: %v (replayed %q), first answer via %s: %v", key, other.owner, b, b.header.Get("Idempotent-Replayed"), r.owner, a)
		}
	}

	// The feeder hands out the keys; at each event's key it waits until
	// the test goroutine takes the event up (the previous one is over), so
	// every event happens with requests in flight.
	events := []int{1000, 2500, 4000, 5500, 7000, 8500} // five SIGKILLs, then the SIGSTOP
	keys, reach := make(chan int), make(chan int)
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(keys)
		for k := range total {
			if i := slices.Index(events, k); i >= 0 {
				select {
				case reach <- i:
				case <-ctx.Done():
					return
				}
			}
			select {
			case keys <- k:
			case <-ctx.Done():
				return
			}
		}
	}()
	var callersWG sync.WaitGroup
	for range callers {
		callersWG.Add(1)
		go func() {
			defer callersWG.Done()
			for k := range keys {
				once(fmt.Sprintf("k%05d", k), body(k), reps[via[k]], reps[1-via[k]], drop[k])
			}
		}()
	}
	start := time.Now()
	var gaps []time.Duration
	for i := range events {
		select {
		case <-reach:
		case <-ctx.Done():
			t.Fatalf("event %d not reached: %v", i, ctx.Err())
		}
		if i < len(events)-1 {
			gaps = append(gaps, killLeader(ctx, t, tc, i, func(key string) { once(key, body(i), reps[i%2], reps[1-i%2], false) }))
		} else {
			pauseLeader(ctx, t, tc, func(key string) { once(key, body(i), reps[0], reps[1], true) })
		}
	}
	callersWG.Wait()
	elapsed := time.Since(start)
	if len(gaps) != len(events)-1 {
		t.Fatalf("%d leader SIGKILLs, want %d", len(gaps), len(events)-1)
	}
	if n := failed.Load(); n > 0 || ctx.Err() != nil {
		t.Fatalf("%d failures (%v), the first ones:\n%s", n, ctx.Err(), strings.Join(failures, "\n"))
	}
	t.Logf("%d transfers (%d replies dropped and retried through the other replica) in %v: %.0f/s, with %d leader kills and a pause",
		len(first), retried.Load(), elapsed.Round(time.Millisecond), float64(len(first)+int(retried.Load()))/elapsed.Seconds(), len(gaps))
	slices.Sort(gaps)
	t.Logf("failover gap after a leader's SIGKILL (a request sent at the kill, until its 201), over %d kills: p50 %v, p99 %v, all %v",
		len(gaps), gaps[len(gaps)/2].Round(time.Millisecond), gaps[len(gaps)-1].Round(time.Millisecond), gaps)

	// Replica a dies between a transfer's effect and its Commit.
	a, b := reps[0], reps[1]
	const crashBody = `{"from":"alice","to":"bob","amount":7}`
	if r, err := a.post(ctx, hc, crashKey, crashBody); err == nil {
		t.Fatalf("%s via a: answered %v, want the process to die after the effect", crashKey, r)
	}
	if st := a.p.WaitExit(ctx); st.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("replica a ended with %v, want SIGKILL", st)
	}
	if r, err := b.post(ctx, hc, crashKey, crashBody); err != nil || r.code != http.StatusConflict || !bytes.Contains(r.body, []byte(idemhttp.CodeProcessing)) {
		t.Fatalf("%s via b while a is down: %v %v, want 409 %s (a's claim is in doubt)", crashKey, r, err, idemhttp.CodeProcessing)
	}
	if c, rel := a.start(ctx); c != "1" || rel != "0" {
		t.Fatalf("replica a restarted settled %s committed, %s released; want 1, 0", c, rel)
	}
	var crashReply []byte
	for _, r := range []*replica{b, a} {
		ans, ok := send(r, crashKey, crashBody)
		if !ok {
			continue
		}
		if ans.header.Get("Idempotent-Replayed") != "true" || (crashReply != nil && !bytes.Equal(ans.body, crashReply)) {
			t.Fatalf("%s via %s after a's restart: %v %v", crashKey, r.owner, ans, ans.header)
		}
		crashReply = ans.body
		mu.Lock()
		first[crashKey] = ans
		mu.Unlock()
	}

	// Every key's effect exactly once, and it is what its caller got.
	effects := map[string][]transfer{}
	for _, r := range reps {
		for _, tr := range readEffects(t, r.effects) {
			effects[tr.Key] = append(effects[tr.Key], tr)
		}
	}
	for key, ans := range first {
		trs := effects[key]
		if len(trs) != 1 {
			fail("%s: %d transfers in the effects logs: %+v", key, len(trs), trs)
			continue
		}
		if want := reply(trs[0]).Body; !bytes.Equal(ans.body, want) {
			fail("%s: the caller got %q, the effect is %q", key, ans.body, want)
		}
	}
	for key, trs := range effects {
		if _, ok := first[key]; !ok {
			fail("%s: %d transfers in the effects logs, never acknowledged: %+v", key, len(trs), trs)
		}
	}
	// Nothing acknowledged lost: each reply is in the cluster, read back
	// with a linearizable Lookup.
	c, err := idemcluster.Dial(ctx, []string{tc.nodes[0].grpc, tc.nodes[1].grpc, tc.nodes[2].grpc}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	scope := idemhttp.ScopeFor("", "")
	lookups := make(chan string)
	var lwg sync.WaitGroup
	for range 16 {
		lwg.Add(1)
		go func() {
			defer lwg.Done()
			for key := range lookups {
				r, err := c.Lookup(ctx, idem.Request{Scope: scope, ID: []byte(key)})
				if err != nil || r.Status != idem.Done {
					fail("%s acknowledged, then the cluster has %v %v", key, r.Status, err)
					continue
				}
				s, err := idemhttp.DecodeStoredResponse(r.Reply)
				mu.Lock()
				want := first[key]
				mu.Unlock()
				if err != nil || s.Status != want.code || !bytes.Equal(s.Body, want.body) {
					fail("%s: the cluster stores %+v (%v), the caller got %v", key, s, err, want)
				}
			}
		}()
	}
	for key := range first {
		lookups <- key
	}
	close(lookups)
	lwg.Wait()
	if n := failed.Load(); n > 0 {
		t.Fatalf("%d failures, the first ones:\n%s", n, strings.Join(failures, "\n"))
	}
	if want := total + len(gaps) + pausedTransfers + 1; len(first) != want {
		t.Fatalf("%d keys acknowledged, want %d", len(first), want)
	}
}

// killLeader kills the leader with SIGKILL (paused first, so that the
// node killed is the one that leads: proctest.PauseLeader), checks that one
// of its followers is elected, sends a probe transfer at once and returns
// how long it took to be answered (the failover gap as a client sees it,
// from the kill; the leader was paused a few milliseconds before), then
// restarts the node and waits until it caught up.
func killLeader(ctx context.Context, t *testing.T, tc *testCluster, i int, probe func(key string)) time.Duration {
	t.Helper()
	p := proctest.PauseLeader(ctx, t, tc.members)
	lead := tc.node(p.Lead)
	// For the log: when a node first says it leads (polled every 10 ms),
	// to tell the election's share of the gap from the client's.
	elected := make(chan time.Duration, 1)
	pctx, stopPoll := context.WithCancel(ctx)
	t0 := time.Now()
	go func() {
		for pctx.Err() == nil {
			for _, n := range tc.nodes {
				if st, err := n.status(pctx); n != lead && err == nil && st.State == "Leader" {
					elected <- time.Since(t0)
					return
				}
			}
			time.Sleep(10 * time.Millisecond)
		}
		elected <- -1
	}()
	lead.p.Kill(syscall.SIGKILL)
	probe(fmt.Sprintf("probe-%d", i))
	gap := time.Since(t0)
	next := tc.node(p.NextLeader(ctx, t, tc.members))
	stopPoll()
	el := <-elected
	t1 := time.Now()
	lead.start(ctx)
	tc.caughtUp(ctx, lead)
	t.Logf("kill %d: leader %s of term %d paused (try %d) and killed; %s, its follower, says it leads after %v; a request sent at the kill answered after %v; %s restarted and caught up in %v",
		i+1, lead.id, p.Term, p.Tries, next.id, el.Round(time.Millisecond), gap.Round(time.Millisecond), lead.id, time.Since(t1).Round(time.Millisecond))
	return gap
}

// pausedTransfers are made while the old leader is paused.
const pausedTransfers = 16

// pauseLeader pauses the leader (SIGSTOP) until the two others have
// elected a leader and committed transfers without it, then asks it
// directly (no leader following) about those transfers, and for a fresh
// claim on one, before continuing it (SIGCONT): it must not answer from
// its stale state (say a transfer is absent, or hand out its key).
func pauseLeader(ctx context.Context, t *testing.T, tc *testCluster, transfer func(key string)) {
	t.Helper()
	// A connection of its own to each node, whose stats handler says when
	// each request has been handed to the connection (the requests are
	// queued to the paused process before it is continued); the one to the
	// node paused as leader is used.
	addrs := map[string]string{}
	for _, n := range tc.nodes {
		addrs[n.id] = n.grpc
	}
	probes := clustertest.Probes(ctx, t, addrs, pausedTransfers+1)
	p := proctest.PauseLeader(ctx, t, tc.members)
	lead := tc.node(p.Lead)
	cc, sent := probes[lead.id].Conn, probes[lead.id].Sent
	next := tc.node(p.NextLeader(ctx, t, tc.members)) // elected without it: it is paused longer than the election timeout
	var keys []string
	for j := range pausedTransfers {
		keys = append(keys, fmt.Sprintf("paused-%d", j))
		transfer(keys[j])
	}
	ic := clusterpb.NewIdemClient(cc)
	scope := idemhttp.ScopeFor("", "")
	// Each answer is "stale: ..." (a failure), or what the node said.
	answers := make(chan string, pausedTransfers)
	for j, key := range keys {
		go func() {
			actx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			var st clusterpb.Status
			var err error
			what := "Lookup"
			if j == 0 { // a claim on a transfer made while it slept
				what = "Begin"
				tok := make([]byte, 16)
				crand.Read(tok)
				var out *clusterpb.BeginResponse
				if out, err = ic.Begin(actx, &clusterpb.BeginRequest{Request: &clusterpb.Request{Scope: scope, Id: []byte(key)}, Owner: "stale-probe", Token: tok}); err == nil {
					st = out.Result.Status
				}
			} else {
				var out *clusterpb.LookupResponse
				if out, err = ic.Lookup(actx, &clusterpb.LookupRequest{Request: &clusterpb.Request{Scope: scope, Id: []byte(key)}}); err == nil {
					st = out.Result.Status
				}
			}
			switch {
			case err != nil:
				answers <- fmt.Sprintf("%s: %v", what, status.Code(err))
			case st != clusterpb.Status_STATUS_DONE:
				answers <- fmt.Sprintf("stale: %s %s answered %v", what, key, st)
			default:
				answers <- what + ": done"
			}
		}()
	}
	for range keys {
		select {
		case <-sent.C:
		case <-ctx.Done():
			t.Fatalf("the requests to the paused leader were not sent: %v", ctx.Err())
		}
	}
	lead.p.Signal(syscall.SIGCONT)
	said := map[string]int{}
	for range keys {
		a := <-answers
		if strings.HasPrefix(a, "stale: ") {
			t.Errorf("the deposed leader %s, continued, answered from its stale state: %s (committed through %s while it was paused)", lead.id, a, next.id)
			continue
		}
		said[a]++
	}
	tc.caughtUp(ctx, lead)
	t.Logf("pause: leader %s of term %d stopped (try %d); %s, its follower, elected, %d transfers made; asked before SIGCONT, %s answered %v; caught up", lead.id, p.Term, p.Tries, next.id, len(keys), lead.id, said)
}
