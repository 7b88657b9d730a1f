package idemstream

import (
	"github.com/prometheus/client_golang/prometheus"
)

// NewCollector exports the counters of idempotent sinks and outboxes
// (the backlog) as Prometheus metrics, read when scraped:
//
//	idemstream_sink_events_total{sink,status}            applied, replayed, busy, failed
//	idemstream_sink_recovered_events_total{sink,decision} committed, released (in doubt after a crash)
//	idemstream_sink_frontier_writes_total{sink}
//	idemstream_sink_retried_total{sink}                   failed deliveries handed back (Nak)
//	idemstream_sink_terminated_total{sink}                events ended without their effect (failed for good, or MaxDeliveries)
//	idemstream_sink_dead_lettered_total{sink}             of those, handed to a dead-letter destination
//	idemstream_outbox_pending{outbox}                     the backlog
//	idemstream_outbox_oldest_pending_seconds{outbox}
//	idemstream_outbox_delivered_total{outbox}
//	idemstream_outbox_attempts_total{outbox}
//	idemstream_outbox_failures_total{outbox}
//	idemstream_outbox_orphaned_total{outbox}
//
// Register it with prometheus.MustRegister.
func NewCollector(sinks []*Sink, outboxes []*Outbox) prometheus.Collector {
	return &collector{sinks: sinks, outboxes: outboxes}
}

var (
	descSinkEvents    = prometheus.NewDesc("idemstream_sink_events_total", "Events handled by an idempotent sink, by outcome.", []string{"sink", "status"}, nil)
	descSinkRecovered = prometheus.NewDesc("idemstream_sink_recovered_events_total", "Events left in doubt by a crash and settled at start-up.", []string{"sink", "decision"}, nil)
	descSinkFrontier  = prometheus.NewDesc("idemstream_sink_frontier_writes_total", "Records that carried a partition frontier (event commits with an offset, advances past replays).", []string{"sink"}, nil)
	descSinkRetried   = prometheus.NewDesc("idemstream_sink_retried_total", "Failed deliveries handed back to the broker for a redelivery.", []string{"sink"}, nil)
	descSinkTerm      = prometheus.NewDesc("idemstream_sink_terminated_total", "Events terminated without their effect: failed for good (conflict, invalid, permanent) or at MaxDeliveries.", []string{"sink"}, nil)
	descSinkDead      = prometheus.NewDesc("idemstream_sink_dead_lettered_total", "Terminated events handed to the source's dead-letter destination.", []string{"sink"}, nil)
	descObPending     = prometheus.NewDesc("idemstream_outbox_pending", "Outbox messages recorded and not yet delivered (the backlog).", []string{"outbox"}, nil)
	descObOldest      = prometheus.NewDesc("idemstream_outbox_oldest_pending_seconds", "Age of the oldest undelivered outbox message.", []string{"outbox"}, nil)
	descObDelivered   = prometheus.NewDesc("idemstream_outbox_delivered_total", "Outbox messages delivered and removed.", []string{"outbox"}, nil)
	descObAttempts    = prometheus.NewDesc("idemstream_outbox_attempts_total", "Delivery attempts.", []string{"outbox"}, nil)
	descObFailures    = prometheus.NewDesc("idemstream_outbox_failures_total", "Failed delivery attempts (retried with backoff).", []string{"outbox"}, nil)
	descObOrphaned    = prometheus.NewDesc("idemstream_outbox_orphaned_total", "Pending messages whose event record had expired at start-up.", []string{"outbox"}, nil)
)

type collector struct {
	sinks    []*Sink
	outboxes []*Outbox
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descSinkEvents, descSinkRecovered, descSinkFrontier, descSinkRetried, descSinkTerm, descSinkDead, descObPending, descObOldest, descObDelivered, descObAttempts, descObFailures, descObOrphaned} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	for _, s := range c.sinks {
		st := s.Stats()
		counter(descSinkEvents, st.Applied, s.name, "applied")
		counter(descSinkEvents, st.Replayed, s.name, "replayed")
		counter(descSinkEvents, st.Busy, s.name, "busy")
		counter(descSinkEvents, st.Failed, s.name, "failed")
		counter(descSinkRecovered, st.RecoveredCommitted, s.name, "committed")
		counter(descSinkRecovered, st.RecoveredAborted, s.name, "released")
		counter(descSinkFrontier, st.FrontierWrites, s.name)
		counter(descSinkRetried, st.Retried, s.name)
		counter(descSinkTerm, st.Terminated, s.name)
		counter(descSinkDead, st.DeadLettered, s.name)
	}
	for _, o := range c.outboxes {
		st := o.Stats()
		ch <- prometheus.MustNewConstMetric(descObPending, prometheus.GaugeValue, float64(st.Pending), o.name)
		ch <- prometheus.MustNewConstMetric(descObOldest, prometheus.GaugeValue, st.OldestPending.Seconds(), o.name)
		counter(descObDelivered, st.Delivered, o.name)
		counter(descObAttempts, st.Attempts, o.name)
		counter(descObFailures, st.Failures, o.name)
		counter(descObOrphaned, st.Orphaned, o.name)
	}
}
