package idemhttp_test

import (
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem/idemhttp"
)

// A 5xx that may follow the side effect (Options.NoEffect false for it) is
// stored and replayed: the handler never runs twice for the key. A 5xx the
// option certifies as effect-free releases the key, as every 5xx does by
// default (the Idempotency-Key service's rule). A panic counts as a 500.
func TestNoEffectOption(t *testing.T) {
	e := openEngine(t, nil, nil)
	var runs atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		switch r.Header.Get("X-Fail") {
		case "after-effect":
			http.Error(w, "the payment went out, the receipt failed", http.StatusInternalServerError)
		case "unavailable":
			http.Error(w, "the database is down: nothing done", http.StatusServiceUnavailable)
		case "panic":
			panic("handler bug after the effect")
		default:
			w.WriteHeader(http.StatusCreated)
		}
	})
	only503 := func(status int) bool { return status == http.StatusServiceUnavailable }
	srv := serveQuiet(t, mw(t, e, &idemhttp.Options{NoEffect: only503})(h))
	ctx := testCtx(t, 30*time.Second)

	first := post(t, ctx, srv, "k-500", "{}", "X-Fail", "after-effect")
	again := post(t, ctx, srv, "k-500", "{}", "X-Fail", "after-effect")
	if first.status != http.StatusInternalServerError || runs.Load() != 1 {
		t.Fatalf("a 500 after the effect: %d, %d runs", first.status, runs.Load())
	}
	sameResponse(t, first, again)

	runs.Store(0)
	post(t, ctx, srv, "k-503", "{}", "X-Fail", "unavailable")
	post(t, ctx, srv, "k-503", "{}", "X-Fail", "unavailable")
	if runs.Load() != 2 {
		t.Fatalf("a certified effect-free 503 ran %d times for 2 requests, want 2 (released)", runs.Load())
	}

	runs.Store(0)
	_, _ = tryDo(ctx, srv.Client(), http.MethodPost, srv.URL+itemsPath, "{}", idemhttp.HeaderKey, "k-panic", "X-Fail", "panic")
	r := post(t, ctx, srv, "k-panic", "{}", "X-Fail", "panic")
	if runs.Load() != 1 || r.errorBody(t).ErrorCode != idemhttp.CodeResponseNotStored {
		t.Fatalf("a panic with NoEffect(500) false: %d runs, retry got %d %s", runs.Load(), r.status, r.body)
	}

	// The default: every 5xx releases its key.
	runs.Store(0)
	def := serveQuiet(t, mw(t, e, &idemhttp.Options{ScopePrefix: "default"})(h))
	post(t, ctx, def, "k-500", "{}", "X-Fail", "after-effect")
	post(t, ctx, def, "k-500", "{}", "X-Fail", "after-effect")
	if runs.Load() != 2 {
		t.Fatalf("default: a 500 ran %d times for 2 requests, want 2 (released)", runs.Load())
	}
}
