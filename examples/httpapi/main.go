// Command httpapi is a small item-intake service behind the idemhttp
// middleware: POST /api/v1/items creates an item once per Idempotency-Key,
// and a retry with the same key gets the stored response with
// "Idempotent-Replayed: true". See README.md for a session with curl.
//
//	go run ./examples/httpapi -addr 127.0.0.1:8080 -dir /tmp/httpapi
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemhttp"
	"github.com/idemdb/idem/idemprom"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8080", "listen address")
	dir := flag.String("dir", "httpapi-data", "data directory (the idem engine and the items file)")
	ttl := flag.Duration("ttl", time.Hour, "how long a key's response is replayed")
	auth := flag.Bool("auth", false, "require 'Authorization: Bearer <user>' on every /api/v1 request (401 without): keys and items are then per user, and Idempotency-Acked-Keys is honoured")
	flag.Parse()

	s, err := open(*dir, *ttl, *auth)
	if err != nil {
		log.Fatal(err)
	}
	h, err := s.handler()
	if err != nil {
		log.Fatal(err)
	}
	srv := &http.Server{Addr: *addr, Handler: h, ReadHeaderTimeout: 10 * time.Second}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	go func() {
		<-ctx.Done()
		shut, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = srv.Shutdown(shut)
	}()
	slog.Info("httpapi listening", "addr", *addr, "dir", *dir)
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		log.Print(err)
	}
	if err := s.close(); err != nil {
		log.Print(err)
	}
}

// item is what POST /api/v1/items creates.
type item struct {
	ID    int    `json:"id"`
	SKU   string `json:"sku"`
	Title string `json:"title"`
	// Key is the Idempotency-Key that created it (and Owner its user): kept
	// with the item, so that after a crash the service can tell whether a
	// key in doubt made its item.
	Key   string `json:"idempotency_key,omitempty"`
	Owner string `json:"owner,omitempty"`
}

type service struct {
	e    *idem.Engine
	ttl  time.Duration
	auth bool

	mu    sync.Mutex
	items []item
	file  *os.File // items.jsonl, one item per line, fsynced
}

func open(dir string, ttl time.Duration, auth bool) (*service, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	e, err := idem.Open(filepath.Join(dir, "idem"), &idem.Options{Logger: slog.Default()})
	if err != nil {
		return nil, err
	}
	s := &service{e: e, ttl: ttl, auth: auth}
	if err := s.loadItems(filepath.Join(dir, "items.jsonl")); err != nil {
		e.Close()
		return nil, err
	}
	if err := s.resolveInDoubt(context.Background()); err != nil {
		s.close()
		return nil, err
	}
	return s, nil
}

// options are the middleware's: the same for serving and for resolving the
// keys a crash left in doubt (the same key spaces).
func (s *service) options() *idemhttp.Options {
	opts := &idemhttp.Options{TTL: s.ttl}
	if s.auth {
		opts.Actor = bearerUser
	}
	return opts
}

func (s *service) loadItems(path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var it item
		if err := json.Unmarshal(sc.Bytes(), &it); err != nil {
			break // a torn last line from a crash: ignored (its key is in doubt, and aborted below)
		}
		s.items = append(s.items, it)
	}
	s.file = f
	return nil
}

// resolveInDoubt settles the keys a crash left in flight: if the item was
// made, its response is stored (retries get it); if not, the key is released
// (the retry creates the item).
func (s *service) resolveInDoubt(ctx context.Context) error {
	_, _, err := idemhttp.ResolveInDoubt(ctx, s.e, s.options(), func(d idemhttp.InDoubt) (*idemhttp.StoredResponse, bool, error) {
		it, found := s.findByKey(d.Actor, d.Key)
		slog.Info("resolving a key left in doubt by a crash", "key", d.Key, "item_found", found)
		if !found {
			return nil, false, nil
		}
		return createdResponse(it), true, nil
	})
	return err
}

func (s *service) findByKey(owner, key string) (item, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, it := range s.items {
		if it.Key == key && it.Owner == owner {
			return it, true
		}
	}
	return item{}, false
}

