package main

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// progress draws a one-line bar with rate and ETA on a terminal:
//
//	verify [##########..........]  52%  41.2 MB/s  ETA 3s
//
// A nil *progress is valid and draws nothing, which is what commands get when
// stderr is not a terminal: no extra output at all.
type progress struct {
	w     io.Writer
	label string
	bytes bool // cur and total are bytes (rate in MB/s), else operations
	start time.Time

	total atomic.Int64 // 0: unknown (no bar, no ETA)
	cur   atomic.Int64 // position towards total
	// ops, when set, counts what the rate shows instead of cur (bench: the
	// bar follows time, the rate follows requests).
	ops *atomic.Int64
	// span, when set, makes the bar follow the time elapsed out of span.
	span time.Duration

	stop     chan struct{}
	done     chan struct{}
	stopOnce sync.Once
}

// startProgress returns a running bar, or nil when c may not draw one.
func startProgress(c *cli, label string, total int64, bytes bool) *progress {
	return startProgressWith(c, &progress{label: label, bytes: bytes}, total)
}

// startOpsProgress is a bar for a run of operations counted by ops, that
// ends after total operations or, when span is set, after span.
func startOpsProgress(c *cli, label string, total int64, span time.Duration, ops *atomic.Int64) *progress {
	return startProgressWith(c, &progress{label: label, ops: ops, span: span}, total)
}

func startProgressWith(c *cli, p *progress, total int64) *progress {
	if !c.progressOK {
		return nil
	}
	p.w, p.start = c.stderr, time.Now()
	p.stop, p.done = make(chan struct{}), make(chan struct{})
	p.total.Store(total)
	go p.loop()
	return p
}

func (p *progress) set(v int64) {
	if p != nil {
		p.cur.Store(v)
	}
}

func (p *progress) add(d int64) {
	if p != nil {
		p.cur.Add(d)
	}
}

func (p *progress) loop() {
	defer close(p.done)
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			fmt.Fprint(p.w, "\r\x1b[K") // clear the line
			return
		case <-t.C:
			fmt.Fprint(p.w, "\r\x1b[K"+p.line())
		}
	}
}

func (p *progress) line() string {
	elapsed := time.Since(p.start)
	cur, total := p.cur.Load(), p.total.Load()
	count := cur // what the rate counts
	if p.ops != nil {
		count = p.ops.Load()
		cur = count
	}
	if p.span > 0 {
		cur, total = int64(elapsed), int64(p.span)
	}
	var b strings.Builder
	b.WriteString(p.label)
	if total > 0 {
		f := min(float64(cur)/float64(total), 1)
		const width = 24
		n := int(f * width)
		fmt.Fprintf(&b, " [%s%s] %3.0f%%", strings.Repeat("#", n), strings.Repeat(".", width-n), f*100)
	}
	if sec := elapsed.Seconds(); sec > 0 {
		r := float64(count) / sec
		if p.bytes {
			fmt.Fprintf(&b, "  %.1f MB/s", r/1e6)
		} else {
			fmt.Fprintf(&b, "  %s/s", humanCount(r))
		}
	}
	if total > 0 && cur > 0 && cur < total {
		eta := time.Duration(float64(elapsed) * float64(total-cur) / float64(cur))
		fmt.Fprintf(&b, "  ETA %s", eta.Round(time.Second))
	}
	return b.String()
}

// finish stops the bar and clears its line. Safe on nil and twice.
func (p *progress) finish() {
	if p == nil {
		return
	}
	p.stopOnce.Do(func() {
		close(p.stop)
		<-p.done
	})
}

func humanCount(v float64) string {
	switch {
	case v >= 1e6:
		return fmt.Sprintf("%.2fM", v/1e6)
	case v >= 1e3:
		return fmt.Sprintf("%.1fk", v/1e3)
	}
	return fmt.Sprintf("%.0f", v)
}

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
