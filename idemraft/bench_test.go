package idemraft

import (
	"context"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem/internal/cputime"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
)

// BenchmarkReplicated measures replicated requests/s (and the process's
// CPU time per request, all three nodes together) of a 3-node
// in-process cluster (raft's in-memory transport and stores, BatchApplyCh
// on, so that the leader appends and every FSM applies in batches), 64
// concurrent callers applying on the leader: "bare" applies the
// application's operations directly, "idemraft" wraps the FSM and sends
// each operation as a Command with a fresh id.
//
//	go test -run xxx -bench Replicated -benchtime 20000x ./idemraft/
func BenchmarkReplicated(b *testing.B) {
	for _, wrap := range []bool{false, true} {
		name := "bare"
		if wrap {
			name = "idemraft"
		}
		b.Run(name, func(b *testing.B) {
			// Long timeouts: on a loaded machine a starved heartbeat must not
			// cost the leader (the bare run would lose it just the same).
			// Engine defaults; the application is the benchmarks'
			// counterFSM (newBenchCounter) on every node, as in the bare run.
			c := newCluster(b, 3, clusterOpts{wrap: wrap, timeout: time.Second, engine: &idem.Options{}, plainApps: true})
			l := c.waitLeader(10 * time.Second)
			r, _, _, _ := l.current()
			var next atomic.Int64
			var failed atomic.Value
			var wg sync.WaitGroup
			b.ResetTimer()
			start, cpu0 := time.Now(), cputime.Process()
			for g := 0; g < 64; g++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for {
						i := next.Add(1)
						if i > int64(b.N) {
							return
						}
						id := "bench-" + strconv.FormatInt(i, 10)
						data := encodeOp(counterOp{ID: id, Key: "k" + strconv.FormatInt(i%16, 10), Delta: 1})
						if wrap {
							var err error
							if data, err = Command(idem.Request{ID: []byte(id)}, data); err != nil {
								failed.Store(err)
								return
							}
						}
						if err := r.Apply(data, 10*time.Second).Error(); err != nil {
							failed.Store(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			el := time.Since(start)
			b.StopTimer()
			if err := failed.Load(); err != nil {
				b.Fatal(err)
			}
			b.ReportMetric(float64(b.N)/el.Seconds(), "req/s")
			b.ReportMetric(float64((cputime.Process()-cpu0).Microseconds())/float64(b.N), "cpu-us/req")
		})
	}
}

// BenchmarkFSMApply is the wrapper's cost per entry without raft: Begin,
// the application's Apply and Commit, on one node.
func BenchmarkFSMApply(b *testing.B) {
	app := newBenchCounter()
	f, err := Wrap(app, &Options{Dir: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	fd := &feeder{f: f, at: t0}
	cmds := make([][]byte, b.N)
	for i := range cmds {
		id := "req-" + strconv.Itoa(i)
		cmds[i], _ = Command(idem.Request{ID: []byte(id)}, encodeOp(counterOp{ID: id, Key: "k", Delta: 1}))
	}
	b.ResetTimer()
	cpu0 := cputime.Process()
	for i := 0; i < b.N; i++ {
		fd.apply(cmds[i])
	}
	b.ReportMetric(float64((cputime.Process()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
}

// BenchmarkFSMApplyBatch is BenchmarkFSMApply through ApplyBatch, in
// batches of 64 and 512 fresh requests (what raft hands a BatchingFSM
// under load: one AppendedAt per batch); ns/op is per entry. cpu-ns/op
// is the process's CPU per entry (the engine's WAL flusher, applier and
// Pebble included); run-cpu-ns/op is the CPU of the goroutine calling
// ApplyBatch (locked to its thread), with the GC assists it is charged:
// the wrapper's own cost, which varies far less from run to run on a
// shared machine (Linux only; 0 elsewhere). Both include the
// application's Apply: BenchmarkFSMApplyBatchBare measures that alone.
func BenchmarkFSMApplyBatch(b *testing.B) {
	for _, size := range []int{64, 512} {
		b.Run(strconv.Itoa(size), func(b *testing.B) {
			app := newBenchCounter()
			f, err := Wrap(app, &Options{Dir: b.TempDir()})
			if err != nil {
				b.Fatal(err)
			}
			defer f.Close()
			logs := benchLogs(b.N, size, true)
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			b.ResetTimer()
			cpu0, tcpu0 := cputime.Process(), cputime.Thread()
			for i := 0; i < b.N; i += size {
				for _, r := range f.ApplyBatch(logs[i:min(i+size, b.N)]) {
					if resp := r.(*Response); resp.Err != nil || resp.Duplicate {
						b.Fatalf("%+v", resp)
					}
				}
			}
			b.ReportMetric(float64((cputime.Thread()-tcpu0).Nanoseconds())/float64(b.N), "run-cpu-ns/op")
			b.ReportMetric(float64((cputime.Process()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
			b.StopTimer()
			if app.ops != b.N {
				b.Fatalf("the application applied %d operations, want %d", app.ops, b.N)
			}
		})
	}
}

// BenchmarkFSMApplyBatchBare is the application's share of
// BenchmarkFSMApplyBatch: the same counterFSM applies the same operations
// (the Data the wrapper hands it, with the same index and log time), one
// Apply per entry as raft calls an FSM that is not a raft.BatchingFSM
// (and as the wrapper calls it), in the same batches, without the
// wrapper; same metrics. BenchmarkFSMApplyBatch minus this is what the
// wrapper costs per entry (decoding, the dedup lookup and write, the
// engine's background work).
func BenchmarkFSMApplyBatchBare(b *testing.B) {
	for _, size := range []int{64, 512} {
		b.Run(strconv.Itoa(size), func(b *testing.B) {
			app := newBenchCounter()
			logs := benchLogs(b.N, size, false)
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			b.ResetTimer()
			cpu0, tcpu0 := cputime.Process(), cputime.Thread()
			for i := 0; i < b.N; i += size {
				for _, l := range logs[i:min(i+size, b.N)] {
					if r, ok := app.Apply(l).([]byte); !ok || len(r) != 8 {
						b.Fatalf("%v", r)
					}
				}
			}
			b.ReportMetric(float64((cputime.Thread()-tcpu0).Nanoseconds())/float64(b.N), "run-cpu-ns/op")
			b.ReportMetric(float64((cputime.Process()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
			b.StopTimer()
			if app.ops != b.N {
				b.Fatalf("the application applied %d operations, want %d", app.ops, b.N)
			}
		})
	}
}

// benchLogs returns the n entries of BenchmarkFSMApplyBatch, one log time
// per batch of size: each a fresh request's Command (wrapped) or its
// operation alone (the Data the wrapper hands the application).
func benchLogs(n, size int, wrapped bool) []*raft.Log {
	logs := make([]*raft.Log, n)
	for i := range logs {
		id := "req-" + strconv.Itoa(i)
		c := encodeOp(counterOp{ID: id, Key: "k", Delta: 1})
		if wrapped {
			c, _ = Command(idem.Request{ID: []byte(id)}, c)
		}
		logs[i] = &raft.Log{Index: uint64(i + 1), Term: 1, Type: raft.LogCommand, Data: c, AppendedAt: t0.Add(time.Duration(i/size) * time.Millisecond)}
	}
	return logs
}

// BenchmarkEngineSequential is the part of BenchmarkFSMApply that is the
// dedup engine's: Begin and Commit of fresh ids one after another, with
// the options idemraft uses (what raft's single FSM goroutine does).
func BenchmarkEngineSequential(b *testing.B) {
	e, err := idem.Open(b.TempDir(), &idem.Options{Sync: idem.SyncNever, NoPreallocate: true, RelaxedClaims: true})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	ctx := context.Background()
	reply := make([]byte, 24)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		res, err := e.Begin(ctx, idem.Request{ID: []byte("req-" + strconv.Itoa(i))})
		if err != nil {
			b.Fatal(err)
		}
		if err := res.Claim.Commit(ctx, reply); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDecode is the codec's cost per entry on raft's FSM goroutine:
// decoding a command as the benchmarks above send it (an id and a small
// operation, and one with every field and a reply window), and a stored
// envelope (what every duplicate decodes).
//
//	go test -run xxx -bench Decode ./idemraft/
func BenchmarkDecode(b *testing.B) {
	plain, _ := Command(idem.Request{ID: []byte("req-123456")}, encodeOp(counterOp{ID: "req-123456", Key: "k", Delta: 1}))
	full, _ := Command(idem.Request{Scope: "s", Client: "client-7", Seq: 42, Fingerprint: []byte("0123456789abcdef0123456789abcdef"),
		Acked: [][]byte{[]byte("a-1"), []byte("a-2")}, TTL: time.Hour, KeepReplies: 8, KeepRepliesFor: time.Minute}, make([]byte, 100))
	for _, c := range []struct {
		name string
		data []byte
	}{{"command", plain}, {"window-command", full}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := decodeCommand(c.data); err != nil {
					b.Fatal(err)
				}
			}
		})
		// The same body through the library's Decoder alone (what every
		// body that is not in Command's own encoding takes): what
		// decodeCanonical saves per entry.
		body, window := c.data[len(commandMagic)+1:], c.data[len(commandMagic)] == kindWindowCommand
		b.Run(c.name+"-decoder", func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, _, err := decodeGeneral(body, window); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	env := encodeEnvelope(envelope{Kind: replyBytes, Reply: make([]byte, 24)})
	b.Run("envelope", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := decodeEnvelope(env); err != nil {
				b.Fatal(err)
			}
		}
	})
}
