// Package latency is the log-linear latency histogram of `idem bench`,
// `idem scale` and the peer benchmark (bench/peers).
package latency

import (
	"math/bits"
	"time"
)

// Histogram is a log-linear histogram of durations: values below 64ns are
// exact, and every power of two above is split into 64 buckets, so a
// percentile is off by less than 1/64 (1.6%). Fixed size, no allocation per
// sample, merged across workers.
type Histogram struct {
	counts [histBuckets]uint64
	n      uint64
	max    time.Duration
}

// N is the number of samples.
func (h *Histogram) N() uint64 { return h.n }

// Max is the largest sample.
func (h *Histogram) Max() time.Duration { return h.max }

const (
	histSubBits = 6
	histSub     = 1 << histSubBits
	histBuckets = (64 - histSubBits + 1) * histSub
)

func histBucket(v time.Duration) int {
	if v < histSub {
		return max(int(v), 0)
	}
	e := bits.Len64(uint64(v)) - histSubBits - 1 // shift that leaves 7 significant bits
	return (e+1)*histSub + int(uint64(v)>>uint(e)) - histSub
}

// histLow returns the smallest value of bucket b.
func histLow(b int) time.Duration {
	if b < histSub {
		return time.Duration(b)
	}
	e := b/histSub - 1
	return time.Duration(uint64(b%histSub+histSub) << uint(e))
}

// Record adds one sample.
func (h *Histogram) Record(v time.Duration) {
	h.counts[histBucket(v)]++
	h.n++
	h.max = max(h.max, v)
}

// Merge adds o's samples.
func (h *Histogram) Merge(o *Histogram) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
	h.max = max(h.max, o.max)
}

// Quantile returns the q-quantile (0 < q <= 1), the middle of its bucket.
func (h *Histogram) Quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(q*float64(h.n) + 0.5)
	rank = min(max(rank, 1), h.n)
	var seen uint64
	for b, c := range h.counts {
		seen += c
		if seen >= rank {
			if b == histBuckets-1 {
				return h.max
			}
			lo, hi := histLow(b), histLow(b+1)
			return min(lo+(hi-lo)/2, h.max)
		}
	}
	return h.max
}
