package wal

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/idemdb/idem/internal/cputime"
	"github.com/idemdb/idem/internal/vfstest"
)

// cohortWork stands for the CPU an engine caller spends between two
// durability waits (a fresh request's Begin or its Commit: 3-4 µs).
func cohortWork(n int) uint64 {
	x := uint64(n) | 1
	for i := 0; i < n; i++ {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
	}
	return x
}

var cohortSink atomic.Uint64

// BenchmarkGroupCommitWork measures group commit when the callers work
// between their records, as the engine's do: each of 8, 64 or 512
// goroutines appends a 120-byte record, waits for its fsync, then works
// (cohortWork, about 3 µs) before its next one. With hundreds of callers
// on a few processors, the cohort woken by one fsync takes longer to come
// back than an fsync lasts, and how much of its work overlaps the next
// fsync decides the throughput. Reports records/s, records per fsync and
// the process's CPU per record. The "sleep" variants run on an in-memory
// file system whose fsyncs sleep 400 µs (a quiet SSD's fdatasync; more on
// a loaded machine), away from the noise of a shared disk; "disk" on the
// real file system, preallocated.
//
// It does not stand for the engine in every way: without gather (the
// flusher taking the buffer as soon as the last flush ended) it ran 512
// goroutines at 300-358k records/s instead of 169-183k, while the engine
// at 512 callers lost a third of its throughput that way (bench/peers).
func BenchmarkGroupCommitWork(b *testing.B) {
	const work = 2000
	for _, disk := range []string{"sleep", "disk"} {
		for _, goroutines := range []int{8, 64, 512} {
			b.Run(fmt.Sprintf("%s/c=%d", disk, goroutines), func(b *testing.B) {
				benchGroupCommitWork(b, disk == "sleep", goroutines, work)
			})
		}
	}
}

func benchGroupCommitWork(b *testing.B, sleep bool, goroutines, work int) {
	o := Options{FS: vfs.Default, Dir: vfs.Default.PathJoin(b.TempDir(), "wal"), Preallocate: true,
		OnSynced: func([]Synced) {}}
	if sleep {
		o.FS = &vfstest.SyncHookFS{FS: vfs.NewMem(), Hook: func() { time.Sleep(400 * time.Microsecond) }}
		o.Dir, o.Preallocate = testDir, false
	}
	w, _, err := Open(o, 0, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer w.Close()
	payload := make([]byte, 120)
	b.SetParallelism(max(goroutines/runtime.GOMAXPROCS(0), 1))
	syncs0 := w.Stats().Syncs
	b.ResetTimer()
	start, cpu0 := time.Now(), cputime.Process()
	b.RunParallel(func(pb *testing.PB) {
		var s uint64
		for pb.Next() {
			if err := appendDurable(w, payload); err != nil {
				b.Error(err)
				return
			}
			s += cohortWork(work)
		}
		cohortSink.Add(s)
	})
	elapsed := time.Since(start)
	b.StopTimer()
	syncs := w.Stats().Syncs - syncs0
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "records/s")
	b.ReportMetric(float64(b.N)/float64(max(syncs, 1)), "records/fsync")
	b.ReportMetric(float64((cputime.Process()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
}
