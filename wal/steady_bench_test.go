package wal

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"

	"github.com/idemdb/idem/internal/cputime"
)

// BenchmarkSteadyTruncated is the log's steady state on the real disk (under
// /var/tmp): preallocated 4 MiB (and the default 64 MiB) segments, records of 512 bytes appended by
// one writer in groups of 64 (one WaitDurable, so one fdatasync, per group)
// and truncation keeping up (RemoveSegmentsThrough the synced LSN after
// every group), after a warm-up through 4 segments. It reports the
// process's CPU per record and the bytes the process wrote (wchar: every
// write(2)/pwrite(2), zero-filling included) and sent to the disk
// (write_bytes), and read from the disk (read_bytes: a partial-page write
// into a file page that is not cached reads it first), per record.
func BenchmarkSteadyTruncated(b *testing.B) {
	for _, segSize := range []int{4 << 20, 64 << 20} {
		b.Run(fmt.Sprintf("seg=%dMiB", segSize>>20), func(b *testing.B) { benchSteadyTruncated(b, segSize) })
	}
}

func benchSteadyTruncated(b *testing.B, segSize int) {
	const group = 64
	dir, err := os.MkdirTemp("/var/tmp", "walsteady")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(dir)
	o := Options{FS: vfs.Default, Dir: dir, SegmentSize: int64(segSize), Preallocate: true}
	w, _, err := Open(o, 0, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer w.Close()
	payload := make([]byte, 512)
	for i := range payload {
		payload[i] = byte(i * 7)
	}
	step := func(n int) {
		var lsn LSN
		for i := 0; i < n; i++ {
			if lsn, err = w.Append(1, payload, nil); err != nil {
				b.Fatal(err)
			}
			if (i+1)%group == 0 || i == n-1 {
				if err := w.WaitDurable(lsn); err != nil {
					b.Fatal(err)
				}
				if _, _, err := w.RemoveSegmentsThrough(w.SyncedLSN()); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	step(4 * segSize / frameSize(len(payload)))
	b.ResetTimer()
	io0, cpu0, t0 := procIO(b), cputime.Process(), time.Now()
	step(b.N)
	cpu, io1 := cputime.Process()-cpu0, procIO(b)
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/rec")
	b.ReportMetric(float64(io1["wchar"]-io0["wchar"])/float64(b.N), "wchar-B/rec")
	b.ReportMetric(float64(io1["write_bytes"]-io0["write_bytes"])/float64(b.N), "disk-B/rec")
	b.ReportMetric(float64(io1["read_bytes"]-io0["read_bytes"])/float64(b.N), "disk-read-B/rec")
	b.ReportMetric(float64(b.N)/time.Since(t0).Seconds(), "rec/s")
}

// procIO reads /proc/self/io.
func procIO(b *testing.B) map[string]int64 {
	f, err := os.Open("/proc/self/io")
	if err != nil {
		b.Skip("no /proc/self/io")
	}
	defer f.Close()
	m := map[string]int64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ": ")
		if n, err := strconv.ParseInt(v, 10, 64); ok && err == nil {
			m[k] = n
		}
	}
	return m
}
