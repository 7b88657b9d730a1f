package main

import (
	"bufio"
	"context"
	crand "crypto/rand"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemdb/idem"
)

var scaleCmd = &command{
	name:    "scale",
	summary: "fill an engine with millions of ids and measure what scale costs (RSS, disk per id, compaction, reopen, lookups)",
	help: `
Fills a new engine with --ids fresh requests (Do: claim and reply, both
fsynced; --concurrency callers; ids are 16 bytes derived from a counter, so
nothing is kept in memory to find them again), then measures:

  fill        requests/s, every --every ids: rate, RSS, the Go runtime's
              share of it, the engine's accounted memory, WAL and index
              bytes;
  compact     an explicit Compact after the fill: its time and the bytes
              the process wrote meanwhile (/proc/self/io);
  disk        WAL, index and snapshot bytes, and per live id;
  reopen      Close, then Open again: the time Open takes after a clean close;
  duplicate   --lookups of random duplicate Begins over all the ids (reads
              from disk once the set outgrows the caches): requests/s and
              latency percentiles;
  memory      peak RSS of the process (VmHWM) against --memory-budget.

It takes a while: about 10 minutes for 10 million ids on a 2-core machine.
The directory is a new temporary one, removed at the end, unless --dir is
given (then it is kept).`,
	examples: []string{
		"idem scale --ids 10000000",
		"idem scale --ids 100000000 --dir /var/tmp/idem-scale",
		"idem scale --ids 1000000 --memory-budget 64MiB --json",
	},
	setup: func(fs *flag.FlagSet) func(*cli, []string) error {
		o := &scaleOpts{}
		fs.StringVar(&o.dir, "dir", "", "run in this `directory` and keep it (default: a temporary directory, removed)")
		fs.Int64Var(&o.ids, "ids", 10_000_000, "`n` ids to fill")
		fs.IntVar(&o.concurrency, "concurrency", 256, "concurrent callers (`n` goroutines)")
		fs.IntVar(&o.replySize, "reply-size", 128, "reply size in `bytes`")
		fs.StringVar(&o.budget, "memory-budget", "", "Options.MemoryBudget (`size`, e.g. 64MiB; default the engine's, 256MiB)")
		fs.Int64Var(&o.every, "every", 1_000_000, "print a fill line every `n` ids (at most one per 100 ms)")
		fs.DurationVar(&o.lookups, "lookups", 10*time.Second, "how long the duplicate phase runs (`d`)")
		fs.BoolVar(&o.json, "json", false, "print one JSON object at the end")
		fs.StringVar(&o.pprof, "pprof", "", "serve net/http/pprof on this loopback `address` (e.g. 127.0.0.1:6060) while it runs, to profile a long run")
		fs.BoolVar(&o.skipFill, "skip-fill", false, "the --dir holds the --ids ids of an earlier run: skip the fill and the compaction, measure the rest")
		return o.run
	},
}

type scaleOpts struct {
	dir         string
	ids         int64
	concurrency int
	replySize   int
	budget      string
	every       int64
	lookups     time.Duration
	json        bool
	skipFill    bool
	pprof       string
}

type scaleFillLine struct {
	IDs         int64   `json:"ids"`
	Seconds     float64 `json:"seconds"`
	RatePerSec  float64 `json:"rate_per_sec"` // over the last interval
	RSSBytes    int64   `json:"rss_bytes"`
	GoBytes     int64   `json:"go_bytes"` // the Go runtime's memory not returned to the OS (goMemory)
	MemoryBytes int64   `json:"memory_accounted_bytes"`
	WALBytes    int64   `json:"wal_bytes"`
	IndexBytes  int64   `json:"index_bytes"`
}

