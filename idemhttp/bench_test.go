package idemhttp_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemdb/idem/idemhttp"
)

// benchClients is the number of concurrent clients of the benchmarks.
const benchClients = 64

// BenchmarkMiddleware measures requests/s on loopback with 64 concurrent
// clients: the same handler bare, through the middleware with a new key per
// request (claim and response both fsynced: two group-committed fsyncs per
// request), and through the middleware replaying stored responses.
//
//	go test -run xxx -bench Middleware -benchtime 3s ./idemhttp/
func BenchmarkMiddleware(b *testing.B) {
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"%d","status":"created","size":%d}`, len(body)*7, len(body))
	})
	body := `{"sku":"ITEM-001","title":"Sample Item","quantity":3,"price":"19.99"}`
	run := func(b *testing.B, h http.Handler, key func(i int64) string) {
		srv := serve(b, h)
		tr := srv.Client().Transport.(*http.Transport)
		tr.MaxIdleConnsPerHost = 2 * benchClients
		c := srv.Client()
		var n atomic.Int64
		var failed atomic.Int64
		b.SetParallelism((benchClients + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
		b.ReportAllocs()
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, srv.URL+"/api/v1/items", strings.NewReader(body))
				if key != nil {
					req.Header.Set(idemhttp.HeaderKey, key(n.Add(1)))
				}
				resp, err := c.Do(req)
				if err != nil {
					failed.Add(1)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != http.StatusCreated {
					failed.Add(1)
				}
			}
		})
		b.StopTimer()
		if f := failed.Load(); f > 0 {
			b.Fatalf("%d of %d requests failed", f, b.N)
		}
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
	}
	b.Run("bare", func(b *testing.B) { run(b, handler, nil) })
	b.Run("new-keys", func(b *testing.B) {
		e := openEngine(b, nil, nil)
		prefix := fmt.Sprintf("bench-%d-", b.N)
		run(b, mw(b, e, nil)(handler), func(i int64) string { return prefix + fmt.Sprint(i) })
	})
	b.Run("replays", func(b *testing.B) {
		e := openEngine(b, nil, nil)
		h := mw(b, e, nil)(handler)
		const keys = 1024
		srv := serve(b, h)
		for i := range keys {
			r := do(b, context.Background(), srv.Client(), http.MethodPost, srv.URL+"/api/v1/items", body, idemhttp.HeaderKey, fmt.Sprint("replay-", i))
			if r.status != http.StatusCreated {
				b.Fatal(r.status)
			}
		}
		run(b, h, func(i int64) string { return fmt.Sprint("replay-", i%keys) })
	})
}
