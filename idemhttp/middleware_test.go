package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemhttp"
	"github.com/idemdb/idem/internal/testclock"
)

const (
	item1 = `{"sku": "ITEM-001", "title": "Sample Item"}`
	item2 = `{"sku": "ITEM-002", "title": "Different Item"}`
)

func wantError(t *testing.T, r response, status int, code, key string) idemhttp.ErrorBody {
	t.Helper()
	if r.status != status {
		t.Fatalf("status %d (%s), want %d", r.status, r.body, status)
	}
	eb := r.errorBody(t)
	if eb.ErrorCode != code || eb.IdempotencyKey != key || eb.Detail == "" {
		t.Fatalf("error body %+v, want error_code %s, idempotency_key %q and a detail", eb, code, key)
	}
	return eb
}

// The Idempotency-Key service's four scenarios, in order, on one key.
func TestScenarios(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	app := &items{}
	srv := serve(t, mw(t, e, &idemhttp.Options{Logger: testLogger(t)})(app))

	// 1. New key: runs, 201.
	first := post(t, ctx, srv, "new-key-123", item1)
	if first.status != http.StatusCreated || app.calls.Load() != 1 {
		t.Fatalf("new key: %d %q, %d calls", first.status, first.body, app.calls.Load())
	}
	if want := `{"id":1,"request":"{\"sku\": \"ITEM-001\", \"title\": \"Sample Item\"}"}`; string(first.body) != want {
		t.Fatalf("body %s, want %s", first.body, want)
	}
	if first.header.Get("Location") != itemsPath+"/1" {
		t.Fatalf("Location %q", first.header.Get("Location"))
	}

	// 2. Same key, same body: the stored 201, byte for byte; nothing runs.
	for range 3 {
		replay := post(t, ctx, srv, "new-key-123", item1)
		sameResponse(t, first, replay)
	}
	if n := app.calls.Load(); n != 1 {
		t.Fatalf("replays ran the handler: %d calls", n)
	}

	// 3. Same key, other body: 409 IDEMPOTENCY_KEY_CONFLICT.
	c := post(t, ctx, srv, "new-key-123", item2)
	eb := wantError(t, c, http.StatusConflict, idemhttp.CodeConflict, "new-key-123")
	if eb.Detail != "Idempotency key already used with different request body" {
		t.Fatalf("detail %q", eb.Detail)
	}
	if want := `{"detail":"Idempotency key already used with different request body","error_code":"IDEMPOTENCY_KEY_CONFLICT","idempotency_key":"new-key-123"}` + "\n"; string(c.body) != want {
		t.Fatalf("conflict body %s, want %s", c.body, want)
	}

	// 4. Race: a second request while the first is handled: 409
	// IDEMPOTENCY_KEY_PROCESSING with Retry-After; then the first's 201.
	app.gate, app.started = make(chan struct{}), make(chan struct{}, 1)
	done := make(chan response, 1)
	go func() {
		r, err := tryDo(ctx, srv.Client(), http.MethodPost, srv.URL+itemsPath, item1, idemhttp.HeaderKey, "race-key")
		if err != nil {
			t.Error(err)
		}
		done <- r
	}()
	<-app.started
	p := post(t, ctx, srv, "race-key", item1)
	wantError(t, p, http.StatusConflict, idemhttp.CodeProcessing, "race-key")
	if ra := p.header.Get("Retry-After"); ra != "1" {
		t.Fatalf("Retry-After %q, want 1", ra)
	}
	if p.errorBody(t).Detail != "Request with this idempotency key is already being processed" {
		t.Fatalf("detail %q", p.errorBody(t).Detail)
	}
	close(app.gate)
	r1 := <-done
	if r1.status != http.StatusCreated {
		t.Fatalf("first of the race: %d %s", r1.status, r1.body)
	}
	sameResponse(t, r1, post(t, ctx, srv, "race-key", item1))
	if n := app.calls.Load(); n != 2 {
		t.Fatalf("%d calls, want 2", n)
	}
	if st := e.Stats(); st.Hits != 4 || st.Misses != 2 || st.Conflicts != 1 || st.InFlightCollisions != 1 {
		t.Fatalf("engine stats %+v", st)
	}
}

