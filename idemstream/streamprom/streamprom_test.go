package streamprom

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func outboxHandler(ctx context.Context, ev idemstream.Event) (idemstream.Effect, error) {
	return idemstream.Effect{Result: []byte("queued"), Outbox: []idemstream.OutboxMessage{
		{Destination: "bank", Payload: ev.Payload},
		{Destination: "audit", Payload: ev.ID},
	}}, nil
}

func TestCollector(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	e, err := idem.Open("db", &idem.Options{FS: vfs.NewMem()})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ob, err := idemstream.NewOutbox(ctx, e, "mail", &idemstream.OutboxOptions{Deliver: func(context.Context, idemstream.Delivery) error { return nil }})
	if err != nil {
		t.Fatal(err)
	}
	s, err := idemstream.NewSink(ctx, e, "orders", &idemstream.SinkOptions{Outbox: ob})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		if _, err := s.Apply(ctx, idemstream.Event{ID: []byte("a")}, outboxHandler); err != nil {
			t.Fatal(err)
		}
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(NewCollector([]*idemstream.Sink{s}, []*idemstream.Outbox{ob}, nil))
	want := `
# HELP idemstream_outbox_pending Outbox messages recorded and not yet delivered (the backlog).
# TYPE idemstream_outbox_pending gauge
idemstream_outbox_pending{outbox="mail"} 2
# HELP idemstream_sink_events_total Events handled by an idempotent sink, by outcome.
# TYPE idemstream_sink_events_total counter
idemstream_sink_events_total{sink="orders",status="applied"} 1
idemstream_sink_events_total{sink="orders",status="busy"} 0
idemstream_sink_events_total{sink="orders",status="failed"} 0
idemstream_sink_events_total{sink="orders",status="replayed"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "idemstream_outbox_pending", "idemstream_sink_events_total"); err != nil {
		t.Fatal(err)
	}
	if _, err := ob.DeliverPending(ctx); err != nil {
		t.Fatal(err)
	}
	after := `
# HELP idemstream_outbox_delivered_total Outbox messages delivered and removed.
# TYPE idemstream_outbox_delivered_total counter
idemstream_outbox_delivered_total{outbox="mail"} 2
# HELP idemstream_outbox_pending Outbox messages recorded and not yet delivered (the backlog).
# TYPE idemstream_outbox_pending gauge
idemstream_outbox_pending{outbox="mail"} 0
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(after), "idemstream_outbox_pending", "idemstream_outbox_delivered_total"); err != nil {
		t.Fatal(err)
	}
}
