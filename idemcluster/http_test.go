package idemcluster

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/idemdb/idem/idemhttp"
)

// TestHTTPReplicasShareTheCluster runs two HTTP replicas of one API, each
// with idemhttp's middleware over its own Client of a three-node cluster.
// A fifth of the replies are dropped and the request is retried through
// the other replica; the leader is stopped abruptly and restarted during
// the run. Every key runs once, and every retry gets the first response
// byte for byte.
func TestHTTPReplicasShareTheCluster(t *testing.T) {
	tc := newTestCluster(t, 3)
	var (
		mu   sync.Mutex
		runs = map[string]int{}
	)
	api := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		runs[key]++
		n := runs[key]
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"key":%q,"run":%d,"nonce":%d}`, key, n, rand.Int64())
	})
	var replicas []*httptest.Server
	for i := range 2 {
		c := dial(t, tc, fmt.Sprintf("replica-%d", i))
		mw, err := idemhttp.Middleware(c, nil)
		if err != nil {
			t.Fatal(err)
		}
		s := httptest.NewServer(mw(api))
		t.Cleanup(s.Close)
		replicas = append(replicas, s)
	}
	post := func(ctx context.Context, srv *httptest.Server, key string) (int, []byte, error) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", bytes.NewReader([]byte("body-"+key)))
		req.Header.Set("Idempotency-Key", key)
		resp, err := srv.Client().Do(req)
		if err != nil {
			return 0, nil, err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp.StatusCode, b, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const total = 600
	first := map[string][]byte{}
	rng := rand.New(rand.NewPCG(1, 2))
	restarts := 0
	for i := range total {
		if i > 0 && i%150 == 0 { // stop the leader abruptly, restart it
			old := tc.leader(30 * time.Second)
			tc.stop(old)
			tc.start(old)
			restarts++
		}
		key := fmt.Sprintf("key-%04d", i)
		via := rng.IntN(2)
		// Retry through the same replica until an answer comes (the
		// cluster may be electing), as a client with a timeout would.
		var code int
		var body []byte
		for {
			var err error
			code, body, err = post(ctx, replicas[via], key)
			if err == nil && code == http.StatusCreated {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("%s: %d %s %v", key, code, body, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
		first[key] = body
		if rng.IntN(5) == 0 { // the reply was lost: retry via the other replica
			code, again, err := post(ctx, replicas[1-via], key)
			if err != nil || code != http.StatusCreated || !bytes.Equal(again, body) {
				t.Fatalf("%s retried via the other replica: %d %q %v, first answer %q", key, code, again, err, body)
			}
		}
	}
	for key, body := range first {
		code, again, err := post(ctx, replicas[0], key)
		if err != nil || code != http.StatusCreated || !bytes.Equal(again, body) {
			t.Fatalf("%s at the end: %d %q %v, first answer %q", key, code, again, err, body)
		}
		if runs[key] != 1 {
			t.Fatalf("%s ran %d times", key, runs[key])
		}
	}
	if restarts < 3 {
		t.Fatalf("only %d leader restarts", restarts)
	}
}
