// Command peers runs the exactly-once job on one store at a time and
// writes the figures as CSV; bench/peers/run.sh drives it (see README.md).
//
//	peers run -peer idem -c 64 -round 1 -out raw.csv
//	peers summary -in raw.csv -csv ../../docs/peers.csv -medians ../../docs/peers-medians.csv [-base idem]
//	peers freeport
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/idemdb/idem/bench/peers"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "run":
		err = run(os.Args[2:])
	case "summary":
		err = summary(os.Args[2:])
	case "freeport":
		err = freeport()
	case "-h", "-help", "--help", "help":
		usage()
	default:
		fmt.Fprintf(os.Stderr, "peers: unknown command %q\n", os.Args[1])
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "peers:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintf(os.Stderr, `usage:
  peers run -peer NAMES -c N [-round R] [-warmup 0] [-fresh 3s] [-dup 2s] [-out FILE] [-redis ADDR -redis-pid PID] [-postgres URL -postgres-pid PID] [-cpuprofile FILE] [-mutexprofile FILE] [-blockprofile FILE]
      run each named peer (comma-separated; known: %s) on a new
      store and append its fresh and duplicate rows to FILE (CSV; stdout if none)
  peers summary -in RAW.csv [-csv OUT.csv] [-medians MEDIANS.csv] [-base PEER]
      add each row's ratio to PEER's (default idem; same round, callers, phase),
      write medians, print markdown tables
  peers freeport
      print a free TCP port on 127.0.0.1
