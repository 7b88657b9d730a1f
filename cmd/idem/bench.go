package main

import (
	"context"
	crand "crypto/rand"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/internal/latency"
)

var benchCmd = &command{
	name:    "bench",
	summary: "measure fresh and duplicate throughput and latency (p50, p99, p99.9)",
	help: `
Runs an engine on a real directory and measures two phases:

  fresh       Do on new random ids: claim (fsynced unless --relaxed-claims),
              then commit of the reply (fsynced), as a first request does;
  duplicate   Begin on ids committed by the fresh phase, in random order, as
              a retry does: the stored reply comes back, nothing is written.

--concurrency goroutines run each phase for --duration, or until --requests
requests are done. Latencies are per request, from a log-linear histogram
(within 1.6%). Each caller yields the processor between requests, as a
server's goroutine does while it waits for the next request; --no-yield
measures callers that never block instead, whose latencies then include Go's
10 ms preemption slices of every other runnable caller (with more callers
than cores, that dominates the duplicate phase's tail). The directory is a new temporary one, removed at the end,
unless --dir is given (then it is kept, and may already hold data).`,
	examples: []string{
		"idem bench",
		"idem bench --duration 10s --concurrency 256",
		"idem bench --relaxed-claims --reply-size 1024",
		"idem bench --sync interval --requests 100000 --json",
	},
	setup: func(fs *flag.FlagSet) func(*cli, []string) error {
		o := &benchOpts{}
		fs.StringVar(&o.dir, "dir", "", "run on this `directory` and keep it (default: a temporary directory, removed)")
		fs.IntVar(&o.concurrency, "concurrency", 64, "concurrent callers (`n` goroutines)")
		fs.StringVar(&o.sync, "sync", "always", "durability `mode`: always (fsync before acknowledging; group commit), interval (fsync every 100ms) or never")
		fs.IntVar(&o.idSize, "id-size", 16, "request id size in `bytes` (random ids)")
		fs.IntVar(&o.replySize, "reply-size", 128, "reply size in `bytes` (random, incompressible)")
		fs.DurationVar(&o.duration, "duration", 5*time.Second, "how long each phase runs (`d`)")
		fs.Int64Var(&o.requests, "requests", 0, "run each phase for `n` requests instead of --duration")
		fs.BoolVar(&o.relaxed, "relaxed-claims", false, "Begin does not wait for the claim's fsync (one fsync per request instead of two)")
		fs.BoolVar(&o.noYield, "no-yield", false, "callers do not yield the processor between requests (see the help text)")
		fs.BoolVar(&o.json, "json", false, "print one JSON object")
		o.fs = fs
		return o.run
	},
}

type benchOpts struct {
	fs          *flag.FlagSet
	dir         string
	concurrency int
	sync        string
	idSize      int
	replySize   int
	duration    time.Duration
	requests    int64
	relaxed     bool
	noYield     bool
	json        bool
}

type phaseResult struct {
	Phase     string  `json:"phase"`
	Ops       uint64  `json:"ops"`
	Errors    uint64  `json:"errors"`
	Seconds   float64 `json:"seconds"`
	OpsPerSec float64 `json:"ops_per_sec"`
	P50us     float64 `json:"p50_us"`
	P99us     float64 `json:"p99_us"`
	P999us    float64 `json:"p999_us"`
	MaxUs     float64 `json:"max_us"`
	FirstErr  string  `json:"first_error,omitempty"`
}

type benchOut struct {
	Dir           string        `json:"dir"`
	Kept          bool          `json:"kept"`
	Sync          string        `json:"sync"`
	RelaxedClaims bool          `json:"relaxed_claims"`
	Concurrency   int           `json:"concurrency"`
	IDSize        int           `json:"id_size"`
	ReplySize     int           `json:"reply_size"`
	GOMAXPROCS    int           `json:"gomaxprocs"`
	Phases        []phaseResult `json:"phases"`
	WALBytes      int64         `json:"wal_bytes"`
	IndexBytes    uint64        `json:"index_bytes"`
	LiveEntries   int64         `json:"live_entries"`
}

