// Package idemprom exports an idem store's counters and sizes (Store.Stats;
// an *idem.Engine's or any other idem.Store's) to Prometheus as a
// prometheus.Collector.
//
//	c, err := idemprom.NewCollector(e, nil)
//	...
//	reg := prometheus.NewRegistry()
//	reg.MustRegister(c)
//	http.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
//
// Every scrape reads Store.Stats once; nothing is kept between scrapes.
// Counters (names ending in _total) count since the engine was opened: a
// restart resets them, which Prometheus' rate() and increase() handle.
//
// The Idempotency-Key service's metrics map to:
//
//	idempotency.hit                   idem_hits_total
//	idempotency.miss                  idem_misses_total
//	idempotency.conflict              idem_conflicts_total
//	idempotency.processing_collision  idem_inflight_collisions_total
//	idempotency.cleanup.count         idem_cleanups_total
//
// and its hit rate, hit / (hit + miss), over the last 5 minutes is
//
//	rate(idem_hits_total[5m]) / (rate(idem_hits_total[5m]) + rate(idem_misses_total[5m]))
//
// (in code: float64(s.Hits) / float64(s.Hits+s.Misses) from Engine.Stats).
// The service's guidance: above 0.8 retries are common and served from
// storage; below 0.5 deserves a look. Note that the engine counts every
// Begin: with several middlewares (or other users) on one engine the rate
// is theirs together; use one engine per labelled collector (ConstLabels)
// to tell them apart.
package idemprom

import (
	"errors"
	"fmt"

	"github.com/idemdb/idem"
	"github.com/prometheus/client_golang/prometheus"
)

// Options configure the collector. nil is the defaults.
type Options struct {
	// Namespace prefixes every metric name (default "idem"). It must make
	// valid metric names.
	Namespace string
	// ConstLabels are added to every metric (for example the engine's
	// name when a process runs several). Valid label names and UTF-8
	// values; "part" is taken (idem_memory_bytes).
	ConstLabels prometheus.Labels
}

type metric struct {
	desc   *prometheus.Desc
	typ    prometheus.ValueType
	value  func(*idem.Stats) float64
	labels []string // values of the desc's variable labels
}

// Collector is a prometheus.Collector of one store's Stats.
type Collector struct {
	s       idem.Store
	metrics []metric
}