type scaleOut struct {
	IDs                 int64           `json:"ids"`
	Concurrency         int             `json:"concurrency"`
	ReplySize           int             `json:"reply_size"`
	MemoryBudget        int64           `json:"memory_budget"`
	GOMAXPROCS          int             `json:"gomaxprocs"`
	Fill                []scaleFillLine `json:"fill"`
	FillPerSec          float64         `json:"fill_per_sec"`
	CompactSeconds      float64         `json:"compact_seconds"`
	CompactWrittenBytes int64           `json:"compact_written_bytes"`
	WALBytes            int64           `json:"wal_bytes"`
	IndexBytes          int64           `json:"index_bytes"`
	SnapshotBytes       int64           `json:"snapshot_bytes"`
	DiskPerID           float64         `json:"disk_bytes_per_id"`
	CloseSeconds        float64         `json:"close_seconds"`
	ReopenSeconds       float64         `json:"reopen_seconds"`
	Duplicate           phaseResult     `json:"duplicate"`
	// FillPeakRSSBytes is the process's peak RSS during the fill and the
	// compaction; PeakRSSBytes the peak during the reopen and the duplicate
	// phase, after the first engine's memory was returned to the OS (the
	// peak is reset where Linux allows it: /proc/self/clear_refs).
	FillPeakRSSBytes int64 `json:"fill_peak_rss_bytes"`
	PeakRSSBytes     int64 `json:"peak_rss_bytes"`
	RSSBytes         int64 `json:"rss_bytes"`
	GoBytes          int64 `json:"go_bytes"` // the Go runtime's part of RSSBytes (goMemory)
}

// scaleID is the i-th id: 16 bytes, a bijective mix of i (distinct for
// distinct i, spread over the key space like random ids).
func scaleID(dst []byte, i uint64) []byte {
	a := mix64(i ^ 0x9e3779b97f4a7c15)
	b := mix64(i + 0xbf58476d1ce4e5b9)
	dst = binary.BigEndian.AppendUint64(dst[:0], a)
	return binary.BigEndian.AppendUint64(dst, b^i)
}

