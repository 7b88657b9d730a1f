package idem

import (
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/idemdb/idem/internal/cputime"
)

// BenchmarkBeginCommit: the single-request path of a fresh id (Begin,
// then Claim.Commit, both fsynced through group commit) at 64 and 512
// concurrent callers, as bench/peers runs idem. Reports the process's CPU
// per request (every goroutine: the WAL's flusher, the applier, the
// ingests, Pebble) and the allocations per request (every goroutine's).
// The mem variants run on vfs.NewMem (an fsync costs nothing): the CPU of
// the engine's own path, with less of the disk's and the machine's noise.
func BenchmarkBeginCommit(b *testing.B) {
	for _, callers := range []int{64, 512} {
		b.Run(fmt.Sprintf("c=%d", callers), func(b *testing.B) { benchBeginCommit(b, callers, false) })
	}
	b.Run("mem/c=512", func(b *testing.B) { benchBeginCommit(b, 512, true) })
}

func benchBeginCommit(b *testing.B, callers int, mem bool) {
	dir, o := b.TempDir(), &Options{}
	if mem {
		dir, o.FS = "db", vfs.NewMem()
	}
	e, err := Open(dir, o)
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	g := newIDGen()
	b.SetParallelism(max(callers/runtime.GOMAXPROCS(0), 1))
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	cpu0 := cputime.Process()
	defer func() {
		b.ReportMetric(float64((cputime.Process()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
	}()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			res, err := e.Begin(bg, Request{ID: g.next()})
			if err != nil || res.Status != Fresh {
				b.Errorf("Begin: %v %v", res.Status, err)
				return
			}
			if err := res.Claim.Commit(bg, benchReply); err != nil {
				b.Error(err)
				return
			}
		}
	})
	opsPerSec(b, start)
}
