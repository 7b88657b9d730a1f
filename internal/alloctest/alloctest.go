// Package alloctest bounds the heap a function allocates: the allocation
// checks of the decoders' fuzz targets (fuzz/, snapshot/), which promise to
// allocate no more than a fixed bound plus a small multiple of their input
// whatever the bytes say, and the exact allocation counts of hot paths
// (AllocsPerRun, CheckAllocs).
//
// The only exact count the runtime gives is process-wide
// (runtime.MemStats.TotalAlloc: ReadMemStats stops the world and flushes
// every P's allocation cache first). It counts every goroutine's
// allocations, the fuzzing engine's, the testing package's and those of
// goroutines an earlier input left behind, so one measurement over the
// limit does not prove that the function breached it. Other goroutines can
// only add to a measurement, though, never hide what the function
// allocates: a measurement at or under the limit proves the function
// stayed under it. So Check takes one measurement and, only when it is
// over the limit, runs the function again, up to Runs times in all: the
// function breached the bound if and only if every run is over the limit
// (its own allocation is the same in each run, and the smallest
// measurement is an upper bound of it). A false failure would need other
// goroutines to allocate more than the limit's slack inside each of Runs
// separate runs of the same function; a real breach fails every time.
package alloctest

import (
	"runtime"
	"testing"
)

// Runs is how many times Check runs a function whose first measurement is
// over the limit before it calls that a breach (the first run included).
const Runs = 5

// Measure returns the heap bytes the whole process allocated while f ran.
func Measure(f func()) uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	before := ms.TotalAlloc
	f()
	runtime.ReadMemStats(&ms)
	return ms.TotalAlloc - before
}

// Over runs f, measured, and says whether f itself allocates more than
// limit bytes: when the first measurement is over the limit, f is run
// again (undo, when f returns one, runs between runs, unmeasured), up to
// Runs times, and Over is true only if every measurement is over the
// limit. got holds the measurements taken. f must allocate the same in
// every run (a decoder of the same bytes does) and must be safe to run
// again once its undo has run.
func Over(limit uint64, f func() (undo func())) (over bool, got []uint64) {
	for range Runs {
		var undo func()
		n := Measure(func() { undo = f() })
		got = append(got, n)
		if n <= limit {
			return false, got
		}
		if len(got) < Runs && undo != nil {
			undo()
		}
	}
	return true, got
}

// Check fails tb if f allocates more than limit bytes (see Over: f may run
// up to Runs times, so it must be repeatable and free of side effects;
// CheckUndo takes a function with side effects). what names f in the
// failure.
func Check(tb testing.TB, what string, limit uint64, f func()) {
	tb.Helper()
	CheckUndo(tb, what, limit, func() func() { f(); return nil })
}

// CheckUndo is Check for a function with side effects: f returns the
// function that undoes them (nil if none), which runs, unmeasured, before
// f runs again. After CheckUndo returns, the effects of the last run of f
// stand.
func CheckUndo(tb testing.TB, what string, limit uint64, f func() (undo func())) {
	tb.Helper()
	if over, got := Over(limit, f); over {
		tb.Fatalf("%s allocated more than its limit of %d bytes in each of %d runs: %v bytes", what, limit, len(got), got)
	}
}

// AllocsPerRun is testing.AllocsPerRun (the average number of heap
// allocations per call of f over runs calls) made immune to other
// goroutines. testing.AllocsPerRun counts the whole process's allocations
// (runtime.MemStats.Mallocs), so a background goroutine (Pebble's, a
// timer's, the testing package's) that allocates during the measurement
// raises it; it can never lower it, since f's own allocations are counted
// in full. So AllocsPerRun measures up to Runs times and returns the
// smallest measurement, stopping at the first one at or under want: the
// result is f's own count unless other goroutines allocated at least runs
// times inside each of Runs measurements, and a count over want that f
// itself makes is reported every time. f runs runs+1 times per
// measurement (testing.AllocsPerRun's warm-up call included), so it must be
// repeatable.
func AllocsPerRun(want float64, runs int, f func()) float64 {
	least := testing.AllocsPerRun(runs, f)
	for i := 1; i < Runs && least > want; i++ {
		least = min(least, testing.AllocsPerRun(runs, f))
	}
	return least
}

// CheckAllocs fails tb unless f allocates exactly want times per call
// (AllocsPerRun over runs calls: other goroutines' allocations do not
// count). what names f in the failure.
func CheckAllocs(tb testing.TB, what string, want float64, runs int, f func()) {
	tb.Helper()
	if got := AllocsPerRun(want, runs, f); got != want {
		tb.Fatalf("%s: %v allocations per call (the least of up to %d measurements of %d calls), want %v", what, got, Runs, runs, want)
	}
}
