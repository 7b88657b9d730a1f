package idemhttp_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemhttp"
)

// dropper serves h but, for the first n requests, lets h handle the request
// completely (the key is stored) and then drops the connection instead of
// answering: the lost-reply failure retries exist for.
type dropper struct {
	h     http.Handler
	drops atomic.Int64
	seen  atomic.Int64
	mu    sync.Mutex
	keys  []string // Idempotency-Key of every request
	acks  []string // Idempotency-Acked-Keys of every request
}

func (d *dropper) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	d.seen.Add(1)
	d.mu.Lock()
	d.keys = append(d.keys, r.Header.Get(idemhttp.HeaderKey))
	d.acks = append(d.acks, r.Header.Get(idemhttp.HeaderAckedKeys))
	d.mu.Unlock()
	if d.drops.Add(-1) < 0 {
		d.h.ServeHTTP(w, r)
		return
	}
	d.h.ServeHTTP(httptest.NewRecorder(), r)
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(err)
	}
	conn.Close()
}

func newTransportEnv(t *testing.T, opts *idemhttp.Options, drops int64) (*dropper, *items, *httptest.Server, *idem.Engine) {
	e := openEngine(t, nil, nil)
	app := &items{}
	d := &dropper{h: mw(t, e, opts)(app)}
	d.drops.Store(drops)
	return d, app, serve(t, d), e
}

func client(srv *httptest.Server, tr *idemhttp.Transport) *http.Client {
	tr.Base = srv.Client().Transport
	if tr.BaseDelay == 0 {
		tr.BaseDelay = 5 * time.Millisecond
	}
	return &http.Client{Transport: tr}
}

func readAll(t *testing.T, resp *http.Response) string {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// The server handles the request and drops the connection, twice: the
// transport retries with the same key and gets the stored response; the
// handler ran once.
func TestTransportRetriesDroppedConnections(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	d, app, srv, _ := newTransportEnv(t, nil, 2)
	c := client(srv, &idemhttp.Transport{})
	// A body without GetBody: the transport buffers it.
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+itemsPath, io.MultiReader(strings.NewReader(item1)))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body := readAll(t, resp)
	if resp.StatusCode != http.StatusCreated || resp.Header.Get(idemhttp.HeaderReplayed) != "true" || !strings.Contains(body, "ITEM-001") {
		t.Fatalf("%d %v %s", resp.StatusCode, resp.Header, body)
	}
	if app.calls.Load() != 1 || d.seen.Load() != 3 {
		t.Fatalf("%d executions, %d requests seen; want 1 and 3", app.calls.Load(), d.seen.Load())
	}
	key := d.keys[0]
	if _, err := idem.ParseRequestID(key); err != nil {
		t.Fatalf("key %q is not a RequestID: %v", key, err)
	}
	for _, k := range d.keys {
		if k != key {
			t.Fatalf("retries changed the key: %v", d.keys)
		}
	}
	if got := resp.Request.Header.Get(idemhttp.HeaderKey); got != key {
		t.Fatalf("resp.Request carries key %q, want %q", got, key)
	}
	// A new request gets a new key.
	resp, err = c.Post(srv.URL+itemsPath, "application/json", strings.NewReader(item2))
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if d.keys[3] == key || app.calls.Load() != 2 {
		t.Fatalf("second request: key %q, %d calls", d.keys[3], app.calls.Load())
	}
}

// A body too large to buffer (and without GetBody) is sent once: no retry.
func TestTransportLargeBodyNotRetried(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	d, app, srv, _ := newTransportEnv(t, nil, 1)
	c := client(srv, &idemhttp.Transport{MaxBufferBytes: 10})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+itemsPath, io.MultiReader(strings.NewReader(item1)))
	if _, err := c.Do(req); err == nil {
		t.Fatal("a response from a dropped connection")
	}
	if d.seen.Load() != 1 || app.calls.Load() != 1 {
		t.Fatalf("%d requests, %d calls", d.seen.Load(), app.calls.Load())
	}
}

