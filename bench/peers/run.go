package peers

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/idemdb/idem/internal/latency"
)

// The job's shape, as in idem's root benchmarks and `idem bench`.
const (
	IDSize    = 16
	ReplySize = 128
)

// RunConfig says how to run one peer at one concurrency.
type RunConfig struct {
	Concurrency int
	Fresh       time.Duration // length of the fresh phase
	// Warmup, when positive, is a phase of fresh requests run before the
	// fresh phase and not measured (no row; its ids are not among the
	// duplicate phase's): a store that has just been opened first fills
	// its memory (idem's table, pending sets and key filter: up to about
	// 90 MiB of Go heap at the default budget), and every page it touches
	// for the first time is a page fault, which costs 10-15 µs of CPU on
	// the development machine (a virtual machine). Without a warm-up, a
	// short fresh phase measures that start as well as the steady state.
	Warmup    time.Duration
	Duplicate time.Duration // length of the duplicate phase
	// ServerPIDs are the server processes whose CPU time (with all their
	// descendants) is added to the peer's (Redis, PostgreSQL).
	ServerPIDs []int
}

// Result is one phase of one run: a row of the CSV.
type Result struct {
	Date        string // UTC, RFC 3339, when the run started
	Round       int
	Peer        string
	Concurrency int
	Phase       string // "fresh" or "duplicate"
	Requests    uint64
	Errors      uint64
	Seconds     float64
	PerSec      float64
	P50us       float64
	P99us       float64
	P999us      float64
	MaxUs       float64
	ClientCPU   float64 // seconds of CPU of this process (user + system)
	ServerCPU   float64 // seconds of CPU of the server processes
	CPUusPerReq float64 // (ClientCPU + ServerCPU) / Requests, in µs
	Ratio       float64 // PerSec / idem's PerSec in the same round (0: unknown)
	FirstError  string
}

// Run opens nothing: it drives an opened peer through the fresh phase and
// then (unless the peer has no lookups or nothing was committed) the
// duplicate phase.
func Run(ctx context.Context, p Peer, cfg RunConfig) ([]Result, error) {
	if cfg.Concurrency < 1 {
		return nil, fmt.Errorf("concurrency %d: want at least 1", cfg.Concurrency)
	}
	reply := make([]byte, ReplySize)
	_, _ = crand.Read(reply)
	ids := make([][][]byte, cfg.Concurrency)
	if ph, ok := p.(Phased); ok {
		ph.Phase(true)
	}
	// freshOp is one fresh request; keep says to remember its id for the
	// duplicate phase.
	freshOp := func(keep bool) func(w int, rng *rand.ChaCha8) error {
		return func(w int, rng *rand.ChaCha8) error {
			id := make([]byte, IDSize)
			_, _ = rng.Read(id)
			got, isFresh, err := p.Do(ctx, id, func() []byte { return reply })
			if err != nil {
				return err
			}
			if !isFresh {
				return fmt.Errorf("new id %x: found as already committed", id)
			}
			if !bytes.Equal(got, reply) {
				return fmt.Errorf("new id %x: reply of %d bytes differs from the one stored", id, len(got))
			}
			if keep {
				ids[w] = append(ids[w], id)
			}
			return nil
		}
	}
	if cfg.Warmup > 0 {
		if r := phase(ctx, "warmup", cfg, cfg.Warmup, freshOp(false)); r.Errors > 0 {
			return nil, fmt.Errorf("warm-up: %d errors, first: %s", r.Errors, r.FirstError)
		}
	}
	fresh := phase(ctx, "fresh", cfg, cfg.Fresh, freshOp(true))
	out := []Result{fresh}
	var all [][]byte
	for _, l := range ids {
		all = append(all, l...)
	}
	if _, ok := p.(NoLookups); ok || len(all) == 0 || cfg.Duplicate <= 0 {
		return out, nil
	}
	if s, ok := p.(Settler); ok {
		s.Settle(ctx)
	}
	if ph, ok := p.(Phased); ok {
		ph.Phase(false)
	}
	dup := phase(ctx, "duplicate", cfg, cfg.Duplicate, func(w int, rng *rand.ChaCha8) error {
		id := all[rng.Uint64()%uint64(len(all))]
		got, isFresh, err := p.Do(ctx, id, func() []byte { return nil })
		if err != nil {
			return err
		}
		if isFresh {
			return fmt.Errorf("committed id %x: ran again as new", id)
		}
		if !bytes.Equal(got, reply) {
			return fmt.Errorf("committed id %x: stored reply of %d bytes differs from the committed one", id, len(got))
		}
		return nil
	})
	return append(out, dup), nil
}

