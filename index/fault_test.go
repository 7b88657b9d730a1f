package index

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/idemdb/idem/wal"
)

// These tests inject the I/O errors that make Pebble call Logger.Fatalf (a
// failed MANIFEST write or sync) or panic (a failed fsync of the index
// directory while the MANIFEST marker moves) on one of its own goroutines,
// found by the index fault sweep (fuzz.TestFaultSweepIndex). Each must stop
// the index (ErrBackground, wrapping the injected error) without a panic,
// and Open and Close must return: a hang is detected by a generous bound
// (hangBound), nothing is timed. Parked Pebble goroutines are leaked on
// purpose (index.go, pebbleLogger).

const hangBound = 20 * time.Second

// faultKeys is how many entries populateIndex applies (LSNs 1..faultKeys).
const faultKeys = 20

func faultKey(i int) []byte { return EntryKey(nil, "s", ModeID, []byte(fmt.Sprint("id-", i))) }

// populateIndex applies faultKeys entries to a new index in fs over a few
// opens (so that the store has sstables, a MANIFEST and a WAL file to
// recover), and closes it flushed.
func populateIndex(t *testing.T, fs vfs.FS) {
	t.Helper()
	lsn := wal.LSN(0)
	for round := 0; round < 2; round++ {
		ix, err := Open(Options{FS: fs, Dir: "ix", IngestBytes: 1})
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < faultKeys/2; i++ {
			lsn++
			e := &Entry{Committed: true, CommitTime: int64(lsn), CommitLSN: lsn, LSN: lsn, ReplyKept: true, Reply: []byte("r")}
			if err := ix.Apply([]*Update{{LSN: lsn, Transitions: []Transition{{Key: faultKey(int(lsn)), Mode: ModeID, Next: e}}}}); err != nil {
				t.Fatal(err)
			}
		}
		if err := ix.Close(true); err != nil {
			t.Fatal(err)
		}
	}
}

// checkRecovers opens a crash image of mem (what a new process finds: a
// parked Pebble keeps its lock in this one) and checks every entry.
func checkRecovers(t *testing.T, mem *vfs.MemFS) {
	t.Helper()
	ix, err := Open(Options{FS: mem.CrashClone(vfs.CrashCloneCfg{}), Dir: "ix"})
	if err != nil {
		t.Fatalf("reopen of the crash image: %v", err)
	}
	defer ix.Close(false)
	if ix.Applied() != faultKeys {
		t.Fatalf("reopened index applied through LSN %d, want %d", ix.Applied(), faultKeys)
	}
	for i := 1; i <= faultKeys; i++ {
		if e, err := ix.Get(faultKey(i)); err != nil || e == nil || e.CommitLSN != wal.LSN(i) {
			t.Fatalf("entry %d after reopen: %+v, %v", i, e, err)
		}
	}
}

// onceInjector fails the first operation match accepts once armed, and
// records where.
type onceInjector struct {
	armed atomic.Bool
	match func(op errorfs.Op) bool
	mu    sync.Mutex
	fired []string
}

