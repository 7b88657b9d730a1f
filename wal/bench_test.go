package wal

import (
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/idemdb/idem/internal/cputime"
)

// BenchmarkAppendContended measures the append lock at the engine's
// concurrency: 64 and 512 goroutines each Append a 120-byte record (about
// a claim's) with OnSynced set, as the engine does, and WaitDurable for
// it, on an in-memory file system (an fsync costs nothing, so the lock
// and the hand-offs are what is left). Reports the process's CPU per
// record.
func BenchmarkAppendContended(b *testing.B) {
	for _, goroutines := range []int{64, 512} {
		b.Run(fmt.Sprintf("c=%d", goroutines), func(b *testing.B) {
			o := Options{FS: vfs.NewMem(), Dir: testDir, OnSynced: func([]Synced) {}}
			w, _, err := Open(o, 0, nil)
			if err != nil {
				b.Fatal(err)
			}
			defer w.Close()
			payload := make([]byte, 120)
			b.SetParallelism(max(goroutines/runtime.GOMAXPROCS(0), 1))
			b.ResetTimer()
			start, cpu0 := time.Now(), cputime.Process()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := appendDurable(w, payload); err != nil {
						b.Error(err)
						return
					}
				}
			})
			elapsed := time.Since(start)
			b.ReportMetric(float64((cputime.Process()-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "appends/s")
		})
	}
}

// BenchmarkAppendSyncAlways measures group commit on the real file system:
// 64 goroutines each Append a 200-byte record and WaitDurable for it, in
// SyncAlways mode (every acknowledgement follows an fsync).
func BenchmarkAppendSyncAlways(b *testing.B) {
	const goroutines = 64
	o := Options{FS: vfs.Default, Dir: vfs.Default.PathJoin(b.TempDir(), "wal"), Preallocate: true}
	w, _, err := Open(o, 0, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer w.Close()
	payload := make([]byte, 200)
	for i := range payload {
		payload[i] = byte(i)
	}
	b.SetParallelism((goroutines + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
	syncs0 := w.Stats().Syncs
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			lsn, err := w.Append(1, payload, nil)
			if err == nil {
				err = w.WaitDurable(lsn)
			}
			if err != nil {
				b.Error(err)
				return
			}
		}
	})
	elapsed := time.Since(start)
	b.StopTimer()
	syncs := w.Stats().Syncs - syncs0
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "appends/s")
	b.ReportMetric(float64(b.N)/float64(max(syncs, 1)), "records/fsync")
	b.ReportMetric(float64(elapsed.Microseconds())/float64(max(syncs, 1)), "µs/fsync-cycle")
}

var scanBench struct {
	once  sync.Once
	fs    *vfs.MemFS
	n     int
	bytes int64
	err   error
}

// BenchmarkScan measures Scan over an in-memory log of ~1M records with
// 64-byte payloads.
func BenchmarkScan(b *testing.B) {
	const n = 1 << 20
	scanBench.once.Do(func() {
		fs := vfs.NewMem()
		w, _, err := Open(Options{FS: fs, Dir: testDir, SyncMode: SyncNever}, 0, nil)
		if err != nil {
			scanBench.err = err
			return
		}
		payload := make([]byte, 64)
		for i := 0; i < n; i++ {
			payload[0] = byte(i)
			if _, err := w.Append(1, payload, nil); err != nil {
				scanBench.err = err
				return
			}
		}
		if err := w.Close(); err != nil {
			scanBench.err = err
			return
		}
		for _, s := range w.Segments() {
			scanBench.bytes += s.Size
		}
		scanBench.fs, scanBench.n = fs, n
	})
	if scanBench.err != nil {
		b.Fatal(scanBench.err)
	}
	b.SetBytes(scanBench.bytes)
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < b.N; i++ {
		count := 0
		res, err := Scan(scanBench.fs, testDir, 0, 0, func(Record) error { count++; return nil })
		if err != nil || count != scanBench.n || res.LastLSN != LSN(scanBench.n) {
			b.Fatalf("Scan: %d records, %v", count, err)
		}
	}
	b.ReportMetric(float64(b.N*scanBench.n)/time.Since(start).Seconds(), "records/s")
}

// appendDurable appends one record of type 1 and waits until it is durable:
// one caller's request in the contended benchmarks.
func appendDurable(w *WAL, payload []byte) error {
	lsn, err := w.AppendWith(1, payload, func(LSN) any { return nil })
	if err == nil {
		err = w.WaitDurable(lsn)
	}
	return err
}
