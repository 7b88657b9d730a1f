package fuzz

import (
	"context"
	"crypto/rand"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
)

// BenchmarkReopen measures Open + Close of a directory holding
// IDEM_BENCH_REOPEN_IDS committed ids (16-byte ids, 128-byte replies, on
// the OS filesystem, default options; filled with 256 callers in
// SyncNever mode, which writes the same WAL), after a clean Close. It
// also times the parts: the WAL's Open as the engine calls it (after = the
// applied LSN), the WAL's Open checking every frame (Options.CheckApplied,
// what every Open did before), and the index's Open. Opt-in (the fill
// takes minutes): IDEM_BENCH_REOPEN_IDS=3000000 go test -run '^$' -bench
// BenchmarkReopen -benchtime 10x ./fuzz/. IDEM_BENCH_REOPEN_DIR keeps the
// filled directory for later runs.
func BenchmarkReopen(b *testing.B) {
	n, _ := strconv.Atoi(os.Getenv("IDEM_BENCH_REOPEN_IDS"))
	if n <= 0 {
		b.Skip("set IDEM_BENCH_REOPEN_IDS")
	}
	dir := os.Getenv("IDEM_BENCH_REOPEN_DIR")
	if dir == "" {
		dir = filepath.Join(b.TempDir(), "db")
	}
	if _, err := os.Stat(filepath.Join(dir, "wal")); err != nil {
		fillIDs(b, dir, n)
	}
	walDir := filepath.Join(dir, "wal")
	var applied wal.LSN
	b.Run("engine", func(b *testing.B) {
		var open, close time.Duration
		for b.Loop() {
			t0 := time.Now()
			e, err := idem.Open(dir, nil)
			if err != nil {
				b.Fatal(err)
			}
			t1 := time.Now()
			applied = wal.LSN(e.Stats().LastLSN)
			if err := e.Close(); err != nil {
				b.Fatal(err)
			}
			open, close = open+t1.Sub(t0), close+time.Since(t1)
		}
		b.ReportMetric(float64(open.Microseconds())/1e3/float64(b.N), "open-ms/op")
		b.ReportMetric(float64(close.Microseconds())/1e3/float64(b.N), "close-ms/op")
	})
	for _, full := range []bool{false, true} {
		name := "wal-after-applied"
		if full {
			name = "wal-check-every-frame"
		}
		b.Run(name, func(b *testing.B) {
			var res wal.ScanResult
			for b.Loop() {
				w, r, err := wal.Open(wal.Options{FS: vfs.Default, Dir: walDir, Preallocate: true, CheckApplied: full}, applied, func(wal.Record) error { return nil })
				if err != nil {
					b.Fatal(err)
				}
				res = r
				if err := w.Close(); err != nil {
					b.Fatal(err)
				}
			}
			var total int64
			for _, s := range res.Segments {
				total += s.Allocated
			}
			b.ReportMetric(float64(total-res.SkippedBytes), "bytes-read/op")
			b.ReportMetric(float64(len(res.Segments)), "segments")
		})
	}
	b.Run("index", func(b *testing.B) {
		for b.Loop() {
			ix, err := index.Open(index.Options{FS: vfs.Default, Dir: filepath.Join(dir, "index")})
			if err != nil {
				b.Fatal(err)
			}
			if err := ix.Close(false); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func fillIDs(b *testing.B, dir string, n int) {
	b.Helper()
	start := time.Now()
	e, err := idem.Open(dir, &idem.Options{Sync: idem.SyncNever})
	if err != nil {
		b.Fatal(err)
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	ctx := context.Background()
	for g := 0; g < 256; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id, reply := make([]byte, 16), make([]byte, 128)
			for next.Add(1) <= int64(n) {
				rand.Read(id)
				rand.Read(reply)
				if _, err := e.Do(ctx, idem.Request{ID: id}, func(context.Context) ([]byte, error) { return reply, nil }); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err := e.Close(); err != nil {
		b.Fatal(err)
	}
	b.Logf("filled %d ids in %v", n, time.Since(start))
}
