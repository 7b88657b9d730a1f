package jetstream

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemdb/idem/idemstream/internal/brokertest"
	"github.com/nats-io/nats.go"
	njs "github.com/nats-io/nats.go/jetstream"
)

// The consumers' scenarios against JetStream (exactly once, crashes,
// poison messages and dead letters) are in idemstream's brokers_test.go.

// TestNewSourceConfigErrors: configuration errors are returned, naming the
// field and the value.
func TestNewSourceConfigErrors(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	nc, err := nats.Connect(brokertest.StartNATS(t).ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := njs.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, njs.StreamConfig{Name: "S", Subjects: []string{"s.>"}}); err != nil {
		t.Fatal(err)
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, "S", njs.ConsumerConfig{Durable: "c", AckPolicy: njs.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		cons njs.Consumer
		opts *Options
		want string
	}{
		{nil, nil, "nil consumer"},
		{cons, &Options{FetchWait: -time.Second}, "Options.FetchWait -1s"},
		{cons, &Options{DeadLetterSubject: "dead.s"}, `Options.DeadLetterSubject "dead.s" needs DeadLetterJS`},
	} {
		if _, err := NewSource(c.cons, c.opts); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error with %q", c.opts, err, c.want)
		}
	}
	src, err := NewSource(cons, nil)
	if err != nil || src.opts.FetchWait != time.Second || src.opts.IDHeader != nats.MsgIdHdr {
		t.Fatalf("defaults: %+v %v", src, err)
	}
}
