package main

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemdb/idem"
)

// TestEffectsLogFailureIsFinal: a transfer whose effects log write fails
// may be on disk, so its 500 is stored and replayed (the key is never run
// again); the log is not written again, and later transfers are refused
// with a 503 that releases their key (no effect happened). The handler
// runs over an embedded engine here: the cluster's tests are the others.
func TestEffectsLogFailureIsFinal(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	path := filepath.Join(dir, "effects.jsonl")
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	ro, err := os.Open(path) // read-only: every write fails
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	e, err := idem.Open(filepath.Join(dir, "idem"), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	a := &app{owner: "r", file: ro, byKey: map[string]int{}}
	srv := httptest.NewServer(a.routes(e))
	defer srv.Close()
	r := &replica{owner: "r", url: srv.URL}
	body := `{"from":"alice","to":"bob","amount":1}`
	for i, want := range []struct {
		key      string
		code     int
		replayed string
	}{
		{"k1", http.StatusInternalServerError, ""},
		{"k1", http.StatusInternalServerError, "true"}, // stored: the transfer may have been made
		{"k2", http.StatusServiceUnavailable, ""},
		{"k2", http.StatusServiceUnavailable, ""}, // released: nothing was made
	} {
		got, err := r.post(ctx, srv.Client(), want.key, body)
		if err != nil || got.code != want.code || got.header.Get("Idempotent-Replayed") != want.replayed {
			t.Fatalf("request %d (%s): %v %v, replayed %q; want %d, replayed %q", i, want.key, got, err, got.header.Get("Idempotent-Replayed"), want.code, want.replayed)
		}
	}
}

// TestEffectsLogTornTail: a torn last line (a crash during an append) is
// cut off at start, so that the next transfer starts a line of its own;
// a bad line before the last is an error, never skipped.
func TestEffectsLogTornTail(t *testing.T) {
	good := `{"id":"r-1","idempotency_key":"k1","from":"a","to":"b","amount":1}` + "\n" +
		`{"id":"r-2","idempotency_key":"k2","from":"a","to":"b","amount":2}` + "\n"
	for _, tc := range []struct {
		name, content, wantErr string
		made                   int
	}{
		{"whole", good, "", 2},
		{"torn", good + `{"id":"r-3","idempotency_k`, "", 2},
		{"torn line ended", good + `{"id":"r-3","idem` + "\n", "", 2},
		{"corrupt before the last", `{"id":"r-0"` + "\n" + good, "corrupt line at offset 0", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "effects.jsonl")
			if err := os.WriteFile(path, []byte(tc.content), 0o644); err != nil {
				t.Fatal(err)
			}
			f, err := os.OpenFile(path, os.O_RDWR|os.O_APPEND, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			a := &app{file: f, byKey: map[string]int{}}
			err = a.load()
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("load: %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || a.made != tc.made || a.byKey["k2"] != 1 {
				t.Fatalf("load: %v, made %d, byKey %v", err, a.made, a.byKey)
			}
			if b, _ := os.ReadFile(path); !bytes.Equal(b, []byte(good)) {
				t.Fatalf("the log after load: %q", b)
			}
		})
	}
}