// mix64 is splitmix64's finalizer (a bijection on uint64).
func mix64(z uint64) uint64 {
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

func (o *scaleOpts) run(c *cli, pos []string) error {
	if len(pos) > 0 {
		return usagef("scale takes no arguments (use --dir to choose the directory)")
	}
	switch {
	case o.ids < 1:
		return usagef("--ids must be positive")
	case o.concurrency < 1 || o.concurrency > 1<<16:
		return usagef("--concurrency must be between 1 and 65536")
	case o.replySize < 0 || o.replySize > 1<<20:
		return usagef("--reply-size must be between 0 and 1 MiB")
	case o.every < 1:
		return usagef("--every must be positive")
	case o.skipFill && o.dir == "":
		return usagef("--skip-fill needs the --dir of an earlier run")
	}
	opts := &idem.Options{}
	if o.budget != "" {
		n, err := parseSize(o.budget)
		if err != nil {
			return usagef("--memory-budget: %v", err)
		}
		opts.MemoryBudget = n
	}
	dir := o.dir
	if dir == "" {
		tmp, err := os.MkdirTemp("", "idem-scale-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		dir = tmp
	}
	e, err := idem.Open(dir, opts)
	if errors.Is(err, idem.ErrLocked) {
		return fmt.Errorf("%s is locked by another engine (ErrLocked)", dir)
	}
	if err != nil {
		return err
	}
	defer func() { _ = e.Close() }()
	out := scaleOut{IDs: o.ids, Concurrency: o.concurrency, ReplySize: o.replySize,
		MemoryBudget: e.Stats().Memory.Budget, GOMAXPROCS: runtime.GOMAXPROCS(0)}
	say := func(format string, args ...any) {
		if !o.json {
			fmt.Fprintf(c.stdout, format, args...)
		}
	}
	say("scale     dir %s, %d ids, concurrency %d, reply %d bytes, memory budget %s, GOMAXPROCS %d\n",
		dir, o.ids, o.concurrency, o.replySize, humanBytes(out.MemoryBudget), out.GOMAXPROCS)
	if o.pprof != "" {
		addr, stop, err := servePprof(o.pprof)
		if err != nil {
			return err
		}
		defer stop()
		say("pprof     http://%s/debug/pprof/\n", addr)
	}
	reply := make([]byte, o.replySize)
	_, _ = crand.Read(reply)
	ctx := context.Background()

	if !o.skipFill {
		if err := o.fill(c, e, &out, dir, reply, say); err != nil {
			return err
		}
	}
	out.FillPeakRSSBytes = procStatus("VmHWM")
	out.WALBytes = treeBytes(filepath.Join(dir, "wal"))
	out.IndexBytes = treeBytes(filepath.Join(dir, "index"))
	out.SnapshotBytes = treeBytes(filepath.Join(dir, "snapshot"))
	out.DiskPerID = float64(out.WALBytes+out.IndexBytes+out.SnapshotBytes) / float64(o.ids)
	say("disk      wal %s, index %s, snapshots %s: %.1f bytes per id (index alone %.1f; total/index %.2fx)\n",
		humanBytes(out.WALBytes), humanBytes(out.IndexBytes), humanBytes(out.SnapshotBytes), out.DiskPerID,
		float64(out.IndexBytes)/float64(o.ids), float64(out.WALBytes+out.IndexBytes+out.SnapshotBytes)/float64(max(out.IndexBytes, 1)))

	// Reopen, in a process whose first engine's memory went back to the OS.
	t0 := time.Now()
	if err := e.Close(); err != nil {
		return fmt.Errorf("close: %w", err)
	}
	out.CloseSeconds = time.Since(t0).Seconds()
	runtime.GC()
	debug.FreeOSMemory()
	_ = os.WriteFile("/proc/self/clear_refs", []byte("5"), 0) // reset VmHWM (Linux)
	t0 = time.Now()
	e, err = idem.Open(dir, opts)
	if err != nil {
		return fmt.Errorf("reopen: %w", err)
	}
	out.ReopenSeconds = time.Since(t0).Seconds()
	say("reopen    close %.3fs, open %.3fs (%d live entries)\n", out.CloseSeconds, out.ReopenSeconds, e.Stats().LiveEntries)

	// Duplicates.
	b := &benchOpts{concurrency: o.concurrency, duration: o.lookups}
	out.Duplicate = b.phase(c, "duplicate", func(w int, rng *rand.ChaCha8) error {
		id := scaleID(make([]byte, 0, 16), rng.Uint64()%uint64(o.ids))
		res, err := e.Begin(ctx, idem.Request{ID: id})
		if err != nil {
			return err
		}
		if res.Status != idem.Done {
			return fmt.Errorf("id 0x%x: status %v, want done", id, res.Status)
		}
		return nil
	})
	if !o.json {
		printPhase(c, &out.Duplicate)
	}
	out.PeakRSSBytes, out.RSSBytes, out.GoBytes = procStatus("VmHWM"), procStatus("VmRSS"), goMemory()
	say("memory    peak RSS %s during the fill (%.2fx the budget), %s during reopen and duplicates (%.2fx), now %s (Go %s); budget %s, accounted now %s\n",
		humanBytes(out.FillPeakRSSBytes), float64(out.FillPeakRSSBytes)/float64(out.MemoryBudget),
		humanBytes(out.PeakRSSBytes), float64(out.PeakRSSBytes)/float64(out.MemoryBudget), humanBytes(out.RSSBytes),
		humanBytes(out.GoBytes), humanBytes(out.MemoryBudget), humanBytes(e.Stats().Memory.Total))
	if o.json {
		if err := writeJSONLine(c.stdout, &out); err != nil {
			return err
		}
	}
	if out.Duplicate.Errors > 0 {
		return fmt.Errorf("duplicate phase: %d requests failed, first: %s", out.Duplicate.Errors, out.Duplicate.FirstErr)
	}
	return nil
}

// fill runs the fill phase and the compaction after it.
func (o *scaleOpts) fill(c *cli, e *idem.Engine, out *scaleOut, dir string, reply []byte, say func(string, ...any)) error {
	ctx := context.Background()
	var (
		next, done atomic.Int64
		firstErr   atomic.Pointer[error]
		wg         sync.WaitGroup
	)
	start := time.Now()
	for w := 0; w < o.concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := make([]byte, 0, 16)
			for {
				i := next.Add(1) - 1
				if i >= o.ids || firstErr.Load() != nil {
					return
				}
				id = scaleID(id, uint64(i))
				if _, err := e.Do(ctx, idem.Request{ID: id}, func(context.Context) ([]byte, error) { return reply, nil }); err != nil {
					firstErr.CompareAndSwap(nil, &err)
					return
				}
				done.Add(1)
			}
		}()
	}
	fillDone := make(chan struct{})
	go func() { wg.Wait(); close(fillDone) }()
	lastN, lastT := int64(0), start
	mark := o.every
	tick := time.NewTicker(100 * time.Millisecond)
	for running := true; running; {
		select {
		case <-fillDone:
			running = false
		case <-tick.C:
		}
		n := done.Load()
		if n >= mark || (!running && n > lastN) {
			now := time.Now()
			st := e.Stats()
			l := scaleFillLine{IDs: n, Seconds: now.Sub(start).Seconds(), RatePerSec: float64(n-lastN) / now.Sub(lastT).Seconds(),
				RSSBytes: procStatus("VmRSS"), GoBytes: goMemory(), MemoryBytes: st.Memory.Total, WALBytes: treeBytes(filepath.Join(dir, "wal")),
				IndexBytes: treeBytes(filepath.Join(dir, "index"))}
			out.Fill = append(out.Fill, l)
			say("fill      %11d ids %7.0fs %9.0f req/s  rss %-9s go %-9s accounted %-9s wal %-9s index %s\n", l.IDs, l.Seconds, l.RatePerSec,
				humanBytes(l.RSSBytes), humanBytes(l.GoBytes), humanBytes(l.MemoryBytes), humanBytes(l.WALBytes), humanBytes(l.IndexBytes))
			lastN, lastT = n, now
			for mark <= n {
				mark += o.every
			}
		}
	}
	tick.Stop()
	if f := firstErr.Load(); f != nil {
		return fmt.Errorf("fill: %w", *f)
	}
	out.FillPerSec = float64(o.ids) / time.Since(start).Seconds()
	say("fill      %d ids in %.1fs: %.0f req/s\n", o.ids, time.Since(start).Seconds(), out.FillPerSec)

	// Compact.
	w0 := procIO("write_bytes")
	t0 := time.Now()
	if _, err := e.Compact(ctx); err != nil {
		return fmt.Errorf("compact: %w", err)
	}
	out.CompactSeconds = time.Since(t0).Seconds()
	out.CompactWrittenBytes = procIO("write_bytes") - w0
	say("compact   %.2fs, %s written by the process meanwhile\n", out.CompactSeconds, humanBytes(out.CompactWrittenBytes))
	return nil
}

