package idemcluster

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/idemdb/idem"
)

// The per-key specification checked by porcupine: a key is absent,
// claimed (by one Begin, named by its token, until its lease ends, in log
// time) or committed (with its reply, for good). A Begin claims an absent
// key, or takes a claimed one over once the lease ran out; a Commit or an
// Abort by the claim's holder commits it or makes it absent again, and is
// ErrLeaseLost for anyone else; a Lookup reads it.
const (
	keyAbsent byte = iota
	keyClaimed
	keyDone
)

const (
	opBegin byte = iota + 1
	opCommit
	opAbort
	opLookup
)

// keyState is the model's state of one key. lease is the claim's
// LeaseUntil (Unix ns), 0 when unknown (the Begin's answer was lost).
type keyState struct {
	st    byte
	tok   string
	lease int64
	reply string
}

type keyInput struct {
	op    byte
	key   string
	tok   string // Begin: the new claim's name; Commit, Abort: the claim's
	reply string // Commit
}

// keyOutput is what the call returned. unknown: the outcome is unknown
// (ErrInDoubt, ctx ended), so the operation may or may not have happened.
type keyOutput struct {
	unknown   bool
	status    idem.Status
	lease     int64
	reply     string
	leaseLost bool
}

// keyModel is the specification for a cluster whose lease is lease.
func keyModel(lease time.Duration) porcupine.Model {
	nm := porcupine.NondeterministicModel{
		Partition: func(h []porcupine.Operation) [][]porcupine.Operation {
			by := map[string][]porcupine.Operation{}
			for _, op := range h {
				k := op.Input.(keyInput).key
				by[k] = append(by[k], op)
			}
			keys := make([]string, 0, len(by))
			for k := range by {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			out := make([][]porcupine.Operation, 0, len(keys))
			for _, k := range keys {
				out = append(out, by[k])
			}
			return out
		},
		Init: func() []any { return []any{keyState{}} },
		Step: func(state, input, output any) []any {
			return keyStep(lease, state.(keyState), input.(keyInput), output.(keyOutput))
		},
		DescribeOperation: func(input, output any) string {
			in, out := input.(keyInput), output.(keyOutput)
			call := map[byte]string{opBegin: "Begin", opCommit: "Commit", opAbort: "Abort", opLookup: "Lookup"}[in.op] + "(" + in.tok
			if in.op == opCommit {
				call += "," + in.reply
			}
			call += ")"
			switch {
			case out.unknown:
				return call + " -> unknown"
			case out.leaseLost:
				return call + " -> ErrLeaseLost"
			case in.op == opCommit || in.op == opAbort:
				return call + " -> ok"
			}
			return fmt.Sprintf("%s -> %v lease=%d reply=%q", call, out.status, out.lease, out.reply)
		},
		DescribeState: func(state any) string {
			s := state.(keyState)
			return fmt.Sprintf("%v", s)
		},
	}
	return nm.ToModel()
}

func keyStep(lease time.Duration, s keyState, in keyInput, out keyOutput) []any {
	same := []any{s}
	none := []any{}
	held := s.st == keyClaimed && s.tok == in.tok
	switch in.op {
	case opBegin:
		// A claim may be taken over once its lease ran out: the new claim
		// starts (its LeaseUntil - lease) at or after the old LeaseUntil.
		canClaim := func(newLease int64) bool {
			return s.st == keyAbsent || (s.st == keyClaimed && (s.lease == 0 || newLease == 0 || newLease-int64(lease) >= s.lease))
		}
		switch {
		case out.unknown:
			if canClaim(0) {
				return []any{s, keyState{st: keyClaimed, tok: in.tok}}
			}
			return same
		case out.status == idem.Fresh && canClaim(out.lease):
			return []any{keyState{st: keyClaimed, tok: in.tok, lease: out.lease}}
		case out.status == idem.InFlight:
			return inFlight(s, out.lease)
		case out.status == idem.Done && s.st == keyDone && s.reply == out.reply:
			return same
		}
		return none
	case opCommit, opAbort:
		next := keyState{st: keyDone, reply: in.reply}
		if in.op == opAbort {
			next = keyState{}
		}
		switch {
		case out.unknown && held:
			return []any{s, next}
		case out.unknown, out.leaseLost && !held:
			return same
		case !out.leaseLost && held:
			return []any{next}
		}
		return none
	case opLookup:
		switch {
		case out.status == idem.Absent && s.st == keyAbsent:
			return same
		case out.status == idem.InFlight:
			return inFlight(s, out.lease)
		case out.status == idem.Done && s.st == keyDone && s.reply == out.reply:
			return same
		}
		return none
	}
	return none
}

// inFlight: an InFlight answer names the claim by its lease; a claim
// whose lease was unknown (its Begin's answer was lost) learns it.
func inFlight(s keyState, lease int64) []any {
	switch {
	case s.st == keyClaimed && s.lease == lease:
		return []any{s}
	case s.st == keyClaimed && s.lease == 0:
		s.lease = lease
		return []any{s}
	}
	return []any{}
}

// history records the operations of concurrent clients.
type history struct {
	start time.Time
	mu    sync.Mutex
	ops   []porcupine.Operation
}

func (h *history) now() int64 { return time.Since(h.start).Nanoseconds() }

// add records an operation; an unknown outcome stays pending to the end
// (its return is after every other event).
func (h *history) add(client int, in keyInput, call int64, out keyOutput) {
	ret := h.now()
	if out.unknown {
		ret = math.MaxInt64
	}
	h.mu.Lock()
	h.ops = append(h.ops, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
	h.mu.Unlock()
}

func beginOutput(r idem.Result, err error) keyOutput {
	if err != nil {
		return keyOutput{unknown: true}
	}
	return keyOutput{status: r.Status, lease: leaseNanos(r.LeaseUntil), reply: string(r.Reply)}
}

func leaseNanos(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func finishOutput(err error) keyOutput {
	switch {
	case err == nil:
		return keyOutput{}
	case errors.Is(err, idem.ErrLeaseLost):
		return keyOutput{leaseLost: true}
	}
	return keyOutput{unknown: true}
}

// chaosLoad is the porcupine test's clients: writers that claim keys
// (then commit, abort, or walk away and leave the claim to be taken over
// after its lease) and read them, and readers that only read.
type chaosLoad struct {
	h        *history
	keys     atomic.Int64 // moves the window of hot keys
	takeover atomic.Int64 // Fresh claims of a key whose claim was left open
	tokens   atomic.Int64
	mu       sync.Mutex
	revisit  []revisit // keys whose claim was left open, to claim again later
	lease    time.Duration
}

type revisit struct {
	key string
	at  time.Time
}

const pScope = "p"

func (l *chaosLoad) hotKey(rng *rand.Rand) string {
	return fmt.Sprintf("h%d", l.keys.Add(1)/16+rng.Int64N(4))
}

// dueKey returns a key left claimed more than 1.25 leases ago (by
// the test's clock, which is the log's on this machine), if any.
func (l *chaosLoad) dueKey() (string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.revisit) == 0 || time.Since(l.revisit[0].at) < l.lease*5/4 {
		return "", false
	}
	k := l.revisit[0].key
	l.revisit = l.revisit[1:]
	return k, true
}

func (l *chaosLoad) leave(key string) {
	l.mu.Lock()
	l.revisit = append(l.revisit, revisit{key: key, at: time.Now()})
	l.mu.Unlock()
}

// opCtx bounds one call. It is a quarter of the lease: a Begin retried
// inside its call then finds its own claim still leased and gets it back,
// so one call claims once (a retry after the lease ran out could take the
// key over again, a second effect of one call).
func opCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), time.Second)
}

