package idemhttp_test

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem/idemhttp"
)

// rawServer is a TCP server on loopback that hands each accepted
// connection (numbered from 1) to serve: a server that can go silent on a
// connection, as a peer that vanished without a reset does.
type rawServer struct {
	ln       net.Listener
	accepted atomic.Int64
	serve    func(n int64, c net.Conn)
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    []net.Conn
}

func newRawServer(t *testing.T, serve func(n int64, c net.Conn)) *rawServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &rawServer{ln: ln, serve: serve}
	s.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			n := s.accepted.Add(1)
			s.mu.Lock()
			s.conns = append(s.conns, c)
			s.mu.Unlock()
			s.wg.Go(func() { s.serve(n, c) })
		}
	})
	t.Cleanup(func() {
		_ = ln.Close()
		s.mu.Lock()
		for _, c := range s.conns {
			_ = c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return s
}

func (s *rawServer) url() string { return "http://" + s.ln.Addr().String() }

// hold reads (and discards) what the client sends and never answers, until
// the connection is closed.
func hold(c net.Conn) { _, _ = io.Copy(io.Discard, c) }

// Every attempt has a deadline of the transport's own, even when neither
// the caller's context nor the Transport sets one: DefaultAttemptTimeout.
func TestTransportDefaultAttemptTimeout(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	var deadlines []time.Time
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		dl, ok := r.Context().Deadline()
		if !ok {
			return nil, errors.New("attempt without a deadline")
		}
		deadlines = append(deadlines, dl)
		return &http.Response{StatusCode: http.StatusCreated, Body: http.NoBody, Request: r}, nil
	})
	c := &http.Client{Transport: &idemhttp.Transport{Base: base}}
	before := time.Now()
	req, _ := http.NewRequestWithContext(context.WithoutCancel(ctx), http.MethodPost, "http://example.invalid/x", strings.NewReader("x"))
	resp, err := c.Do(req)
	after := time.Now()
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if idemhttp.DefaultAttemptTimeout != 30*time.Second {
		t.Fatalf("DefaultAttemptTimeout %v, documented as 30s", idemhttp.DefaultAttemptTimeout)
	}
	dl := deadlines[0]
	if dl.Before(before.Add(idemhttp.DefaultAttemptTimeout)) || dl.After(after.Add(idemhttp.DefaultAttemptTimeout)) {
		t.Fatalf("attempt deadline %v after the call, want %v", dl.Sub(before), idemhttp.DefaultAttemptTimeout)
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// A server that accepts connections and never answers on them: each
// attempt times out, and each retry opens a new connection (the timed-out
// one is never reused).
func TestTransportTimeoutRetriesOnNewConnection(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	srv := newRawServer(t, func(_ int64, c net.Conn) { hold(c) })
	base := &http.Transport{}
	t.Cleanup(base.CloseIdleConnections)
	c := &http.Client{Transport: &idemhttp.Transport{Base: base, MaxAttempts: 3, AttemptTimeout: 200 * time.Millisecond, BaseDelay: time.Millisecond}}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.url()+"/x", strings.NewReader("x"))
	_, err := c.Do(req)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want the last attempt's timeout", err)
	}
	if n := srv.accepted.Load(); n != 3 {
		t.Fatalf("%d connections accepted for 3 attempts, want one each", n)
	}
}

// Zombie sockets: two pooled keep-alive connections go silent. The first
// attempt times out on one of them; the retry must not take the other from
// the pool (it would time out too) but dial a new connection.
func TestTransportTimeoutDiscardsPool(t *testing.T) {
	ctx := testCtx(t, 30*time.Second)
	warm := make(chan struct{})
	var warmed sync.WaitGroup
	warmed.Add(2)
	var zombieRequests atomic.Int64
	var madeOn atomic.Int64
	srv := newRawServer(t, func(n int64, c net.Conn) {
		if n > 2 {
			br := bufio.NewReader(c)
			for {
				req, err := http.ReadRequest(br)
				if err != nil {
					return
				}
				_, _ = io.Copy(io.Discard, req.Body)
				madeOn.Store(n)
				_, _ = io.WriteString(c, "HTTP/1.1 201 Created\r\nContent-Length: 4\r\n\r\nmade")
			}
		}
		// Connections 1 and 2: answer one request each once both have
		// one (so both end in the pool), then go silent.
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		warmed.Done()
		<-warm
		_, _ = io.WriteString(c, "HTTP/1.1 204 No Content\r\n\r\n")
		for {
			if _, err := http.ReadRequest(br); err != nil {
				return
			}
			zombieRequests.Add(1)
		}
	})
	base := &http.Transport{MaxIdleConnsPerHost: 2}
	t.Cleanup(base.CloseIdleConnections)
	go func() { warmed.Wait(); close(warm) }()
	parallel(2, func(int) {
		resp, err := (&http.Client{Transport: base}).Get(srv.url() + "/warm")
		if err != nil {
			t.Error(err)
			return
		}
		resp.Body.Close()
	})
	if t.Failed() || srv.accepted.Load() != 2 {
		t.Fatalf("warm-up: %d connections", srv.accepted.Load())
	}

	// Attempts to spare: a retry that took the other silent connection
	// would still succeed on the third; what is checked is that only one
	// attempt went to a silent connection.
	c := &http.Client{Transport: &idemhttp.Transport{Base: base, MaxAttempts: 4, AttemptTimeout: time.Second, BaseDelay: time.Millisecond}}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.url()+"/x", strings.NewReader("x"))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%v (%d requests went to silent pooled connections, %d connections accepted)", err, zombieRequests.Load(), srv.accepted.Load())
	}
	if body := readAll(t, resp); resp.StatusCode != http.StatusCreated || body != "made" {
		t.Fatalf("%d %q", resp.StatusCode, body)
	}
	if z, on := zombieRequests.Load(), madeOn.Load(); z != 1 || on < 3 {
		t.Fatalf("%d requests on silent pooled connections (want 1), answered on connection %d (want a new one)", z, on)
	}
}
