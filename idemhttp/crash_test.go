package idemhttp_test

import (
	"context"
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
	opts := &idemhttp.Options{Principal: bearer}
	e, err := idem.Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := serve(t, idemhttp.Middleware(e, opts)(app))
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
	srv = serve(t, idemhttp.Middleware(e, opts)(app))
	sameResponse(t, first, post(t, ctx, srv, "restart-key", item1, "Authorization", "Bearer alice"))
	wantError(t, post(t, ctx, srv, "restart-key", item2, "Authorization", "Bearer alice"), http.StatusConflict, idemhttp.CodeConflict, "restart-key")
	if app.calls.Load() != 1 {
		t.Fatalf("%d calls", app.calls.Load())
	}
}

// The server crashes while requests are being handled: after the restart
// their keys are in doubt. Retries get IDEMPOTENCY_KEY_PROCESSING until the
// application resolves them (InDoubt + ParseKey: commit the response it
// finds it made, or abort), or until the claim's lease runs out.
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
	opts := &idemhttp.Options{Principal: bearer}
	srv := serve(t, idemhttp.Middleware(e, opts)(app))
	keys := []string{"crash-commit", "crash-abort", "crash-lease"}
	for _, k := range keys {
		go func() {
			_, _ = tryDo(ctx, srv.Client(), http.MethodPost, srv.URL+itemsPath, item1, idemhttp.HeaderKey, k, "Authorization", "Bearer alice")
		}()
	}
	for range keys {
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
	srv = serve(t, idemhttp.Middleware(e, opts)(app2))
	for _, k := range keys {
		r := post(t, ctx, srv, k, item1, "Authorization", "Bearer alice")
		wantError(t, r, http.StatusConflict, idemhttp.CodeProcessing, k)
	}

	// Start-up resolution, as the package documentation shows.
	doubts, err := e.InDoubt(context.Background(), "")
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, d := range doubts {
		info, ok := idemhttp.ParseKey(d.Scope, d.ID)
		if !ok || info.Principal != "alice" || info.Prefix != "" {
			t.Fatalf("in-doubt claim %q %q: %+v %v", d.Scope, d.ID, info, ok)
		}
		found = append(found, info.Key)
		switch info.Key {
		case "crash-commit": // the application finds the item it made: store its response
			sr := &idemhttp.StoredResponse{
				Status: http.StatusCreated,
				Header: http.Header{"Content-Type": {"application/json"}, "Location": {itemsPath + "/1"}},
				Body:   []byte(`{"id":1,"recovered":true}`),
			}
			reply, err := sr.Encode()
			if err != nil {
				t.Fatal(err)
			}
			if err := d.Claim.Commit(ctx, reply); err != nil {
				t.Fatal(err)
			}
		case "crash-abort": // nothing happened: release the key
			if err := d.Claim.Abort(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	slices.Sort(found)
	if !slices.Equal(found, []string{"crash-abort", "crash-commit", "crash-lease"}) {
		t.Fatalf("in doubt: %v", found)
	}
	r := post(t, ctx, srv, "crash-commit", item1, "Authorization", "Bearer alice")
	if r.status != http.StatusCreated || string(r.body) != `{"id":1,"recovered":true}` || r.header.Get(idemhttp.HeaderReplayed) != "true" || r.header.Get("Location") != itemsPath+"/1" {
		t.Fatalf("committed in-doubt key: %d %s %v", r.status, r.body, r.header)
	}
	if r := post(t, ctx, srv, "crash-abort", item1, "Authorization", "Bearer alice"); r.status != http.StatusCreated || r.header.Get(idemhttp.HeaderReplayed) != "" {
		t.Fatalf("aborted in-doubt key: %d %v", r.status, r.header)
	}
	// The unresolved one: processing until its lease runs out, then new.
	wantError(t, post(t, ctx, srv, "crash-lease", item1, "Authorization", "Bearer alice"), http.StatusConflict, idemhttp.CodeProcessing, "crash-lease")
	clk.Advance(10*time.Minute + time.Second)
	if r := post(t, ctx, srv, "crash-lease", item1, "Authorization", "Bearer alice"); r.status != http.StatusCreated || r.header.Get(idemhttp.HeaderReplayed) != "" {
		t.Fatalf("in-doubt key after its lease: %d %v", r.status, r.header)
	}
	if app2.calls.Load() != 2 {
		t.Fatalf("%d calls after the crash, want 2", app2.calls.Load())
	}
}
