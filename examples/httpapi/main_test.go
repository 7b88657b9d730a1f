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
	srv := httptest.NewServer(s.handler())
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
	srv = httptest.NewServer(s.handler())
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
