package idem

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestMemoryRSSWithinBudget measures the engine from outside its own
// accounting (TestMemoryBudgetHonoured checks Stats.Memory, which is the
// engine's word for what it holds): the growth of the process's resident
// set (VmRSS, /proc/self/status) while a 32 MiB-budget engine on disk takes
// 200,000 fresh requests and lookups must stay within rssAllowance(budget).
//
// It runs in a child process of its own (this test binary, running only
// this test), so that what other tests of the package left in the heap,
// in the C allocator or in Pebble's caches does not count, and it measures
// the growth from a baseline taken in the child right before Open, after a
// forced GC and return of free memory to the OS. The data is on disk in a
// temporary directory (an in-memory filesystem would put the files
// themselves in the heap); the page cache is not part of RSS (Pebble reads
// with pread, it does not mmap). The sampler reads VmRSS every
// millisecond and keeps the peak; the load of the machine changes how
// often it samples, not what it reads.
//
// The margin: the budget bounds the engine's data, and Go's collector
// lets the heap grow to twice its live size (GOGC=100), so the Go-heap
// parts (at most 11/32 of the budget, see Options.MemoryBudget) can take
// twice their share; the process also holds goroutine stacks, the WAL's
// buffers and the requests in flight. docs/design.md measures about 1.25x
// the budget at 10 and 100 million ids; rssAllowance is 1.5x the budget
// plus 20 MiB for the Go runtime and the test's own workers, which a
// 32 MiB budget makes visible (measured: 38-44 MiB of growth against the
// 68 MiB allowed; an in-memory table that is not accounted for, slotSize
// returning 1, grows it by 109 MiB while Stats.Memory stays under 3 MiB,
// and TestMemoryBudgetHonoured passes).
//
// Under the race detector RSS measures the detector's shadow memory (5-10x
// every allocation), not the engine: the test is skipped there.
func TestMemoryRSSWithinBudget(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector's shadow memory multiplies RSS: this measures the engine only without -race")
	}
	if runtime.GOOS != "linux" {
		t.Skip("reads VmRSS from /proc/self/status (Linux)")
	}
	if os.Getenv(rssChildEnv) == "" {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestMemoryRSSWithinBudget$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), rssChildEnv+"=1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("child process: %v\n%s", err, out)
		}
		for _, l := range strings.Split(string(out), "\n") {
			if strings.Contains(l, "memrss_test.go") {
				t.Log(strings.TrimSpace(l))
			}
		}
		return
	}

	const (
		budget = 32 << 20
		n      = 200_000
	)
	runtime.GC()
	debug.FreeOSMemory()
	base, err := vmRSS()
	if err != nil {
		t.Fatal(err)
	}
	e, err := Open(t.TempDir(), &Options{MemoryBudget: budget, Sync: SyncNever})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	var (
		peak, peakAccounted atomic.Int64
		stop                = make(chan struct{})
		sampler             sync.WaitGroup
	)
	sampler.Add(1)
	go func() {
		defer sampler.Done()
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			r, err := vmRSS()
			if err != nil {
				t.Error(err)
				return
			}
			if r > peak.Load() {
				peak.Store(r)
				peakAccounted.Store(e.Stats().Memory.Total)
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	doFresh(t, e, "rss", n, 16, 128)
	for i := 0; i < n; i += 3 {
		if l, err := lookupID(e, "", []byte(fmt.Sprintf("rss-%010d", i))); err != nil || l.Status != Done {
			t.Fatalf("lookup %d: %v %v", i, l.Status, err)
		}
	}
	close(stop)
	sampler.Wait()
	grew := peak.Load() - base
	allowed := rssAllowance(budget)
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	t.Logf("%d requests: RSS grew by %d MiB at its peak (base %d MiB); allowed %d MiB for a %d MiB budget; the engine accounted for %d MiB then; Go heap now %d MiB in use, %d MiB from the OS",
		n, grew>>20, base>>20, allowed>>20, budget>>20, peakAccounted.Load()>>20, ms.HeapInuse>>20, ms.HeapSys>>20)
	if grew > allowed {
		t.Fatalf("RSS grew by %d MiB with a %d MiB budget, over the %d MiB allowed (the engine accounted for %d MiB at that peak: memory it does not account for)",
			grew>>20, budget>>20, allowed>>20, peakAccounted.Load()>>20)
	}
}

const rssChildEnv = "IDEM_TEST_RSS_CHILD"

// rssAllowance is how much RSS may grow for an engine with this budget
// (see TestMemoryRSSWithinBudget).
func rssAllowance(budget int64) int64 { return budget*3/2 + 20<<20 }

// vmRSS returns the process's resident set size in bytes.
func vmRSS() (int64, error) {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0, err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) == 3 && f[0] == "VmRSS:" && f[2] == "kB" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("/proc/self/status: %q: %w", sc.Text(), err)
			}
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("/proc/self/status has no VmRSS line")
}
