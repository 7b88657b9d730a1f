package idemhttp_test

import (
	"errors"
	"net/http"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemhttp"
	"github.com/idemdb/idem/internal/testclock"
)

// The engine is closed and opened again between a request and its retry
// (a deploy, a restart): the stored response survives and is replayed.
func TestRestartBetweenRequestAndRetry(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	dir := filepath.Join(t.TempDir(), "idem")
	app := &items{}
	opts := &idemhttp.Options{Actor: bearer}
	e, err := idem.Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := serve(t, mw(t, e, opts)(app))
	first := post(t, ctx, srv, "restart-key", item1, "Authorization", "Bearer alice")
	if first.status != http.StatusCreated {
		t.Fatal(first.status)
	}
	srv.Close()
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}

	e, err = idem.Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	srv = serve(t, mw(t, e, opts)(app))
	sameResponse(t, first, post(t, ctx, srv, "restart-key", item1, "Authorization", "Bearer alice"))
	wantError(t, post(t, ctx, srv, "restart-key", item2, "Authorization", "Bearer alice"), http.StatusConflict, idemhttp.CodeConflict, "restart-key")
	if app.calls.Load() != 1 {
		t.Fatalf("%d calls", app.calls.Load())
	}
}

// The server crashes while requests are being handled: after the restart
// their keys are in doubt. Retries get IDEMPOTENCY_KEY_PROCESSING until the
// application resolves them (ResolveInDoubt: commit the response it finds it
// made, or abort), or until the claim's lease runs out. ResolveInDoubt only
// touches the keys of the middleware whose options it gets.
func TestCrashInFlight(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	clk := testclock.New()
	mem := vfs.NewCrashableMem()
	engOpts := func(fs vfs.FS) *idem.Options {
		return &idem.Options{FS: fs, Clock: clk.Now, Lease: 10 * time.Minute}
	}
	e, err := idem.Open("/idem", engOpts(mem))
	if err != nil {
		t.Fatal(err)
	}
	app := &items{gate: make(chan struct{}), started: make(chan struct{}, 3)}
	opts := &idemhttp.Options{Actor: bearer}
	other := &idemhttp.Options{Actor: bearer, ScopePrefix: "v2"} // another middleware on the same store
	mux := func(app http.Handler) http.Handler {
		m := http.NewServeMux()
		m.Handle(itemsPath, mw(t, e, opts)(app))
		m.Handle("/v2"+itemsPath, mw(t, e, other)(app))
		return m
	}
	srv := serve(t, mux(app))
	paths := map[string]string{"crash-commit": itemsPath, "crash-abort": itemsPath, "crash-lease": "/v2" + itemsPath}
	for k, path := range paths {
		go func() {
			_, _ = tryDo(ctx, srv.Client(), http.MethodPost, srv.URL+path, item1, idemhttp.HeaderKey, k, "Authorization", "Bearer alice")
		}()
	}
	for range paths {
		<-app.started
	}
	// The machine dies now: only what was fsynced survives.
	crashed := mem.CrashClone(vfs.CrashCloneCfg{})
	close(app.gate)
	srv.Close()
	_ = e.Close()

	e, err = idem.Open("/idem", engOpts(crashed))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	app2 := &items{}
	srv = serve(t, mux(app2))
	send := func(k string) response {
		return do(t, ctx, srv.Client(), http.MethodPost, srv.URL+paths[k], item1, idemhttp.HeaderKey, k, "Authorization", "Bearer alice")
	}
	for k := range paths {
		wantError(t, send(k), http.StatusConflict, idemhttp.CodeProcessing, k)
	}

	// An error from decide stops the resolution, the key left as it was.
	boom := errors.New("records unavailable")
	if c, a, err := idemhttp.ResolveInDoubt(ctx, e, opts, func(idemhttp.InDoubt) (*idemhttp.StoredResponse, bool, error) {
		return nil, false, boom
	}); !errors.Is(err, boom) || c != 0 || a != 0 {
		t.Fatalf("decide's error: %d committed, %d aborted, %v", c, a, err)
	}
	wantError(t, send("crash-abort"), http.StatusConflict, idemhttp.CodeProcessing, "crash-abort")

	// Start-up resolution, as the package documentation shows.
	var found []string
	committed, aborted, err := idemhttp.ResolveInDoubt(ctx, e, opts, func(d idemhttp.InDoubt) (*idemhttp.StoredResponse, bool, error) {
		if d.Actor != "alice" || d.ActorHashed || d.Scope != idemhttp.ScopeFor("", "alice") || !d.ClaimedAt.Equal(testclock.Epoch) {
			t.Errorf("in doubt: %+v", d)
		}
		found = append(found, d.Key)
		if d.Key == "crash-commit" { // the application finds the item it made: store its response
			return &idemhttp.StoredResponse{
				Status: http.StatusCreated,
				Header: http.Header{"Content-Type": {"application/json"}, "Location": {itemsPath + "/1"}},
				Body:   []byte(`{"id":1,"recovered":true}`),
			}, true, nil
		}
		return nil, false, nil // nothing happened: release the key
	})
	if err != nil || committed != 1 || aborted != 1 {
		t.Fatalf("ResolveInDoubt: %d committed, %d aborted, %v", committed, aborted, err)
	}
	slices.Sort(found)
	if !slices.Equal(found, []string{"crash-abort", "crash-commit"}) {
		t.Fatalf("in doubt: %v", found)
	}
	r := send("crash-commit")
	if r.status != http.StatusCreated || string(r.body) != `{"id":1,"recovered":true}` || r.header.Get(idemhttp.HeaderReplayed) != "true" || r.header.Get("Location") != itemsPath+"/1" {
		t.Fatalf("committed in-doubt key: %d %s %v", r.status, r.body, r.header)
	}
	if r := send("crash-abort"); r.status != http.StatusCreated || r.header.Get(idemhttp.HeaderReplayed) != "" {
		t.Fatalf("aborted in-doubt key: %d %v", r.status, r.header)
	}
	// The other middleware's key, left alone: processing until its lease
	// runs out, then new.
	wantError(t, send("crash-lease"), http.StatusConflict, idemhttp.CodeProcessing, "crash-lease")
	clk.Advance(10*time.Minute + time.Second)
	if r := send("crash-lease"); r.status != http.StatusCreated || r.header.Get(idemhttp.HeaderReplayed) != "" {
		t.Fatalf("in-doubt key after its lease: %d %v", r.status, r.header)
	}
	if app2.calls.Load() != 2 {
		t.Fatalf("%d calls after the crash, want 2", app2.calls.Load())
	}
	// A decide error stops it; options are checked.
	if _, _, err := idemhttp.ResolveInDoubt(ctx, e, &idemhttp.Options{TTL: -1}, nil); err == nil {
		t.Fatal("ResolveInDoubt took a nil decide and a negative TTL")
	}
}
