// Command cluster is one replica of a small transfer API that runs as
// several processes over one idem cluster: POST /transfers makes a transfer
// once per Idempotency-Key, whichever replica the request (or its retry)
// reaches, across restarts of the replicas and failovers of the cluster.
//
// Each replica is the idemhttp middleware over its own idemcluster.Client
// (Options.Owner is the replica's -owner, stable across its restarts). A
// transfer is appended to the replica's effects log (-effects, one JSON
// line per transfer, fsynced) before the reply; at start-up the replica
// settles the keys its previous run left in doubt from that log
// (idemhttp.ResolveInDoubt): a key whose transfer is in the log is
// committed with the transfer's reply, any other is released. See
// README.md for a session with three `idem serve` nodes and curl.
//
//	go run ./examples/cluster -addr 127.0.0.1:8081 -owner replica-a -effects /tmp/a.jsonl \
//	    -cluster 127.0.0.1:7071,127.0.0.1:7072,127.0.0.1:7073
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster"
	"github.com/idemdb/idem/idemhttp"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8081", "`host:port` the API listens on (port 0: any; the address is printed)")
	nodes := flag.String("cluster", "127.0.0.1:7071,127.0.0.1:7072,127.0.0.1:7073", "gRPC `addresses` of the idem cluster's nodes, comma-separated")
	owner := flag.String("owner", "", "this replica's `name`, the same at every restart: the claims it leaves in doubt are its own to settle (required)")
	effects := flag.String("effects", "", "the replica's effects log, one JSON line per transfer (default <owner>-transfers.jsonl)")
	attempt := flag.Duration("attempt-timeout", 2*time.Second, "bound of each call to a node (a paused node is given up after it)")
	flag.Parse()
	if *owner == "" {
		log.Fatal("cluster: -owner is required (a stable name per replica, for example replica-a)")
	}
	if *effects == "" {
		*effects = *owner + "-transfers.jsonl"
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	startCtx, cancel := context.WithTimeout(ctx, time.Minute)
	a, committed, aborted, err := open(startCtx, strings.Split(*nodes, ","), *owner, *effects, *attempt)
	cancel()
	if err != nil {
		log.Fatal(err)
	}
	defer a.close()
	l, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	srv := &http.Server{Handler: a.routes(a.c), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		shut, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = srv.Shutdown(shut)
	}()
	// The line the README and the tests wait for: printed once the keys in
	// doubt are settled, when requests are served.
	fmt.Printf("cluster: replica %s serving on http://%s (keys in doubt at start: %d committed, %d released)\n", *owner, l.Addr(), committed, aborted)
	if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
		log.Print(err)
	}
}

// transfer is the side effect of POST /transfers, one line of the effects
// log. Key is the Idempotency-Key that made it: kept with the effect, so
// that after a crash the replica can tell whether a key in doubt made its
// transfer.
type transfer struct {
	ID     string `json:"id"` // <owner>-<n>: which replica made it, and its n-th transfer
	Key    string `json:"idempotency_key"`
	From   string `json:"from"`
	To     string `json:"to"`
	Amount int64  `json:"amount"`
}

// app is one replica.
type app struct {
	c     *idemcluster.Client
	owner string

	mu   sync.Mutex // guards file, failed, made, done, byKey
	file *os.File   // the effects log (O_APPEND), fsynced after every transfer
	// failed is the effects log's first write or fsync error: the log is
	// not written again (what is on disk after a failed fsync is
	// unknown), every later transfer is refused until a restart reads it.
	failed error
	made   int // transfers numbered so far (the ids' n)
	// done are the transfers in the log, in order, and byKey indexes them
	// by key: read at start (for the keys in doubt), kept up to date.
	done  []transfer
	byKey map[string]int
}

// options are the middleware's, the same for serving and for settling
// the keys in doubt (the same key space).
func options() *idemhttp.Options {
	return &idemhttp.Options{
		RequireKey: true, // a transfer without a key would not be safe to retry
		// The handler's 503 comes before any effect (the effects log
		// failed earlier): the key is released, a retry may go to another
		// replica. Its 500 may follow the effect (the line may be on disk
		// when its fsync failed): it is stored and replayed, so the
		// transfer never runs twice for the key.
		NoEffect: func(status int) bool { return status == http.StatusServiceUnavailable },
	}
}

// open dials the cluster, reads the effects log, and settles the keys the
// previous run of this owner left in doubt.
func open(ctx context.Context, nodes []string, owner, effects string, attempt time.Duration) (*app, int, int, error) {
	f, err := os.OpenFile(effects, os.O_CREATE|os.O_RDWR|os.O_APPEND, 0o644)
	if err != nil {
		return nil, 0, 0, err
	}
	a := &app{owner: owner, file: f, byKey: map[string]int{}}
	if err := a.load(); err != nil {
		f.Close()
		return nil, 0, 0, fmt.Errorf("cluster: effects log %s: %w", effects, err)
	}
	a.c, err = idemcluster.Dial(ctx, nodes, &idemcluster.Options{Owner: owner, AttemptTimeout: attempt})
	if err != nil {
		f.Close()
		return nil, 0, 0, err
	}
	committed, aborted, err := idemhttp.ResolveInDoubt(ctx, a.c, options(), func(d idemhttp.InDoubt) (*idemhttp.StoredResponse, bool, error) {
		a.mu.Lock()
		i, made := a.byKey[d.Key]
		var t transfer
		if made {
			t = a.done[i]
		}
		a.mu.Unlock()
		slog.Info("settling a key left in doubt", "key", d.Key, "transfer_made", made)
		if !made {
			return nil, false, nil // released: a retry makes the transfer
		}
		return reply(t), true, nil // committed: retries get the transfer's reply
	})
	if err != nil {
		a.close()
		return nil, 0, 0, err
	}
	return a, committed, aborted, nil
}

