package idemhttp_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemhttp"
)

// A POST endpoint behind the middleware: the retry with the same key gets
// the stored response, and the order is created once.
func Example() {
	dir, err := os.MkdirTemp("", "idemhttp-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	e, err := idem.Open(dir, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close()

	var created atomic.Int64
	orders := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := created.Add(1) // the side effect
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"order":%d}`, n)
	})
	mw, err := idemhttp.Middleware(e, nil)
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw(orders))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for range 2 {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"sku":"ITEM-001"}`))
		req.Header.Set("Idempotency-Key", "order-123")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), string(body))
	}
	fmt.Println("orders created:", created.Load())
	// Output:
	// 201  {"order":1}
	// 201 true {"order":1}
	// orders created: 1
}

// A client whose POSTs get keys and safe retries.
func ExampleTransport() {
	client := &http.Client{Transport: &idemhttp.Transport{}} // Base: http.DefaultTransport
	resp, err := client.Post("https://api.example.com/orders", "application/json", strings.NewReader(`{"sku":"ITEM-001"}`))
	if err != nil {
		log.Print(err) // every attempt failed, or the context ended
		return
	}
	defer resp.Body.Close()
	log.Print("key ", resp.Request.Header.Get(idemhttp.HeaderKey), ": ", resp.Status)
}

// At start-up, before serving, resolve the keys a crash left in flight:
// commit the response if the side effect happened, abort otherwise.
func ExampleResolveInDoubt() {
	e, err := idem.Open("/var/lib/orders/idem", nil)
	if err != nil {
		log.Fatal(err)
	}
	opts := &idemhttp.Options{Actor: userFromToken}
	committed, aborted, err := idemhttp.ResolveInDoubt(context.Background(), e, opts, func(d idemhttp.InDoubt) (*idemhttp.StoredResponse, bool, error) {
		order, found := lookupOrderByKey(d.Actor, d.Key) // the application's own records
		if !found {
			return nil, false, nil // nothing happened: a retry runs again
		}
		return &idemhttp.StoredResponse{ // retries get this response
			Status: http.StatusCreated,
			Header: http.Header{"Content-Type": {"application/json"}},
			Body:   order,
		}, true, nil
	})
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("keys in doubt: %d committed, %d aborted", committed, aborted)
	mw, err := idemhttp.Middleware(e, opts) // the same options: the same key spaces
	if err != nil {
		log.Fatal(err)
	}
	_ = mw
}

func lookupOrderByKey(actor, key string) ([]byte, bool) { return nil, false }

func userFromToken(r *http.Request) (string, error) { return "", nil }
