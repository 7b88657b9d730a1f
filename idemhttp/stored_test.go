package idemhttp_test

import (
	"bytes"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/idemdb/idem/idemhttp"
	"github.com/vmihailenco/msgpack/v5"
)

func TestStoredResponseRoundTrip(t *testing.T) {
	for _, s := range []*idemhttp.StoredResponse{
		{Status: 201, Header: http.Header{"Content-Type": {"application/json"}, "Set-Cookie": {"a=1", "b=2"}}, Body: []byte(`{"id":1}`)},
		{Status: 204, Header: http.Header{}},
		{Status: 200, Header: http.Header{"Trailer": {"X-Sum"}}, Body: bytes.Repeat([]byte{0, 0xff}, 5000), Trailer: http.Header{"X-Sum": {"1"}, "Trailer:X-Late": {"2"}}},
		{Status: 200, Header: http.Header{"Content-Type": {"text/plain"}}, NotStored: true},
	} {
		b, err := s.Encode()
		if err != nil {
			t.Fatal(err)
		}
		got, err := idemhttp.DecodeStoredResponse(b)
		if err != nil {
			t.Fatal(err)
		}
		if got.Status != s.Status || !bytes.Equal(got.Body, s.Body) || got.NotStored != s.NotStored ||
			!reflect.DeepEqual(nonNil(got.Header), nonNil(s.Header)) || !reflect.DeepEqual(nonNil(got.Trailer), nonNil(s.Trailer)) {
			t.Fatalf("round trip of %+v gave %+v", s, got)
		}
		// Deterministic: the same response always encodes the same way.
		b2, _ := s.Encode()
		if !bytes.Equal(b, b2) {
			t.Fatal("two encodings differ")
		}
		// Every truncation is an error, never a panic or a partial response.
		for i := range len(b) {
			if _, err := idemhttp.DecodeStoredResponse(b[:i]); err == nil {
				t.Fatalf("truncated to %d of %d bytes: decoded", i, len(b))
			}
		}
	}
	if _, err := (&idemhttp.StoredResponse{Status: 42}).Encode(); err == nil {
		t.Fatal("status 42 encoded")
	}
}

func nonNil(h http.Header) http.Header {
	if h == nil {
		return http.Header{}
	}
	return h
}

func TestDecodeStoredResponseRejects(t *testing.T) {
	enc := func(v ...any) []byte {
		b, err := msgpack.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for name, b := range map[string][]byte{
		"empty":         nil,
		"plain text":    []byte("reply-of-x"),
		"short array":   enc(1, 200),
		"version 2":     enc(2, 200, map[string][]string{}, []byte{}, map[string][]string{}, 0),
		"bad status":    enc(1, 7, map[string][]string{}, []byte{}, map[string][]string{}, 0),
		"trailing junk": append(enc(1, 200, map[string][]string{}, []byte{}, map[string][]string{}, 0), 0xc0),
	} {
		_, err := idemhttp.DecodeStoredResponse(b)
		if err == nil || !strings.Contains(err.Error(), "not a stored HTTP response") {
			t.Errorf("%s: %v", name, err)
		}
	}
	// A later format version's extra fields are skipped.
	r, err := idemhttp.DecodeStoredResponse(enc(1, 200, map[string][]string{"A": {"b"}}, []byte("x"), map[string][]string{}, 0, "future", 7))
	if err != nil || r.Status != 200 || string(r.Body) != "x" || r.Header.Get("A") != "b" {
		t.Fatalf("%+v %v", r, err)
	}
}

func FuzzDecodeStoredResponse(f *testing.F) {
	b, _ := (&idemhttp.StoredResponse{Status: 201, Header: http.Header{"A": {"b"}}, Body: []byte("x")}).Encode()
	f.Add(b)
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := idemhttp.DecodeStoredResponse(b)
		if err != nil {
			return
		}
		if _, err := r.Encode(); err != nil {
			t.Fatalf("decoded %+v but cannot encode it: %v", r, err)
		}
	})
}

// No two (prefix, actor) pairs share a scope, and ParseKey reads back
// every one.
func TestScopesNeverCollide(t *testing.T) {
	parts := []string{"", "a", "b", "ab", "a/", "/", "-", "p:", "p:a", "1:a", "a/p:b", "/-", "h:00", "0:", ":", "a:b/c",
		strings.Repeat("x", idemhttp.MaxVerbatimActor), strings.Repeat("x", idemhttp.MaxVerbatimActor+1), strings.Repeat("x", 1000)}
	seen := make(map[string][2]string)
	for _, prefix := range parts {
		for _, actor := range parts {
			s := ScopeFor(prefix, actor)
			if prev, ok := seen[s]; ok {
				t.Fatalf("(%q, %q) and (%q, %q) share scope %q", prev[0], prev[1], prefix, actor, s)
			}
			seen[s] = [2]string{prefix, actor}
			if len(s) > 1024 && len(prefix) <= 512 {
				t.Fatalf("scope of %d bytes for a %d-byte prefix", len(s), len(prefix))
			}
			info, ok := idemhttp.ParseKey(s, []byte("key-1"))
			if !ok || info.Prefix != prefix || info.Key != "key-1" {
				t.Fatalf("ParseKey(%q) = %+v %v", s, info, ok)
			}
			if len(actor) > idemhttp.MaxVerbatimActor {
				if !info.ActorHashed || len(info.Actor) != 64 {
					t.Fatalf("long actor: %+v", info)
				}
			} else if info.Actor != actor || info.ActorHashed {
				t.Fatalf("actor %q parsed as %+v", actor, info)
			}
		}
	}
	for _, foreign := range []string{"", "payments", "idemhttp/1/", "idemhttp/1/3:ab/-", "idemhttp/1/x:/-", "idemhttp/1/01:a/-", "idemhttp/1/0:/q", "idemhttp/1/0:/p:", "idemhttp/1/0:/h:00"} {
		if info, ok := idemhttp.ParseKey(foreign, []byte("k")); ok {
			t.Errorf("ParseKey(%q) = %+v", foreign, info)
		}
	}
	if _, ok := idemhttp.ParseKey(ScopeFor("", ""), []byte("bad key")); ok {
		t.Error("an invalid key parsed")
	}
}

var ScopeFor = idemhttp.ScopeFor
