package snapshot

import (
	"bytes"
	"io"
	"testing"
	"time"
)

const benchEntries = 100_000

// BenchmarkWrite measures Writer.Add + Close throughput (compression
// included) for realistic entries: 16-byte ids and 128-byte replies (see
// realisticEntries), into io.Discard.
func BenchmarkWrite(b *testing.B) {
	entries := realisticEntries(1, benchEntries, false)
	var raw, written int64
	for _, e := range entries {
		raw += int64(len(e.key) + len(e.value))
	}
	cw := &countingWriter{w: io.Discard}
	b.SetBytes(raw)
	b.ReportAllocs()
	var elapsed time.Duration
	for b.Loop() {
		cw.n = 0
		start := time.Now()
		w, err := NewWriter(cw, testHeader)
		if err != nil {
			b.Fatal(err)
		}
		for _, e := range entries {
			if err := w.Add(e.key, e.value); err != nil {
				b.Fatal(err)
			}
		}
		if _, err := w.Close(); err != nil {
			b.Fatal(err)
		}
		elapsed += time.Since(start)
		written = cw.n
	}
	b.ReportMetric(float64(benchEntries)*float64(b.N)/elapsed.Seconds(), "entries/s")
	b.ReportMetric(float64(written)/benchEntries, "B/entry")
	b.ReportMetric(float64(raw)/float64(written), "ratio")
}

// BenchmarkRead measures Reader.Next throughput (checksums and
// decompression included) over a snapshot of realistic entries in memory.
func BenchmarkRead(b *testing.B) {
	entries := realisticEntries(1, benchEntries, false)
	data := writeSnapshot(b, testHeader, entries)
	var raw int64
	for _, e := range entries {
		raw += int64(len(e.key) + len(e.value))
	}
	b.SetBytes(raw)
	b.ReportAllocs()
	var elapsed time.Duration
	for b.Loop() {
		start := time.Now()
		r, err := NewReader(bytes.NewReader(data))
		if err != nil {
			b.Fatal(err)
		}
		n := 0
		for {
			_, _, err := r.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				b.Fatal(err)
			}
			n++
		}
		elapsed += time.Since(start)
		if n != benchEntries {
			b.Fatalf("%d entries", n)
		}
	}
	b.ReportMetric(float64(benchEntries)*float64(b.N)/elapsed.Seconds(), "entries/s")
}