func TestConflictOnOtherEndpointAndStatus422(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	app := &items{}
	srv := serve(t, mw(t, e, &idemhttp.Options{ConflictStatus: http.StatusUnprocessableEntity})(app))
	if r := post(t, ctx, srv, "k", item1); r.status != http.StatusCreated {
		t.Fatal(r.status)
	}
	// Same key and body on another path, with another query, another
	// method handled by the middleware: a conflict, never a replay.
	for _, u := range []string{srv.URL + "/api/v1/orders", srv.URL + itemsPath + "?dry_run=1", srv.URL + itemsPath + "/"} {
		r := do(t, ctx, srv.Client(), http.MethodPost, u, item1, idemhttp.HeaderKey, "k")
		wantError(t, r, http.StatusUnprocessableEntity, idemhttp.CodeConflict, "k")
	}
	if app.calls.Load() != 1 {
		t.Fatalf("%d calls", app.calls.Load())
	}
}

func TestInvalidKeys(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	app := &items{}
	srv := serve(t, mw(t, e, nil)(app))
	const detail = "Invalid idempotency key format. Key must be 1-255 characters long and contain only letters, numbers, hyphens, and underscores"
	for _, k := range []string{"@invalid-key#123", "invalid@key#123", "has space", "ключ", "a.b", "a/b", "a+b", strings.Repeat("k", 254) + "!"} {
		r := post(t, ctx, srv, k, item1)
		if eb := wantError(t, r, http.StatusBadRequest, idemhttp.CodeInvalidKey, k); eb.Detail != detail {
			t.Fatalf("detail %q, want %q", eb.Detail, detail)
		}
	}
	// An empty header is present but empty: invalid too.
	r := do(t, ctx, srv.Client(), http.MethodPost, srv.URL+itemsPath, item1, idemhttp.HeaderKey, "")
	if eb := wantError(t, r, http.StatusBadRequest, idemhttp.CodeInvalidKey, ""); eb.Detail != detail {
		t.Fatalf("detail %q", eb.Detail)
	}
	// Sent twice: ambiguous.
	r = do(t, ctx, srv.Client(), http.MethodPost, srv.URL+itemsPath, item1, idemhttp.HeaderKey, "a", idemhttp.HeaderKey, "b")
	if eb := wantError(t, r, http.StatusBadRequest, idemhttp.CodeInvalidKey, "a, b"); eb.Detail != "Invalid idempotency key: the Idempotency-Key header was sent more than once" {
		t.Fatalf("detail %q", eb.Detail)
	}
	// A key longer than 255 bytes is echoed cut to its first 64 bytes and
	// its length, and the detail says so: the whole body, byte for byte.
	for _, n := range []int{256, 300, 10 << 10} {
		long := strings.Repeat("x", n)
		r = post(t, ctx, srv, long, item1)
		want := fmt.Sprintf(`{"detail":"%s. The key sent is %d bytes long: idempotency_key shows its first 64","error_code":"INVALID_IDEMPOTENCY_KEY","idempotency_key":"%s…(%d bytes)"}`+"\n", detail, n, long[:64], n)
		if r.status != http.StatusBadRequest || string(r.body) != want {
			t.Fatalf("%d-byte key: %d %s, want 400 %s", n, r.status, r.body, want)
		}
	}
	if app.calls.Load() != 0 {
		t.Fatalf("invalid keys ran the handler %d times", app.calls.Load())
	}
	// The longest and the odd valid ones work.
	for _, k := range []string{strings.Repeat("k", 255), "a", "-", "_", "client-request-123", "2024-01-15-10-30-00-abc123", "A_z-09"} {
		if r := post(t, ctx, srv, k, item1); r.status != http.StatusCreated {
			t.Fatalf("key %q: %d %s", k, r.status, r.body)
		}
	}
}

