package idemhttp_test

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/idemdb/idem/idemhttp"
)

// The middleware in a chi router (r.Use and r.With), with route parameters
// read by the handler.
func TestChiRouter(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	e := openEngine(t, nil, nil)
	calls := 0
	r := chi.NewRouter()
	r.Use(mw(t, e, &idemhttp.Options{ScopePrefix: "chi"}))
	r.Post("/api/v1/customers/{id}/orders", func(w http.ResponseWriter, r *http.Request) {
		calls++
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d for customer %s", calls, chi.URLParam(r, "id"))
	})
	r.With(mw(t, e, &idemhttp.Options{ScopePrefix: "chi-with", Methods: []string{http.MethodPut}})).
		Put("/api/v1/items/{id}", func(w http.ResponseWriter, r *http.Request) {
			calls++
			fmt.Fprintf(w, "item %s put %d", chi.URLParam(r, "id"), calls)
		})
	srv := serve(t, r)
	c := srv.Client()
	first := do(t, ctx, c, http.MethodPost, srv.URL+"/api/v1/customers/42/orders", item1, idemhttp.HeaderKey, "chi-1")
	if first.status != 201 || string(first.body) != "order 1 for customer 42" {
		t.Fatalf("%d %q", first.status, first.body)
	}
	sameResponse(t, first, do(t, ctx, c, http.MethodPost, srv.URL+"/api/v1/customers/42/orders", item1, idemhttp.HeaderKey, "chi-1"))
	// The same key for another customer is another request: a conflict.
	wantError(t, do(t, ctx, c, http.MethodPost, srv.URL+"/api/v1/customers/43/orders", item1, idemhttp.HeaderKey, "chi-1"),
		http.StatusConflict, idemhttp.CodeConflict, "chi-1")
	put := do(t, ctx, c, http.MethodPut, srv.URL+"/api/v1/items/7", item1, idemhttp.HeaderKey, "chi-1")
	if put.status != 200 || string(put.body) != "item 7 put 2" {
		t.Fatalf("%d %q", put.status, put.body)
	}
	sameResponse(t, put, do(t, ctx, c, http.MethodPut, srv.URL+"/api/v1/items/7", item1, idemhttp.HeaderKey, "chi-1"))
	if calls != 2 {
		t.Fatalf("%d calls", calls)
	}
}
