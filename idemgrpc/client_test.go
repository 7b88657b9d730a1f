package idemgrpc_test

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem/examples/ledger/ledgerpb"
	"github.com/idemdb/idem/examples/ledger/ledgersvc"
	"github.com/idemdb/idem/idemgrpc"
	"github.com/idemdb/idem/internal/testclock"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// TestRetryLostResponse: the retry table's "network timeout" row with the
// response lost after the server committed: the interceptor retries with
// the same (client_id, sequence) and gets the cached WriteSuccess.
func TestRetryLostResponse(t *testing.T) {
	env := startLedger(t, ledgersvc.Options{})
	ctx := testCtx(t)
	var seen []proto.Message
	var retries atomic.Int64
	c := ledgerpb.NewLedgerClient(dial(t, env.addr,
		mustRetry(t, &idemgrpc.RetryOptions{InitialBackoff: 5 * time.Millisecond,
			OnRetry: func(string, int, error, time.Duration) { retries.Add(1) }}),
		lossy(2, &seen)))
	r, err := c.Write(as(ctx, "tok-alice"), write("c", "ns", "", 1, "a", 10))
	if err != nil {
		t.Fatal(err)
	}
	if len(seen) != 2 || retries.Load() != 2 {
		t.Fatalf("%d lost responses, %d retries", len(seen), retries.Load())
	}
	sameReply(t, seen[0], r)
	sameReply(t, seen[1], r)
	if n := env.server().Ledger.ApplyCount(); n != 1 {
		t.Fatalf("applied %d times", n)
	}
	if b := balance(t, ctx, c, "ns", "", "a"); b != 10 {
		t.Fatalf("balance %d", b)
	}
}

// TestRetryAttemptTimeout: the first attempt times out while the handler
// still runs (it is held until the client retries); the retry waits for it
// (or is told IN_FLIGHT) and gets its response; the handler runs once.
func TestRetryAttemptTimeout(t *testing.T) {
	var calls atomic.Int64
	retried := make(chan struct{})
	var once sync.Once
	env := startLedger(t, ledgersvc.Options{BeforeApply: func(context.Context) error {
		if calls.Add(1) == 1 {
			<-retried // ignores the cancelled context, as a slow disk would
		}
		return nil
	}})
	ctx := testCtx(t)
	var codesSeen sync.Map
	c := ledgerpb.NewLedgerClient(dial(t, env.addr, mustRetry(t, &idemgrpc.RetryOptions{
		// The first attempt times out whatever the value (the handler waits
		// for the retry); the others must have time to finish on a loaded
		// machine.
		PerAttemptTimeout: time.Second, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 100 * time.Millisecond, MaxAttempts: -1,
		OnRetry: func(_ string, _ int, err error, _ time.Duration) {
			codesSeen.Store(status.Code(err), true)
			if status.Code(err) == codes.DeadlineExceeded {
				once.Do(func() { close(retried) })
			}
		},
	})))
	r, err := c.Write(as(ctx, "tok-alice"), write("c", "ns", "", 1, "a", 3))
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := codesSeen.Load(codes.DeadlineExceeded); !ok {
		t.Fatal("no DeadlineExceeded attempt was retried")
	}
	if calls.Load() != 1 || env.server().Ledger.ApplyCount() != 1 || r.GetSequence() != 1 {
		t.Fatalf("handler calls %d, applies %d, reply %v", calls.Load(), env.server().Ledger.ApplyCount(), r)
	}
}

