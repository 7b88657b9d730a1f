package idemgrpc_test

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem/internal/cputime"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/examples/ledger/ledgerpb"
	"github.com/idemdb/idem/examples/ledger/ledgersvc"
	"github.com/idemdb/idem/idemgrpc"
	"google.golang.org/grpc"
)

// BenchmarkUnary: unary calls/s of a trivial Write handler over loopback
// TCP, behind the token check, without and with the idemgrpc interceptor
// (new sequences, and replays of a committed one). Parallel callers share
// one connection; each has its own client id.
//
//	go test -run xxx -bench Unary -benchtime 3s ./idemgrpc/
func BenchmarkUnary(b *testing.B) {
	for _, bc := range unarySetups {
		b.Run(bc.name, func(b *testing.B) {
			c := bc.client(b)
			ctx := as(context.Background(), "tok-alice")
			var ids atomic.Int64
			b.SetParallelism(16) // 16 x GOMAXPROCS callers
			cpu0 := cputime.Process()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				client := "bench-" + strconv.FormatInt(ids.Add(1), 10)
				seq := uint64(0)
				if bc.replay {
					if _, err := c.Write(ctx, write(client, "ns", "", 1, "a", 1)); err != nil {
						b.Error(err)
						return
					}
					seq = 1
				}
				for pb.Next() {
					if !bc.replay {
						seq++
					}
					if _, err := c.Write(ctx, write(client, "ns", "", seq, "a", 1)); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "calls/s")
			// CPU time of the whole process (client and server) per call:
			// less sensitive than calls/s to other load on a shared machine.
			b.ReportMetric(float64((cputime.Process()-cpu0).Microseconds())/float64(b.N), "cpu-us/call")
		})
	}
}

// A unarySetup is a server of the unary benchmarks: plain (the token
// check only), or with the idemgrpc interceptor over an engine of the
// given sync mode, called with new sequences or replays of a committed
// one.
type unarySetup struct {
	name   string
	idem   bool
	sync   idem.SyncMode
	replay bool
}

var unarySetups = []unarySetup{
	{name: "plain"},
	{name: "new", idem: true, sync: idem.SyncAlways},
	{name: "new-nofsync", idem: true, sync: idem.SyncNever},
	{name: "replay", idem: true, sync: idem.SyncAlways, replay: true},
}

// client serves benchLedger as the setup says on loopback TCP (stopped,
// with its engine, when b ends) and returns a client of it.
func (u unarySetup) client(b *testing.B) ledgerpb.LedgerClient {
	ints := []grpc.UnaryServerInterceptor{ledgersvc.TokenAuth(tokens)}
	var isrv *idemgrpc.Server
	if u.idem {
		eng, err := idem.Open(b.TempDir(), &idem.Options{Sync: u.sync})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { eng.Close() })
		isrv, err = idemgrpc.NewServer(eng, &idemgrpc.Options{Methods: ledgersvc.Methods()})
		if err != nil {
			b.Fatal(err)
		}
		ints = append(ints, isrv.UnaryServerInterceptor())
	}
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(ints...))
	ledgerpb.RegisterLedgerServer(gs, &benchLedger{runs: new(atomic.Int64)})
	return ledgerpb.NewLedgerClient(dialB(b, serve(b, isrv, gs)))
}

type benchLedger struct {
	ledgerpb.UnimplementedLedgerServer
	runs *atomic.Int64
}

func (l *benchLedger) Write(ctx context.Context, req *ledgerpb.WriteRequest) (*ledgerpb.WriteSuccess, error) {
	l.runs.Add(1)
	return &ledgerpb.WriteSuccess{TxId: "tx", Sequence: req.GetSequence(), Actor: "user:alice",
		Balances: []*ledgerpb.Balance{{Account: req.GetOperation().GetAccount(), Balance: 1}}}, nil
}

// BenchmarkUnaryInterleaved runs the four setups of BenchmarkUnary side by
// side and alternates between them in rounds of 1,024 calls (32 callers),
// so that the load of a shared machine falls on all of them alike; it
// reports each setup's calls/s over all rounds and the ratios to plain.
//
//	go test -run xxx -bench UnaryInterleaved -benchtime 30x ./idemgrpc/
func BenchmarkUnaryInterleaved(b *testing.B) {
	type setup struct {
		unarySetup
		c     ledgerpb.LedgerClient
		seqs  []uint64
		calls int
		wall  time.Duration
	}
	var setups []*setup
	for _, u := range unarySetups {
		setups = append(setups, &setup{unarySetup: u})
	}
	const workers, perWorker = 32, 32
	ctx := as(context.Background(), "tok-alice")
	for _, s := range setups {
		s.c = s.client(b)
		s.seqs = make([]uint64, workers)
		if s.replay {
			for w := range workers {
				if _, err := s.c.Write(ctx, write("w"+strconv.Itoa(w), "ns", "", 1, "a", 1)); err != nil {
					b.Fatal(err)
				}
				s.seqs[w] = 1
			}
		}
	}
	round := func(s *setup) {
		var wg sync.WaitGroup
		start := time.Now()
		for w := range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				client := "w" + strconv.Itoa(w)
				for range perWorker {
					if !s.replay {
						s.seqs[w]++
					}
					if _, err := s.c.Write(ctx, write(client, "ns", "", s.seqs[w], "a", 1)); err != nil {
						b.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		s.wall += time.Since(start)
		s.calls += workers * perWorker
	}
	for _, s := range setups { // warm up
		round(s)
		s.calls, s.wall = 0, 0
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, s := range setups {
			round(s)
		}
	}
	b.StopTimer()
	rate := map[string]float64{}
	for _, s := range setups {
		rate[s.name] = float64(s.calls) / s.wall.Seconds()
		b.ReportMetric(rate[s.name], s.name+"-calls/s")
	}
	for _, s := range setups[1:] {
		b.ReportMetric(rate[s.name]/rate["plain"], s.name+"/plain")
	}
}
