package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemhttp"
)

func TestService(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	s, err := open(dir, time.Hour, false)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mustHandler(t, s))
	post := func(key, body string) (*http.Response, string) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/api/v1/items", strings.NewReader(body))
		req.Header.Set("Idempotency-Key", key)
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	r1, b1 := post("order-1", `{"sku":"ITEM-001","title":"Sample Item"}`)
	r2, b2 := post("order-1", `{"sku":"ITEM-001","title":"Sample Item"}`)
	if r1.StatusCode != 201 || r2.StatusCode != 201 || b1 != b2 || r2.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("%d %q / %d %q %v", r1.StatusCode, b1, r2.StatusCode, b2, r2.Header)
	}
	if r, _ := post("order-1", `{"sku":"ITEM-002"}`); r.StatusCode != http.StatusConflict {
		t.Fatalf("conflict: %d", r.StatusCode)
	}
	srv.Close()
	if err := s.close(); err != nil {
		t.Fatal(err)
	}
	// Restarted: still one item, still replayed.
	s, err = open(dir, time.Hour, false)
	if err != nil {
		t.Fatal(err)
	}
	defer s.close()
	srv = httptest.NewServer(mustHandler(t, s))
	defer srv.Close()
	if r, b := post("order-1", `{"sku":"ITEM-001","title":"Sample Item"}`); b != b1 || r.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("after restart: %q", b)
	}
	if len(s.items) != 1 {
		t.Fatalf("%d items", len(s.items))
	}
	resp, err := srv.Client().Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	m, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(m), "idem_hits_total 1") {
		t.Fatalf("metrics lack the hit:\n%s", m)
	}
}

// A crash between the claim and the response leaves keys in doubt; at the
// next start the service stores the response of the item it finds it made
// and releases the key of the one it did not make.
func TestResolveInDoubtAtStart(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	s, err := open(dir, time.Hour, false)
	if err != nil {
		t.Fatal(err)
	}
	scope := idemhttp.ScopeFor("", "")
	for _, k := range []string{"made", "not-made"} {
		if res, err := s.e.Begin(ctx, idem.Request{Scope: scope, ID: []byte(k)}); err != nil || res.Status != idem.Fresh {
			t.Fatal(res.Status, err)
		}
	}
	line, _ := json.Marshal(item{ID: 1, SKU: "S", Title: "T", Key: "made"})
	s.file.Write(append(line, '\n'))
	s.close() // claims left open stay in doubt, as after a crash

	s, err = open(dir, time.Hour, false)
	if err != nil {
		t.Fatal(err)
	}
	defer s.close()
	for k, want := range map[string]idem.Status{"made": idem.Done, "not-made": idem.Absent} {
		res, err := s.e.Lookup(context.Background(), idem.Request{Scope: scope, ID: []byte(k)})
		if err != nil || res.Status != want {
			t.Fatalf("%s: %v %v, want %v", k, res.Status, err, want)
		}
	}
}

func mustHandler(t *testing.T, s *service) http.Handler {
	t.Helper()
	h, err := s.handler()
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// send makes one request; header pairs are name, value.
func send(t *testing.T, ctx context.Context, srv *httptest.Server, method, path, body string, header ...string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, method, srv.URL+path, strings.NewReader(body))
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// -auth requires a bearer on every request: without one, with or without
// an Idempotency-Key, it is a 401 and no item is made.
func TestAuthRequiresBearer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s, err := open(t.TempDir(), time.Hour, true)
	if err != nil {
		t.Fatal(err)
	}
	defer s.close()
	srv := httptest.NewServer(mustHandler(t, s))
	defer srv.Close()
	const body = `{"sku":"ITEM-001","title":"Sample Item"}`
	for _, h := range [][]string{
		nil,
		{"Idempotency-Key", "k1"},
		{"Authorization", "Basic YWxpY2U6cHc="},
		{"Authorization", "Bearer "},
	} {
		if r, b := send(t, ctx, srv, http.MethodPost, "/api/v1/items", body, h...); r.StatusCode != http.StatusUnauthorized {
			t.Fatalf("POST with %q: %d %s, want 401", h, r.StatusCode, b)
		}
	}
	if r, b := send(t, ctx, srv, http.MethodGet, "/api/v1/items", ""); r.StatusCode != http.StatusUnauthorized {
		t.Fatalf("GET without a bearer: %d %s", r.StatusCode, b)
	}
	if len(s.items) != 0 {
		t.Fatalf("%d items made without a bearer: %+v", len(s.items), s.items)
	}
	// With one: made, owned, and the key replayed for that user only.
	r, b := send(t, ctx, srv, http.MethodPost, "/api/v1/items", body, "Authorization", "Bearer alice", "Idempotency-Key", "k1")
	if r.StatusCode != http.StatusCreated || len(s.items) != 1 || s.items[0].Owner != "alice" {
		t.Fatalf("%d %s %+v", r.StatusCode, b, s.items)
	}
	if r, _ := send(t, ctx, srv, http.MethodPost, "/api/v1/items", body, "Authorization", "Bearer bob", "Idempotency-Key", "k1"); r.StatusCode != http.StatusCreated || r.Header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("bob's k1: %d %v", r.StatusCode, r.Header)
	}
}

// The Location of a 201 is served: GET it and get the item; with -auth,
// only its owner does.
func TestLocationIsServed(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, auth := range []bool{false, true} {
		s, err := open(t.TempDir(), time.Hour, auth)
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(mustHandler(t, s))
		r, b := send(t, ctx, srv, http.MethodPost, "/api/v1/items", `{"sku":"ITEM-001","title":"Sample Item"}`, "Authorization", "Bearer alice", "Idempotency-Key", "order-1")
		loc := r.Header.Get("Location")
		if r.StatusCode != http.StatusCreated || loc != "/api/v1/items/1" {
			t.Fatalf("auth %v: %d %s, Location %q", auth, r.StatusCode, b, loc)
		}
		g, gb := send(t, ctx, srv, http.MethodGet, loc, "", "Authorization", "Bearer alice")
		var got item
		if g.StatusCode != http.StatusOK || json.Unmarshal([]byte(gb), &got) != nil || got.ID != 1 || got.SKU != "ITEM-001" || got.Key != "order-1" {
			t.Fatalf("auth %v: GET %s: %d %s", auth, loc, g.StatusCode, gb)
		}
		if g, _ := send(t, ctx, srv, http.MethodGet, "/api/v1/items/2", "", "Authorization", "Bearer alice"); g.StatusCode != http.StatusNotFound {
			t.Fatalf("auth %v: GET a missing item: %d", auth, g.StatusCode)
		}
		if auth {
			if g, _ := send(t, ctx, srv, http.MethodGet, loc, "", "Authorization", "Bearer bob"); g.StatusCode != http.StatusNotFound {
				t.Fatalf("bob reads alice's item: %d", g.StatusCode)
			}
		}
		srv.Close()
		if err := s.close(); err != nil {
			t.Fatal(err)
		}
	}
}