func (in *onceInjector) MaybeError(op errorfs.Op) error {
	if !in.armed.Load() || !in.match(op) {
		return nil
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if len(in.fired) > 0 {
		return nil
	}
	var buf [64]byte
	g := strings.Fields(string(buf[:runtime.Stack(buf[:], false)]))[1]
	in.fired = append(in.fired, fmt.Sprintf("%s (goroutine %s)", op.Path, g))
	return fmt.Errorf("injected at %s: %w", op.Path, syscall.EIO)
}

func (in *onceInjector) String() string {
	in.mu.Lock()
	defer in.mu.Unlock()
	return strings.Join(in.fired, ", ")
}

// manifestMarkerMove matches the fsync of the index directory that follows
// the creation of a new MANIFEST marker file (atomicfs.Marker.Move).
func manifestMarkerMove() func(op errorfs.Op) bool {
	var created atomic.Bool
	return func(op errorfs.Op) bool {
		if op.Kind == errorfs.OpCreate && strings.Contains(op.Path, "marker.manifest.") {
			created.Store(true)
		}
		return op.Kind == errorfs.OpFileSync && op.Path == "ix" && created.Load()
	}
}

// TestOpenReturnsAfterFatalOnPebbleGoroutine: while Pebble opens an
// existing store, the flush it starts (on its own goroutine, which Open
// waits for) writes a new MANIFEST and moves the marker to it. A failed
// MANIFEST write or sync makes that goroutine call Fatalf, which parks it:
// pebble.Open then waited for it forever (the sweep's Open hangs). A failed
// fsync of the directory in the marker's move panicked on that goroutine
// (the sweep's panics). Open must now return ErrBackground, and a new
// process must find the index intact.
func TestOpenReturnsAfterFatalOnPebbleGoroutine(t *testing.T) {
	for _, c := range []struct {
		name  string
		match func(op errorfs.Op) bool
	}{
		{"MANIFEST write", func(op errorfs.Op) bool {
			return op.Kind == errorfs.OpFileWrite && strings.Contains(op.Path, "MANIFEST-")
		}},
		{"MANIFEST sync", func(op errorfs.Op) bool {
			return op.Kind == errorfs.OpFileSync && strings.Contains(op.Path, "MANIFEST-")
		}},
		{"directory fsync moving the MANIFEST marker", manifestMarkerMove()},
	} {
		t.Run(c.name, func(t *testing.T) {
			mem := vfs.NewCrashableMem()
			in := &onceInjector{match: c.match}
			fs := errorfs.Wrap(mem, in)
			populateIndex(t, fs)
			in.armed.Store(true)
			type result struct {
				ix  *Index
				err error
			}
			done := make(chan result, 1)
			go func() {
				ix, err := Open(Options{FS: fs, Dir: "ix"})
				done <- result{ix, err}
			}()
			var r result
			select {
			case r = <-done:
			case <-time.After(hangBound):
				t.Fatalf("Open did not return within %v after the fault (%v)", hangBound, in)
			}
			if in.String() == "" {
				t.Fatal("the fault was not reached")
			}
			t.Logf("fault at %v: Open: %v", in, r.err)
			if r.err == nil {
				r.ix.Close(false)
				t.Fatalf("Open succeeded after the fault at %v", in)
			}
			if !errors.Is(r.err, ErrBackground) || !errors.Is(r.err, syscall.EIO) {
				t.Fatalf("Open after the fault at %v: %v (want ErrBackground wrapping the injected EIO)", in, r.err)
			}
			checkRecovers(t, mem)
		})
	}
}

// TestCloseReturnsAfterFatalWhileClosing: a flush is in flight when Close
// starts, and its MANIFEST write fails while Pebble's Close waits for it.
// The flush's goroutine parks in Fatalf, and Close used to wait for it
// forever (the sweep's Close hangs: no failure was recorded yet when Close
// chose to close Pebble without a bound). Close must now return
// ErrBackground, and a new process must find the index intact.
func TestCloseReturnsAfterFatalWhileClosing(t *testing.T) {
	mem := vfs.NewCrashableMem()
	entered, release := make(chan struct{}), make(chan struct{})
	var armed, fired atomic.Bool
	inj := errorfs.InjectorFunc(func(op errorfs.Op) error {
		if !armed.Load() || op.Kind != errorfs.OpFileWrite || !strings.Contains(op.Path, "MANIFEST-") || !fired.CompareAndSwap(false, true) {
			return nil
		}
		close(entered)
		<-release
		return fmt.Errorf("injected at MANIFEST write %s: %w", op.Path, syscall.EIO)
	})
	fs := errorfs.Wrap(mem, inj)
	populateIndex(t, fs)
	ix, err := Open(Options{FS: fs, Dir: "ix"})
	if err != nil {
		t.Fatal(err)
	}
	armed.Store(true)
	// A key outside the index's prefixes makes the memtable worth a flush.
	if err := ix.DB().Set([]byte{0xff, 't'}, []byte("x"), pebble.NoSync); err != nil {
		t.Fatal(err)
	}
	if _, err := ix.DB().AsyncFlush(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-entered: // the flush is writing its MANIFEST record, held here
	case <-time.After(hangBound):
		t.Fatal("the flush did not reach its MANIFEST write")
	}
	closed := make(chan error, 1)
	go func() { closed <- ix.Close(false) }()
	// Fail the write once Close is inside Pebble's Close, waiting for the
	// flush.
	for deadline := time.Now().Add(hangBound); !goroutineIn("pebble/v2.(*DB).Close("); {
		if time.Now().After(deadline) {
			t.Fatal("Close did not reach Pebble's Close")
		}
		time.Sleep(time.Millisecond)
	}
	close(release)
	select {
	case err = <-closed:
	case <-time.After(hangBound):
		t.Fatalf("Close did not return within %v after the flush's MANIFEST write failed under it", hangBound)
	}
	if !errors.Is(err, ErrBackground) || !errors.Is(err, syscall.EIO) {
		t.Fatalf("Close: %v (want ErrBackground wrapping the injected EIO)", err)
	}
	checkRecovers(t, mem)
}

// goroutineIn says whether some goroutine's stack has a frame naming fn.
func goroutineIn(fn string) bool {
	buf := make([]byte, 1<<20)
	return strings.Contains(string(buf[:runtime.Stack(buf, true)]), fn)
}
