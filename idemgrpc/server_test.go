package idemgrpc_test

import (
	"context"
	"github.com/idemdb/idem/internal/testclock"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/examples/ledger/ledgerpb"
	"github.com/idemdb/idem/examples/ledger/ledgersvc"
	"github.com/idemdb/idem/idemgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// TestValidationRules: the per-client sequence validation table, row by
// row, against a real server.
func TestValidationRules(t *testing.T) {
	env := startLedger(t, ledgersvc.Options{KeepReplies: 1}) // the latest reply only: older numbers are ALREADY_COMMITTED
	ctx := testCtx(t)
	c := ledgerpb.NewLedgerClient(dial(t, env.addr))
	alice := as(ctx, "tok-alice")

	// seq == last+1: runs.
	first, err := c.Write(alice, write("c1", "ns", "", 1, "acct", 10))
	if err != nil {
		t.Fatal(err)
	}
	if first.GetSequence() != 1 || first.GetActor() != "user:alice" || first.GetTxId() == "" {
		t.Fatalf("first write: %v", first)
	}
	second, err := c.Write(alice, write("c1", "ns", "", 2, "acct", 5))
	if err != nil {
		t.Fatal(err)
	}
	if got := env.server().Ledger.ApplyCount(); got != 2 {
		t.Fatalf("applies = %d, want 2", got)
	}

	// seq == last, response kept: the cached WriteSuccess, same type and
	// bytes, marked as a replay, nothing runs.
	var hdr metadata.MD
	again, err := c.Write(alice, write("c1", "ns", "", 2, "acct", 5), grpc.Header(&hdr))
	if err != nil {
		t.Fatal(err)
	}
	sameReply(t, second, again)
	if hdr.Get(idemgrpc.ReplayHeader) == nil {
		t.Fatalf("replay header missing: %v", hdr)
	}
	if got := env.server().Ledger.ApplyCount(); got != 2 {
		t.Fatalf("applies = %d after a replay, want 2", got)
	}

	// seq < last: ALREADY_COMMITTED (the engine keeps the latest response
	// of a client only), with last_committed_sequence.
	_, err = c.Write(alice, write("c1", "ns", "", 1, "acct", 10))
	meta := wantStatus(t, err, codes.AlreadyExists, idemgrpc.ReasonAlreadyCommitted)
	if meta[idemgrpc.MetaLastCommitted] != "2" || meta[idemgrpc.MetaSequence] != "1" {
		t.Fatalf("ALREADY_COMMITTED metadata %v", meta)
	}
	if last, ok := idemgrpc.LastCommittedSequence(err); !ok || last != 2 {
		t.Fatalf("LastCommittedSequence = %d, %v", last, ok)
	}

	// seq > last+1: SEQUENCE_GAP with last_committed_sequence; nothing runs.
	_, err = c.Write(alice, write("c1", "ns", "", 5, "acct", 1))
	meta = wantStatus(t, err, codes.FailedPrecondition, idemgrpc.ReasonSequenceGap)
	if meta[idemgrpc.MetaLastCommitted] != "2" || meta[idemgrpc.MetaSequence] != "5" || meta[idemgrpc.MetaClient] != "c1" {
		t.Fatalf("SEQUENCE_GAP metadata %v", meta)
	}
	if !idemgrpc.IsSequenceGap(err) {
		t.Fatal("IsSequenceGap false")
	}

	// the same identity with another payload: IDEMPOTENCY_CONFLICT, not a
	// replay of the other request's response.
	_, err = c.Write(alice, write("c1", "ns", "", 2, "acct", 500))
	wantStatus(t, err, codes.AlreadyExists, idemgrpc.ReasonConflict)

	// invalid identities: nothing runs.
	for _, r := range []*ledgerpb.WriteRequest{
		write("c1", "ns", "", 0, "acct", 1),                       // no sequence
		write("", "ns", "", 3, "acct", 1),                         // no client
		write("c1", "", "", 3, "acct", 1),                         // no namespace
		write(string(make([]byte, 2000)), "ns", "", 1, "acct", 1), // client id too long for the engine
	} {
		_, err = c.Write(alice, r)
		wantStatus(t, err, codes.InvalidArgument, idemgrpc.ReasonInvalidIdentity)
	}
	if got := env.server().Ledger.ApplyCount(); got != 2 {
		t.Fatalf("applies = %d, want 2", got)
	}
	if b := balance(t, ctx, c, "ns", "", "acct"); b != 15 {
		t.Fatalf("balance %d, want 15", b)
	}
	if last := clientState(t, ctx, c, "tok-alice", "c1", "ns", ""); last != 2 {
		t.Fatalf("client state %d, want 2", last)
	}
}

// TestResponseTTL: with Options.TTL a stored response is kept for that long
// (the ledger's five-minute cache); after it the last sequence is
// ALREADY_COMMITTED and the next one still runs.
func TestResponseTTL(t *testing.T) {
	clk := testclock.New()
	env := startLedger(t, ledgersvc.Options{TTL: 5 * time.Minute, Engine: &idem.Options{Clock: clk.Now}})
	ctx := testCtx(t)
	c := ledgerpb.NewLedgerClient(dial(t, env.addr))
	alice := as(ctx, "tok-alice")
	first, err := c.Write(alice, write("c1", "ns", "", 1, "a", 1))
	if err != nil {
		t.Fatal(err)
	}
	clk.Advance(4 * time.Minute)
	again, err := c.Write(alice, write("c1", "ns", "", 1, "a", 1))
	if err != nil {
		t.Fatal(err)
	}
	sameReply(t, first, again)
	clk.Advance(2 * time.Minute)
	_, err = c.Write(alice, write("c1", "ns", "", 1, "a", 1))
	wantStatus(t, err, codes.AlreadyExists, idemgrpc.ReasonAlreadyCommitted)
	if _, err := c.Write(alice, write("c1", "ns", "", 2, "a", 1)); err != nil {
		t.Fatal(err)
	}
	if got := env.server().Ledger.ApplyCount(); got != 2 {
		t.Fatalf("applies = %d, want 2", got)
	}
}

// TestHandlerErrorConsumesNothing: a failing handler consumes no sequence
// and its error is not replayed: the same sequence runs again.
func TestHandlerErrorConsumesNothing(t *testing.T) {
	var fail atomic.Bool
	fail.Store(true)
	env := startLedger(t, ledgersvc.Options{BeforeApply: func(context.Context) error {
		if fail.Load() {
			return status.Error(codes.ResourceExhausted, "test: quota")
		}
		return nil
	}})
	ctx := testCtx(t)
	c := ledgerpb.NewLedgerClient(dial(t, env.addr))
	alice := as(ctx, "tok-alice")
	_, err := c.Write(alice, write("c1", "ns", "", 1, "a", 7))
	wantStatus(t, err, codes.ResourceExhausted, "") // the handler's status, untouched
	if last := clientState(t, ctx, c, "tok-alice", "c1", "ns", ""); last != 0 {
		t.Fatalf("a failed call consumed a sequence: last %d", last)
	}
	fail.Store(false)
	r, err := c.Write(alice, write("c1", "ns", "", 1, "a", 7))
	if err != nil {
		t.Fatalf("same sequence after a failure: %v", err)
	}
	if r.GetSequence() != 1 || env.server().Ledger.ApplyCount() != 1 {
		t.Fatalf("got %v, applies %d", r, env.server().Ledger.ApplyCount())
	}
	// a different payload under the aborted number is not a conflict: the
	// failure left nothing behind.
	if _, err := c.Write(alice, write("c2", "ns", "", 1, "a", 1)); err != nil {
		t.Fatal(err)
	}
}

// TestBatchSequencing: the batch table: one sequence per batch, all or
// nothing, a failure consumes none; batches and single writes share the
// scope's stream.
func TestBatchSequencing(t *testing.T) {
	env := startLedger(t, ledgersvc.Options{KeepReplies: 1}) // the latest reply only: older numbers are ALREADY_COMMITTED
	ctx := testCtx(t)
	c := ledgerpb.NewLedgerClient(dial(t, env.addr))
	alice := as(ctx, "tok-alice")
	ops := func(o ...*ledgerpb.Operation) []*ledgerpb.Operation { return o }
	op := func(acct string, amt int64) *ledgerpb.Operation {
		return &ledgerpb.Operation{Account: acct, Amount: amt}
	}
	cas := func(acct string, amt, expect int64) *ledgerpb.Operation {
		return &ledgerpb.Operation{Account: acct, Amount: amt, ExpectBalance: &expect}
	}
	batch := func(seq uint64, o []*ledgerpb.Operation) *ledgerpb.BatchWriteRequest {
		return &ledgerpb.BatchWriteRequest{ClientId: "c", Sequence: seq, NamespaceId: "ns", VaultId: "v", Operations: o}
	}

	// batch.sequence == last+1: valid; single increment.
	r, err := c.BatchWrite(alice, batch(1, ops(op("a", 100), op("b", 50), op("a", -30))))
	if err != nil {
		t.Fatal(err)
	}
	if len(r.GetBalances()) != 2 || r.GetBalances()[0].GetBalance() != 70 || r.GetBalances()[1].GetBalance() != 50 {
		t.Fatalf("batch result %v", r)
	}
	if last := clientState(t, ctx, c, "tok-alice", "c", "ns", "v"); last != 1 {
		t.Fatalf("after a 3-write batch last = %d, want 1", last)
	}

	// failure (CAS): nothing applied, sequence unchanged.
	_, err = c.BatchWrite(alice, batch(2, ops(op("b", 1), cas("a", -70, 999))))
	wantStatus(t, err, codes.FailedPrecondition, "")
	if last := clientState(t, ctx, c, "tok-alice", "c", "ns", "v"); last != 1 {
		t.Fatalf("failed batch consumed a sequence: %d", last)
	}
	if b := balance(t, ctx, c, "ns", "v", "b"); b != 50 {
		t.Fatalf("failed batch applied a write: b = %d", b)
	}

	// sequence error (gap): unchanged.
	_, err = c.BatchWrite(alice, batch(3, ops(op("a", 1))))
	wantStatus(t, err, codes.FailedPrecondition, idemgrpc.ReasonSequenceGap)

	// the same number now runs a (corrected) batch.
	if _, err := c.BatchWrite(alice, batch(2, ops(op("b", 1), cas("a", -70, 70)))); err != nil {
		t.Fatal(err)
	}
	if a, b := balance(t, ctx, c, "ns", "v", "a"), balance(t, ctx, c, "ns", "v", "b"); a != 0 || b != 51 {
		t.Fatalf("balances a=%d b=%d", a, b)
	}

	// batch.sequence <= last: ALREADY_COMMITTED (older than the last).
	_, err = c.BatchWrite(alice, batch(1, ops(op("a", 100), op("b", 50), op("a", -30))))
	wantStatus(t, err, codes.AlreadyExists, idemgrpc.ReasonAlreadyCommitted)

	// a single write continues the same stream.
	if _, err := c.Write(alice, write("c", "ns", "v", 3, "a", 5)); err != nil {
		t.Fatal(err)
	}
	// the namespace level is a separate stream: it starts at 1.
	if _, err := c.Write(alice, write("c", "ns", "", 1, "a", 5)); err != nil {
		t.Fatal(err)
	}
	if a, b := clientState(t, ctx, c, "tok-alice", "c", "ns", "v"), clientState(t, ctx, c, "tok-alice", "c", "ns", ""); a != 3 || b != 1 {
		t.Fatalf("vault state %d, namespace state %d; want 3, 1", a, b)
	}
	if got := env.server().Ledger.ApplyCount(); got != 4 {
		t.Fatalf("applies %d, want 4", got)
	}
}

// TestActorFromAuthContext: the actor is assigned by the server from the
// token; a client that sends another actor (in the request's actor field,
// or in metadata) gets its own actor, and cannot read or advance the other
// actor's sequences.
func TestActorFromAuthContext(t *testing.T) {
	env := startLedger(t, ledgersvc.Options{})
	ctx := testCtx(t)
	c := ledgerpb.NewLedgerClient(dial(t, env.addr))

	// bob writes seq 1.
	if _, err := c.Write(as(ctx, "tok-bob"), write("shared", "ns", "", 1, "a", 1)); err != nil {
		t.Fatal(err)
	}
	// alice claims to be bob and sends bob's next sequence.
	req := write("shared", "ns", "", 2, "a", 1000)
	req.Actor = "user:bob"
	spoof := metadata.AppendToOutgoingContext(as(ctx, "tok-alice"), "actor", "user:bob", "x-actor", "user:bob")
	_, err := c.Write(spoof, req)
	// in alice's own scope, sequence 2 is a gap: she never wrote 1.
	meta := wantStatus(t, err, codes.FailedPrecondition, idemgrpc.ReasonSequenceGap)
	if meta[idemgrpc.MetaLastCommitted] != "0" {
		t.Fatalf("alice sees someone else's sequence: %v", meta)
	}
	req.Sequence = 1
	r, err := c.Write(spoof, req)
	if err != nil {
		t.Fatal(err)
	}
	if r.GetActor() != "user:alice" {
		t.Fatalf("actor %q, want the authenticated user:alice", r.GetActor())
	}
	// bob's stream is untouched, alice's has her write.
	if last := clientState(t, ctx, c, "tok-bob", "shared", "ns", ""); last != 1 {
		t.Fatalf("bob's last = %d, want 1", last)
	}
	if last := clientState(t, ctx, c, "tok-alice", "shared", "ns", ""); last != 1 {
		t.Fatalf("alice's last = %d, want 1", last)
	}
	// bob's retry of his seq 1 still replays his own response.
	rb, err := c.Write(as(ctx, "tok-bob"), write("shared", "ns", "", 1, "a", 1))
	if err != nil || rb.GetActor() != "user:bob" {
		t.Fatalf("bob's replay: %v, %v", rb, err)
	}
	// no token, or an unknown one: Unauthenticated, nothing runs.
	_, err = c.Write(ctx, write("x", "ns", "", 1, "a", 1))
	wantStatus(t, err, codes.Unauthenticated, "")
	_, err = c.Write(as(ctx, "tok-mallory"), write("x", "ns", "", 1, "a", 1))
	wantStatus(t, err, codes.Unauthenticated, "")
	if got := env.server().Ledger.ApplyCount(); got != 2 {
		t.Fatalf("applies %d, want 2", got)
	}
}

// TestClientStateService: the generic ClientState service answers per actor,
// client and scope level.
func TestClientStateService(t *testing.T) {
	env := startLedger(t, ledgersvc.Options{})
	ctx := testCtx(t)
	cc := dial(t, env.addr)
	c := ledgerpb.NewLedgerClient(cc)
	alice := as(ctx, "tok-alice")
	for seq := uint64(1); seq <= 3; seq++ {
		if _, err := c.Write(alice, write("c", "ns", "", seq, "a", 1)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Write(alice, write("c", "ns", "v", 1, "a", 1)); err != nil {
		t.Fatal(err)
	}
	state := idemgrpc.ServiceState(cc)
	for _, tc := range []struct {
		ctx   context.Context
		scope []string
		want  uint64
	}{
		{alice, []string{"ns"}, 3},
		{alice, []string{"ns", "v"}, 1},
		{alice, []string{"ns", "other"}, 0},
		{alice, []string{"ns", ""}, 0}, // not the namespace level
		{as(ctx, "tok-bob"), []string{"ns"}, 0},
	} {
		got, err := state(tc.ctx, "c", tc.scope)
		if err != nil || got != tc.want {
			t.Fatalf("state %v = %d, %v; want %d", tc.scope, got, err, tc.want)
		}
	}
	_, err := state(alice, "", []string{"ns"})
	wantStatus(t, err, codes.InvalidArgument, idemgrpc.ReasonInvalidIdentity)
	_, err = state(ctx, "c", []string{"ns"})
	wantStatus(t, err, codes.Unauthenticated, "")
}

// TestConcurrentRetriesRunOnce: hundreds of concurrent calls of one
// sequence run the handler once; all get the same response. The handler
// is held until every other call has met it in flight (the engine's
// InFlightCollisions count).
func TestConcurrentRetriesRunOnce(t *testing.T) {
	n := 300
	for _, wait := range []time.Duration{0, -1} { // server waits for the first; or answers IN_FLIGHT and the client retries
		t.Run("InFlightWait="+wait.String(), func(t *testing.T) {
			started := make(chan struct{})
			var once sync.Once
			var env *ledgerEnv
			envSet := make(chan struct{})
			env = startLedger(t, ledgersvc.Options{InFlightWait: wait, BeforeApply: func(ctx context.Context) error {
				once.Do(func() { close(started) })
				<-envSet
				tick := time.NewTicker(time.Millisecond)
				defer tick.Stop()
				for env.server().Engine.Stats().InFlightCollisions < uint64(n-1) {
					select {
					case <-ctx.Done():
						return ctx.Err()
					case <-tick.C:
					}
				}
				return nil
			}})
			close(envSet)
			ctx := testCtx(t)
			var retries atomic.Int64
			c := ledgerpb.NewLedgerClient(dial(t, env.addr, mustRetry(t, &idemgrpc.RetryOptions{
				MaxAttempts: -1, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
				OnRetry: func(_ string, _ int, err error, _ time.Duration) {
					if r, _ := idemgrpc.ErrorReason(err); r != idemgrpc.ReasonInFlight {
						t.Errorf("retried %v", err)
					}
					retries.Add(1)
				},
			})))
			alice := as(ctx, "tok-alice")
			replies := make([]*ledgerpb.WriteSuccess, n)
			errs := make([]error, n)
			var wg sync.WaitGroup
			wg.Add(1)
			go func() {
				defer wg.Done()
				replies[0], errs[0] = c.Write(alice, write("c", "ns", "", 1, "a", 1))
			}()
			<-started
			for i := 1; i < n; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					replies[i], errs[i] = c.Write(alice, write("c", "ns", "", 1, "a", 1))
				}()
			}
			wg.Wait()
			for i := range n {
				if errs[i] != nil {
					t.Fatalf("call %d: %v", i, errs[i])
				}
				sameReply(t, replies[0], replies[i])
			}
			if got := env.server().Ledger.ApplyCount(); got != 1 {
				t.Fatalf("handler ran %d times", got)
			}
			if wait < 0 && retries.Load() == 0 {
				t.Fatal("no IN_FLIGHT answer was retried")
			}
			t.Logf("%d calls, %d IN_FLIGHT retries", n, retries.Load())
		})
	}
}

// TestInFlightStatus: without waiting, a call whose identity is running
// gets Aborted IN_FLIGHT with RetryInfo advice.
func TestInFlightStatus(t *testing.T) {
	release := make(chan struct{})
	started := make(chan struct{})
	env := startLedger(t, ledgersvc.Options{InFlightWait: -1, BeforeApply: func(context.Context) error {
		close(started)
		<-release
		return nil
	}})
	ctx := testCtx(t)
	c := ledgerpb.NewLedgerClient(dial(t, env.addr))
	alice := as(ctx, "tok-alice")
	done := make(chan error, 1)
	go func() {
		_, err := c.Write(alice, write("c", "ns", "", 1, "a", 1))
		done <- err
	}()
	<-started
	_, err := c.Write(alice, write("c", "ns", "", 1, "a", 1))
	meta := wantStatus(t, err, codes.Aborted, idemgrpc.ReasonInFlight)
	if meta[idemgrpc.MetaLeaseUntil] == "" || meta[idemgrpc.MetaSequence] != "1" {
		t.Fatalf("IN_FLIGHT metadata %v", meta)
	}
	if ri := retryInfo(err); ri == nil || ri.GetRetryDelay().AsDuration() <= 0 {
		t.Fatalf("no RetryInfo in %v", err)
	}
	if !idemgrpc.Retryable(ctx, err) {
		t.Fatal("IN_FLIGHT not retryable")
	}
	// the next sequence while 1 is in flight: a gap (1 is not committed).
	_, err = c.Write(alice, write("c", "ns", "", 2, "a", 1))
	wantStatus(t, err, codes.FailedPrecondition, idemgrpc.ReasonSequenceGap)
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestIdempotencyKeyMetadata: the identity can come from metadata instead
// of the message.
func TestIdempotencyKeyMetadata(t *testing.T) {
	eng, err := idem.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	isrv, err := idemgrpc.NewServer(eng, &idemgrpc.Options{Methods: map[string]idemgrpc.IdentifyFunc{
		ledgersvc.MethodWrite: idemgrpc.KeyFromMetadata(""),
	}})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(ledgersvc.TokenAuth(tokens), isrv.UnaryServerInterceptor()))
	ledgerpb.RegisterLedgerServer(gs, &keyLedger{runs: &runs})
	ctx := testCtx(t)
	c := ledgerpb.NewLedgerClient(dial(t, serve(t, isrv, gs)))
	withKey := func(k ...string) context.Context {
		ctx := as(ctx, "tok-alice")
		for _, v := range k {
			ctx = metadata.AppendToOutgoingContext(ctx, idemgrpc.DefaultKeyHeader, v)
		}
		return ctx
	}
	req := &ledgerpb.WriteRequest{NamespaceId: "ns", Operation: &ledgerpb.Operation{Account: "a", Amount: 1}}
	r1, err := c.Write(withKey("key-1"), req)
	if err != nil {
		t.Fatal(err)
	}
	r2, err := c.Write(withKey("key-1"), req)
	if err != nil {
		t.Fatal(err)
	}
	sameReply(t, r1, r2)
	if runs.Load() != 1 {
		t.Fatalf("runs %d", runs.Load())
	}
	// bob's key-1 is his own.
	if _, err := c.Write(metadata.AppendToOutgoingContext(as(ctx, "tok-bob"), idemgrpc.DefaultKeyHeader, "key-1"), req); err != nil || runs.Load() != 2 {
		t.Fatalf("bob: %v, runs %d", err, runs.Load())
	}
	other := &ledgerpb.WriteRequest{NamespaceId: "ns", Operation: &ledgerpb.Operation{Account: "a", Amount: 2}}
	_, err = c.Write(withKey("key-1"), other)
	wantStatus(t, err, codes.AlreadyExists, idemgrpc.ReasonConflict)
	for _, k := range [][]string{nil, {""}, {"bad key"}, {"k1", "k2"}, {strings.Repeat("k", 256)}} {
		_, err = c.Write(withKey(k...), req)
		wantStatus(t, err, codes.InvalidArgument, idemgrpc.ReasonInvalidIdentity)
	}
	if runs.Load() != 2 {
		t.Fatalf("runs %d", runs.Load())
	}
}

// keyLedger is a minimal Ledger implementation counting its runs.
type keyLedger struct {
	ledgerpb.UnimplementedLedgerServer
	runs *atomic.Int64
}

func (k *keyLedger) Write(ctx context.Context, req *ledgerpb.WriteRequest) (*ledgerpb.WriteSuccess, error) {
	n := k.runs.Add(1)
	call, _ := idemgrpc.CallFromContext(ctx)
	return &ledgerpb.WriteSuccess{TxId: "tx-" + strconv.FormatInt(n, 10), Actor: call.Actor, Sequence: req.GetSequence()}, nil
}