// load reads the effects log. A torn last line (a crash in the middle of
// an append) is cut off, so that the next transfer starts a line of its
// own; its key is in doubt and released (its fsync never returned, so
// its reply was never sent).
func (a *app) load() error {
	data, err := io.ReadAll(a.file)
	if err != nil {
		return err
	}
	good := 0
	for len(data[good:]) > 0 {
		line, _, complete := bytes.Cut(data[good:], []byte("\n"))
		var t transfer
		if !complete || json.Unmarshal(line, &t) != nil {
			if complete && bytes.IndexByte(data[good+len(line)+1:], '\n') >= 0 {
				return fmt.Errorf("corrupt line at offset %d (not the last one): %.80q", good, line)
			}
			break
		}
		a.byKey[t.Key] = len(a.done)
		a.done = append(a.done, t)
		a.made++
		good += len(line) + 1
	}
	if good < len(data) {
		slog.Warn("cutting a torn last line off the effects log", "offset", good, "bytes", len(data)-good)
		if err := a.file.Truncate(int64(good)); err != nil {
			return err
		}
		return a.file.Sync()
	}
	return nil
}

func (a *app) close() error {
	return errors.Join(a.c.Close(), a.file.Close())
}

// reply is the response to a transfer: the handler sends it, and a key
// settled after a crash is committed with it, so both are the same bytes.
func reply(t transfer) *idemhttp.StoredResponse {
	b, _ := json.Marshal(t)
	return &idemhttp.StoredResponse{Status: http.StatusCreated, Header: http.Header{"Content-Type": {"application/json"}}, Body: append(b, '\n')}
}

// routes are the API over store (the cluster's client; the tests of the
// handler alone give an embedded engine).
func (a *app) routes(store idem.Store) http.Handler {
	mw, err := idemhttp.Middleware(store, options())
	if err != nil {
		panic(err) // options() is fixed: a failure here is a bug
	}
	mux := http.NewServeMux()
	mux.Handle("POST /transfers", mw(http.HandlerFunc(a.transfer)))
	mux.HandleFunc("GET /transfers", a.list)
	mux.HandleFunc("GET /cluster", a.status)
	return mux
}

// transfer makes a transfer: appended to the effects log and fsynced,
// then answered. The middleware around it stores the answer in the
// cluster before it is sent.
func (a *app) transfer(w http.ResponseWriter, r *http.Request) {
	var in struct {
		From, To string
		Amount   int64
	}
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.From == "" || in.To == "" || in.Amount <= 0 {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": `want {"from":..., "to":..., "amount": > 0}`}) // stored: a retry gets the same 400
		return
	}
	a.mu.Lock()
	if a.failed != nil {
		a.mu.Unlock()
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": "this replica's effects log failed: no transfer made, retry on another replica"})
		return
	}
	t := transfer{ID: fmt.Sprintf("%s-%d", a.owner, a.made+1), Key: r.Header.Get(idemhttp.HeaderKey), From: in.From, To: in.To, Amount: in.Amount}
	line, _ := json.Marshal(t)
	_, err := a.file.Write(append(line, '\n'))
	if err == nil {
		err = a.file.Sync()
	}
	a.made++
	if err == nil {
		a.byKey[t.Key] = len(a.done)
		a.done = append(a.done, t)
	} else {
		a.failed = err
	}
	a.mu.Unlock()
	if err != nil {
		slog.Error("writing the effects log", "key", t.Key, "error", err)
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": "the transfer may or may not be recorded"})
		return
	}
	afterEffect(t.Key)
	s := reply(t)
	for k, v := range s.Header {
		w.Header()[k] = v
	}
	w.WriteHeader(s.Status)
	w.Write(s.Body)
}

// list answers this replica's transfers.
func (a *app) list(w http.ResponseWriter, r *http.Request) {
	a.mu.Lock()
	out := append([]transfer{}, a.done...)
	a.mu.Unlock()
	writeJSON(w, http.StatusOK, out)
}

// status answers the cluster's view (who leads) from the node the client
// reaches first.
func (a *app) status(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	st, err := a.c.Status(ctx)
	if err != nil {
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": err.Error()})
		return
	}
	out := struct {
		Leader  string   `json:"leader"`
		Members []string `json:"members"`
	}{Leader: st.LeaderId}
	for _, m := range st.Members {
		out.Members = append(out.Members, m.NodeId)
	}
	writeJSON(w, http.StatusOK, out)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
