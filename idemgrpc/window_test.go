package idemgrpc_test

import (
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/examples/ledger/ledgerpb"
	"github.com/idemdb/idem/examples/ledger/ledgersvc"
	"github.com/idemdb/idem/idemgrpc"
	"github.com/idemdb/idem/internal/testclock"
	"google.golang.org/grpc/codes"
)

// A client that pipelines sequences 1, 2, 3 and lost the reply of 1 gets
// it back while it is in the reply cache (the ledger's 10,000 replies for
// 5 minutes by default), and ALREADY_COMMITTED with the last committed
// sequence after it leaves it: by age, or by count.
func TestPipelinedRetryGetsItsReply(t *testing.T) {
	for _, tc := range []struct {
		name       string
		keep       int
		advance    time.Duration
		wantReplay bool
	}{
		{"defaults", 0, 0, true},
		{"defaults, after 5 minutes", 0, 5*time.Minute + time.Second, false},
		{"count 2", 2, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := testclock.New()
			env := startLedger(t, ledgersvc.Options{Engine: &idem.Options{Clock: clk.Now}, KeepReplies: tc.keep})
			ctx := as(testCtx(t), "tok-alice")
			c := ledgerpb.NewLedgerClient(dial(t, env.addr))
			var first *ledgerpb.WriteSuccess
			for seq := uint64(1); seq <= 3; seq++ {
				r, err := c.Write(ctx, write("c", "ns", "", seq, "a", int64(seq)))
				if err != nil {
					t.Fatal(err)
				}
				if seq == 1 {
					first = r
				}
			}
			clk.Advance(tc.advance)
			again, err := c.Write(ctx, write("c", "ns", "", 1, "a", 1))
			if tc.wantReplay {
				if err != nil {
					t.Fatalf("retry of sequence 1: %v", err)
				}
				sameReply(t, first, again)
				return
			}
			meta := wantStatus(t, err, codes.AlreadyExists, idemgrpc.ReasonAlreadyCommitted)
			if meta[idemgrpc.MetaLastCommitted] != "3" {
				t.Fatalf("last committed %q, want 3", meta[idemgrpc.MetaLastCommitted])
			}
		})
	}
}