func (l *chaosLoad) lookup(ci int, c *Client, key string) {
	ctx, cancel := opCtx()
	defer cancel()
	call := l.h.now()
	r, err := c.Lookup(ctx, idem.Request{Scope: pScope, ID: []byte(key)})
	if err != nil {
		return // a read that failed changed nothing: leave it out
	}
	l.h.add(ci, keyInput{op: opLookup, key: key}, call, keyOutput{status: r.Status, lease: leaseNanos(r.LeaseUntil), reply: string(r.Reply)})
}

func (l *chaosLoad) write(ci int, c *Client, rng *rand.Rand) {
	key, revisited := l.dueKey()
	if !revisited {
		key = l.hotKey(rng)
	}
	tok := fmt.Sprintf("c%d.%d", ci, l.tokens.Add(1))
	ctx, cancel := opCtx()
	call := l.h.now()
	r, err := c.Begin(ctx, idem.Request{Scope: pScope, ID: []byte(key)})
	cancel()
	out := beginOutput(r, err)
	l.h.add(ci, keyInput{op: opBegin, key: key, tok: tok}, call, out)
	if out.unknown {
		l.leave(key) // its claim may exist: taken over later
		return
	}
	if r.Status != idem.Fresh {
		return
	}
	if revisited {
		l.takeover.Add(1)
	}
	in := keyInput{key: key, tok: tok}
	ctx, cancel = opCtx()
	defer cancel()
	switch p := rng.IntN(100); {
	case p < 45:
		in.op, in.reply = opCommit, tok
		call = l.h.now()
		l.h.add(ci, in, call, finishOutput(r.Claim.Commit(ctx, []byte(tok))))
	case p < 85:
		in.op = opAbort
		call = l.h.now()
		l.h.add(ci, in, call, finishOutput(r.Claim.Abort(ctx)))
	default:
		l.leave(key) // walk away: the claim stays until its lease ends
	}
}