// NewCollector returns the collector of store's Stats (see the package
// documentation for the metric names). A nil store, a Namespace that makes
// invalid metric names or invalid ConstLabels are an error naming the
// option (found here, not at the first scrape or at registration).
func NewCollector(store idem.Store, opts *Options) (*Collector, error) {
	if store == nil {
		return nil, errors.New("idemprom: NewCollector needs a store (got nil)")
	}
	if opts == nil {
		opts = &Options{}
	}
	ns := opts.Namespace
	if ns == "" {
		ns = "idem"
	}
	// Each option alone, so that the error names the one at fault.
	if err := prometheus.NewDesc(prometheus.BuildFQName(ns, "", "hits_total"), "probe", nil, nil).Err(); err != nil {
		return nil, fmt.Errorf("idemprom: Options.Namespace %q: %w", opts.Namespace, err)
	}
	if err := prometheus.NewDesc("idem_probe", "probe", []string{"part"}, opts.ConstLabels).Err(); err != nil {
		return nil, fmt.Errorf("idemprom: Options.ConstLabels %v: %w", opts.ConstLabels, err)
	}
	c := &Collector{s: store}
	counter := func(name, help string, v func(*idem.Stats) float64) {
		c.metrics = append(c.metrics, metric{prometheus.NewDesc(prometheus.BuildFQName(ns, "", name), help, nil, opts.ConstLabels), prometheus.CounterValue, v, nil})
	}
	gauge := func(name, help string, v func(*idem.Stats) float64) {
		c.metrics = append(c.metrics, metric{prometheus.NewDesc(prometheus.BuildFQName(ns, "", name), help, nil, opts.ConstLabels), prometheus.GaugeValue, v, nil})
	}
	counter("hits_total", "Begin calls that found the id committed and returned its stored reply (idempotency.hit).",
		func(s *idem.Stats) float64 { return float64(s.Hits) })
	counter("misses_total", "Begin calls that claimed a new id (idempotency.miss).",
		func(s *idem.Stats) float64 { return float64(s.Misses) })
	counter("conflicts_total", "Begin calls refused because the id was used with another fingerprint (idempotency.conflict).",
		func(s *idem.Stats) float64 { return float64(s.Conflicts) })
	counter("inflight_collisions_total", "Begin calls that found the id in flight (idempotency.processing_collision).",
		func(s *idem.Stats) float64 { return float64(s.InFlightCollisions) })
	counter("cleanups_total", "Replies and abandoned claims removed by cleanup and forget records (idempotency.cleanup.count).",
		func(s *idem.Stats) float64 { return float64(s.Cleanups) })
	counter("evictions_total", "Replies removed because the engine's MaxEntries was reached.",
		func(s *idem.Stats) float64 { return float64(s.Evictions) })
	counter("acked_total", "Replies removed because their clients acked them.",
		func(s *idem.Stats) float64 { return float64(s.Acked) })
	counter("expired_total", "Ids found expired at Begin and run again as new.",
		func(s *idem.Stats) float64 { return float64(s.Expired) })
	counter("sequence_gaps_total", "Sequence-mode requests refused with a sequence gap.",
		func(s *idem.Stats) float64 { return float64(s.SequenceGaps) })
	counter("already_committed_total", "Sequence-mode requests at or below the last committed number whose reply is gone.",
		func(s *idem.Stats) float64 { return float64(s.AlreadyCommitted) })
	counter("lease_lost_total", "Commits and aborts refused because the claim's lease ran out and it was taken over (or it was finished already).",
		func(s *idem.Stats) float64 { return float64(s.LeaseLost) })
	counter("takeovers_total", "Claims taken over after their lease ran out.",
		func(s *idem.Stats) float64 { return float64(s.Takeovers) })
	counter("torn_tails_cut_total", "Torn WAL tails cut when the engine was opened.",
		func(s *idem.Stats) float64 { return float64(s.TornTailsCut) })
	counter("index_filter_builds_total", "In-memory key filters built.",
		func(s *idem.Stats) float64 { return float64(s.IndexFilterBuilds) })
	counter("wal_syncs_total", "Group-commit fdatasyncs of the WAL.",
		func(s *idem.Stats) float64 { return float64(s.WALSyncs) })
	counter("wal_sync_seconds_total", "Time spent in the WAL's group-commit fdatasyncs; divided by idem_wal_syncs_total, the mean fsync latency.",
		func(s *idem.Stats) float64 { return s.WALSyncTime.Seconds() })
	counter("wal_segments_recycled_total", "Old WAL segments kept for reuse by a compaction instead of being removed.",
		func(s *idem.Stats) float64 { return float64(s.WALSegmentsRecycled) })
	counter("wal_spares_recycled_total", "WAL segments started from a recycled file instead of a newly zero-filled one.",
		func(s *idem.Stats) float64 { return float64(s.WALSparesRecycled) })
	gauge("live_entries", "Entries in the index: ids and sequence-mode clients.",
		func(s *idem.Stats) float64 { return float64(s.LiveEntries) })
	gauge("replies", "Entries keeping a reply.",
		func(s *idem.Stats) float64 { return float64(s.Replies) })
	gauge("in_doubt_claims", "Claims found in flight when the engine opened and not resolved yet.",
		func(s *idem.Stats) float64 { return float64(s.InDoubt) })
	gauge("cache_bytes", "Accounted size of the in-memory entry table.",
		func(s *idem.Stats) float64 { return float64(s.CacheBytes) })
	gauge("wal_bytes", "Bytes of WAL on disk.",
		func(s *idem.Stats) float64 { return float64(s.WALBytes) })
	gauge("wal_segments", "WAL segments on disk.",
		func(s *idem.Stats) float64 { return float64(s.WALSegments) })
	gauge("index_bytes", "Size of the index on disk.",
		func(s *idem.Stats) float64 { return float64(s.IndexBytes) })
	gauge("last_lsn", "LSN of the last record appended to the WAL.",
		func(s *idem.Stats) float64 { return float64(s.LastLSN) })
	gauge("durable_lsn", "LSN of the last record fsynced.",
		func(s *idem.Stats) float64 { return float64(s.DurableLSN) })
	gauge("applied_lsn", "LSN of the last record applied to the index.",
		func(s *idem.Stats) float64 { return float64(s.AppliedLSN) })
	gauge("memory_budget_bytes", "The engine's memory budget (Options.MemoryBudget).",
		func(s *idem.Stats) float64 { return float64(s.Memory.Budget) })
	mem := prometheus.NewDesc(prometheus.BuildFQName(ns, "", "memory_bytes"),
		"Memory the engine accounts for against its budget, by part (sum them for the total).", []string{"part"}, opts.ConstLabels)
	for _, p := range []struct {
		name string
		v    func(*idem.Stats) float64
	}{
		{"cache", func(s *idem.Stats) float64 { return float64(s.Memory.Cache) }},
		{"pending", func(s *idem.Stats) float64 { return float64(s.Memory.Pending) }},
		{"filter", func(s *idem.Stats) float64 { return float64(s.Memory.Filter) }},
		{"block_cache", func(s *idem.Stats) float64 { return float64(s.Memory.BlockCache) }},
		{"memtables", func(s *idem.Stats) float64 { return float64(s.Memory.MemTables) }},
		{"backlog", func(s *idem.Stats) float64 { return float64(s.Memory.Backlog) }},
	} {
		c.metrics = append(c.metrics, metric{mem, prometheus.GaugeValue, p.v, []string{p.name}})
	}
	for _, m := range c.metrics { // cannot fail after the probes; checked all the same
		if err := m.desc.Err(); err != nil {
			return nil, fmt.Errorf("idemprom: %w", err)
		}
	}
	return c, nil
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	var last *prometheus.Desc
	for _, m := range c.metrics {
		if m.desc != last { // labelled metrics share their desc, in a row
			ch <- m.desc
			last = m.desc
		}
	}
}

// Collect implements prometheus.Collector: one Store.Stats per scrape.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	s := c.s.Stats()
	for _, m := range c.metrics {
		pm, err := prometheus.NewConstMetric(m.desc, m.typ, m.value(&s), m.labels...)
		if err != nil { // cannot happen (NewCollector checked the descs): the scrape reports it
			pm = prometheus.NewInvalidMetric(m.desc, err)
		}
		ch <- pm
	}
}
