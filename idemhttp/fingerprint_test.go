package idemhttp

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemdb/idem"
)

// The fingerprint's fields are framed: moving bytes from one field to the
// next changes it.
func TestFingerprintFraming(t *testing.T) {
	fp := func(method, target, body string) []byte {
		return DefaultFingerprint(httptest.NewRequest(method, target, nil), []byte(body))
	}
	cases := [][3]string{
		{"POST", "/ab", "c"},
		{"POST", "/a", "bc"},
		{"POST", "/a?b", "c"},
		{"POST", "/a?b=", "c"},
		{"POST", "/a", "?bc"},
		{"POS", "/Ta", "bc"},
		{"PUT", "/ab", "c"},
		{"POST", "/a%2Fb", "c"},
		{"POST", "/a/b", "c"},
		{"POST", "/ab", ""},
	}
	for i, a := range cases {
		for j, b := range cases {
			if i != j && bytes.Equal(fp(a[0], a[1], a[2]), fp(b[0], b[1], b[2])) {
				t.Errorf("%q and %q share a fingerprint", a, b)
			}
		}
	}
	if !bytes.Equal(fp("POST", "/a?x=1", "b"), fp("POST", "/a?x=1", "b")) {
		t.Fatal("not deterministic")
	}
	// An empty query is no query: the same request.
	if !bytes.Equal(fp("POST", "/a?", "b"), fp("POST", "/a", "b")) {
		t.Fatal("an empty query changed the fingerprint")
	}
}

// Options.Fingerprint: a gateway in front of the service adds a query
// parameter of its own (a different one on every attempt). With the
// default fingerprint each retry is a conflict; with one that leaves the
// parameter out, retries replay, and another body still conflicts.
func TestFingerprintOption(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e, err := idem.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	withoutGateway := func(r *http.Request, body []byte) []byte {
		u := *r.URL
		q := u.Query()
		q.Del("gw_attempt")
		u.RawQuery = q.Encode()
		r2 := *r
		r2.URL = &u
		return DefaultFingerprint(&r2, body)
	}
	var calls int
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "made %d", calls)
	})
	post := func(srv *httptest.Server, attempt int, body string) (int, string) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, fmt.Sprintf("%s/items?dry=0&gw_attempt=%d", srv.URL, attempt), strings.NewReader(body))
		req.Header.Set(HeaderKey, "gw-key")
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	for _, tc := range []struct {
		name   string
		opts   *Options
		second int
	}{
		{"default", &Options{ScopePrefix: "default"}, http.StatusConflict},
		{"custom", &Options{ScopePrefix: "custom", Fingerprint: withoutGateway}, http.StatusCreated},
	} {
		mw, err := Middleware(e, tc.opts)
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(mw(h))
		calls = 0
		if st, b := post(srv, 1, "x"); st != http.StatusCreated || b != "made 1" {
			t.Fatalf("%s: first %d %q", tc.name, st, b)
		}
		if st, b := post(srv, 2, "x"); st != tc.second || calls != 1 {
			t.Fatalf("%s: retry through the gateway: %d %q, want %d; %d calls", tc.name, st, b, tc.second, calls)
		}
		if st, _ := post(srv, 3, "y"); st != http.StatusConflict {
			t.Fatalf("%s: another body: %d, want 409", tc.name, st)
		}
		srv.Close()
	}
}
