package idemhttp_test

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemhttp"
)

// memStore is a small idem.Store, written against the interface only (an
// in-memory map under a mutex, claims made with idem.NewClaim): that it
// drives the middleware shows the middleware needs nothing of *idem.Engine.
// It keeps ids forever (no TTL, no lease takeover) and has no sequence
// mode; Commit and Abort follow the cancellation contract (they write
// whatever ctx says) and record whether ctx had ended.
type memStore struct {
	mu      sync.Mutex
	changed chan struct{} // closed and replaced at every commit and abort
	entries map[memKey]*memEntry
	stats   idem.Stats
	// finishedCanceled counts the commits and aborts whose ctx had ended.
	finishedCanceled int
	// waiting gets a value each time Wait blocks on an id in flight.
	waiting chan struct{}
}

type memKey struct{ scope, id string }

type memEntry struct {
	fp       []byte
	inFlight bool
	reply    []byte
}

func newMemStore() *memStore {
	return &memStore{changed: make(chan struct{}), entries: make(map[memKey]*memEntry), waiting: make(chan struct{}, 16)}
}

var _ idem.Store = (*memStore)(nil)

// answer is what Begin and Lookup say of an existing entry (nil: absent).
func (s *memStore) answer(en *memEntry, req idem.Request) (idem.Result, error) {
	switch {
	case en == nil:
		return idem.Result{Status: idem.Absent}, nil
	case req.Fingerprint != nil && string(en.fp) != string(req.Fingerprint):
		return idem.Result{}, idem.ErrConflict
	case en.inFlight:
		return idem.Result{Status: idem.InFlight, LeaseUntil: time.Now().Add(time.Hour)}, nil
	default:
		return idem.Result{Status: idem.Done, Reply: en.reply}, nil
	}
}

func (s *memStore) Begin(ctx context.Context, req idem.Request) (idem.Result, error) {
	if req.Client != "" {
		return idem.Result{}, errors.New("memStore: no sequence mode")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, a := range req.Acked {
		delete(s.entries, memKey{req.Scope, string(a)})
	}
	k := memKey{req.Scope, string(req.ID)}
	res, err := s.answer(s.entries[k], req)
	switch {
	case errors.Is(err, idem.ErrConflict):
		s.stats.Conflicts++
		return res, err
	case res.Status == idem.InFlight:
		s.stats.InFlightCollisions++
		return res, nil
	case res.Status == idem.Done:
		s.stats.Hits++
		return res, nil
	}
	s.stats.Misses++
	s.entries[k] = &memEntry{fp: req.Fingerprint, inFlight: true}
	lease := time.Now().Add(time.Hour)
	return idem.Result{Status: idem.Fresh, Claim: idem.NewClaim(&memClaim{s: s, k: k}, lease), LeaseUntil: lease}, nil
}

func (s *memStore) Lookup(ctx context.Context, req idem.Request) (idem.Result, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.answer(s.entries[memKey{req.Scope, string(req.ID)}], req)
}

func (s *memStore) Wait(ctx context.Context, req idem.Request) (idem.Result, error) {
	for {
		s.mu.Lock()
		res, err := s.answer(s.entries[memKey{req.Scope, string(req.ID)}], req)
		changed := s.changed
		s.mu.Unlock()
		if err != nil || res.Status != idem.InFlight {
			return res, err
		}
		select {
		case s.waiting <- struct{}{}:
		default:
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return idem.Result{}, ctx.Err()
		}
	}
}

func (s *memStore) Ack(ctx context.Context, scope string, ids ...[]byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range ids {
		if en := s.entries[memKey{scope, string(id)}]; en != nil && !en.inFlight {
			delete(s.entries, memKey{scope, string(id)})
		}
	}
	return nil
}

func (s *memStore) Advance(context.Context, ...idem.Advance) error {
	return errors.New("memStore: no sequence mode")
}

func (s *memStore) ClientState(context.Context, string, string) (uint64, error) {
	return 0, errors.New("memStore: no sequence mode")
}

func (s *memStore) InDoubt(context.Context, string) ([]idem.InDoubtClaim, error) { return nil, nil }

func (s *memStore) Now() time.Time { return time.Now() }

func (s *memStore) Stats() idem.Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats
}

func (s *memStore) status(scope, id string) idem.Status {
	res, err := s.Lookup(context.Background(), idem.Request{Scope: scope, ID: []byte(id)})
	if err != nil {
		return idem.Absent
	}
	return res.Status
}

// memClaim is the memStore's side of a claim.
type memClaim struct {
	s *memStore
	k memKey
}

func (c *memClaim) finish(ctx context.Context, reply []byte, abort bool) error {
	s := c.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ctx.Err() != nil {
		s.finishedCanceled++ // written all the same: the contract
	}
	if abort {
		delete(s.entries, c.k)
	} else {
		en := s.entries[c.k]
		en.inFlight, en.reply = false, append([]byte{}, reply...)
	}
	close(s.changed)
	s.changed = make(chan struct{})
	return nil
}