// phase runs op on cfg.Concurrency workers for d, timing every call.
func phase(ctx context.Context, name string, cfg RunConfig, d time.Duration, op func(worker int, rng *rand.ChaCha8) error) Result {
	var (
		errs     atomic.Uint64
		firstErr atomic.Pointer[error]
		hist     latency.Histogram
		wg       sync.WaitGroup
	)
	// Each worker's histogram is on the heap, not on its goroutine's
	// stack: a histogram is about 60 KB, and on the stack it put every
	// worker at the edge of a 64 KB stack, so that a store whose call
	// path is a few KB deep (idem's) had each worker's stack grown to
	// 128 KB (copied, and its new pages faulted in) during the measured
	// phase, and a shallow one (the file peer) did not.
	hists := make([]latency.Histogram, cfg.Concurrency)
	cpu0, srv0 := selfCPU(), serverCPU(cfg.ServerPIDs)
	start := time.Now()
	deadline := start.Add(d)
	for w := 0; w < cfg.Concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var seed [32]byte
			_, _ = crand.Read(seed[:])
			rng := rand.NewChaCha8(seed)
			h := &hists[w]
			for ctx.Err() == nil {
				t0 := time.Now()
				if !t0.Before(deadline) {
					break
				}
				err := op(w, rng)
				h.Record(time.Since(t0))
				if err != nil {
					if errs.Add(1) == 1 {
						firstErr.Store(&err)
					}
					if errs.Load() > 1000 { // broken: stop rather than spin
						break
					}
				}
			}
		}()
	}
	wg.Wait()
	el := time.Since(start)
	cpu := selfCPU() - cpu0
	srv := serverCPU(cfg.ServerPIDs) - srv0
	for i := range hists {
		hist.Merge(&hists[i])
	}
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	r := Result{
		Date: start.UTC().Format(time.RFC3339), Peer: "", Concurrency: cfg.Concurrency, Phase: name,
		Requests: hist.N(), Errors: errs.Load(), Seconds: el.Seconds(),
		PerSec: float64(hist.N()) / el.Seconds(),
		P50us:  us(hist.Quantile(0.50)), P99us: us(hist.Quantile(0.99)),
		P999us: us(hist.Quantile(0.999)), MaxUs: us(hist.Max()),
		ClientCPU: cpu.Seconds(), ServerCPU: srv.Seconds(),
	}
	if hist.N() > 0 {
		r.CPUusPerReq = us(cpu+srv) / float64(hist.N())
	}
	if f := firstErr.Load(); f != nil {
		r.FirstError = (*f).Error()
	}
	return r
}

// selfCPU is the user + system CPU time of this process, all threads.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// clockTick is the unit of /proc/<pid>/stat times (USER_HZ, 100 on Linux).
const clockTick = 10 * time.Millisecond

// serverCPU is the CPU time of the processes pids and all their
// descendants, read from /proc (zero where there is no /proc): for each
// process the time its threads spent on a CPU, in nanoseconds
// (/proc/<pid>/task/<tid>/schedstat, user and system together), plus the
// user and system time of the children it has waited for (cutime and
// cstime in /proc/<pid>/stat, in clock ticks), so that a backend or a
// fork that exited still counts, through its parent. The per-process
// times of /proc/<pid>/stat are not used for the living processes: they
// are whole clock ticks (10 ms), which loses most of the time of 500
// PostgreSQL backends that each run a few milliseconds.
func serverCPU(pids []int) time.Duration {
	if len(pids) == 0 {
		return 0
	}
	ents, _ := os.ReadDir("/proc")
	parent := map[int]int{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if ppid, _, err := readStat(pid); err == nil {
			parent[pid] = ppid
		}
	}
	in := map[int]bool{}
	for _, p := range pids {
		in[p] = true
	}
	// Descendants: repeat until no process is added (trees are shallow).
	for changed := true; changed; {
		changed = false
		for pid, ppid := range parent {
			if !in[pid] && in[ppid] {
				in[pid], changed = true, true
			}
		}
	}
	var total time.Duration
	for pid := range in {
		_, waited, err := readStat(pid)
		if err != nil {
			continue // exited meanwhile: its parent's cutime has it
		}
		total += waited + threadsCPU(pid)
	}
	return total
}

// readStat returns a process's parent and the CPU time of its children it
// has waited for (cutime + cstime).
func readStat(pid int) (ppid int, waited time.Duration, err error) {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, 0, err
	}
	// The command name (field 2) is in parentheses and may hold spaces.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, errors.New("malformed stat")
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state): ppid is field 4, cutime and cstime 16, 17.
	if len(f) < 15 {
		return 0, 0, errors.New("short stat")
	}
	if ppid, err = strconv.Atoi(f[1]); err != nil {
		return 0, 0, err
	}
	var ticks int64
	for _, s := range f[13:15] {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, 0, err
		}
		ticks += v
	}
	return ppid, time.Duration(ticks) * clockTick, nil
}

// threadsCPU is the time the threads of pid have spent on a CPU, from
// their schedstat (first field, nanoseconds).
func threadsCPU(pid int) time.Duration {
	dir := filepath.Join("/proc", strconv.Itoa(pid), "task")
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return 0
	}
	var total time.Duration
	for _, t := range tasks {
		b, err := os.ReadFile(filepath.Join(dir, t.Name(), "schedstat"))
		if err != nil {
			continue
		}
		f := strings.Fields(string(b))
		if len(f) == 0 {
			continue
		}
		if ns, err := strconv.ParseInt(f[0], 10, 64); err == nil {
			total += time.Duration(ns)
		}
	}
	return total
}