// What is retried and what is not.
func TestTransportRetryPolicy(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	var mu sync.Mutex
	var script []int // statuses to answer, in order; then 201
	attempts := 0
	srv := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		attempts++
		if b, _ := io.ReadAll(r.Body); string(b) != item1 {
			w.WriteHeader(http.StatusTeapot) // the body was not replayed
			return
		}
		if len(script) == 0 {
			w.WriteHeader(http.StatusCreated)
			return
		}
		st := script[0]
		script = script[1:]
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(st)
		switch st {
		case http.StatusConflict:
			io.WriteString(w, `{"detail":"x","error_code":"`+r.Header.Get("X-Code")+`","idempotency_key":"k"}`)
		default:
			io.WriteString(w, `{}`)
		}
	}))
	c := client(srv, &idemhttp.Transport{MaxAttempts: 4})
	run := func(code string, statuses ...int) (int, int) {
		mu.Lock()
		script, attempts = statuses, 0
		mu.Unlock()
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(item1))
		req.Header.Set("X-Code", code)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body := readAll(t, resp)
		if resp.StatusCode == http.StatusConflict && !strings.Contains(body, "error_code") {
			t.Fatalf("the 409 body was not given back whole: %q", body)
		}
		mu.Lock()
		defer mu.Unlock()
		return resp.StatusCode, attempts
	}
	for _, tc := range []struct {
		code      string
		statuses  []int
		wantFinal int
		wantTries int
	}{
		{"", []int{500, 502, 503}, 201, 4},
		{"", []int{504, 500, 500, 500, 500}, 500, 4}, // MaxAttempts: the last answer
		{idemhttp.CodeProcessing, []int{409}, 201, 2},
		{idemhttp.CodeConflict, []int{409}, 409, 1},
		{"", []int{400}, 400, 1},
		{"", []int{422}, 422, 1},
		{"", []int{429}, 429, 1},
		{"", []int{501}, 501, 1},
		{"", []int{404}, 404, 1},
	} {
		final, tries := run(tc.code, tc.statuses...)
		if final != tc.wantFinal || tries != tc.wantTries {
			t.Errorf("%v %s: final %d after %d attempts, want %d after %d", tc.statuses, tc.code, final, tries, tc.wantFinal, tc.wantTries)
		}
	}
}

// Retry-After is honoured, within the request's context: a wait that would
// outlast the context returns the last response at once.
func TestTransportRetryAfterAndContext(t *testing.T) {
	var attempts atomic.Int64
	retryAfter := "1"
	srv := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if attempts.Add(1) == 1 {
			w.Header().Set("Retry-After", retryAfter)
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	c := client(srv, &idemhttp.Transport{})
	ctx := testCtx(t, 30*time.Second)
	start := time.Now()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader("x"))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if resp.StatusCode != http.StatusCreated || attempts.Load() != 2 || time.Since(start) < time.Second {
		t.Fatalf("%d after %d attempts in %v; want 201 after 2, at least 1s (Retry-After)", resp.StatusCode, attempts.Load(), time.Since(start))
	}

	// Retry-After 60 with a 20 s context: no retry, the 503 comes back at
	// once, long before the context ends (with 2 s, an attempt slowed
	// down on a loaded machine could end it first and fail the test).
	attempts.Store(0)
	retryAfter = "60"
	short, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ = http.NewRequestWithContext(short, http.MethodPost, srv.URL, strings.NewReader("x"))
	resp, err = c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if resp.StatusCode != http.StatusServiceUnavailable || attempts.Load() != 1 || short.Err() != nil {
		t.Fatalf("%d after %d attempts (context %v)", resp.StatusCode, attempts.Load(), short.Err())
	}
}