func (o *benchOpts) run(c *cli, pos []string) error {
	if len(pos) > 0 {
		return usagef("bench takes no arguments (use --dir to choose the directory)")
	}
	durationSet := false
	o.fs.Visit(func(f *flag.Flag) { durationSet = durationSet || f.Name == "duration" })
	switch {
	case o.requests > 0 && durationSet:
		return usagef("give --duration or --requests, not both")
	case o.requests < 0:
		return usagef("--requests must be positive")
	case o.requests == 0 && o.duration <= 0:
		return usagef("--duration must be positive")
	case o.concurrency < 1 || o.concurrency > 1<<16:
		return usagef("--concurrency must be between 1 and 65536")
	case o.idSize < 1 || o.idSize > 1024:
		return usagef("--id-size must be between 1 and 1024 bytes")
	case o.replySize < 0 || o.replySize > 16<<20:
		return usagef("--reply-size must be between 0 and 16 MiB")
	}
	opts := &idem.Options{RelaxedClaims: o.relaxed}
	switch o.sync {
	case "always":
		opts.Sync = idem.SyncAlways
	case "interval":
		opts.Sync = idem.SyncInterval
	case "never":
		opts.Sync = idem.SyncNever
	default:
		return usagef("unknown --sync %q (want always, interval or never)", o.sync)
	}
	out := benchOut{Sync: o.sync, RelaxedClaims: o.relaxed, Concurrency: o.concurrency,
		IDSize: o.idSize, ReplySize: o.replySize, GOMAXPROCS: runtime.GOMAXPROCS(0)}
	dir := o.dir
	if dir == "" {
		tmp, err := os.MkdirTemp("", "idem-bench-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		dir = tmp
	} else {
		out.Kept = true
	}
	out.Dir = dir
	e, err := idem.Open(dir, opts)
	if errors.Is(err, idem.ErrLocked) {
		return fmt.Errorf("%s is locked by another engine (ErrLocked)", dir)
	}
	if err != nil {
		return err
	}
	defer e.Close()
	if !o.json {
		fmt.Fprintf(c.stdout, "bench     dir %s (%s), sync=%s, relaxed-claims=%v, concurrency=%d, id-size=%d, reply-size=%d, GOMAXPROCS=%d\n",
			dir, map[bool]string{true: "kept", false: "removed at the end"}[out.Kept], o.sync, o.relaxed, o.concurrency, o.idSize, o.replySize, out.GOMAXPROCS)
	}
	reply := make([]byte, o.replySize)
	_, _ = crand.Read(reply)
	ctx := context.Background()

	// Fresh: Do on new random ids. Each worker keeps its ids for the
	// duplicate phase.
	ids := make([][][]byte, o.concurrency)
	fresh := o.phase(c, "fresh", func(w int, rng *rand.ChaCha8) error {
		id := make([]byte, o.idSize)
		_, _ = rng.Read(id)
		if _, err := e.Do(ctx, idem.Request{ID: id}, func(context.Context) ([]byte, error) { return reply, nil }); err != nil {
			return err
		}
		ids[w] = append(ids[w], id)
		return nil
	})
	out.Phases = append(out.Phases, fresh)
	if !o.json {
		printPhase(c, &fresh)
	}
	var all [][]byte
	for _, l := range ids {
		all = append(all, l...)
	}
	if len(all) > 0 {
		settle(e)
		dup := o.phase(c, "duplicate", func(w int, rng *rand.ChaCha8) error {
			id := all[rng.Uint64()%uint64(len(all))]
			res, err := e.Begin(ctx, idem.Request{ID: id})
			if err != nil {
				return err
			}
			if res.Status != idem.Done {
				return fmt.Errorf("id 0x%x: status %v, want done", id, res.Status)
			}
			return nil
		})
		out.Phases = append(out.Phases, dup)
		if !o.json {
			printPhase(c, &dup)
		}
	}
	if err := e.Close(); err != nil {
		return err
	}
	st := e.Stats() // after Close: everything is applied and flushed
	out.WALBytes, out.LiveEntries = st.WALBytes, st.LiveEntries
	out.IndexBytes = uint64(dirBytes(filepath.Join(dir, "index")))
	if o.json {
		if err := writeJSONLine(c.stdout, &out); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(c.stdout, "storage   wal %s, index %s, %d live entries\n", humanBytes(out.WALBytes), humanBytes(int64(out.IndexBytes)), out.LiveEntries)
	}
	for _, p := range out.Phases {
		if p.Errors > 0 {
			return fmt.Errorf("%s phase: %d requests failed, first: %s", p.Phase, p.Errors, p.FirstErr)
		}
	}
	return nil
}

// settle waits (at most 10s) until the index has applied every durable
// record, so that the duplicate phase measures lookups, not the tail of the
// fresh phase's writes.
func settle(e *idem.Engine) {
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		if st := e.Stats(); st.AppliedLSN >= st.DurableLSN {
			return
		}
	}
}

