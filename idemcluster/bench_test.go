package idemcluster

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem"
)

// BenchmarkClusterFresh measures fresh requests (Begin, then Commit, each
// majority-replicated and fsynced before its answer) through a Client of a
// three-node cluster on loopback, 64 callers at once. Compare it in one
// run with BenchmarkEngineFresh (the embedded engine, SyncAlways).
//
//	go test -run '^$' -bench 'Fresh' -benchtime 3000x ./idemcluster/
func BenchmarkClusterFresh(b *testing.B) {
	tc := newTestCluster(b, 3)
	ctx := context.Background()
	c, err := Dial(ctx, tc.addrs, &Options{Owner: "bench"})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	benchFresh(b, c)
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

func benchFresh(b *testing.B, s idem.Store) {
	var n atomic.Int64
	b.SetParallelism(32) // 64 callers on 2 cores
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		for pb.Next() {
			id := fmt.Sprintf("f-%d", n.Add(1))
			if _, err := idem.Do(ctx, s, idem.Request{ID: []byte(id)}, func(context.Context) ([]byte, error) { return []byte("ok"), nil }); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "req/s")
}