// TestRetryStopsOnFinalErrors: SEQUENCE_GAP, conflicts and handler errors
// are not retried; Unavailable is, with growing jittered delays, bounded by
// MaxAttempts and the call's deadline.
func TestRetryStopsOnFinalErrors(t *testing.T) {
	var fail atomic.Bool
	env := startLedger(t, ledgersvc.Options{BeforeApply: func(context.Context) error {
		if fail.Load() {
			return status.Error(codes.PermissionDenied, "test: no")
		}
		return nil
	}})
	ctx := testCtx(t)
	var retries atomic.Int64
	opts := idemgrpc.RetryOptions{OnRetry: func(string, int, error, time.Duration) { retries.Add(1) }}
	c := ledgerpb.NewLedgerClient(dial(t, env.addr, mustRetry(t, &opts)))
	alice := as(ctx, "tok-alice")
	_, err := c.Write(alice, write("c", "ns", "", 7, "a", 1))
	wantStatus(t, err, codes.FailedPrecondition, idemgrpc.ReasonSequenceGap)
	fail.Store(true)
	_, err = c.Write(alice, write("c", "ns", "", 1, "a", 1))
	wantStatus(t, err, codes.PermissionDenied, "")
	if retries.Load() != 0 {
		t.Fatalf("%d retries of final errors", retries.Load())
	}

	// A server that is down: Unavailable, retried MaxAttempts-1 times with
	// delays 10, 20, 40, 40 ms ±20%.
	dead := listen(t)
	addr := dead.Addr().String()
	dead.Close()
	var delays []time.Duration
	var mu sync.Mutex
	c2 := ledgerpb.NewLedgerClient(dial(t, addr, mustRetry(t, &idemgrpc.RetryOptions{
		MaxAttempts: 5, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 40 * time.Millisecond,
		OnRetry: func(_ string, _ int, _ error, d time.Duration) { mu.Lock(); delays = append(delays, d); mu.Unlock() },
	})))
	_, err = c2.Write(alice, write("c", "ns", "", 1, "a", 1))
	wantStatus(t, err, codes.Unavailable, "")
	want := []time.Duration{10, 20, 40, 40}
	if len(delays) != len(want) {
		t.Fatalf("delays %v", delays)
	}
	for i, d := range delays {
		lo, hi := want[i]*time.Millisecond*8/10, want[i]*time.Millisecond*12/10
		if d < lo || d > hi {
			t.Fatalf("delay %d = %v, want %v..%v", i, d, lo, hi)
		}
	}
	// The call's deadline bounds the retries: no sleep past it. The
	// interceptor reads a manual clock set 275ms before the deadline, and
	// its sleeps advance that clock: 50ms delays (jitter negligible) fit
	// five times, a sixth would end past the deadline.
	deadline := time.Now().Add(20 * time.Second) // before testCtx's
	clk := testclock.At(deadline.Add(-275 * time.Millisecond))
	var sleeps []time.Duration
	var attempts atomic.Int64
	sleepOpts := idemgrpc.WithRetryClock(idemgrpc.RetryOptions{
		MaxAttempts: -1, InitialBackoff: 50 * time.Millisecond, MaxBackoff: 50 * time.Millisecond, Jitter: 1e-9,
	}, clk.Now, func(ctx context.Context, d time.Duration) error {
		if end := clk.Now().Add(d); end.After(deadline) {
			t.Errorf("sleep of %v from %v ends %v past the deadline", d, clk.Now(), end.Sub(deadline))
		}
		sleeps = append(sleeps, d)
		clk.Advance(d)
		return nil
	})
	count := func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		attempts.Add(1)
		return invoker(ctx, method, req, reply, cc, opts...)
	}
	c3 := ledgerpb.NewLedgerClient(dial(t, addr, mustRetry(t, sleepOpts), count))
	short, cancel := context.WithDeadline(alice, deadline)
	defer cancel()
	_, err = c3.Write(short, write("c", "ns", "", 1, "a", 1))
	wantStatus(t, err, codes.Unavailable, "")
	if len(sleeps) != 5 || attempts.Load() != 6 {
		t.Fatalf("%d sleeps %v, %d attempts; want 5 sleeps of 50ms and 6 attempts", len(sleeps), sleeps, attempts.Load())
	}
}