// phase runs op on o.concurrency workers until the duration ends or the
// requests are done, timing every call.
func (o *benchOpts) phase(c *cli, name string, op func(worker int, rng *rand.ChaCha8) error) phaseResult {
	var (
		next, done atomic.Int64
		errs       atomic.Uint64
		stop       atomic.Bool
		firstErr   atomic.Pointer[error]
		mu         sync.Mutex
		hist       latency.Histogram
		wg         sync.WaitGroup
	)
	var span time.Duration
	if o.requests == 0 {
		span = o.duration
	}
	p := startOpsProgress(c, name, o.requests, span, &done)
	start := time.Now()
	deadline := start.Add(o.duration)
	for w := 0; w < o.concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var seed [32]byte
			_, _ = crand.Read(seed[:])
			rng := rand.NewChaCha8(seed)
			h := &latency.Histogram{}
			for !stop.Load() {
				if o.requests > 0 {
					if next.Add(1) > o.requests {
						break
					}
				}
				t0 := time.Now()
				if o.requests == 0 && !t0.Before(deadline) {
					break
				}
				err := op(w, rng)
				h.Record(time.Since(t0))
				if !o.noYield {
					// A server's goroutine parks between requests (it
					// waits for the next one); without this, callers that
					// never block (duplicates: ~4 µs of CPU each) run for
					// Go's whole 10 ms preemption slice, and a request
					// caught by the preemption waits for every other
					// caller's slice: at 64 callers on 2 cores that is
					// ~300 ms of queueing measured as its latency.
					runtime.Gosched()
				}
				done.Add(1)
				if err != nil {
					if errs.Add(1) == 1 {
						firstErr.Store(&err)
					}
					if errors.Is(err, idem.ErrFailed) || errors.Is(err, idem.ErrClosed) {
						stop.Store(true)
					}
				}
			}
			mu.Lock()
			hist.Merge(h)
			mu.Unlock()
		}()
	}
	wg.Wait()
	el := time.Since(start)
	p.finish()
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	r := phaseResult{Phase: name, Ops: hist.N(), Errors: errs.Load(), Seconds: el.Seconds(),
		OpsPerSec: float64(hist.N()) / el.Seconds(),
		P50us:     us(hist.Quantile(0.50)), P99us: us(hist.Quantile(0.99)),
		P999us: us(hist.Quantile(0.999)), MaxUs: us(hist.Max())}
	if f := firstErr.Load(); f != nil {
		r.FirstErr = (*f).Error()
	}
	return r
}

func printPhase(c *cli, p *phaseResult) {
	d := func(us float64) string {
		return time.Duration(us * float64(time.Microsecond)).Round(time.Microsecond).String()
	}
	fmt.Fprintf(c.stdout, "%-9s %9d requests in %.2fs  %10.0f req/s   p50 %-8s p99 %-8s p99.9 %-8s max %s\n",
		p.Phase, p.Ops, p.Seconds, p.OpsPerSec, d(p.P50us), d(p.P99us), d(p.P999us), d(p.MaxUs))
	if p.Errors > 0 {
		fmt.Fprintf(c.stdout, "          %d errors, first: %s\n", p.Errors, p.FirstErr)
	}
}
