package idemhttp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemhttp"
	"github.com/idemdb/idem/internal/testclock"
)

const itemsPath = "/api/v1/items"

// items is the application behind the middleware: the Idempotency-Key
// service's item intake. Each call creates an item (a side effect, counted)
// and answers 201 with its id and the request body.
type items struct {
	calls atomic.Int64
	// gate, when set, is where a call waits after it started (started
	// gets a value) until the test closes gate.
	gate    chan struct{}
	started chan struct{}
}

func (a *items) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := a.calls.Add(1)
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if a.started != nil {
		a.started <- struct{}{}
	}
	if a.gate != nil {
		<-a.gate
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("%s/%d", itemsPath, n))
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":%d,"request":%q}`, n, body)
}

// testLogger logs through t (so the middleware's warnings show up with the
// test that caused them).
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// openEngine opens an engine in a temporary directory on the engine clock
// clk (nil: the real clock).
func openEngine(t testing.TB, clk *testclock.Clock, o *idem.Options) *idem.Engine {
	t.Helper()
	if o == nil {
		o = &idem.Options{}
	}
	if clk != nil {
		o.Clock = clk.Now
	}
	e, err := idem.Open(t.TempDir(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	return e
}

// serve starts a loopback server with h mounted at every path.
func serve(t testing.TB, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// serveQuiet is serve with net/http's own log (panics recovered by the
// server) discarded.
func serveQuiet(t testing.TB, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.Start()
	t.Cleanup(srv.Close)
	return srv
}

func testCtx(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

type response struct {
	status int
	header http.Header
	body   []byte
}

func (r response) errorBody(t testing.TB) idemhttp.ErrorBody {
	t.Helper()
	var eb idemhttp.ErrorBody
	if err := json.Unmarshal(r.body, &eb); err != nil {
		t.Fatalf("body %q is not a JSON error body: %v", r.body, err)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("error body with Content-Type %q", ct)
	}
	return eb
}

// do sends one request; header pairs are name, value.
func do(t testing.TB, ctx context.Context, c *http.Client, method, url, body string, header ...string) response {
	t.Helper()
	r, err := tryDo(ctx, c, method, url, body, header...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func tryDo(ctx context.Context, c *http.Client, method, url, body string, header ...string) (response, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, strings.NewReader(body))
	if err != nil {
		return response{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		return response{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return response{}, err
	}
	return response{status: resp.StatusCode, header: resp.Header, body: b}, nil
}

// post sends a POST to the items path with a key ("" for none).
func post(t testing.TB, ctx context.Context, srv *httptest.Server, key, body string, header ...string) response {
	t.Helper()
	if key != "" {
		header = append(header, idemhttp.HeaderKey, key)
	}
	return do(t, ctx, srv.Client(), http.MethodPost, srv.URL+itemsPath, body, header...)
}

// sameResponse checks that a replay is the first response byte for byte:
// status, body, and every header but Date, plus Idempotent-Replayed: true.
func sameResponse(t testing.TB, first, replay response) {
	t.Helper()
	if replay.status != first.status || !bytes.Equal(replay.body, first.body) {
		t.Fatalf("replay %d %q, first %d %q", replay.status, replay.body, first.status, first.body)
	}
	if first.header.Get(idemhttp.HeaderReplayed) != "" {
		t.Fatalf("first response has %s", idemhttp.HeaderReplayed)
	}
	if got := replay.header.Get(idemhttp.HeaderReplayed); got != "true" {
		t.Fatalf("replay has %s %q, want true", idemhttp.HeaderReplayed, got)
	}
	for k, v := range first.header {
		if k == "Date" {
			continue
		}
		if got := replay.header[k]; !equalStrings(got, v) {
			t.Fatalf("replay header %s = %q, first had %q", k, got, v)
		}
	}
	for k := range replay.header {
		if _, ok := first.header[k]; !ok && k != idemhttp.HeaderReplayed && k != "Date" {
			t.Fatalf("replay has header %s the first response had not", k)
		}
	}
}

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// parallel runs n functions at once and waits for them.
func parallel(n int, f func(i int)) {
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { f(i) })
	}
	wg.Wait()
}

// waitApplied waits until the engine's index has applied every record.
func waitApplied(t testing.TB, e *idem.Engine) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		st := e.Stats()
		if st.AppliedLSN >= st.LastLSN {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("index stuck at LSN %d of %d", st.AppliedLSN, st.LastLSN)
		}
	}
}

// mw builds the middleware on s, failing the test on a configuration error.
func mw(t testing.TB, s idem.Store, o *idemhttp.Options) func(http.Handler) http.Handler {
	t.Helper()
	m, err := idemhttp.Middleware(s, o)
	if err != nil {
		t.Fatal(err)
	}
	return m
}