// AttemptTimeout: a slow first attempt is abandoned; the retry finds the
// key in flight (IDEMPOTENCY_KEY_PROCESSING), waits, and gets the replay.
// Gates order the steps, not durations: the handler answers only once its
// client has abandoned the attempt (only the transport's AttemptTimeout
// ends it: the test's context has 30 s) and another attempt has been told
// IDEMPOTENCY_KEY_PROCESSING; a request arriving after that waits until
// the handler's response is stored, so it gets the replay. The attempts
// sent once the handler runs have the test's deadline instead of the
// transport's 100 ms: how long they take is not what is tested, and a
// loaded machine must not time them out (with a 100 ms deadline on every
// attempt, four slow attempts in a row failed the test).
func TestTransportAttemptTimeout(t *testing.T) {
	// Ended when the test returns, before the server's Close waits for
	// the handler (which may still wait on a gate when the test failed).
	ctx, cancel := context.WithCancel(testCtx(t, 30*time.Second))
	defer cancel()
	e := openEngine(t, nil, nil)
	var (
		calls      atomic.Int64
		entered    = make(chan struct{}) // the handler runs
		processing = make(chan struct{}) // an attempt got IDEMPOTENCY_KEY_PROCESSING
		stored     = make(chan struct{}) // the handler's response is stored
		once       sync.Once
	)
	wait := func(ch <-chan struct{}) {
		select {
		case <-ch:
		case <-ctx.Done():
		}
	}
	type ranKey struct{}
	slow := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			r.Context().Value(ranKey{}).(*atomic.Bool).Store(true)
			close(entered)
			wait(r.Context().Done()) // it ignores its context: it finishes anyway
			wait(processing)
		}
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "made")
	})
	inner := mw(t, e, &idemhttp.Options{RetryAfter: 500 * time.Millisecond})(slow)
	srv := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-processing:
			wait(stored)
		default:
		}
		ran := new(atomic.Bool)
		inner.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), ranKey{}, ran)))
		if ran.Load() {
			close(stored)
		}
	}))
	base := srv.Client().Transport.(*http.Transport)
	gated := &gatedTransport{Transport: base, round: func(r *http.Request) (*http.Response, error) {
		select {
		case <-entered:
			r = r.WithContext(ctx)
		default:
		}
		resp, err := base.RoundTrip(r)
		if err == nil && resp.StatusCode == http.StatusConflict {
			once.Do(func() { close(processing) })
		}
		return resp, err
	}}
	c := &http.Client{Transport: &idemhttp.Transport{Base: gated, MaxAttempts: 10, AttemptTimeout: 100 * time.Millisecond, BaseDelay: 5 * time.Millisecond}}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader("x"))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, resp); resp.StatusCode != 201 || body != "made" || resp.Header.Get(idemhttp.HeaderReplayed) != "true" || calls.Load() != 1 {
		t.Fatalf("%d %q %v, %d calls", resp.StatusCode, body, resp.Header, calls.Load())
	}
}

// gatedTransport sends each request with round; its idle connections are
// those of the *http.Transport it embeds (idemhttp.Transport closes them
// after a timed-out attempt).
type gatedTransport struct {
	*http.Transport
	round func(*http.Request) (*http.Response, error)
}

func (g *gatedTransport) RoundTrip(r *http.Request) (*http.Response, error) { return g.round(r) }

// Keys and methods: a caller's key is kept; other methods pass untouched.
func TestTransportKeysAndMethods(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	d, _, srv, _ := newTransportEnv(t, nil, 0)
	c := client(srv, &idemhttp.Transport{})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+itemsPath, strings.NewReader(item1))
	req.Header.Set(idemhttp.HeaderKey, "callers-key")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if req.Header.Get(idemhttp.HeaderKey) != "callers-key" || d.keys[0] != "callers-key" {
		t.Fatalf("key %q", d.keys[0])
	}
	resp, err = c.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if d.keys[1] != "" {
		t.Fatalf("GET got key %q", d.keys[1])
	}
	// The transport never changes the caller's request.
	req, _ = http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+itemsPath, strings.NewReader(item1))
	resp, err = c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if req.Header.Get(idemhttp.HeaderKey) != "" {
		t.Fatal("the caller's request was modified")
	}
}

// Acked keys, end to end: the transport acks the keys whose responses it
// read, the middleware (with a Actor) frees them.
func TestTransportAcksKeys(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	d, _, srv, e := newTransportEnv(t, &idemhttp.Options{Actor: bearer}, 0)
	tr := &idemhttp.Transport{MaxAckedKeys: 2}
	c := client(srv, tr)
	send := func(read bool) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+itemsPath, strings.NewReader(item1))
		req.Header.Set("Authorization", "Bearer alice")
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if read {
			readAll(t, resp)
		} else {
			resp.Body.Close()
		}
	}
	scope := idemhttp.ScopeFor("", "alice")
	status := func(k string) idem.Status {
		res, err := e.Lookup(context.Background(), idem.Request{Scope: scope, ID: []byte(k)})
		if err != nil {
			t.Fatal(err)
		}
		return res.Status
	}
	send(true)
	send(false) // closed unread: not acked
	send(true)
	if d.acks[0] != "" || d.acks[1] != d.keys[0] || d.acks[2] != "" {
		t.Fatalf("acks sent %q; keys %q", d.acks, d.keys)
	}
	if status(d.keys[0]) != idem.Absent || status(d.keys[1]) != idem.Done || status(d.keys[2]) != idem.Done {
		t.Fatal("wrong keys freed")
	}
	if idemhttp.PendingAcks(tr) != 1 {
		t.Fatalf("%d pending acks", idemhttp.PendingAcks(tr))
	}
	// Bob's request does not carry alice's acks.
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+itemsPath, strings.NewReader(item1))
	req.Header.Set("Authorization", "Bearer bob")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	readAll(t, resp)
	if d.acks[3] != "" {
		t.Fatalf("bob's request acked %q", d.acks[3])
	}
}