func createdResponse(it item) *idemhttp.StoredResponse {
	body, _ := json.Marshal(it)
	return &idemhttp.StoredResponse{
		Status: http.StatusCreated,
		Header: http.Header{"Content-Type": {"application/json"}, "Location": {fmt.Sprintf("/api/v1/items/%d", it.ID)}},
		Body:   append(body, '\n'),
	}
}

func (s *service) close() error {
	err := s.e.Close()
	if s.file != nil {
		err = errors.Join(err, s.file.Close())
	}
	return err
}

func (s *service) handler() (http.Handler, error) {
	mw, err := idemhttp.Middleware(s.e, s.options())
	if err != nil {
		return nil, err
	}
	c, err := idemprom.NewCollector(s.e, nil)
	if err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(c, collectors.NewGoCollector())

	mux := http.NewServeMux()
	mux.Handle("POST /api/v1/items", s.authenticate(mw(http.HandlerFunc(s.create))))
	mux.Handle("GET /api/v1/items", s.authenticate(http.HandlerFunc(s.list)))
	mux.Handle("GET /api/v1/items/{id}", s.authenticate(http.HandlerFunc(s.get)))
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	return mux, nil
}

// authenticate refuses, with -auth, every request without a bearer (with
// or without an Idempotency-Key): 401, outside the idempotency middleware,
// so that the refusal is never stored.
func (s *service) authenticate(next http.Handler) http.Handler {
	if !s.auth {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := bearerUser(r); err != nil {
			w.Header().Set("WWW-Authenticate", `Bearer realm="httpapi"`)
			writeJSONError(w, http.StatusUnauthorized, "requires 'Authorization: Bearer <user>'")
			return
		}
		next.ServeHTTP(w, r)
	})
}

func writeJSONError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"error": msg})
}

func bearerUser(r *http.Request) (string, error) {
	u, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || u == "" {
		return "", errors.New("missing bearer token")
	}
	return u, nil
}

func (s *service) create(w http.ResponseWriter, r *http.Request) {
	var in struct{ SKU, Title string }
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.SKU == "" {
		http.Error(w, `{"error":"want a JSON body with sku and title"}`, http.StatusBadRequest) // stored: the retry gets the same 400
		return
	}
	owner, err := s.owner(r)
	if err != nil { // authenticate refused it already
		writeJSONError(w, http.StatusUnauthorized, err.Error())
		return
	}
	s.mu.Lock()
	it := item{ID: len(s.items) + 1, SKU: in.SKU, Title: in.Title, Key: r.Header.Get(idemhttp.HeaderKey), Owner: owner}
	line, _ := json.Marshal(it)
	_, err = s.file.Write(append(line, '\n'))
	if err == nil {
		err = s.file.Sync()
	}
	if err == nil {
		s.items = append(s.items, it)
	}
	s.mu.Unlock()
	if err != nil {
		http.Error(w, `{"error":"storage"}`, http.StatusInternalServerError) // 5xx: the key is released
		return
	}
	resp := createdResponse(it)
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	w.WriteHeader(resp.Status)
	w.Write(resp.Body)
}

// list answers the items of the caller (with -auth) or all of them.
func (s *service) list(w http.ResponseWriter, r *http.Request) {
	owner, _ := s.owner(r)
	s.mu.Lock()
	out := make([]item, 0, len(s.items))
	for _, it := range s.items {
		if !s.auth || it.Owner == owner {
			out = append(out, it)
		}
	}
	s.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}

// get answers one item: the Location of a 201. With -auth, another user's
// item is a 404 (as if it did not exist).
func (s *service) get(w http.ResponseWriter, r *http.Request) {
	id, err := strconv.Atoi(r.PathValue("id"))
	owner, _ := s.owner(r)
	s.mu.Lock()
	var it item
	found := err == nil && id >= 1 && id <= len(s.items)
	if found {
		it = s.items[id-1]
		found = !s.auth || it.Owner == owner
	}
	s.mu.Unlock()
	if !found {
		writeJSONError(w, http.StatusNotFound, "no such item")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(it)
}

// owner is the caller's user with -auth ("" without).
func (s *service) owner(r *http.Request) (string, error) {
	if !s.auth {
		return "", nil
	}
	return bearerUser(r)
}
