package idemcluster

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem/internal/cputime"

	"github.com/idemdb/idem"
)

// BenchmarkClusterFresh measures fresh requests (Begin, then Commit, each
// majority-replicated and fsynced before its answer) through a Client of a
// three-node cluster on loopback, 64 callers at once. Compare it in one
// run with BenchmarkEngineFresh (the embedded engine, SyncAlways).
//
//	go test -run '^$' -bench 'Fresh' -benchtime 3000x ./idemcluster/
func BenchmarkClusterFresh(b *testing.B) {
	c := benchClient(b)
	benchFresh(b, c)
}

// BenchmarkClusterFreshRequestCtx is BenchmarkClusterFresh with each
// request under a ctx that can end, as a request handler's (an HTTP
// request's, a gRPC call's) is: the claim's finish must go on when the
// caller stops waiting, which BenchmarkClusterFresh's Background (never
// ends) does not ask.
func BenchmarkClusterFreshRequestCtx(b *testing.B) {
	ctx := context.Background()
	c := benchClient(b)
	benchFreshCtx(b, c, func() (context.Context, context.CancelFunc) { return context.WithCancel(ctx) })
}

// BenchmarkEngineFresh is BenchmarkClusterFresh on an embedded engine.
func BenchmarkEngineFresh(b *testing.B) {
	e, err := idem.Open(b.TempDir(), nil)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	benchFresh(b, e)
}

// BenchmarkClusterDuplicate measures duplicates: linearizable Lookups of
// committed ids (each confirmed by a leadership round shared with the
// reads that arrived before it) through a Client of a three-node cluster,
// 64 callers at once. Compare it in one run with BenchmarkEngineDuplicate.
//
//	go test -run '^$' -bench 'Duplicate' -benchtime 20000x ./idemcluster/
func BenchmarkClusterDuplicate(b *testing.B) {
	c := benchClient(b)
	benchDuplicate(b, c, c.Lookup)
}

// BenchmarkClusterDuplicateBegin is BenchmarkClusterDuplicate with Begin
// (what a retried request sends): a Begin of a committed id is answered
// as a linearizable read, with no log entry.
func BenchmarkClusterDuplicateBegin(b *testing.B) {
	c := benchClient(b)
	benchDuplicate(b, c, c.Begin)
}

// BenchmarkEngineDuplicate is BenchmarkClusterDuplicate on an embedded
// engine.
func BenchmarkEngineDuplicate(b *testing.B) {
	e, err := idem.Open(b.TempDir(), nil)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	benchDuplicate(b, e, e.Lookup)
}

// benchDuplicate commits dupIDs ids, then asks for them with op (Lookup
// or Begin).
func benchDuplicate(b *testing.B, s idem.Store, op func(context.Context, idem.Request) (idem.Result, error)) {
	const dupIDs = 1024
	ctx := context.Background()
	var wg sync.WaitGroup
	for w := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < dupIDs; i += 64 {
				if _, err := idem.Do(ctx, s, idem.Request{ID: []byte(fmt.Sprintf("d-%d", i))}, func(context.Context) ([]byte, error) { return []byte("ok"), nil }); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	var n atomic.Int64
	b.SetParallelism(32) // 64 callers on 2 cores
	b.ResetTimer()
	start, cpu := time.Now(), cputime.Process()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			id := fmt.Sprintf("d-%d", n.Add(1)%dupIDs)
			r, err := op(ctx, idem.Request{ID: []byte(id)})
			if err != nil || r.Status != idem.Done {
				b.Errorf("duplicate %s: %+v %v", id, r, err)
				return
			}
		}
	})
	report(b, start, cpu)
}

// report adds req/s and the process's CPU time per request (every node
// and the client: the figure that a loaded machine changes least).
func report(b *testing.B, start time.Time, cpu time.Duration) {
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "req/s")
	b.ReportMetric(float64(cputime.Process()-cpu)/float64(time.Microsecond)/float64(b.N), "cpu-µs/req")
}

func benchFresh(b *testing.B, s idem.Store) {
	benchFreshCtx(b, s, nil)
}

// benchFreshCtx is benchFresh with each request under a ctx of reqCtx
// (nil: context.Background for all).
func benchFreshCtx(b *testing.B, s idem.Store, reqCtx func() (context.Context, context.CancelFunc)) {
	var n atomic.Int64
	b.SetParallelism(32) // 64 callers on 2 cores
	b.ResetTimer()
	start, cpu := time.Now(), cputime.Process()
	b.RunParallel(func(pb *testing.PB) {
		ctx, cancel := context.Background(), context.CancelFunc(func() {})
		for pb.Next() {
			if reqCtx != nil {
				ctx, cancel = reqCtx()
			}
			id := fmt.Sprintf("f-%d", n.Add(1))
			_, err := idem.Do(ctx, s, idem.Request{ID: []byte(id)}, func(context.Context) ([]byte, error) { return []byte("ok"), nil })
			cancel()
			if err != nil {
				b.Error(err)
				return
			}
		}
	})
	report(b, start, cpu)
}

// BenchmarkClusterMixed runs b.N fresh requests (idem.Do, 32 callers)
// while 32 more callers look committed ids up (duplicates) through the
// same Client, until the fresh requests are done: the writes' rate beside
// reads, and the reads' beside write batches.
func BenchmarkClusterMixed(b *testing.B) {
	const dupIDs = 1024
	ctx := context.Background()
	c := benchClient(b)
	for i := range dupIDs {
		if _, err := idem.Do(ctx, c, idem.Request{ID: []byte(fmt.Sprintf("d-%d", i))}, func(context.Context) ([]byte, error) { return []byte("ok"), nil }); err != nil {
			b.Fatal(err)
		}
	}
	var n, dups atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	b.ResetTimer()
	start, cpu := time.Now(), cputime.Process()
	for w := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				id := fmt.Sprintf("d-%d", i%dupIDs)
				if r, err := c.Lookup(ctx, idem.Request{ID: []byte(id)}); err != nil || r.Status != idem.Done {
					b.Errorf("duplicate %s: %+v %v", id, r, err)
					return
				}
				dups.Add(1)
			}
		}()
	}
	b.SetParallelism(16) // 32 fresh callers on 2 cores
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := idem.Do(ctx, c, idem.Request{ID: []byte(fmt.Sprintf("f-%d", n.Add(1)))}, func(context.Context) ([]byte, error) { return []byte("ok"), nil }); err != nil {
				b.Error(err)
				return
			}
		}
	})
	close(stop)
	wg.Wait()
	sec := time.Since(start).Seconds()
	b.ReportMetric(float64(b.N)/sec, "fresh/s")
	b.ReportMetric(float64(dups.Load())/sec, "dup/s")
	b.ReportMetric(float64(cputime.Process()-cpu)/float64(time.Microsecond)/float64(int64(b.N)+dups.Load()), "cpu-µs/req")
}

// benchClient starts a three-node cluster on loopback and returns a Client
// of it, closed when the benchmark ends.
func benchClient(b *testing.B) *Client {
	tc := newTestCluster(b, 3)
	c, err := Dial(context.Background(), tc.addrs, &Options{Owner: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	return c
}