// TestClusterLinearizableUnderPartitions: 4 writers and 3 readers work on
// a small moving set of keys through idemcluster.Client while the leader
// and a follower are cut off in turn and healed (new leaders each time),
// with a lease of 4 s of log time so that claims left open are taken
// over; porcupine must find each key's history linearizable against the
// specification above, with calls whose outcome is unknown left pending.
func TestClusterLinearizableUnderPartitions(t *testing.T) {
	const lease = 4 * time.Second
	cc := newChaosCluster(t, 3, func(o *NodeOptions) { o.Engine.Lease = lease })
	l := &chaosLoad{h: &history{start: time.Now()}, lease: lease}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	const writers, readers = 4, 3
	dctx, dcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer dcancel()
	for ci := range writers + readers {
		c, err := Dial(dctx, cc.addrs, &Options{Owner: fmt.Sprintf("p%d", ci), AttemptTimeout: 500 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		if ci >= writers {
			// Reader i asks node i first: whichever node is cut off, a
			// reader asks it, and must be sent on to the leader.
			c.setLeader(cc.addrs[ci-writers])
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(ci), 99))
			for {
				select {
				case <-stop:
					return
				default:
				}
				if ci >= writers || rng.IntN(4) == 0 {
					l.lookup(ci, c, l.hotKey(rng))
				} else {
					l.write(ci, c, rng)
				}
			}
		}()
	}
	halt := sync.OnceFunc(func() { close(stop); wg.Wait() })
	t.Cleanup(halt)
	ops := func() int {
		l.h.mu.Lock()
		defer l.h.mu.Unlock()
		return len(l.h.ops)
	}
	progress := func(n int, during string) {
		t.Helper()
		want := ops() + n
		eventually(t, 30*time.Second, fmt.Sprintf("%d operations %s", n, during), func() bool { return ops() >= want })
	}
	progress(50, "before the partitions")
	for round := range 4 {
		victim := cc.leader(30 * time.Second)
		if round%2 == 1 {
			victim = cc.others(victim)[0]
		}
		cc.isolate(victim)
		cc.leaderAmong(cc.others(victim), 30*time.Second)
		progress(60, fmt.Sprintf("with %s cut off", victim))
		cc.heal()
		progress(30, "healed")
	}
	eventually(t, 30*time.Second, "3 claims taken over after their lease", func() bool { return l.takeover.Load() >= 3 })
	halt()
	l.h.mu.Lock()
	hist := l.h.ops
	l.h.mu.Unlock()
	model := keyModel(lease)
	if res := porcupine.CheckOperationsTimeout(model, hist, 60*time.Second); res != porcupine.Ok {
		t.Fatalf("porcupine: %v\n%s", res, explain(model, hist))
	}
	pending := 0
	for _, op := range hist {
		if op.Output.(keyOutput).unknown {
			pending++
		}
	}
	t.Logf("%d operations (%d with an unknown outcome), %d takeovers after a lease: linearizable", len(hist), pending, l.takeover.Load())
	var leaseReads uint64
	for _, nd := range cc.nodes {
		leaseReads += nd.lease.served.Load()
	}
	t.Logf("%d reads answered on a leader lease (the nodes running at the end)", leaseReads)
}