// servePprof serves net/http/pprof's handlers on addr, which must be a
// loopback address (profiles show the process's memory and code paths).
func servePprof(addr string) (served string, stop func(), err error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return "", nil, usagef("--pprof %q: %v", addr, err)
	}
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return "", nil, usagef("--pprof %q: only a loopback address (127.0.0.1, ::1, localhost) is served", addr)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", nil, fmt.Errorf("--pprof: %w", err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	return ln.Addr().String(), func() { srv.Close() }, nil
}

// treeBytes is the size of the files under dir (0 if it does not exist).
func treeBytes(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			if info, err := d.Info(); err == nil {
				n += info.Size()
			}
		}
		return nil
	})
	return n
}

// procStatus reads a "kB" field of /proc/self/status in bytes (0 where
// there is no /proc).
// goMemory is the memory the Go runtime holds from the OS (heap, stacks,
// its own metadata), less what it returned: the part of RSS that is Go's
// rather than C's (Pebble's block cache and memtables live in C memory when
// cgo is on).
func goMemory() int64 {
	s := []metrics.Sample{{Name: "/memory/classes/total:bytes"}, {Name: "/memory/classes/heap/released:bytes"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 || s[1].Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return int64(s[0].Value.Uint64() - s[1].Value.Uint64())
}

func procStatus(field string) int64 {
	return procField("/proc/self/status", field+":", 1024)
}

// procIO reads a field of /proc/self/io in bytes (0 where unavailable).
func procIO(field string) int64 {
	return procField("/proc/self/io", field+":", 1)
}

func procField(path, prefix string, unit int64) int64 {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, prefix); ok {
			fields := strings.Fields(rest)
			if len(fields) == 0 {
				return 0
			}
			v, err := strconv.ParseInt(fields[0], 10, 64)
			if err != nil {
				return 0
			}
			return v * unit
		}
	}
	return 0
}

// parseSize parses 64MiB, 1GiB, 512MB, 1048576.
func parseSize(s string) (int64, error) {
	units := []struct {
		suffix string
		mult   int64
	}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"B", 1}}
	t := strings.TrimSpace(s)
	mult := int64(1)
	for _, u := range units {
		if strings.HasSuffix(strings.ToUpper(t), strings.ToUpper(u.suffix)) {
			t, mult = strings.TrimSpace(t[:len(t)-len(u.suffix)]), u.mult
			break
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	if err != nil || v <= 0 {
		return 0, fmt.Errorf("%q is not a size (for example 64MiB)", s)
	}
	return int64(v * float64(mult)), nil
}
