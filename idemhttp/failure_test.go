package idemhttp_test

import (
	"bytes"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
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
	if !strings.Contains(out, "storing the response") || !strings.Contains(out, "key=closing") || !strings.Contains(out, "engine unavailable") {
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

// loggedCleanups sums the counts of the engine's cleanup log lines.
func loggedCleanups(logs string) int {
	n := 0
	for line := range strings.SplitSeq(logs, "\n") {
		if !strings.Contains(line, "TTL cleanup removed") {
			continue
		}
		if _, c, ok := strings.Cut(line, "count="); ok {
			v, _ := strconv.Atoi(strings.TrimSpace(c))
			n += v
		}
	}
	return n
}