// explain prints the operations of the first key porcupine could not
// linearize, in call order, up to the first one after which the key's
// history is not linearizable (the last ten of them).
func explain(model porcupine.Model, hist []porcupine.Operation) string {
	for _, part := range model.Partition(hist) {
		if porcupine.CheckOperationsTimeout(model, part, 10*time.Second) != porcupine.Illegal {
			continue
		}
		sort.Slice(part, func(i, j int) bool { return part[i].Call < part[j].Call })
		end := len(part)
		for i := 1; i < len(part); i++ {
			if porcupine.CheckOperationsTimeout(model, part[:i], 10*time.Second) == porcupine.Illegal {
				end = i
				break
			}
		}
		var b strings.Builder
		fmt.Fprintf(&b, "key %s (%d operations; up to the first one that cannot be linearized):\n", part[0].Input.(keyInput).key, len(part))
		for _, op := range part[max(0, end-10):end] {
			ret := fmt.Sprint(op.Return / 1e6)
			if op.Return == math.MaxInt64 {
				ret = "never"
			}
			fmt.Fprintf(&b, "  [%d ms, %s ms] client %d: %s\n", op.Call/1e6, ret, op.ClientId, model.DescribeOperation(op.Input, op.Output))
		}
		return b.String()
	}
	return "(no single key fails alone)"
}

// TestKeyModel pins the specification on small histories: what it must
// accept and what it must reject.
func TestKeyModel(t *testing.T) {
	const lease = 10
	type o = porcupine.Operation
	op := func(call, ret int64, in keyInput, out keyOutput) o {
		return o{Input: in, Call: call, Output: out, Return: ret}
	}
	begin := func(tok string) keyInput { return keyInput{op: opBegin, key: "k", tok: tok} }
	commit := func(tok string) keyInput { return keyInput{op: opCommit, key: "k", tok: tok, reply: tok} }
	abort := func(tok string) keyInput { return keyInput{op: opAbort, key: "k", tok: tok} }
	lookup := keyInput{op: opLookup, key: "k"}
	fresh := func(l int64) keyOutput { return keyOutput{status: idem.Fresh, lease: l} }
	inflight := func(l int64) keyOutput { return keyOutput{status: idem.InFlight, lease: l} }
	done := func(r string) keyOutput { return keyOutput{status: idem.Done, reply: r} }
	ok, lost, unknown := keyOutput{}, keyOutput{leaseLost: true}, keyOutput{unknown: true}
	never := int64(math.MaxInt64)
	for _, tc := range []struct {
		name string
		h    []o
		want bool
	}{
		{"claim, commit, read", []o{op(0, 1, begin("a"), fresh(100)), op(2, 3, commit("a"), ok), op(4, 5, lookup, done("a")), op(6, 7, begin("b"), done("a"))}, true},
		{"a second Fresh within the lease", []o{op(0, 1, begin("a"), fresh(100)), op(2, 3, begin("b"), fresh(105))}, false},
		{"a takeover after the lease", []o{op(0, 1, begin("a"), fresh(100)), op(2, 3, begin("b"), fresh(110)), op(4, 5, commit("a"), lost), op(6, 7, commit("b"), ok)}, true},
		{"the holder's commit lost", []o{op(0, 1, begin("a"), fresh(100)), op(2, 3, commit("a"), lost)}, false},
		{"abort, then claimed again", []o{op(0, 1, begin("a"), fresh(100)), op(2, 3, abort("a"), ok), op(4, 5, lookup, keyOutput{status: idem.Absent}), op(6, 7, begin("b"), fresh(101))}, true},
		{"absent after a commit returned", []o{op(0, 1, begin("a"), fresh(100)), op(2, 3, commit("a"), ok), op(4, 5, lookup, keyOutput{status: idem.Absent})}, false},
		{"InFlight names another lease", []o{op(0, 1, begin("a"), fresh(100)), op(2, 3, lookup, inflight(99))}, false},
		{"an unknown Begin's claim, seen and taken over", []o{op(0, never, begin("a"), unknown), op(2, 3, lookup, inflight(50)), op(4, 5, begin("b"), fresh(60))}, true},
		{"an unknown Begin's claim taken over too early", []o{op(0, never, begin("a"), unknown), op(2, 3, lookup, inflight(50)), op(4, 5, begin("b"), fresh(59))}, false},
		{"an unknown commit may have happened", []o{op(0, 1, begin("a"), fresh(100)), op(2, never, commit("a"), unknown), op(4, 5, lookup, done("a"))}, true},
		{"or not", []o{op(0, 1, begin("a"), fresh(100)), op(2, never, commit("a"), unknown), op(4, 5, lookup, inflight(100))}, true},
		{"but not twice", []o{op(0, 1, begin("a"), fresh(100)), op(2, never, commit("a"), unknown), op(4, 5, lookup, done("a")), op(6, 7, lookup, inflight(100))}, false},
	} {
		if got := porcupine.CheckOperations(keyModel(lease), tc.h); got != tc.want {
			t.Errorf("%s: linearizable %v, want %v", tc.name, got, tc.want)
		}
	}
}