func TestPassThroughAndRequireKey(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	app := &items{}
	srv := serve(t, mw(t, e, nil)(app))
	// No key: passes through, every time.
	for i := 1; i <= 2; i++ {
		if r := post(t, ctx, srv, "", item1); r.status != http.StatusCreated || r.header.Get(idemhttp.HeaderReplayed) != "" {
			t.Fatalf("%d %v", r.status, r.header)
		}
	}
	// Methods not in Methods pass through even with a (bad) key.
	for range 2 {
		r := do(t, ctx, srv.Client(), http.MethodPut, srv.URL+itemsPath, item1, idemhttp.HeaderKey, "@bad")
		if r.status != http.StatusCreated {
			t.Fatalf("PUT: %d", r.status)
		}
	}
	if app.calls.Load() != 4 || e.Stats().Misses != 0 {
		t.Fatalf("%d calls, %d misses", app.calls.Load(), e.Stats().Misses)
	}

	// RequireKey: 400 MISSING_IDEMPOTENCY_KEY; Methods: PUT too.
	srv2 := serve(t, mw(t, e, &idemhttp.Options{RequireKey: true, Methods: []string{"POST", "PUT"}})(app))
	r := do(t, ctx, srv2.Client(), http.MethodPut, srv2.URL+itemsPath, item1)
	if eb := wantError(t, r, http.StatusBadRequest, idemhttp.CodeMissingKey, ""); eb.Detail != "This endpoint requires an Idempotency-Key header" {
		t.Fatalf("detail %q", eb.Detail)
	}
	r = do(t, ctx, srv2.Client(), http.MethodPut, srv2.URL+itemsPath, item1, idemhttp.HeaderKey, "put-1")
	if r.status != http.StatusCreated {
		t.Fatal(r.status)
	}
	sameResponse(t, r, do(t, ctx, srv2.Client(), http.MethodPut, srv2.URL+itemsPath, item1, idemhttp.HeaderKey, "put-1"))
	if r := do(t, ctx, srv2.Client(), http.MethodGet, srv2.URL+itemsPath, ""); r.status != http.StatusCreated {
		t.Fatalf("GET with RequireKey: %d", r.status)
	}
}

// The Idempotency-Key service's timing table, on the engine's clock: a key
// made at T replays at T+1m, T+10m and T+60m, and runs again at T+61m.
func TestTimingTable(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	clk := testclock.New()
	e := openEngine(t, clk, nil)
	app := &items{}
	srv := serve(t, mw(t, e, nil)(app)) // default TTL: 1 hour
	start := clk.Now()
	first := post(t, ctx, srv, "timed-key", item1)
	if first.status != http.StatusCreated {
		t.Fatal(first.status)
	}
	for _, step := range []struct {
		at    time.Duration
		calls int64
	}{
		{time.Minute, 1},
		{10 * time.Minute, 1},
		{60 * time.Minute, 1}, // expires_at == now: not expired yet
		{60*time.Minute + time.Microsecond, 2},
	} {
		clk.Set(start.Add(step.at))
		r := post(t, ctx, srv, "timed-key", item1)
		if r.status != http.StatusCreated || app.calls.Load() != step.calls {
			t.Fatalf("T+%v: %d, %d calls, want %d", step.at, r.status, app.calls.Load(), step.calls)
		}
		if step.calls == 1 {
			sameResponse(t, first, r)
		} else if r.header.Get(idemhttp.HeaderReplayed) != "" || string(r.body) == string(first.body) {
			t.Fatalf("T+%v: ran again but looks replayed: %v %s", step.at, r.header, r.body)
		}
	}
	// The table's T+61m row, on a key of its own.
	clk.Set(start)
	post(t, ctx, srv, "timed-key-2", item1)
	clk.Set(start.Add(61 * time.Minute))
	if r := post(t, ctx, srv, "timed-key-2", item1); r.header.Get(idemhttp.HeaderReplayed) != "" {
		t.Fatal("T+61m replayed")
	}
	// The cleanup removes what expired, by the engine's clock.
	clk.Set(start.Add(3 * time.Hour))
	waitApplied(t, e) // the cleanup walks the index, which trails the WAL a little
	n, err := e.CleanupExpired(ctx)
	if err != nil || n != 2 {
		t.Fatalf("cleanup removed %d (%v), want 2", n, err)
	}
	if st := e.Stats(); st.Cleanups != 2 {
		t.Fatalf("Stats.Cleanups %d", st.Cleanups)
	}
}

