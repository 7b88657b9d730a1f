// Command raftkv is a small replicated key-value store of counters with an
// HTTP API: three processes on one machine form a raft cluster, and every
// increment runs exactly once however often a client retries it, thanks
// to idemraft. See README.md for the commands.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemraft"
)

// peer is one member of the cluster: its raft id, raft address and HTTP address.
type peer struct {
	id         raft.ServerID
	raft, http string
}

func parsePeers(s string) ([]peer, error) {
	var ps []peer
	for _, p := range strings.Split(s, ",") {
		f := strings.Split(strings.TrimSpace(p), "=")
		if len(f) != 3 || f[0] == "" || f[1] == "" || f[2] == "" {
			return nil, fmt.Errorf("peer %q: want id=raftaddr=httpaddr", p)
		}
		ps = append(ps, peer{raft.ServerID(f[0]), f[1], f[2]})
	}
	return ps, nil
}

// ---- the application's state machine: named counters ----

type op struct {
	Key   string `json:"key"`
	Delta int64  `json:"delta"`
}

type store struct {
	mu   sync.Mutex
	vals map[string]int64
}

func (s *store) Apply(l *raft.Log) any {
	var o op
	if err := json.Unmarshal(l.Data, &o); err != nil {
		return fmt.Errorf("not an operation: %v", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.vals[o.Key] += o.Delta
	return []byte(strconv.FormatInt(s.vals[o.Key], 10))
}

func (s *store) get(key string) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.vals[key]
}

func (s *store) Snapshot() (raft.FSMSnapshot, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, err := json.Marshal(s.vals)
	return snapshot(b), err
}

func (s *store) Restore(rc io.ReadCloser) error {
	vals := map[string]int64{}
	if err := json.NewDecoder(rc).Decode(&vals); err != nil {
		return err
	}
	s.mu.Lock()
	s.vals = vals
	s.mu.Unlock()
	return nil
}

type snapshot []byte

func (b snapshot) Persist(sink raft.SnapshotSink) error {
	if _, err := sink.Write(b); err != nil {
		sink.Cancel()
		return err
	}
	return sink.Close()
}
func (snapshot) Release() {}

// ---- the node ----

type node struct {
	self      peer
	peers     []peer
	r         *raft.Raft
	heartbeat time.Duration // raft's HeartbeatTimeout: how long a follower trusts a silent leader
	fsm       *idemraft.FSM
	app       *store
	bolt      *raftboltdb.BoltStore
	proxy     *httputil.ReverseProxy // to the leader's HTTP address
	apply     http.Handler           // idemraft.Handler, for idemraft.HTTPNode clients
	stopOnce  sync.Once
}

// streamLayer is raft's TCP stream layer (what raft.NewTCPTransport
// builds) over a listener the caller bound already, so that the raft port
// is held from the moment it is chosen: nothing can take it between a
// check and the bind.
type streamLayer struct {
	net.Listener
	advertise net.Addr
}

func (l *streamLayer) Addr() net.Addr { return l.advertise }

func (l *streamLayer) Dial(a raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	return net.DialTimeout("tcp", string(a), timeout)
}

// start runs the node self of peers with its state in dir; raft serves on
// rl (bound to self's raft address by the caller) and start owns it from
// then on, also when it fails.
func start(self raft.ServerID, dir string, peers []peer, rl net.Listener) (_ *node, err error) {
	n := &node{peers: peers, app: &store{vals: map[string]int64{}}}
	var trans *raft.NetworkTransport
	defer func() {
		if err == nil {
			return
		}
		switch {
		case n.r != nil:
			n.stop() // closes rl with the transport
		default:
			if n.fsm != nil {
				n.fsm.Close()
			}
			if n.bolt != nil {
				n.bolt.Close()
			}
			if trans != nil {
				trans.Close() // and rl
			} else {
				rl.Close()
			}
		}
	}()
	for _, p := range peers {
		if p.id == self {
			n.self = p
		}
	}
	if n.self.id == "" {
		return nil, fmt.Errorf("-id %s is not in -peers", self)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	logger := hclog.New(&hclog.LoggerOptions{Name: "raft-" + string(self), Level: hclog.Warn})
	conf := raft.DefaultConfig()
	conf.LocalID = self
	conf.Logger = logger
	conf.SnapshotThreshold = 1024
	n.heartbeat = conf.HeartbeatTimeout
	if n.bolt, err = raftboltdb.New(raftboltdb.Options{Path: filepath.Join(dir, "raft.db")}); err != nil {
		return nil, err
	}
	snaps, err := raft.NewFileSnapshotStoreWithLogger(filepath.Join(dir, "snapshots"), 2, logger)
	if err != nil {
		return nil, err
	}
	advertise, err := net.ResolveTCPAddr("tcp", n.self.raft)
	if err != nil {
		return nil, fmt.Errorf("raft address %s: %w", n.self.raft, err)
	}
	trans = raft.NewNetworkTransportWithConfig(&raft.NetworkTransportConfig{
		Stream: &streamLayer{Listener: rl, advertise: advertise}, MaxPool: 3, Timeout: 5 * time.Second, Logger: logger,
	})
	if n.fsm, err = idemraft.Wrap(n.app, &idemraft.Options{Dir: filepath.Join(dir, "dedup")}); err != nil {
		return nil, err
	}
	has, err := raft.HasExistingState(n.bolt, n.bolt, snaps)
	if err != nil {
		return nil, err
	}
	if !has {
		var c raft.Configuration
		for _, p := range peers {
			c.Servers = append(c.Servers, raft.Server{ID: p.id, Address: raft.ServerAddress(p.raft)})
		}
		if err := raft.BootstrapCluster(conf, n.bolt, n.bolt, snaps, trans, c); err != nil {
			return nil, err
		}
	}
	if n.r, err = raft.NewRaft(conf, n.fsm, n.bolt, n.bolt, snaps, trans); err != nil {
		return nil, err
	}
	if n.apply, err = idemraft.Handler(n.self.id, n.r, n.fsm); err != nil {
		return nil, err
	}
	n.proxy = &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme, pr.Out.URL.Host = "http", pr.In.Context().Value(leaderKey{}).(peer).http
			pr.Out.Header.Set(headerForwarded, string(n.self.id))
		},
		ErrorHandler: func(w http.ResponseWriter, req *http.Request, err error) {
			leader := req.Context().Value(leaderKey{}).(peer)
			unavailable(w, fmt.Sprintf("leader %s unreachable (%v)", leader.id, err))
		},
	}
	return n, nil
}