// TestRetryOptionsErrors: bad retry options are errors naming the field.
func TestRetryOptionsErrors(t *testing.T) {
	for _, tc := range []struct {
		o     idemgrpc.RetryOptions
		field string
	}{
		{idemgrpc.RetryOptions{InitialBackoff: -1}, "InitialBackoff"},
		{idemgrpc.RetryOptions{MaxBackoff: -1}, "MaxBackoff"},
		{idemgrpc.RetryOptions{InitialBackoff: time.Second, MaxBackoff: time.Millisecond}, "MaxBackoff"},
		{idemgrpc.RetryOptions{Multiplier: 0.5}, "Multiplier"},
		{idemgrpc.RetryOptions{Jitter: 1.5}, "Jitter"},
		{idemgrpc.RetryOptions{Jitter: -0.1}, "Jitter"},
		{idemgrpc.RetryOptions{PerAttemptTimeout: -1}, "PerAttemptTimeout"},
	} {
		if _, err := idemgrpc.UnaryClientInterceptor(&tc.o); err == nil || !strings.Contains(err.Error(), "RetryOptions."+tc.field) {
			t.Errorf("%+v: %v; want an error naming %s", tc.o, err, tc.field)
		}
		if _, err := idemgrpc.DialOptions(&tc.o); err == nil {
			t.Errorf("DialOptions(%+v) accepted it", tc.o)
		}
	}
	if _, err := idemgrpc.UnaryClientInterceptor(nil); err != nil {
		t.Fatal(err)
	}
}

// countingState wraps a StateFunc and counts its calls.
func countingState(f idemgrpc.StateFunc, n *atomic.Int64) idemgrpc.StateFunc {
	return func(ctx context.Context, client string, scope []string) (uint64, error) {
		n.Add(1)
		return f(ctx, client, scope)
	}
}

func trackedWrite(c ledgerpb.LedgerClient, ctx context.Context, tr *idemgrpc.Tracker, ns, vault, acct string, amt int64, out **ledgerpb.WriteSuccess) error {
	return tr.Call(ctx, ledgersvc.Scope(ns, vault), func(ctx context.Context, seq uint64) error {
		r, err := c.Write(ctx, write(tr.Client(), ns, vault, seq, acct, amt))
		if out != nil {
			*out = r
		}
		return err
	})
}