func (c *memClaim) Commit(ctx context.Context, reply []byte, _ []idem.Advance) error {
	return c.finish(ctx, reply, false)
}

func (c *memClaim) Abort(ctx context.Context) error { return c.finish(ctx, nil, true) }

// The middleware on a Store that is not an *idem.Engine: fresh, replay,
// conflict, in flight (answered at once, and waited for), a 5xx releasing
// the key.
func TestMiddlewareOnAnotherStore(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	s := newMemStore()
	app := &items{}
	srv := serve(t, mw(t, s, &idemhttp.Options{Logger: testLogger(t)})(app))

	first := post(t, ctx, srv, "k1", item1) // fresh
	if first.status != http.StatusCreated || app.calls.Load() != 1 {
		t.Fatalf("fresh: %d %s", first.status, first.body)
	}
	sameResponse(t, first, post(t, ctx, srv, "k1", item1))                                         // replay
	wantError(t, post(t, ctx, srv, "k1", item2), http.StatusConflict, idemhttp.CodeConflict, "k1") // conflict

	// In flight: a second request is told at once; a waiting one gets the
	// first's response when it is committed.
	app.gate, app.started = make(chan struct{}), make(chan struct{}, 1)
	done := make(chan response, 1)
	go func() {
		r, err := tryDo(ctx, srv.Client(), http.MethodPost, srv.URL+itemsPath, item1, idemhttp.HeaderKey, "k2")
		if err != nil {
			t.Error(err)
		}
		done <- r
	}()
	<-app.started
	wantError(t, post(t, ctx, srv, "k2", item1), http.StatusConflict, idemhttp.CodeProcessing, "k2")
	waiting := serve(t, mw(t, s, &idemhttp.Options{WaitInFlight: 20 * time.Second})(app))
	waited := make(chan response, 1)
	go func() {
		r, err := tryDo(ctx, waiting.Client(), http.MethodPost, waiting.URL+itemsPath, item1, idemhttp.HeaderKey, "k2")
		if err != nil {
			t.Error(err)
		}
		waited <- r
	}()
	<-s.waiting // the waiting request is in Wait: let the first finish
	close(app.gate)
	r1 := <-done
	if r1.status != http.StatusCreated {
		t.Fatalf("first: %d %s", r1.status, r1.body)
	}
	sameResponse(t, r1, <-waited)
	app.gate, app.started = nil, nil
	if n := app.calls.Load(); n != 2 {
		t.Fatalf("%d calls, want 2", n)
	}
	if st := s.Stats(); st.Misses != 2 || st.Conflicts != 1 || st.InFlightCollisions < 1 || st.Hits < 2 {
		t.Fatalf("stats %+v", st)
	}

	// A 5xx releases the key.
	fail := serve(t, mw(t, s, &idemhttp.Options{ScopePrefix: "fail"})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	})))
	if r := do(t, ctx, fail.Client(), http.MethodPost, fail.URL, "", idemhttp.HeaderKey, "k3"); r.status != http.StatusServiceUnavailable {
		t.Fatal(r.status)
	}
	if st := s.status(idemhttp.ScopeFor("fail", ""), "k3"); st != idem.Absent {
		t.Fatalf("a 5xx left the key %v", st)
	}
}

// The client hangs up before the response is stored: the request's context
// has ended when the middleware commits, and the key ends Done (the
// middleware hands Commit the request's context, and the store writes
// whatever it says: the cancellation contract), not stranded in flight.
func TestCommitAfterClientHangsUp(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	s := newMemStore()
	started, finished := make(chan struct{}), make(chan struct{}, 2)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(started)
		<-r.Context().Done() // the client went away
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("done anyway"))
	})
	m := mw(t, s, nil)(h)
	srv := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() { finished <- struct{}{} }() // after the middleware returned: stored or not
		m.ServeHTTP(w, r)
	}))
	cctx, cancel := context.WithCancel(ctx)
	go func() { <-started; cancel() }()
	if _, err := tryDo(cctx, srv.Client(), http.MethodPost, srv.URL, "", idemhttp.HeaderKey, "hung-up"); err == nil {
		t.Fatal("a response after the client hung up")
	}
	<-finished
	if st := s.status(idemhttp.ScopeFor("", ""), "hung-up"); st != idem.Done {
		t.Fatalf("key %v after the client hung up, want Done", st)
	}
	if s.finishedCanceled != 1 {
		t.Fatalf("Commit got a live context %d times: the request's context (ended) is what it must get", 1-s.finishedCanceled)
	}
	r := do(t, ctx, srv.Client(), http.MethodPost, srv.URL, "", idemhttp.HeaderKey, "hung-up")
	if r.status != http.StatusCreated || string(r.body) != "done anyway" || r.header.Get(idemhttp.HeaderReplayed) != "true" {
		t.Fatalf("retry: %d %q %v", r.status, r.body, r.header)
	}
}