// stop shuts the node down (raft, which closes its listener, then the
// stores). Safe to call twice.
func (n *node) stop() {
	n.stopOnce.Do(func() {
		n.r.Shutdown().Error()
		n.fsm.Close()
		n.bolt.Close()
	})
}

// headerForwarded marks a request a follower forwarded to the node it
// believes is the leader; that node answers it itself (never forwards it
// again), so two nodes with stale views cannot pass it back and forth.
const headerForwarded = "Raftkv-Forwarded-By"

type leaderKey struct{}

// unavailable answers 503 with Retry-After: there is no live leader (an
// election is under way, or the leader is unreachable) or the outcome is
// unknown; the client retries with the same Idempotency-Key.
func unavailable(w http.ResponseWriter, why string) {
	w.Header().Set("Retry-After", "1")
	http.Error(w, why+"; retry with the same Idempotency-Key", http.StatusServiceUnavailable)
}

// forward hands a request that reached a follower to the leader and
// relays its answer. A leader that this node has not heard from within
// raft's heartbeat timeout, or that does not answer, is not live: 503
// with Retry-After. (A redirect would send the client to a dead leader
// for as long as the followers still name it, about a second and a half
// after a crash.)
func (n *node) forward(w http.ResponseWriter, req *http.Request, leader raft.ServerID) {
	if by := req.Header.Get(headerForwarded); by != "" {
		unavailable(w, fmt.Sprintf("node %s is not the leader (forwarded by %s, who thought so)", n.self.id, by))
		return
	}
	if leader == "" || time.Since(n.r.LastContact()) > n.heartbeat {
		unavailable(w, "no live leader (an election is under way)")
		return
	}
	for _, p := range n.peers {
		if p.id == leader {
			ctx, cancel := context.WithTimeout(req.Context(), 10*time.Second) // as Submit's
			defer cancel()
			n.proxy.ServeHTTP(w, req.WithContext(context.WithValue(ctx, leaderKey{}, p)))
			return
		}
	}
	unavailable(w, fmt.Sprintf("leader %s is not in -peers", leader))
}

var keyRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,255}$`) // the Idempotency-Key rules

func (n *node) routes() http.Handler {
	mux := http.NewServeMux()
	// POST /kv/{key}?add=N with an Idempotency-Key header: add N, once.
	mux.HandleFunc("POST /kv/{key}", func(w http.ResponseWriter, req *http.Request) {
		key := req.PathValue("key")
		delta, err := strconv.ParseInt(req.URL.Query().Get("add"), 10, 64)
		if err != nil {
			http.Error(w, "add=N (an integer) is required", http.StatusBadRequest)
			return
		}
		ik := req.Header.Get("Idempotency-Key")
		if !keyRE.MatchString(ik) {
			http.Error(w, "Idempotency-Key header: 1-255 characters of A-Z a-z 0-9 _ -", http.StatusBadRequest)
			return
		}
		body, _ := json.Marshal(op{Key: key, Delta: delta})
		fp := sha256.Sum256(body)
		cmd, err := idemraft.Command(idem.Request{Scope: "kv", ID: []byte(ik), Fingerprint: fp[:]}, body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		ctx, cancel := context.WithTimeout(req.Context(), 10*time.Second)
		defer cancel()
		resp, err := idemraft.Submit(ctx, n.r, n.fsm, cmd)
		var nl *idemraft.NotLeaderError
		switch {
		case errors.As(err, &nl):
			n.forward(w, req, nl.Leader)
			return
		case err != nil:
			unavailable(w, err.Error())
			return
		case errors.Is(resp.Err, idem.ErrConflict):
			http.Error(w, "IDEMPOTENCY_KEY_CONFLICT: this key was used with another request", http.StatusConflict)
			return
		case resp.Err != nil:
			http.Error(w, resp.Err.Error(), http.StatusUnprocessableEntity)
			return
		}
		v, _ := strconv.ParseInt(string(resp.Reply), 10, 64)
		writeJSON(w, map[string]any{"key": key, "value": v, "duplicate": resp.Duplicate, "node": n.self.id})
	})
	// GET /kv/{key}: this node's value (a follower's may be a little behind).
	mux.HandleFunc("GET /kv/{key}", func(w http.ResponseWriter, req *http.Request) {
		writeJSON(w, map[string]any{"key": req.PathValue("key"), "value": n.app.get(req.PathValue("key")), "node": n.self.id})
	})
	mux.HandleFunc("GET /status", func(w http.ResponseWriter, req *http.Request) {
		_, leader := n.r.LeaderWithID()
		st := n.fsm.Stats()
		writeJSON(w, map[string]any{"node": n.self.id, "state": n.r.State().String(), "leader": leader,
			"applied_index": st.LastIndex, "requests_applied": st.Applied,
			// Replays: those this node answered from its set without the
			// log (as leader), and those it met in the log (every replica).
			"duplicates": st.LocalDuplicates + st.Duplicates, "dedup_entries": st.Engine.LiveEntries})
	})
	// The generic idemraft endpoint, for idemraft.HTTPNode clients.
	mux.Handle("POST /idemraft/apply", n.apply)
	return mux
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(v)
}

func main() {
	id := flag.String("id", "", "this node's id, one of -peers (required)")
	dir := flag.String("dir", "", "this node's data directory (required)")
	peersFlag := flag.String("peers", "", "the cluster: id=raftaddr=httpaddr,... (required), e.g. n1=127.0.0.1:7001=127.0.0.1:8001,...")
	flag.Parse()
	if *id == "" || *dir == "" || *peersFlag == "" {
		flag.Usage()
		os.Exit(2)
	}
	peers, err := parsePeers(*peersFlag)
	if err != nil {
		log.Fatal(err)
	}
	var self peer
	for _, p := range peers {
		if p.id == raft.ServerID(*id) {
			self = p
		}
	}
	if self.id == "" {
		log.Fatalf("-id %s is not in -peers", *id)
	}
	rl, err := net.Listen("tcp", self.raft)
	if err != nil {
		log.Fatal(err)
	}
	n, err := start(self.id, *dir, peers, rl)
	if err != nil {
		log.Fatal(err)
	}
	srv := &http.Server{Addr: n.self.http, Handler: n.routes(), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
		<-sig
		srv.Close()
	}()
	log.Printf("raftkv %s: raft on %s, HTTP on %s", *id, n.self.raft, n.self.http)
	if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Print(err)
	}
	n.stop()
}
