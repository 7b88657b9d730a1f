package idem

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// BenchmarkSoak is the long run of issue 3: many requests from 1,000 live
// clients, each acking its previous request, with retention on, reporting
// disk use and RSS over time. It only runs when IDEM_SOAK is set to the
// number of requests:
//
//	IDEM_SOAK=10000000 go test -run xxx -bench Soak -benchtime 1x -timeout 2h .
func BenchmarkSoak(b *testing.B) {
	total, _ := strconv.Atoi(os.Getenv("IDEM_SOAK"))
	if total <= 0 {
		b.Skip("set IDEM_SOAK=<requests> to run the soak")
	}
	dir := b.TempDir()
	if d := os.Getenv("IDEM_SOAK_DIR"); d != "" {
		dir = d
	}
	e, err := Open(dir, &Options{
		Retention:       time.Minute,
		CleanupInterval: 10 * time.Second,
		CompactInterval: 5 * time.Second,
		SegmentSize:     16 << 20,
	})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	const clients = 1000
	var done atomic.Int64
	start := time.Now()
	stop := make(chan struct{})
	var report sync.WaitGroup
	report.Add(1)
	go func() {
		defer report.Done()
		t := time.NewTicker(10 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				soakLine(b, e, dir, start, done.Load())
			}
		}
	}()
	reply := make([]byte, 128)
	var wg sync.WaitGroup
	per := total / clients
	for c := 0; c < clients; c++ {
		wg.Add(1)
		go func(c int) {
			defer wg.Done()
			var prev []byte
			for i := 0; i < per; i++ {
				id := make([]byte, 16)
				_, _ = rand.Read(id)
				req := Request{Scope: "soak", ID: id}
				if prev != nil {
					req.Acked = [][]byte{prev}
				}
				if _, err := e.Do(context.Background(), req, func(context.Context) ([]byte, error) { return reply, nil }); err != nil {
					b.Error(err)
					return
				}
				prev = id
				done.Add(1)
			}
		}(c)
	}
	wg.Wait()
	close(stop)
	report.Wait()
	soakLine(b, e, dir, start, done.Load())
	b.ReportMetric(float64(done.Load())/time.Since(start).Seconds(), "req/s")
}

func soakLine(b *testing.B, e *Engine, dir string, start time.Time, n int64) {
	st := e.Stats()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	fmt.Fprintf(os.Stderr, "soak t=%4.0fs requests=%9d live=%6d replies=%6d disk=%6.1fMiB (wal %5.1f, index %5.1f, snapshot %4.1f) rss=%6.1fMiB heap=%6.1fMiB segments=%d\n",
		time.Since(start).Seconds(), n, st.LiveEntries, st.Replies,
		mib(dirSize(dir)), mib(dirSize(filepath.Join(dir, "wal"))), mib(dirSize(filepath.Join(dir, "index"))), mib(dirSize(filepath.Join(dir, "snapshot"))),
		mib(rss()), mib(int64(ms.HeapInuse)), st.WALSegments)
}

func mib(n int64) float64 { return float64(n) / (1 << 20) }

// dirSize is the space files under dir take on disk (allocated blocks, so
// preallocated WAL segments count in full).
func dirSize(dir string) int64 {
	var n int64
	_ = filepath.Walk(dir, func(_ string, info os.FileInfo, err error) error {
		if err == nil && !info.IsDir() {
			n += info.Size()
		}
		return nil
	})
	return n
}

func rss() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb << 10
		}
	}
	return 0
}
