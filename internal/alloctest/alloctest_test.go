package alloctest

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
)

var sink []byte

const limit = 1 << 20

// A function that allocates over the limit itself is over in every run.
func TestOverCatchesOwnAllocation(t *testing.T) {
	over, got := Over(limit, func() func() { sink = make([]byte, 4<<20); return nil })
	if !over || len(got) != Runs {
		t.Fatalf("4 MiB against a 1 MiB limit: over %v after %d runs (%v)", over, len(got), got)
	}
	for _, n := range got {
		if n < 4<<20 {
			t.Fatalf("measured %d bytes for a 4 MiB allocation", n)
		}
	}
}

// foreign makes another goroutine allocate n bytes while the caller waits:
// what the fuzzing engine, or a goroutine an earlier input left behind,
// does inside a measurement.
func foreign(n int) {
	done := make(chan struct{})
	go func() {
		sink = make([]byte, n)
		close(done)
	}()
	<-done
}

// Another goroutine's allocation inside every run but the last does not
// fail a function that stays under the limit; inside the first only, one
// more run settles it.
func TestOverIgnoresOtherGoroutines(t *testing.T) {
	for _, noisy := range []int{1, Runs - 1} {
		runs := 0
		over, got := Over(limit, func() func() {
			runs++
			sink = make([]byte, 1<<10)
			if runs <= noisy {
				foreign(64 << 20)
			}
			return nil
		})
		if over || len(got) != noisy+1 {
			t.Fatalf("1 KiB, with 64 MiB allocated by another goroutine in %d runs: over %v after %d runs (%v)", noisy, over, len(got), got)
		}
		if got[0] < 64<<20 {
			t.Fatalf("the first run measured %d bytes: the other goroutine's 64 MiB are not counted, the test shows nothing", got[0])
		}
	}
}

// CheckUndo undoes the effects of each run it repeats, and leaves the last
// run's.
func TestCheckUndo(t *testing.T) {
	var open []int
	runs := 0
	CheckUndo(t, "f", limit, func() func() {
		runs++
		open = append(open, runs)
		if runs < 3 {
			foreign(8 << 20)
		}
		return func() { open = open[:len(open)-1] }
	})
	if runs != 3 || len(open) != 1 || open[0] != 3 {
		t.Fatalf("%d runs leave %v open, want 3 runs leaving the third", runs, open)
	}
}

// fatalTB records Fatalf and ends the goroutine, as testing.T does.
type fatalTB struct {
	testing.TB
	msg string
}

func (f *fatalTB) Helper() {}
func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// Check fails with what, the limit and every measurement.
func TestCheckFails(t *testing.T) {
	tb := &fatalTB{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		Check(tb, "decoder", limit, func() { sink = make([]byte, 2<<20) })
	}()
	<-done
	if !strings.HasPrefix(tb.msg, "decoder allocated more than its limit of 1048576 bytes in each of 5 runs: [") {
		t.Fatalf("Check of 2 MiB against 1 MiB: %q", tb.msg)
	}
}

var objects [][]*int

// allocObject makes one heap allocation (of pointers, so never a tiny
// allocation the runtime might fold into another).
func allocObject() { objects = append(objects[:0], make([]*int, 4)) }

// foreignObjects makes another goroutine make n allocations while the
// caller waits.
func foreignObjects(n int) {
	done := make(chan struct{})
	go func() {
		for range n {
			allocObject()
		}
		close(done)
	}()
	<-done
}

// Another goroutine's allocations inside the first measurement raise
// testing.AllocsPerRun's count but not AllocsPerRun's: one more measurement
// settles it.
func TestAllocsPerRunIgnoresOtherGoroutines(t *testing.T) {
	const runs = 100
	objects = make([][]*int, 0, 1)
	calls, noisy := 0, true
	f := func() {
		calls++
		allocObject()
		if noisy && calls <= runs+1 { // the first measurement's calls (warm-up included)
			foreignObjects(3)
		}
	}
	if n := testing.AllocsPerRun(runs, f); n < 2 {
		t.Fatalf("testing.AllocsPerRun with another goroutine allocating 3 times a call: %v, the test shows nothing", n)
	}
	calls = 0
	if n := AllocsPerRun(1, runs, f); n != 1 || calls != 2*(runs+1) {
		t.Fatalf("AllocsPerRun with another goroutine allocating in the first measurement: %v after %d calls, want 1 after %d", n, calls, 2*(runs+1))
	}
	noisy = false
	CheckAllocs(t, "one allocation", 1, runs, f)
}

// An allocation f makes itself is counted in every measurement: an extra
// one fails whatever the other goroutines do.
func TestCheckAllocsFails(t *testing.T) {
	const runs = 100
	objects = make([][]*int, 0, 1)
	calls := 0
	f := func() { calls++; allocObject(); allocObject() }
	if n := AllocsPerRun(1, runs, f); n != 2 || calls != Runs*(runs+1) {
		t.Fatalf("two allocations against a want of 1: %v after %d calls, want 2 after %d", n, calls, Runs*(runs+1))
	}
	tb := &fatalTB{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		CheckAllocs(tb, "the hot path", 1, runs, f)
	}()
	<-done
	if want := "the hot path: 2 allocations per call (the least of up to 5 measurements of 100 calls), want 1"; tb.msg != want {
		t.Fatalf("CheckAllocs of 2 allocations against 1: %q, want %q", tb.msg, want)
	}
}