`, strings.Join(peers.Names, ","))
	os.Exit(2)
}

func run(args []string) error {
	fs := flag.NewFlagSet("run", flag.ExitOnError)
	names := fs.String("peer", "", "peers to run, comma-separated")
	conc := fs.Int("c", 64, "concurrent callers")
	round := fs.Int("round", 1, "round number written to the CSV")
	fresh := fs.Duration("fresh", 3*time.Second, "length of the fresh phase")
	dup := fs.Duration("dup", 2*time.Second, "length of the duplicate phase")
	warmup := fs.Duration("warmup", 0, "length of an unmeasured phase of fresh requests before the fresh phase (0: none)")
	out := fs.String("out", "", "append rows to this CSV `file` (header written if it is empty)")
	dir := fs.String("dir", "", "parent `directory` of the embedded peers' stores (default: the system's temporary directory)")
	redisAddr := fs.String("redis", "", "Redis server `host:port`")
	redisPID := fs.Int("redis-pid", 0, "Redis server process id (its CPU time is counted)")
	pgURL := fs.String("postgres", "", "PostgreSQL connection `URL`")
	pgPID := fs.Int("postgres-pid", 0, "PostgreSQL postmaster process id (its and its backends' CPU time is counted)")
	pgMax := fs.Int("postgres-max-conns", peers.PostgresMaxConns, "PostgreSQL pool size bound")
	redisMax := fs.Int("redis-max-conns", peers.RedisMaxConns, "Redis pool size bound")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the runs (opening and closing the stores excluded) to this `file`; with -dup 0 it covers the fresh phase only")
	mutexProfile := fs.String("mutexprofile", "", "write a mutex contention profile of the runs (every contention event sampled) to this `file`; one peer")
	blockProfile := fs.String("blockprofile", "", "write a blocking profile of the runs (every blocking event sampled) to this `file`; one peer")
	_ = fs.Parse(args)
	peers.RedisMaxConns = *redisMax
	if *names == "" {
		return errors.New("run: -peer is required")
	}
	if *conc < 1 || *conc > 4096 {
		return fmt.Errorf("run: -c %d: want 1 to 4096", *conc)
	}
	peers.PostgresMaxConns = *pgMax
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	w := os.Stdout
	header := true
	if *out != "" {
		f, err := os.OpenFile(*out, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
		if err != nil {
			return err
		}
		defer f.Close()
		st, err := f.Stat()
		if err != nil {
			return err
		}
		header = st.Size() == 0
		w = f
	}
	var prof *os.File
	if *cpuProfile != "" {
		if strings.Contains(*names, ",") {
			return errors.New("run: -cpuprofile profiles one peer: name one in -peer")
		}
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		prof = f
		defer func() {
			if err := prof.Close(); err != nil {
				fmt.Fprintln(os.Stderr, "peers: closing the CPU profile:", err)
			}
		}()
	}
	if (*mutexProfile != "" || *blockProfile != "") && strings.Contains(*names, ",") {
		return errors.New("run: -mutexprofile and -blockprofile profile one peer: name one in -peer")
	}
	profs := lockProfiles{mutex: *mutexProfile, block: *blockProfile}
	for _, name := range strings.Split(*names, ",") {
		name = strings.TrimSpace(name)
		tmp, err := os.MkdirTemp(*dir, "peers-"+name+"-")
		if err != nil {
			return err
		}
		cfg := peers.Config{Dir: tmp, Concurrency: *conc, RedisAddr: *redisAddr, PostgresURL: *pgURL}
		rc := peers.RunConfig{Concurrency: *conc, Fresh: *fresh, Duplicate: *dup, Warmup: *warmup}
		switch name {
		case "redis":
			if *redisPID > 0 {
				rc.ServerPIDs = []int{*redisPID}
			}
		case "postgres":
			if *pgPID > 0 {
				rc.ServerPIDs = []int{*pgPID}
			}
		}
		rows, err := runOne(ctx, name, cfg, rc, prof, profs)
		os.RemoveAll(tmp)
		if err != nil {
			return fmt.Errorf("peer %s, %d callers: %w", name, *conc, err)
		}
		for i := range rows {
			rows[i].Round, rows[i].Peer = *round, name
			r := &rows[i]
			fmt.Fprintf(os.Stderr, "round %d  %-8s %4d callers  %-9s %10.0f req/s  p50 %8.0fµs  p99 %8.0fµs  p99.9 %8.0fµs  cpu %6.1fµs/req (client %.2fs, server %.2fs)",
				r.Round, r.Peer, r.Concurrency, r.Phase, r.PerSec, r.P50us, r.P99us, r.P999us, r.CPUusPerReq, r.ClientCPU, r.ServerCPU)
			if r.Errors > 0 {
				fmt.Fprintf(os.Stderr, "  %d ERRORS, first: %s", r.Errors, r.FirstError)
			}
			fmt.Fprintln(os.Stderr)
		}
		if err := peers.WriteCSV(w, rows, header, "idem"); err != nil {
			return err
		}
		header = false
	}
	return nil
}

// lockProfiles names the files of -mutexprofile and -blockprofile (empty:
// not asked for).
type lockProfiles struct{ mutex, block string }

// start turns on the sampling of the profiles asked for, every event
// (rate 1), so that a run's figures cover peers.Run only.
func (l lockProfiles) start() {
	if l.mutex != "" {
		runtime.SetMutexProfileFraction(1)
	}
	if l.block != "" {
		runtime.SetBlockProfileRate(1)
	}
}

// stop turns the sampling off and writes the profiles asked for.
func (l lockProfiles) stop() error {
	var errs []error
	for _, p := range []struct{ name, file string }{{"mutex", l.mutex}, {"block", l.block}} {
		if p.file == "" {
			continue
		}
		if p.name == "mutex" {
			runtime.SetMutexProfileFraction(0)
		} else {
			runtime.SetBlockProfileRate(0)
		}
		f, err := os.Create(p.file)
		if err != nil {
			errs = append(errs, fmt.Errorf("-%sprofile: %w", p.name, err))
			continue
		}
		err = pprof.Lookup(p.name).WriteTo(f, 0)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("-%sprofile %s: %w", p.name, p.file, err))
		}
	}
	return errors.Join(errs...)
}

// runOne opens the peer, runs it and closes it. With prof (-cpuprofile)
// the CPU profile covers peers.Run only, and so do the mutex and block
// profiles of lp.
func runOne(ctx context.Context, name string, cfg peers.Config, rc peers.RunConfig, prof *os.File, lp lockProfiles) ([]peers.Result, error) {
	octx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	p, err := peers.Open(octx, name, cfg)
	cancel()
	if err != nil {
		return nil, err
	}
	if prof != nil {
		if err := pprof.StartCPUProfile(prof); err != nil {
			p.Close()
			return nil, fmt.Errorf("-cpuprofile: %w", err)
		}
	}
	lp.start()
	rows, err := peers.Run(ctx, p, rc)
	if prof != nil {
		pprof.StopCPUProfile()
	}
	if perr := lp.stop(); err == nil && perr != nil {
		err = perr
	}
	if cerr := p.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("close: %w", cerr)
	}
	return rows, err
}

func summary(args []string) error {
	fs := flag.NewFlagSet("summary", flag.ExitOnError)
	in := fs.String("in", "", "raw CSV written by run")
	outCSV := fs.String("csv", "", "write the rows with their ratios to the base peer to this CSV `file`")
	outMed := fs.String("medians", "", "write the medians to this CSV `file`")
	base := fs.String("base", "idem", "the `peer` whose requests/s the ratios are taken to")
	_ = fs.Parse(args)
	if *in == "" {
		return errors.New("summary: -in is required")
	}
	f, err := os.Open(*in)
	if err != nil {
		return err
	}
	rows, err := peers.ReadCSV(f)
	f.Close()
	if err != nil {
		return fmt.Errorf("%s: %w", *in, err)
	}
	peers.SetRatios(rows, *base)
	write := func(path string, fn func(*os.File) error) error {
		if path == "" {
			return nil
		}
		f, err := os.Create(path)
		if err != nil {
			return err
		}
		if err := fn(f); err != nil {
			f.Close()
			return fmt.Errorf("%s: %w", path, err)
		}
		return f.Close()
	}
	if err := write(*outCSV, func(f *os.File) error { return peers.WriteCSV(f, rows, true, *base) }); err != nil {
		return err
	}
	ms := peers.Medians(rows)
	if err := write(*outMed, func(f *os.File) error { return peers.WriteMediansCSV(f, ms, *base) }); err != nil {
		return err
	}
	return peers.WriteMarkdown(os.Stdout, ms, *base)
}

func freeport() error {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	defer l.Close()
	fmt.Println(strconv.Itoa(l.Addr().(*net.TCPAddr).Port))
	return nil
}