// TestTracker: sequences 1, 2, 3 (incremented on success, saved before
// sending); a lost state recovers through GetClientState; a SEQUENCE_GAP
// (the saved state ahead of the server) recovers and resends; a handler
// error gives the number back; an unknown outcome keeps it and the next
// call recovers from the gap.
func TestTracker(t *testing.T) {
	var fail atomic.Bool
	env := startLedger(t, ledgersvc.Options{KeepReplies: 1, BeforeApply: func(context.Context) error {
		if fail.Load() {
			return status.Error(codes.FailedPrecondition, "test: business rule")
		}
		return nil
	}})
	ctx := as(testCtx(t), "tok-alice")
	cc := dial(t, env.addr, mustRetry(t, &idemgrpc.RetryOptions{}))
	c := ledgerpb.NewLedgerClient(cc)
	store := idemgrpc.NewMemoryStore()
	var stateCalls atomic.Int64
	tr, err := idemgrpc.NewTracker("c", store, countingState(idemgrpc.ServiceState(cc), &stateCalls), nil)
	if err != nil {
		t.Fatal(err)
	}
	key := idemgrpc.StoreKey("c", "ns")

	for want := uint64(1); want <= 3; want++ {
		var r *ledgerpb.WriteSuccess
		err := tr.Call(ctx, []string{"ns"}, func(ctx context.Context, seq uint64) error {
			if saved, ok, _ := store.Load(key); !ok || saved != seq {
				t.Errorf("sequence %d sent before it was saved (store: %d, %v)", seq, saved, ok)
			}
			var err error
			r, err = c.Write(ctx, write("c", "ns", "", seq, "a", 1))
			return err
		})
		if err != nil || r.GetSequence() != want {
			t.Fatalf("call %d: %v, %v", want, r, err)
		}
	}
	if stateCalls.Load() != 1 { // only the first, with no saved state
		t.Fatalf("%d GetClientState calls, want 1", stateCalls.Load())
	}

	// lost state: recovered from the server.
	store.Delete(key)
	var r *ledgerpb.WriteSuccess
	if err := trackedWrite(c, ctx, tr, "ns", "", "a", 1, &r); err != nil || r.GetSequence() != 4 {
		t.Fatalf("after losing the state: %v, %v", r, err)
	}

	// saved state ahead of the server (a gap): recovered and resent.
	if err := store.Save(key, 9); err != nil {
		t.Fatal(err)
	}
	if err := trackedWrite(c, ctx, tr, "ns", "", "a", 1, &r); err != nil || r.GetSequence() != 5 {
		t.Fatalf("after a gap: %v, %v", r, err)
	}

	// a handler error: the number is given back and reused.
	fail.Store(true)
	err = trackedWrite(c, ctx, tr, "ns", "", "a", 1, nil)
	wantStatus(t, err, codes.FailedPrecondition, "")
	fail.Store(false)
	before := stateCalls.Load()
	if err := trackedWrite(c, ctx, tr, "ns", "", "a", 1, &r); err != nil || r.GetSequence() != 6 || stateCalls.Load() != before {
		t.Fatalf("after a handler error: %v, %v (%d state calls)", r, err, stateCalls.Load()-before)
	}

	// an unknown outcome (the request never left): the number stays used;
	// the next call meets a gap and recovers.
	err = tr.Call(ctx, []string{"ns"}, func(context.Context, uint64) error {
		return status.Error(codes.Unavailable, "test: connection reset")
	})
	wantStatus(t, err, codes.Unavailable, "")
	if saved, _, _ := store.Load(key); saved != 7 {
		t.Fatalf("saved %d after an unknown outcome, want 7", saved)
	}
	if err := trackedWrite(c, ctx, tr, "ns", "", "a", 1, &r); err != nil || r.GetSequence() != 7 {
		t.Fatalf("after an unknown outcome: %v, %v", r, err)
	}

	// ALREADY_COMMITTED (the saved state behind the server): returned, and
	// the state resynced for the next call.
	if err := store.Save(key, 4); err != nil {
		t.Fatal(err)
	}
	err = trackedWrite(c, ctx, tr, "ns", "", "a", 1, nil)
	wantStatus(t, err, codes.AlreadyExists, idemgrpc.ReasonAlreadyCommitted)
	if err := trackedWrite(c, ctx, tr, "ns", "", "a", 1, &r); err != nil || r.GetSequence() != 8 {
		t.Fatalf("after ALREADY_COMMITTED: %v, %v", r, err)
	}
	if n := env.server().Ledger.ApplyCount(); n != 8 {
		t.Fatalf("applies %d, want 8", n)
	}
	if b := balance(t, ctx, c, "ns", "", "a"); b != 8 {
		t.Fatalf("balance %d, want 8", b)
	}
}

// TestTrackerFileStore: a client restarting on its file store resumes from
// the saved number without asking the server; a corrupt file is a lost
// state, recovered from the server.
func TestTrackerFileStore(t *testing.T) {
	env := startLedger(t, ledgersvc.Options{})
	ctx := as(testCtx(t), "tok-alice")
	cc := dial(t, env.addr)
	c := ledgerpb.NewLedgerClient(cc)
	dir := t.TempDir()
	var stateCalls atomic.Int64
	open := func() (*idemgrpc.FileStore, *idemgrpc.Tracker) {
		fs, err := idemgrpc.OpenFileStore(dir)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { fs.Close() })
		tr, err := idemgrpc.NewTracker("c", fs, countingState(idemgrpc.ServiceState(cc), &stateCalls), nil)
		if err != nil {
			t.Fatal(err)
		}
		return fs, tr
	}
	fs, tr := open()
	var r *ledgerpb.WriteSuccess
	for i := 0; i < 3; i++ {
		if err := trackedWrite(c, ctx, tr, "ns", "v", "a", 1, &r); err != nil {
			t.Fatal(err)
		}
	}
	fs.Close()
	// restart: resumes at 4 from the file.
	fs, tr = open()
	if err := trackedWrite(c, ctx, tr, "ns", "v", "a", 1, &r); err != nil || r.GetSequence() != 4 {
		t.Fatalf("after restart: %v, %v", r, err)
	}
	if stateCalls.Load() != 1 {
		t.Fatalf("%d GetClientState calls, want 1 (the very first)", stateCalls.Load())
	}
	fs.Close()
	// corrupt the file: a lost state.
	files, _ := filepath.Glob(filepath.Join(dir, "*.seq"))
	if len(files) != 1 {
		t.Fatalf("files %v", files)
	}
	b, _ := os.ReadFile(files[0])
	b[9] ^= 0xff
	if err := os.WriteFile(files[0], b, 0o644); err != nil {
		t.Fatal(err)
	}
	fs, tr = open()
	if _, _, err := fs.Load(idemgrpc.StoreKey("c", "ns", "v")); !errors.Is(err, idemgrpc.ErrStateCorrupt) {
		t.Fatalf("Load of a corrupt file: %v", err)
	}
	if err := trackedWrite(c, ctx, tr, "ns", "v", "a", 1, &r); err != nil || r.GetSequence() != 5 {
		t.Fatalf("after corruption: %v, %v", r, err)
	}
	if stateCalls.Load() != 2 {
		t.Fatalf("%d GetClientState calls, want 2", stateCalls.Load())
	}
}