// Two middlewares with different TTLs share one engine opened with
// default options.
func TestTTLPerMiddleware(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	clk := testclock.New()
	e := openEngine(t, clk, nil)
	app := &items{}
	short := serve(t, mw(t, e, &idemhttp.Options{TTL: time.Minute, ScopePrefix: "short"})(app))
	long := serve(t, mw(t, e, &idemhttp.Options{TTL: 24 * time.Hour, ScopePrefix: "long"})(app))
	post(t, ctx, short, "k", item1)
	post(t, ctx, long, "k", item1)
	if app.calls.Load() != 2 {
		t.Fatalf("scopes met: %d calls", app.calls.Load())
	}
	clk.Advance(2 * time.Minute)
	if r := post(t, ctx, short, "k", item1); r.header.Get(idemhttp.HeaderReplayed) != "" {
		t.Fatal("short TTL key replayed after 2 minutes")
	}
	if r := post(t, ctx, long, "k", item1); r.header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Fatal("long TTL key not replayed after 2 minutes")
	}
	if app.calls.Load() != 3 {
		t.Fatalf("%d calls, want 3", app.calls.Load())
	}
}

// Hundreds of parallel requests with one key: the handler runs exactly
// once; every other request gets the replay or IDEMPOTENCY_KEY_PROCESSING.
func TestConcurrentRetriesOneExecution(t *testing.T) {
	ctx := testCtx(t, 60*time.Second)
	e := openEngine(t, nil, nil)
	app := &items{}
	srv := serve(t, mw(t, e, nil)(app))
	tr := srv.Client().Transport.(*http.Transport)
	tr.MaxIdleConnsPerHost = 300
	n, rounds := 300, 3
	if v, _ := strconv.Atoi(os.Getenv("IDEMHTTP_STRESS")); v > 0 { // longer run: IDEMHTTP_STRESS=<rounds>
		n, rounds = 1000, v
		ctx = testCtx(t, time.Duration(v)*30*time.Second)
	}
	for round := range rounds {
		key := fmt.Sprintf("hot-key-%d", round)
		res := make([]response, n)
		errs := make([]error, n)
		parallel(n, func(i int) {
			res[i], errs[i] = tryDo(ctx, srv.Client(), http.MethodPost, srv.URL+itemsPath, item1, idemhttp.HeaderKey, key)
		})
		var created, replayed, processing int
		var body string
		for i, r := range res {
			if errs[i] != nil {
				t.Fatal(errs[i])
			}
			switch {
			case r.status == http.StatusCreated:
				if body == "" {
					body = string(r.body)
				} else if string(r.body) != body {
					t.Fatalf("two different 201 bodies: %s and %s", body, r.body)
				}
				if r.header.Get(idemhttp.HeaderReplayed) == "true" {
					replayed++
				} else {
					created++
				}
			case r.status == http.StatusConflict && r.errorBody(t).ErrorCode == idemhttp.CodeProcessing:
				processing++
			default:
				t.Fatalf("unexpected %d %s", r.status, r.body)
			}
		}
		if created != 1 || app.calls.Load() != int64(round+1) {
			t.Fatalf("round %d: %d executions (%d calls) among %d requests; %d replays, %d processing", round, created, app.calls.Load(), n, replayed, processing)
		}
		t.Logf("round %d: 1 execution, %d replays, %d processing", round, replayed, processing)
	}
}

// With WaitInFlight, parallel requests wait for the first and get its
// response. The handler answers only once every other request found the
// key in flight (the engine's InFlightCollisions): none of them can come
// late and get a replay without having waited.
func TestWaitInFlight(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	app := &items{gate: make(chan struct{}), started: make(chan struct{}, 1)}
	srv := serve(t, mw(t, e, &idemhttp.Options{WaitInFlight: 20 * time.Second})(app))
	const n = 20
	res := make([]response, n)
	go func() {
		defer close(app.gate)
		<-app.started
		for e.Stats().InFlightCollisions < n-1 && ctx.Err() == nil {
			time.Sleep(time.Millisecond) // polling the engine's counter
		}
	}()
	parallel(n, func(i int) { res[i] = post(t, ctx, srv, "waited", item1) })
	for _, r := range res {
		if r.status != http.StatusCreated || string(r.body) != string(res[0].body) {
			t.Fatalf("%d %s", r.status, r.body)
		}
	}
	if app.calls.Load() != 1 {
		t.Fatalf("%d calls", app.calls.Load())
	}
}

