package idemprom_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemprom"
	"github.com/idemdb/idem/internal/testclock"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// openWithTraffic opens an engine and makes 2 misses, 3 hits, 1 conflict
// and 1 in-flight collision.
func openWithTraffic(t *testing.T) *idem.Engine {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	e, err := idem.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	fp := []byte("fp-a")
	for _, id := range []string{"a", "b"} {
		res, err := e.Begin(ctx, idem.Request{ID: []byte(id), Fingerprint: fp})
		if err != nil || res.Status != idem.Fresh {
			t.Fatalf("begin %s: %v %v", id, res.Status, err)
		}
		if id == "a" {
			if err := res.Claim.Commit(ctx, []byte("reply")); err != nil {
				t.Fatal(err)
			}
		}
	}
	for range 3 {
		if res, err := e.Begin(ctx, idem.Request{ID: []byte("a"), Fingerprint: fp}); err != nil || res.Status != idem.Done {
			t.Fatalf("hit: %v %v", res.Status, err)
		}
	}
	if _, err := e.Begin(ctx, idem.Request{ID: []byte("a"), Fingerprint: []byte("fp-other")}); !errors.Is(err, idem.ErrConflict) {
		t.Fatalf("conflict: %v", err)
	}
	if res, err := e.Begin(ctx, idem.Request{ID: []byte("b"), Fingerprint: fp}); err != nil || res.Status != idem.InFlight {
		t.Fatalf("collision: %v %v", res.Status, err)
	}
	return e
}

func TestCollectorCounters(t *testing.T) {
	e := openWithTraffic(t)
	c := newCollector(t, e, &idemprom.Options{ConstLabels: prometheus.Labels{"engine": "orders"}})
	want := `
# HELP idem_hits_total Begin calls that found the id committed and returned its stored reply (idempotency.hit).
# TYPE idem_hits_total counter
idem_hits_total{engine="orders"} 3
# HELP idem_misses_total Begin calls that claimed a new id (idempotency.miss).
# TYPE idem_misses_total counter
idem_misses_total{engine="orders"} 2
# HELP idem_conflicts_total Begin calls refused because the id was used with another fingerprint (idempotency.conflict).
# TYPE idem_conflicts_total counter
idem_conflicts_total{engine="orders"} 1
# HELP idem_inflight_collisions_total Begin calls that found the id in flight (idempotency.processing_collision).
# TYPE idem_inflight_collisions_total counter
idem_inflight_collisions_total{engine="orders"} 1
# HELP idem_live_entries Entries in the index: ids and sequence-mode clients.
# TYPE idem_live_entries gauge
idem_live_entries{engine="orders"} 2
`
	// LiveEntries is as of the applied LSN: wait for the applier.
	deadline := time.Now().Add(10 * time.Second)
	for e.Stats().AppliedLSN < e.Stats().DurableLSN && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if err := testutil.CollectAndCompare(c, strings.NewReader(want),
		"idem_hits_total", "idem_misses_total", "idem_conflicts_total", "idem_inflight_collisions_total", "idem_live_entries"); err != nil {
		t.Fatal(err)
	}
	if n := testutil.CollectAndCount(c); n != 35 {
		t.Fatalf("%d metrics, want 35", n)
	}
	if n := metricValue(c, "idem_wal_syncs_total"); n < 1 {
		t.Fatalf("idem_wal_syncs_total %v after fsynced requests", n)
	}
	problems, err := testutil.CollectAndLint(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
}

// A real scrape of /metrics over loopback.
func TestScrapeOverHTTP(t *testing.T) {
	e := openWithTraffic(t)
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(newCollector(t, e, nil))
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.HTTPErrorOnError}))
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/metrics", nil)
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %d %v\n%s", resp.StatusCode, err, b)
	}
	text := string(b)
	st := e.Stats()
	for _, line := range []string{
		"idem_hits_total 3",
		"idem_misses_total 2",
		"idem_conflicts_total 1",
		"idem_inflight_collisions_total 1",
		"idem_cleanups_total 0",
		"# TYPE idem_wal_bytes gauge",
		"# TYPE idem_last_lsn gauge",
		"# TYPE idem_durable_lsn gauge",
		"# TYPE idem_memory_bytes gauge",
	} {
		if !strings.Contains(text, line+"\n") {
			t.Errorf("scrape lacks %q", line)
		}
	}
	if st.WALBytes <= 0 || !strings.Contains(text, "idem_wal_bytes ") {
		t.Errorf("wal bytes %d not exported", st.WALBytes)
	}
	for _, part := range []string{"cache", "pending", "filter", "block_cache", "memtables", "backlog"} {
		if !strings.Contains(text, `idem_memory_bytes{part="`+part+`"} `) {
			t.Errorf("memory part %s not exported", part)
		}
	}
}

