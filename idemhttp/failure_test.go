package idemhttp_test

import (
	"bytes"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemhttp"
	"github.com/idemdb/idem/internal/testclock"
)

// syncBuffer is a log destination safe for concurrent writers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// The engine closes while a request is handled: the response still goes
// out (and the failure is logged, never the body); later requests get 503
// IDEMPOTENCY_STORE_UNAVAILABLE.
func TestEngineClosedMidRequest(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	var logs syncBuffer
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = e.Close()
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "made")
	})
	srv := serve(t, mw(t, e, &idemhttp.Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})(h))
	r := post(t, ctx, srv, "closing", "secret-body-content")
	if r.status != http.StatusCreated || string(r.body) != "made" {
		t.Fatalf("%d %q", r.status, r.body)
	}
	r = post(t, ctx, srv, "closing", "secret-body-content")
	wantError(t, r, http.StatusServiceUnavailable, idemhttp.CodeStoreUnavailable, "closing")
	if r.header.Get("Retry-After") == "" {
		t.Fatal("503 without Retry-After")
	}
	out := logs.String()
	if !strings.Contains(out, "storing the response") || !strings.Contains(out, "key=closing") || !strings.Contains(out, "store unavailable") {
		t.Fatalf("logs:\n%s", out)
	}
	if strings.Contains(out, "secret-body-content") {
		t.Fatal("the request body was logged")
	}
}

// A response the engine refuses as too large (its MaxReplySize) is kept as
// handled-but-not-replayable, never run twice.
func TestResponseLargerThanEngineStores(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, &idem.Options{MaxReplySize: 1000})
	var calls int
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		w.Write(bytes.Repeat([]byte("y"), 2000))
	})
	srv := serve(t, mw(t, e, &idemhttp.Options{Logger: testLogger(t)})(h))
	if r := post(t, ctx, srv, "huge", ""); r.status != 200 || len(r.body) != 2000 {
		t.Fatalf("%d %d", r.status, len(r.body))
	}
	wantError(t, post(t, ctx, srv, "huge", ""), http.StatusConflict, idemhttp.CodeResponseNotStored, "huge")
	if calls != 1 {
		t.Fatalf("%d calls", calls)
	}
}

// The engine's periodic cleanup removes expired keys and logs the count.
func TestPeriodicCleanup(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	clk := testclock.New()
	var logs syncBuffer
	e := openEngine(t, clk, &idem.Options{CleanupInterval: 20 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	srv := serve(t, mw(t, e, &idemhttp.Options{TTL: time.Minute})(&items{}))
	for _, k := range []string{"c1", "c2", "c3"} {
		post(t, ctx, srv, k, item1)
	}
	clk.Advance(time.Minute + time.Second)
	// The cleanup removes what the index has applied; a key committed a
	// moment before may go in the next round. Every removal is counted and
	// the count of each round logged.
	for e.Stats().Cleanups < 3 || loggedCleanups(logs.String()) < 3 {
		if ctx.Err() != nil {
			t.Fatalf("cleanups %d; logs:\n%s", e.Stats().Cleanups, logs.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if n := loggedCleanups(logs.String()); n != 3 {
		t.Fatalf("logged %d removals, want 3:\n%s", n, logs.String())
	}
	if st := e.Stats(); st.LiveEntries != 0 {
		waitApplied(t, e)
		if st = e.Stats(); st.LiveEntries != 0 {
			t.Fatalf("%d live entries after cleanup", st.LiveEntries)
		}
	}
}

// The engine's retention (idem.Options.Retention) forgets keys on the same
// periodic cleanup, and logs how many it removed too.
func TestPeriodicRetentionCleanup(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	clk := testclock.New()
	var logs syncBuffer
	e := openEngine(t, clk, &idem.Options{Retention: time.Hour, CleanupInterval: 20 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	srv := serve(t, mw(t, e, &idemhttp.Options{TTL: 24 * time.Hour})(&items{}))
	for _, k := range []string{"r1", "r2", "r3"} {
		post(t, ctx, srv, k, item1)
	}
	waitApplied(t, e)
	clk.Advance(time.Hour + time.Second)
	for loggedCount(logs.String(), "retention cleanup removed") < 3 {
		if ctx.Err() != nil {
			t.Fatalf("cleanups %d; logs:\n%s", e.Stats().Cleanups, logs.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if n := loggedCount(logs.String(), "retention cleanup removed"); n != 3 || e.Stats().Cleanups != 3 {
		t.Fatalf("logged %d removals, counted %d; want 3:\n%s", n, e.Stats().Cleanups, logs.String())
	}
	if r := post(t, ctx, srv, "r1", item1); r.status != http.StatusCreated || r.header.Get(idemhttp.HeaderReplayed) != "" {
		t.Fatalf("a forgotten key replayed: %d %v", r.status, r.header)
	}
}

// The engine's default lease (1 hour) is what keeps a key of a request
// still being handled (or left by a crash) from running twice: through the
// middleware, a retry is IDEMPOTENCY_KEY_PROCESSING until the hour is over,
// and runs again after it.
func TestDefaultLeaseOneHour(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	clk := testclock.New()
	e := openEngine(t, clk, nil)
	release := make(chan struct{})
	started := make(chan struct{}, 1)
	var calls atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			started <- struct{}{}
			<-release // the first request outlives its lease
		}
		w.WriteHeader(http.StatusCreated)
	})
	srv := serve(t, mw(t, e, &idemhttp.Options{Logger: testLogger(t)})(h))
	var once sync.Once
	releaseFirst := func() { once.Do(func() { close(release) }) }
	t.Cleanup(releaseFirst) // before the server's Close, which waits for the handler
	first := make(chan response, 1)
	go func() {
		r, err := tryDo(ctx, srv.Client(), http.MethodPost, srv.URL+itemsPath, item1, idemhttp.HeaderKey, "slow")
		if err != nil {
			t.Error(err)
		}
		first <- r
	}()
	<-started
	clk.Advance(time.Hour - time.Second)
	wantError(t, post(t, ctx, srv, "slow", item1), http.StatusConflict, idemhttp.CodeProcessing, "slow")
	clk.Advance(2 * time.Second)
	if r := post(t, ctx, srv, "slow", item1); r.status != http.StatusCreated || calls.Load() != 2 {
		t.Fatalf("after the lease: %d %s, %d calls", r.status, r.body, calls.Load())
	}
	releaseFirst()
	if r := <-first; r.status != http.StatusCreated {
		t.Fatalf("first: %d", r.status)
	}
}

// loggedCleanups sums the counts of the engine's TTL cleanup log lines.
func loggedCleanups(logs string) int { return loggedCount(logs, "TTL cleanup removed") }

// loggedCount sums the count= of the log lines holding msg.
func loggedCount(logs, msg string) int {
	n := 0
	for line := range strings.SplitSeq(logs, "\n") {
		if !strings.Contains(line, msg) {
			continue
		}
		if _, c, ok := strings.Cut(line, "count="); ok {
			v, _ := strconv.Atoi(strings.TrimSpace(c))
			n += v
		}
	}
	return n
}