// A 5xx releases the key (the retry runs again); a 4xx is stored.
func TestServerErrorReleasesKey(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	var calls int
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		switch calls {
		case 1:
			http.Error(w, "database down", http.StatusServiceUnavailable)
		case 2:
			w.WriteHeader(http.StatusInternalServerError) // no body
		default:
			http.Error(w, "sku already exists", http.StatusBadRequest)
		}
	})
	srv := serve(t, mw(t, e, nil)(h))
	r := post(t, ctx, srv, "k5", item1)
	if r.status != http.StatusServiceUnavailable || string(r.body) != "database down\n" {
		t.Fatalf("%d %q", r.status, r.body)
	}
	if r := post(t, ctx, srv, "k5", item1); r.status != http.StatusInternalServerError {
		t.Fatalf("retry: %d", r.status)
	}
	first := post(t, ctx, srv, "k5", item1)
	if first.status != http.StatusBadRequest || calls != 3 {
		t.Fatalf("third: %d, %d calls", first.status, calls)
	}
	sameResponse(t, first, post(t, ctx, srv, "k5", item1))
	if calls != 3 {
		t.Fatalf("a stored 400 ran again: %d calls", calls)
	}
}

// A panic releases the key and goes on to net/http (which drops the
// connection); the retry runs again.
func TestPanicReleasesKey(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	var calls int
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		if calls == 1 {
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "half a resp")
			panic("boom")
		}
		if calls == 2 {
			panic(http.ErrAbortHandler)
		}
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "created")
	})
	recovered := make(chan any, 2)
	srv := serveQuiet(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			v := recover()
			recovered <- v
			if v != nil {
				panic(v)
			}
		}()
		mw(t, e, &idemhttp.Options{Logger: testLogger(t)})(h).ServeHTTP(w, r)
	}))
	for i, want := range []any{"boom", http.ErrAbortHandler} {
		if _, err := tryDo(ctx, srv.Client(), http.MethodPost, srv.URL+itemsPath, item1, idemhttp.HeaderKey, "kp"); err == nil {
			t.Fatalf("request %d: a response despite the panic", i)
		}
		if v := <-recovered; v != want {
			t.Fatalf("panic %v reached net/http, want %v", v, want)
		}
	}
	r := post(t, ctx, srv, "kp", item1)
	if r.status != http.StatusCreated || string(r.body) != "created" || calls != 3 {
		t.Fatalf("%d %q %d calls", r.status, r.body, calls)
	}
	<-recovered
	sameResponse(t, r, post(t, ctx, srv, "kp", item1))
}