// TestServerRestartBetweenWriteAndRetry: the response of a write is lost,
// the server is stopped (engine and journal closed) and a new one started
// on the same directory; the retry gets the cached response.
func TestServerRestartBetweenWriteAndRetry(t *testing.T) {
	env := startLedger(t, ledgersvc.Options{})
	ctx := as(testCtx(t), "tok-alice")
	var seen []proto.Message
	c := ledgerpb.NewLedgerClient(dial(t, env.addr, lossy(1, &seen)))
	req := write("c", "ns", "", 1, "a", 25)
	_, err := c.Write(ctx, req)
	wantStatus(t, err, codes.Unavailable, "")
	if len(seen) != 1 {
		t.Fatal("the write did not run")
	}

	env.restart(false)

	c = ledgerpb.NewLedgerClient(dial(t, env.addr))
	r, err := c.Write(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	sameReply(t, seen[0], r)
	if n := env.server().Ledger.ApplyCount(); n != 0 {
		t.Fatalf("the retry ran again after the restart (%d applies)", n)
	}
	if b := balance(t, ctx, c, "ns", "", "a"); b != 25 {
		t.Fatalf("balance %d, want 25", b)
	}
}

// TestCrashInDoubt: the server dies while a write runs; on restart the call
// left in doubt is settled from the ledger's journal: committed with its
// response if the write reached the journal, aborted (and run by the
// retry) if not. Either way the write is applied once.
func TestCrashInDoubt(t *testing.T) {
	for _, reached := range []bool{true, false} {
		name := map[bool]string{true: "AfterJournal", false: "BeforeJournal"}[reached]
		t.Run(name, func(t *testing.T) {
			block := make(chan struct{})
			blocked := make(chan struct{})
			var once sync.Once
			hook := func() {
				once.Do(func() {
					close(blocked)
					<-block
				})
			}
			opts := ledgersvc.Options{}
			if reached {
				opts.AfterApply = func(context.Context) { hook() }
			} else {
				opts.BeforeApply = func(context.Context) error { hook(); return nil }
			}
			env := startLedger(t, opts)
			ctx := as(testCtx(t), "tok-alice")
			c := ledgerpb.NewLedgerClient(dial(t, env.addr))
			req := write("c", "ns", "", 1, "a", 40)
			done := make(chan error, 1)
			go func() { _, err := c.Write(ctx, req); done <- err }()
			<-blocked
			env.restart(true) // kill: the handler is still blocked
			close(block)
			if err := <-done; err == nil {
				t.Fatal("the cut call succeeded")
			}

			c = ledgerpb.NewLedgerClient(dial(t, env.addr))
			r, err := c.Write(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			wantApplies := int64(1)
			if reached {
				wantApplies = 0 // committed from the journal at restart: a replay
			}
			if n := env.server().Ledger.ApplyCount(); n != wantApplies || r.GetSequence() != 1 || r.GetActor() != "user:alice" {
				t.Fatalf("applies %d (want %d), reply %v", n, wantApplies, r)
			}
			if b := balance(t, ctx, c, "ns", "", "a"); b != 40 {
				t.Fatalf("balance %d, want 40", b)
			}
			if last := clientState(t, ctx, c, "tok-alice", "c", "ns", ""); last != 1 {
				t.Fatalf("last %d", last)
			}
		})
	}
}

// TestTimeoutReconnects: a server that accepts a TCP connection and never
// answers on it (a zombie peer): the attempt runs out of its
// PerAttemptTimeout and the retry goes out on a new connection (the
// listener accepts a second one), after the client closed the first.
// gRPC's own connect timeout is set to a minute, so without DialOptions'
// reconnection no second connection comes within the test's bound.
func TestTimeoutReconnects(t *testing.T) {
	lis := listen(t)
	var (
		mu       sync.Mutex
		conns    []net.Conn
		accepted atomic.Int64
	)
	second, firstClosed := make(chan struct{}), make(chan struct{})
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			switch accepted.Add(1) {
			case 1:
				go func() { _, _ = io.Copy(io.Discard, c); close(firstClosed) }() // never writes; sees the client's close
			case 2:
				close(second)
			}
		}
	}()
	t.Cleanup(func() {
		lis.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	dialOpts, err := idemgrpc.DialOptions(&idemgrpc.RetryOptions{
		PerAttemptTimeout: 50 * time.Millisecond, MaxAttempts: -1, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(lis.Addr().String(), append(dialOpts, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: backoff.DefaultConfig, MinConnectTimeout: time.Minute}))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := ledgerpb.NewLedgerClient(cc).Write(as(ctx, "tok-alice"), write("c", "ns", "", 1, "a", 1))
		done <- err
	}()
	for _, w := range []struct {
		ch   chan struct{}
		what string
	}{{firstClosed, "the client never closed the dead connection"}, {second, "no second connection: the retry stayed on the dead one"}} {
		select {
		case <-w.ch:
		case <-ctx.Done():
			t.Fatalf("%s (%d accepted)", w.what, accepted.Load())
		}
	}
	cancel()
	if err := <-done; err == nil {
		t.Fatal("a call to a server that never answers succeeded")
	}
}

// TestTimeoutReconnectsEstablished: the connection's peer stops answering
// after the handshake and a call (a proxy stops forwarding the server's
// bytes of the first connection: the write runs, its response is lost).
// The attempt times out, the retry goes out on a new connection and gets
// the stored response: the write ran once.
func TestTimeoutReconnectsEstablished(t *testing.T) {
	env := startLedger(t, ledgersvc.Options{})
	lis := listen(t)
	var (
		mu     sync.Mutex
		conns  []net.Conn
		frozen = make(chan struct{})
		n      int
	)
	t.Cleanup(func() {
		lis.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", env.addr)
			if err != nil {
				c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, up)
			n++
			first := n == 1
			mu.Unlock()
			go func() { _, _ = io.Copy(up, c) }()
			go func() {
				buf := make([]byte, 32<<10)
				for {
					k, err := up.Read(buf)
					if first {
						select {
						case <-frozen:
							continue // the peer went silent: drop what the server says
						default:
						}
					}
					if k > 0 {
						if _, werr := c.Write(buf[:k]); werr != nil {
							return
						}
					}
					if err != nil {
						c.Close()
						return
					}
				}
			}()
		}
	}()
	dialOpts, err := idemgrpc.DialOptions(&idemgrpc.RetryOptions{
		// long enough for a call on a loaded machine: only the silent
		// connection must time out.
		PerAttemptTimeout: time.Second, MaxAttempts: -1, InitialBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(lis.Addr().String(), append(dialOpts, grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	ctx := as(testCtx(t), "tok-alice")
	c := ledgerpb.NewLedgerClient(cc)
	if _, err := c.Write(ctx, write("c", "ns", "", 1, "a", 1)); err != nil {
		t.Fatal(err)
	}
	close(frozen)
	r, err := c.Write(ctx, write("c", "ns", "", 2, "a", 1))
	if err != nil {
		t.Fatalf("the retry after the timeout: %v", err)
	}
	mu.Lock()
	got := n
	mu.Unlock()
	if got < 2 || r.GetSequence() != 2 || env.server().Ledger.ApplyCount() != 2 {
		t.Fatalf("%d connections, reply %v, %d applies; want a second connection and 2 applies", got, r, env.server().Ledger.ApplyCount())
	}
}
