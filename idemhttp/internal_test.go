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
	srv := httptest.NewServer(Middleware(e, &Options{Logger: slog.New(slog.DiscardHandler)})(http.NotFoundHandler()))
	defer srv.Close()
	body := "payload"
	fp := fingerprint(httptest.NewRequest(http.MethodPost, "/x", nil), []byte(body))
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
	srv := httptest.NewServer(Middleware(e, &Options{Logger: slog.New(slog.DiscardHandler)})(http.NotFoundHandler()))
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

// Bad options are reported when the middleware is built.
func TestOptionsPanics(t *testing.T) {
	for name, o := range map[string]*Options{
		"ttl":      {TTL: -1},
		"conflict": {ConflictStatus: 400},
		"method":   {Methods: []string{""}},
		"scope":    {Scope: strings.Repeat("s", 513)},
		"request":  {MaxRequestBytes: -1},
		"response": {MaxResponseBytes: 13 << 20},
		"acked":    {MaxAckedKeys: 5000},
	} {
		func() {
			defer func() {
				if v := recover(); v == nil || !strings.Contains(v.(string), "idemhttp: Options.") {
					t.Errorf("%s: panic %v", name, v)
				}
			}()
			newConfig(o)
		}()
	}
	c := newConfig(nil)
	if c.ttl != time.Hour || !c.methods["POST"] || len(c.methods) != 1 || c.conflictStatus != 409 || c.maxAcked != 64 {
		t.Fatalf("defaults %+v", c)
	}
}
