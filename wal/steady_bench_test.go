package wal

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
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
// write(2)/pwrite(2), zero-filling included), the bytes the block device
// holding /var/tmp wrote meanwhile (dev, from /sys/block: other processes'
// writes count too), and the bytes the process read from the disk
// (read_bytes: a partial-page write into a file page that is not cached
// reads it first), per record. (/proc/self/io's write_bytes is no measure
// here: on this kernel an fdatasync of an overwritten file counts about 2 MB
// whatever was written.)
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
	io0, dev0, cpu0, t0 := procIO(b), deviceWritten(), cputime.Process(), time.Now()
	step(b.N)
	cpu, io1 := cputime.Process()-cpu0, procIO(b)
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/rec")
	b.ReportMetric(float64(io1["wchar"]-io0["wchar"])/float64(b.N), "wchar-B/rec")
	if dev1 := deviceWritten(); dev0 > 0 && dev1 > 0 {
		b.ReportMetric(float64(dev1-dev0)/float64(b.N), "dev-B/rec")
	}
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

// deviceWritten returns the bytes written by the block device holding
// /var/tmp (sectors written in /sys/block/<dev>/stat, times 512), or 0.
func deviceWritten() int64 {
	var st syscall.Stat_t
	if err := syscall.Stat("/var/tmp", &st); err != nil {
		return 0
	}
	link, err := os.Readlink(fmt.Sprintf("/sys/dev/block/%d:%d", st.Dev>>8&0xfff, st.Dev&0xff|(st.Dev>>12)&0xfff00))
	if err != nil {
		return 0
	}
	parts := strings.Split(link, "/")
	b, err := os.ReadFile("/sys/block/" + parts[len(parts)-1] + "/stat")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 7 {
		return 0
	}
	n, _ := strconv.ParseInt(f[6], 10, 64)
	return n * 512
}
