// Package streamprom exports the counters of idemstream's sinks,
// two-phase coordinators and outboxes to Prometheus as a
// prometheus.Collector, as idemprom does for the engine:
//
//	reg := prometheus.NewRegistry()
//	reg.MustRegister(streamprom.NewCollector([]*idemstream.Sink{sink}, []*idemstream.Outbox{ob}, nil))
//
// It is a package of its own so that a program using idemstream without
// Prometheus does not link client_golang. Every scrape reads the Stats of
// each component once; counters count since the component was opened.
//
//	idemstream_sink_events_total{sink,status}             applied, replayed, busy, failed
//	idemstream_sink_recovered_events_total{sink,decision} committed, released (in doubt after a crash)
//	idemstream_sink_frontier_writes_total{sink}
//	idemstream_sink_retried_total{sink}                   failed deliveries handed back (Nak)
//	idemstream_sink_terminated_total{sink}                events ended without their effect (failed for good, or MaxDeliveries)
//	idemstream_sink_dead_lettered_total{sink}             of those, handed to a dead-letter destination
//	idemstream_twophase_last_checkpoint{twophase}
//	idemstream_twophase_retried_total{twophase}           (as for sinks)
//	idemstream_twophase_terminated_total{twophase}
//	idemstream_twophase_dead_lettered_total{twophase}
//	idemstream_outbox_pending{outbox}                     the backlog
//	idemstream_outbox_oldest_pending_seconds{outbox}
//	idemstream_outbox_delivered_total{outbox}
//	idemstream_outbox_attempts_total{outbox}
//	idemstream_outbox_failures_total{outbox}
//	idemstream_outbox_orphaned_total{outbox}
package streamprom

import (
	"github.com/idemdb/idem/idemstream"
	"github.com/prometheus/client_golang/prometheus"
)

// TwoPhase is what the collector reads of an idemstream.TwoPhase (of any
// transaction type).
type TwoPhase interface {
	Name() string
	Stats() idemstream.TwoPhaseStats
}

// Options configure the collector. nil is the defaults.
type Options struct {
	// Namespace prefixes every metric name (default "idemstream").
	Namespace string
	// ConstLabels are added to every metric.
	ConstLabels prometheus.Labels
	// TwoPhases are the two-phase coordinators to export.
	TwoPhases []TwoPhase
}

// Collector is a prometheus.Collector of idemstream components' Stats.
type Collector struct {
	sinks    []*idemstream.Sink
	outboxes []*idemstream.Outbox
	tps      []TwoPhase
	d        descs
}

type descs struct {
	sinkEvents, sinkRecovered, sinkFrontier, sinkRetried, sinkTerm, sinkDead *prometheus.Desc
	tpLast, tpRetried, tpTerm, tpDead                                        *prometheus.Desc
	obPending, obOldest, obDelivered, obAttempts, obFailures, obOrphaned     *prometheus.Desc
}

func (d *descs) all() []*prometheus.Desc {
	return []*prometheus.Desc{d.sinkEvents, d.sinkRecovered, d.sinkFrontier, d.sinkRetried, d.sinkTerm, d.sinkDead,
		d.tpLast, d.tpRetried, d.tpTerm, d.tpDead,
		d.obPending, d.obOldest, d.obDelivered, d.obAttempts, d.obFailures, d.obOrphaned}
}

// NewCollector returns the collector of sinks, outboxes and
// opts.TwoPhases (see the package documentation for the metrics).
func NewCollector(sinks []*idemstream.Sink, outboxes []*idemstream.Outbox, opts *Options) *Collector {
	var o Options
	if opts != nil {
		o = *opts
	}
	if o.Namespace == "" {
		o.Namespace = "idemstream"
	}
	desc := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(o.Namespace+"_"+name, help, labels, o.ConstLabels)
	}
	return &Collector{sinks: sinks, outboxes: outboxes, tps: o.TwoPhases, d: descs{
		sinkEvents:    desc("sink_events_total", "Events handled by an idempotent sink, by outcome.", "sink", "status"),
		sinkRecovered: desc("sink_recovered_events_total", "Events left in doubt by a crash and settled at start-up.", "sink", "decision"),
		sinkFrontier:  desc("sink_frontier_writes_total", "Records that carried a partition frontier (event commits with an offset, advances past replays).", "sink"),
		sinkRetried:   desc("sink_retried_total", "Failed deliveries handed back to the broker for a redelivery.", "sink"),
		sinkTerm:      desc("sink_terminated_total", "Events terminated without their effect: failed for good (conflict, invalid, permanent) or at MaxDeliveries.", "sink"),
		sinkDead:      desc("sink_dead_lettered_total", "Terminated events handed to the source's dead-letter destination.", "sink"),
		tpLast:        desc("twophase_last_checkpoint", "Id of the last checkpoint opened.", "twophase"),
		tpRetried:     desc("twophase_retried_total", "Failed deliveries handed back to the broker for a redelivery.", "twophase"),
		tpTerm:        desc("twophase_terminated_total", "Events terminated without their effect: failed for good (conflict, invalid) or at MaxDeliveries.", "twophase"),
		tpDead:        desc("twophase_dead_lettered_total", "Terminated events handed to the source's dead-letter destination.", "twophase"),
		obPending:     desc("outbox_pending", "Outbox messages recorded and not yet delivered (the backlog).", "outbox"),
		obOldest:      desc("outbox_oldest_pending_seconds", "Age of the oldest undelivered outbox message.", "outbox"),
		obDelivered:   desc("outbox_delivered_total", "Outbox messages delivered and removed.", "outbox"),
		obAttempts:    desc("outbox_attempts_total", "Delivery attempts.", "outbox"),
		obFailures:    desc("outbox_failures_total", "Failed delivery attempts (retried with backoff).", "outbox"),
		obOrphaned:    desc("outbox_orphaned_total", "Pending messages whose event record had expired at start-up.", "outbox"),
	}}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.d.all() {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	d := &c.d
	for _, s := range c.sinks {
		st, n := s.Stats(), s.Name()
		counter(d.sinkEvents, st.Applied, n, "applied")
		counter(d.sinkEvents, st.Replayed, n, "replayed")
		counter(d.sinkEvents, st.Busy, n, "busy")
		counter(d.sinkEvents, st.Failed, n, "failed")
		counter(d.sinkRecovered, st.RecoveredCommitted, n, "committed")
		counter(d.sinkRecovered, st.RecoveredAborted, n, "released")
		counter(d.sinkFrontier, st.FrontierWrites, n)
		counter(d.sinkRetried, st.Retried, n)
		counter(d.sinkTerm, st.Terminated, n)
		counter(d.sinkDead, st.DeadLettered, n)
	}
	for _, t := range c.tps {
		st, n := t.Stats(), t.Name()
		ch <- prometheus.MustNewConstMetric(d.tpLast, prometheus.GaugeValue, float64(st.LastCheckpoint), n)
		counter(d.tpRetried, st.Retried, n)
		counter(d.tpTerm, st.Terminated, n)
		counter(d.tpDead, st.DeadLettered, n)
	}
	for _, o := range c.outboxes {
		st, n := o.Stats(), o.Name()
		ch <- prometheus.MustNewConstMetric(d.obPending, prometheus.GaugeValue, float64(st.Pending), n)
		ch <- prometheus.MustNewConstMetric(d.obOldest, prometheus.GaugeValue, st.OldestPending.Seconds(), n)
		counter(d.obDelivered, st.Delivered, n)
		counter(d.obAttempts, st.Attempts, n)
		counter(d.obFailures, st.Failures, n)
		counter(d.obOrphaned, st.Orphaned, n)
	}
}