// Actors: one key space each; a Actor error is a 401.
func TestActorsKeptApart(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	app := &items{}
	opts := &idemhttp.Options{Actor: bearer, Logger: testLogger(t)}
	srv := serve(t, mw(t, e, opts)(app))
	alice := post(t, ctx, srv, "same-key", item1, "Authorization", "Bearer alice")
	bob := post(t, ctx, srv, "same-key", item1, "Authorization", "Bearer bob")
	if alice.status != 201 || bob.status != 201 || string(alice.body) == string(bob.body) || app.calls.Load() != 2 {
		t.Fatalf("alice %d %s, bob %d %s, %d calls", alice.status, alice.body, bob.status, bob.body, app.calls.Load())
	}
	sameResponse(t, alice, post(t, ctx, srv, "same-key", item1, "Authorization", "Bearer alice"))
	sameResponse(t, bob, post(t, ctx, srv, "same-key", item1, "Authorization", "Bearer bob"))
	// Bob's other body is his own conflict, not alice's business.
	wantError(t, post(t, ctx, srv, "same-key", item2, "Authorization", "Bearer bob"), http.StatusConflict, idemhttp.CodeConflict, "same-key")
	// No credentials: 401; without a key the request passes through (the
	// application's own authentication decides).
	wantError(t, post(t, ctx, srv, "same-key", item1), http.StatusUnauthorized, idemhttp.CodeUnauthenticated, "same-key")
	wantError(t, post(t, ctx, srv, "same-key", item1, "Authorization", "Bearer "), http.StatusUnauthorized, idemhttp.CodeUnauthenticated, "same-key")
	if r := post(t, ctx, srv, "", item1); r.status != 201 {
		t.Fatal(r.status)
	}
	// A actor that is a prefix of another, or holds the separators.
	for _, p := range []string{"al", "alice/p:x", "alice/-", strings.Repeat("p", 300), strings.Repeat("p", 301)} {
		r := post(t, ctx, srv, "same-key", item1, "Authorization", "Bearer "+p)
		if r.status != 201 || r.header.Get(idemhttp.HeaderReplayed) != "" {
			t.Fatalf("actor %q met another's key: %d %v", p, r.status, r.header)
		}
	}
	// The engine holds them in scopes ScopeFor names.
	for _, p := range []string{"alice", "bob"} {
		res, err := e.Lookup(ctx, idem.Request{Scope: idemhttp.ScopeFor("", p), ID: []byte("same-key")})
		if err != nil || res.Status != idem.Done {
			t.Fatalf("%s: %v %v", p, res.Status, err)
		}
	}
}

// bearer is the test's authentication: the actor is the bearer token.
func bearer(r *http.Request) (string, error) {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok {
		return "", errors.New("no bearer token")
	}
	return tok, nil
}

// Acked keys free storage at once with a Actor, and are ignored
// without one.
func TestAckedKeys(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	app := &items{}
	srv := serve(t, mw(t, e, &idemhttp.Options{Actor: bearer, MaxAckedKeys: 3})(app))
	auth := []string{"Authorization", "Bearer alice"}
	scope := idemhttp.ScopeFor("", "alice")
	for _, k := range []string{"k1", "k2", "k3", "k4"} {
		post(t, ctx, srv, k, item1, auth...)
	}
	lookup := func(k string) idem.Status {
		res, err := e.Lookup(ctx, idem.Request{Scope: scope, ID: []byte(k)})
		if err != nil {
			t.Fatal(err)
		}
		return res.Status
	}
	// A fresh request acks k1 and k2 (its own key in the list is ignored).
	r := post(t, ctx, srv, "k5", item1, append(auth, idemhttp.HeaderAckedKeys, "k1, k2,k5")...)
	if r.status != 201 || lookup("k1") != idem.Absent || lookup("k2") != idem.Absent || lookup("k3") != idem.Done {
		t.Fatalf("%d; k1 %v k2 %v k3 %v", r.status, lookup("k1"), lookup("k2"), lookup("k3"))
	}
	// A replay acks too (repeated header lines are one list).
	r = post(t, ctx, srv, "k5", item1, append(auth, idemhttp.HeaderAckedKeys, "k3", idemhttp.HeaderAckedKeys, "k4")...)
	if r.header.Get(idemhttp.HeaderReplayed) != "true" || lookup("k3") != idem.Absent || lookup("k4") != idem.Absent {
		t.Fatalf("replay: %v; k3 %v k4 %v", r.header, lookup("k3"), lookup("k4"))
	}
	if st := e.Stats(); st.Acked != 4 {
		t.Fatalf("Stats.Acked %d", st.Acked)
	}
	// Bob cannot ack alice's keys: his acks are in his own space.
	post(t, ctx, srv, "k6", item1, "Authorization", "Bearer bob", idemhttp.HeaderAckedKeys, "k5")
	if lookup("k5") != idem.Done {
		t.Fatal("bob acked alice's key")
	}
	// Invalid lists: 400, nothing run, nothing acked.
	for _, v := range []string{"k5,bad@key", "a,b,c,d"} {
		r := post(t, ctx, srv, "k7", item1, append(auth, idemhttp.HeaderAckedKeys, v)...)
		wantError(t, r, http.StatusBadRequest, idemhttp.CodeInvalidAckedKeys, "k7")
	}
	if lookup("k5") != idem.Done || lookup("k7") != idem.Absent {
		t.Fatal("a refused request changed keys")
	}

	// Without Actor the header is ignored.
	shared := serve(t, mw(t, e, &idemhttp.Options{ScopePrefix: "shared"})(app))
	post(t, ctx, shared, "s1", item1)
	post(t, ctx, shared, "s2", item1, idemhttp.HeaderAckedKeys, "s1")
	if res, _ := e.Lookup(ctx, idem.Request{Scope: idemhttp.ScopeFor("shared", ""), ID: []byte("s1")}); res.Status != idem.Done {
		t.Fatalf("s1 acked without an actor: %v", res.Status)
	}
}

