package idemhttp

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemdb/idem"
)

// A reply in the middleware's scope that is not a stored response (written
// by other code) is a 500 IDEMPOTENCY_INTERNAL_ERROR, logged; never a panic
// or a made-up response.
func TestForeignReplyIs500(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	e, err := idem.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	mw, err := Middleware(e, &Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.NotFoundHandler()))
	defer srv.Close()
	body := "payload"
	fp := DefaultFingerprint(httptest.NewRequest(http.MethodPost, "/x", nil), []byte(body))
	res, err := e.Begin(ctx, idem.Request{Scope: ScopeFor("", ""), ID: []byte("foreign"), Fingerprint: fp})
	if err != nil || res.Status != idem.Fresh {
		t.Fatal(res.Status, err)
	}
	if err := res.Claim.Commit(ctx, []byte("not msgpack")); err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/x", strings.NewReader(body))
	req.Header.Set(HeaderKey, "foreign")
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var eb ErrorBody
	if err := json.NewDecoder(resp.Body).Decode(&eb); err != nil || resp.StatusCode != 500 || eb.ErrorCode != CodeInternal || eb.IdempotencyKey != "foreign" {
		t.Fatalf("%d %+v %v", resp.StatusCode, eb, err)
	}
}

// A body that ends before its Content-Length: 400 REQUEST_BODY_UNREADABLE,
// and the key is not used.
func TestTruncatedBody(t *testing.T) {
	e, err := idem.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	mw, err := Middleware(e, &Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.NotFoundHandler()))
	defer srv.Close()
	conn, err := net.DialTimeout("tcp", srv.Listener.Addr().String(), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(conn, "POST /x HTTP/1.1\r\nHost: test\r\nIdempotency-Key: cut\r\nContent-Length: 100\r\n\r\nonly ten b")
	conn.(*net.TCPConn).CloseWrite()
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var eb ErrorBody
	if err := json.NewDecoder(resp.Body).Decode(&eb); err != nil || resp.StatusCode != 400 || eb.ErrorCode != CodeBodyUnreadable || eb.IdempotencyKey != "cut" {
		t.Fatalf("%d %+v %v", resp.StatusCode, eb, err)
	}
	if res, err := e.Lookup(context.Background(), idem.Request{Scope: ScopeFor("", ""), ID: []byte("cut")}); err != nil || res.Status != idem.Absent {
		t.Fatalf("key %v %v", res.Status, err)
	}
}

// Bad options are errors naming the field, returned when the middleware is
// built; never a panic.
func TestOptionsErrors(t *testing.T) {
	e, err := idem.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	for field, o := range map[string]*Options{
		"TTL":              {TTL: -1},
		"ConflictStatus":   {ConflictStatus: 400},
		"Methods[1]":       {Methods: []string{"POST", ""}},
		"ScopePrefix":      {ScopePrefix: strings.Repeat("s", 513)},
		"MaxRequestBytes":  {MaxRequestBytes: -1},
		"MaxResponseBytes": {MaxResponseBytes: 13 << 20},
		"MaxAckedKeys":     {MaxAckedKeys: 5000},
	} {
		m, err := Middleware(e, o)
		if m != nil || err == nil || !strings.Contains(err.Error(), "idemhttp: Options."+field+" ") {
			t.Errorf("%s: %v", field, err)
		}
	}
	if m, err := Middleware(nil, nil); m != nil || err == nil || !strings.Contains(err.Error(), "store") {
		t.Errorf("nil store: %v", err)
	}
	// A nil handler is a 500 at request time, never a panic.
	m, err := Middleware(e, &Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	w := httptest.NewRecorder()
	m(nil).ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/x", nil))
	if w.Code != http.StatusInternalServerError {
		t.Errorf("nil handler: %d", w.Code)
	}
	c, err := newConfig(nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.ttl != time.Hour || !c.methods["POST"] || len(c.methods) != 1 || c.conflictStatus != 409 || c.maxAcked != 64 {
		t.Fatalf("defaults %+v", c)
	}
}