func newCollector(t *testing.T, s idem.Store, o *idemprom.Options) *idemprom.Collector {
	t.Helper()
	c, err := idemprom.NewCollector(s, o)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// Options that would make invalid metrics are errors naming the option,
// at NewCollector: never a panic at registration or at a scrape.
func TestCollectorOptionErrors(t *testing.T) {
	e, err := idem.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	for field, o := range map[string]*idemprom.Options{
		"Namespace":   {Namespace: "bad\xff"},
		"ConstLabels": {ConstLabels: prometheus.Labels{"part": "x"}},
	} {
		if c, err := idemprom.NewCollector(e, o); c != nil || err == nil || !strings.Contains(err.Error(), "idemprom: Options."+field+" ") {
			t.Errorf("%s: %v", field, err)
		}
	}
	if c, err := idemprom.NewCollector(nil, nil); c != nil || err == nil {
		t.Errorf("nil store: %v", err)
	}
	for _, bad := range []prometheus.Labels{{"": "x"}, {"engine": "\xff"}} {
		if _, err := idemprom.NewCollector(e, &idemprom.Options{ConstLabels: bad}); err == nil {
			t.Errorf("ConstLabels %q accepted", bad)
		}
	}
}

// idem_cleanups_total is the Idempotency-Key service's
// idempotency.cleanup.count: entries removed by the TTL cleanup.
func TestCleanupsTotal(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	clk := testclock.New()
	e, err := idem.Open(t.TempDir(), &idem.Options{Clock: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	for _, id := range []string{"a", "b"} {
		res, err := e.Begin(ctx, idem.Request{ID: []byte(id), TTL: time.Minute})
		if err != nil || res.Status != idem.Fresh {
			t.Fatal(res.Status, err)
		}
		if err := res.Claim.Commit(ctx, []byte("r")); err != nil {
			t.Fatal(err)
		}
	}
	clk.Advance(2 * time.Minute)
	// The cleanup removes what the index has applied: wait for it.
	for e.Stats().AppliedLSN < e.Stats().LastLSN {
		if ctx.Err() != nil {
			t.Fatal("index stuck")
		}
		time.Sleep(time.Millisecond)
	}
	if n, err := e.CleanupExpired(ctx); err != nil || n != 2 {
		t.Fatalf("cleanup removed %d: %v", n, err)
	}
	want := `
# HELP idem_cleanups_total Replies and abandoned claims removed by cleanup and forget records (idempotency.cleanup.count).
# TYPE idem_cleanups_total counter
idem_cleanups_total 2
`
	if err := testutil.CollectAndCompare(newCollector(t, e, nil), strings.NewReader(want), "idem_cleanups_total"); err != nil {
		t.Fatal(err)
	}
}

// TestWALRecyclingCounters: an engine on the OS filesystem with small
// segments, whose compactions release full segments, recycles them, and
// the collector reports it.
func TestWALRecyclingCounters(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	e, err := idem.Open(t.TempDir(), &idem.Options{SegmentSize: 256 << 10, CompactWALBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	c := newCollector(t, e, nil)
	rng := rand.New(rand.NewPCG(1, 2))
	reply := make([]byte, 2048) // random: the log does not compress it away
	n := 0
	for round := 0; round < 4; round++ {
		for range 300 { // ~2.2 KiB of log per request: two or three segments per round
			for i := range reply {
				reply[i] = byte(rng.Uint32())
			}
			n++
			res, err := e.Begin(ctx, idem.Request{ID: []byte(fmt.Sprintf("id-%d", n)), Fingerprint: []byte("fp")})
			if err != nil || res.Status != idem.Fresh {
				t.Fatalf("begin %d: %v %v", n, res.Status, err)
			}
			if err := res.Claim.Commit(ctx, reply); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := e.Compact(ctx); err != nil {
			t.Fatal(err)
		}
	}
	st := e.Stats()
	if st.WALSegmentsRecycled == 0 || st.WALSparesRecycled == 0 {
		t.Fatalf("after 4 rounds of requests, each followed by a Compact: Stats.WALSegmentsRecycled %d, WALSparesRecycled %d; want both > 0",
			st.WALSegmentsRecycled, st.WALSparesRecycled)
	}
	for name, want := range map[string]uint64{
		"idem_wal_segments_recycled_total": st.WALSegmentsRecycled,
		"idem_wal_spares_recycled_total":   st.WALSparesRecycled,
	} {
		if got := metricValue(c, name); got < float64(want) { // counters only grow between Stats and the scrape
			t.Errorf("%s = %v, want at least %d (Stats)", name, got, want)
		}
	}
}

// metricValue is the value of c's metric named name (one without labels).
func metricValue(c prometheus.Collector, name string) float64 {
	return testutil.ToFloat64(prometheus.CollectorFunc(func(ch chan<- prometheus.Metric) {
		all := make(chan prometheus.Metric, 64)
		c.Collect(all)
		close(all)
		for m := range all {
			if strings.Contains(m.Desc().String(), `"`+name+`"`) {
				ch <- m
			}
		}
	}))
}