func TestRequestBodyLimit(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	app := &items{}
	srv := serve(t, mw(t, e, &idemhttp.Options{MaxRequestBytes: 1000})(app))
	big := `"` + strings.Repeat("x", 1000) + `"`
	r := post(t, ctx, srv, "big", big)
	eb := wantError(t, r, http.StatusRequestEntityTooLarge, idemhttp.CodeRequestTooLarge, "big")
	if !strings.Contains(eb.Detail, "1000 bytes") {
		t.Fatalf("detail %q", eb.Detail)
	}
	// Without a Content-Length (chunked): the same, by reading.
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+itemsPath, io.MultiReader(strings.NewReader(big)))
	req.Header.Set(idemhttp.HeaderKey, "big")
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	wantError(t, response{resp.StatusCode, resp.Header, b}, http.StatusRequestEntityTooLarge, idemhttp.CodeRequestTooLarge, "big")
	// Exactly the limit is fine, and the key was not used by the refusals.
	ok := `"` + strings.Repeat("x", 998) + `"`
	if r := post(t, ctx, srv, "big", ok); r.status != 201 || app.calls.Load() != 1 {
		t.Fatalf("%d, %d calls", r.status, app.calls.Load())
	}
}

// A response larger than MaxResponseBytes streams to the first client;
// retries are told it cannot be replayed. Smaller ones are stored whole.
func TestResponseLimit(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	var calls int
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		n := 1000
		if r.URL.Query().Get("big") != "" {
			n = 5000
		}
		w.Header().Set("Content-Type", "text/plain")
		for i := range n / 100 {
			fmt.Fprintf(w, "%099d\n", i)
		}
	})
	srv := serve(t, mw(t, e, &idemhttp.Options{MaxResponseBytes: 2000, Logger: testLogger(t)})(h))
	small := do(t, ctx, srv.Client(), "POST", srv.URL+"/x", "", idemhttp.HeaderKey, "small")
	if small.status != 200 || len(small.body) != 1000 || small.header.Get("Content-Length") != "1000" {
		t.Fatalf("%d %d %v", small.status, len(small.body), small.header)
	}
	sameResponse(t, small, do(t, ctx, srv.Client(), "POST", srv.URL+"/x", "", idemhttp.HeaderKey, "small"))
	big := do(t, ctx, srv.Client(), "POST", srv.URL+"/x?big=1", "", idemhttp.HeaderKey, "big")
	if big.status != 200 || len(big.body) != 5000 || big.header.Get("Content-Type") != "text/plain" {
		t.Fatalf("first client got %d, %d bytes", big.status, len(big.body))
	}
	r := do(t, ctx, srv.Client(), "POST", srv.URL+"/x?big=1", "", idemhttp.HeaderKey, "big")
	eb := wantError(t, r, http.StatusConflict, idemhttp.CodeResponseNotStored, "big")
	if !strings.Contains(eb.Detail, "status 200") || r.header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Fatalf("%q %v", eb.Detail, r.header)
	}
	if calls != 2 {
		t.Fatalf("%d calls", calls)
	}
}

