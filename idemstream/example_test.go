package idemstream_test

import (
	"context"
	"fmt"
	"os"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemstream"
)

// The idempotent sink: a redelivered event replays the stored result and
// its effect does not run again; the frontier records the highest
// committed offset of each partition.
func ExampleSink() {
	ctx := context.Background()
	dir, _ := os.MkdirTemp("", "idemstream-example")
	defer os.RemoveAll(dir)
	e, err := idem.Open(dir, nil)
	if err != nil {
		panic(err)
	}
	defer e.Close()

	balance := 0
	ledger := map[string]bool{} // the effect's target
	sink, err := idemstream.NewSink(ctx, e, "ledger", &idemstream.SinkOptions{
		// After a crash between an effect and its commit: did it happen?
		Recover: func(ctx context.Context, d idemstream.InDoubtEvent) (idemstream.Resolution, error) {
			return idemstream.Resolution{Applied: ledger[string(d.ID)]}, nil
		},
	})
	if err != nil {
		panic(err)
	}
	post := func(ctx context.Context, ev idemstream.Event) (idemstream.Effect, error) {
		balance += 10
		ledger[string(ev.ID)] = true
		return idemstream.Effect{Result: []byte(fmt.Sprintf("balance %d", balance))}, nil
	}
	for _, ev := range []idemstream.Event{
		{ID: []byte("pay-1"), Partition: "payments", Offset: 1, Payload: []byte("10")},
		{ID: []byte("pay-2"), Partition: "payments", Offset: 2, Payload: []byte("10")},
		{ID: []byte("pay-1"), Partition: "payments", Offset: 1, Payload: []byte("10")}, // redelivered
	} {
		out, err := sink.Apply(ctx, ev, post)
		if err != nil {
			panic(err)
		}
		// Acknowledge the delivery to the broker only now. The frontier
		// moved with the commit.
		fmt.Printf("%s: %s (%s)\n", ev.ID, out.Status, out.Result)
	}
	front, _, _ := sink.Frontier("payments")
	fmt.Println("balance", balance, "frontier", front)
	// Output:
	// pay-1: applied (balance 10)
	// pay-2: applied (balance 20)
	// pay-1: replayed (balance 10)
	// balance 20 frontier 2
}

// exampleTxn is the transaction handle of a toy transactional sink; it is
// serialized into the checkpoint.
type exampleTxn struct {
	Checkpoint uint64
	Rows       []string
}

type exampleSink struct{ visible []string }

func (s *exampleSink) BeginTransaction(ctx context.Context, k uint64) (*exampleTxn, error) {
	return &exampleTxn{Checkpoint: k}, nil
}
func (s *exampleSink) Invoke(ctx context.Context, t *exampleTxn, ev idemstream.Event) error {
	t.Rows = append(t.Rows, string(ev.ID))
	return nil
}
func (s *exampleSink) PreCommit(ctx context.Context, t *exampleTxn) error { return nil }
func (s *exampleSink) Commit(ctx context.Context, t *exampleTxn) error {
	s.visible = append(s.visible, t.Rows...)
	return nil
}
func (s *exampleSink) Abort(ctx context.Context, t *exampleTxn) error { return nil }
func (s *exampleSink) RecoverAndCommit(ctx context.Context, t *exampleTxn) error {
	return s.Commit(ctx, t) // a real sink makes this idempotent
}
func (s *exampleSink) RecoverAndAbort(ctx context.Context, t *exampleTxn) error { return nil }

// The two-phase path: one checkpoint per batch; the events are
// acknowledged after Checkpoint returns, and a redelivered batch replays.
func ExampleTwoPhase() {
	ctx := context.Background()
	dir, _ := os.MkdirTemp("", "idemstream-example")
	defer os.RemoveAll(dir)
	e, err := idem.Open(dir, nil)
	if err != nil {
		panic(err)
	}
	defer e.Close()
	sink := &exampleSink{}
	tp, rep, err := idemstream.NewTwoPhase[*exampleTxn](ctx, e, "orders", sink, nil)
	if err != nil {
		panic(err)
	}
	fmt.Println("recovery:", rep.Action)
	batch := []idemstream.Event{
		{ID: []byte("o-1"), Partition: "orders", Offset: 10},
		{ID: []byte("o-2"), Partition: "orders", Offset: 11},
	}
	for round := 0; round < 2; round++ { // the second round is a redelivery
		outs, err := tp.Checkpoint(ctx, batch)
		if err != nil {
			panic(err)
		}
		for i, o := range outs {
			fmt.Printf("%s: %s in checkpoint %d\n", batch[i].ID, o.Status, o.Checkpoint)
		}
	}
	front, _ := tp.Frontier("orders")
	fmt.Println("visible:", sink.visible, "frontier:", front)
	// Output:
	// recovery: none
	// o-1: applied in checkpoint 1
	// o-2: applied in checkpoint 1
	// o-1: replayed in checkpoint 1
	// o-2: replayed in checkpoint 1
	// visible: [o-1 o-2] frontier: 11
}