// Flush is deferred until the response is stored; past the limit the
// response really streams.
func TestStreamingHandler(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	proceed := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			fmt.Fprintf(w, "data: %d\n\n", i)
			w.(http.Flusher).Flush()
			if err := http.NewResponseController(w).Flush(); err != nil {
				t.Errorf("ResponseController.Flush: %v", err)
			}
		}
		if r.URL.Path == "/big" {
			w.Write(make([]byte, 3000)) // past the limit: streaming from here
			w.(http.Flusher).Flush()
			<-proceed // the client has read what was flushed
			io.WriteString(w, "end")
		}
	})
	srv := serve(t, mw(t, e, &idemhttp.Options{MaxResponseBytes: 2000})(h))
	first := do(t, ctx, srv.Client(), "POST", srv.URL+"/small", "", idemhttp.HeaderKey, "sse")
	if string(first.body) != "data: 0\n\ndata: 1\n\ndata: 2\n\n" {
		t.Fatalf("%q", first.body)
	}
	sameResponse(t, first, do(t, ctx, srv.Client(), "POST", srv.URL+"/small", "", idemhttp.HeaderKey, "sse"))

	req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/big", nil)
	req.Header.Set(idemhttp.HeaderKey, "sse-big")
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	head := make([]byte, 27+3000)
	if _, err := io.ReadFull(resp.Body, head); err != nil { // arrives before the handler returns
		t.Fatal(err)
	}
	close(proceed)
	rest, _ := io.ReadAll(resp.Body)
	if string(rest) != "end" {
		t.Fatalf("rest %q", rest)
	}
}

// Trailers are stored and replayed.
func TestTrailers(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Checksum")
		w.WriteHeader(http.StatusAccepted)
		io.WriteString(w, "body")
		w.Header().Set("X-Checksum", "abc")
		w.Header().Set(http.TrailerPrefix+"X-Late", "late")
		w.Header().Set("X-Ignored", "set after the status")
	})
	srv := serve(t, mw(t, e, nil)(h))
	get := func() (*http.Response, string) {
		req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL, nil)
		req.Header.Set(idemhttp.HeaderKey, "tr")
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	for i := range 2 {
		resp, body := get()
		if resp.StatusCode != 202 || body != "body" || resp.Trailer.Get("X-Checksum") != "abc" || resp.Trailer.Get("X-Late") != "late" || resp.Header.Get("X-Ignored") != "" {
			t.Fatalf("attempt %d: %d %q trailer %v header %v", i, resp.StatusCode, body, resp.Trailer, resp.Header)
		}
		if (i == 1) != (resp.Header.Get(idemhttp.HeaderReplayed) == "true") {
			t.Fatalf("attempt %d: replayed header %q", i, resp.Header.Get(idemhttp.HeaderReplayed))
		}
	}
}

// A client that goes away: a handler that gives up without writing
// releases the key; one that finishes anyway has its response stored.
func TestClientDisconnect(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	started := make(chan struct{}, 1)
	finished := make(chan struct{}, 1)
	var calls int
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		started <- struct{}{}
		<-r.Context().Done() // the client went away
		defer func() { finished <- struct{}{} }()
		if r.URL.Path == "/gives-up" {
			return
		}
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "done anyway")
	})
	srv := serve(t, mw(t, e, nil)(h))
	for _, path := range []string{"/gives-up", "/finishes"} {
		cctx, cancel := context.WithCancel(ctx)
		go func() { <-started; cancel() }()
		if _, err := tryDo(cctx, srv.Client(), "POST", srv.URL+path, "", idemhttp.HeaderKey, "gone"+path[1:]); err == nil {
			t.Fatal("a response after cancel")
		}
		<-finished
		// The middleware finishes after the handler returned: wait for it.
		var st idem.Status
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			res, _ := e.Lookup(ctx, idem.Request{Scope: idemhttp.ScopeFor("", ""), ID: []byte("gone" + path[1:])})
			if st = res.Status; st != idem.InFlight {
				break
			}
		}
		if path == "/gives-up" && st != idem.Absent || path == "/finishes" && st != idem.Done {
			t.Fatalf("%s: key %v", path, st)
		}
	}
	r := do(t, ctx, srv.Client(), "POST", srv.URL+"/finishes", "", idemhttp.HeaderKey, "gonefinishes")
	if r.status != 201 || string(r.body) != "done anyway" || r.header.Get(idemhttp.HeaderReplayed) != "true" || calls != 2 {
		t.Fatalf("%d %q %v, %d calls", r.status, r.body, r.header, calls)
	}
}
