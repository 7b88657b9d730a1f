// Pebble failure guards: how the index survives Pebble's fatal errors.
//
// This file is the one to re-read on every Pebble upgrade. It depends on
// Pebble's internals in ways its API does not promise (pebble v2.1.7):
// Fatalf must not return (we park the goroutine, which may hold DB.mu),
// atomicfs.Marker.Move panics on a failed directory fsync (we detect the
// call by its frame name, markerMove), and iterator invariant violations
// are recognised by their message (iteratorInvariant). The index fault
// sweep (fuzz/fault_test.go, TestFaultSweepIndex) checks these guards:
// run it after an upgrade.

package index

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync/atomic"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// guard runs f, a call into Pebble that may block on Pebble's locks, and
// returns its error, or the background failure as soon as there is one: a
// Pebble goroutine parked by Fatalf may hold those locks for good. f then
// stays blocked in its own goroutine.
func (ix *Index) guard(f func() error) error {
	if err := ix.failure(); err != nil {
		return err
	}
	done := make(chan error, 1)
	ix.inPebble.Add(1)
	go func() {
		defer ix.inPebble.Add(-1)
		done <- f()
	}()
	select {
	case err := <-done:
		return err
	case <-ix.bgFired:
		return ix.failure()
	}
}

// ErrBackground wraps the failures Pebble reported from its background
// work: the index stopped and must be reopened.
var ErrBackground = errors.New("index: stopped after a failure in Pebble's background work")

// fail records err as the index's sticky background failure (the first
// one wins) and logs it.
func (ix *Index) fail(err error) {
	ix.bgOnce.Do(func() {
		e := fmt.Errorf("%w: %w", ErrBackground, err)
		ix.bg.Store(&e)
		close(ix.bgFired)
		if ix.logger != nil {
			ix.logger.Error("index: Pebble failed in the background; the index stops", "error", err)
		}
	})
}

// failure returns the sticky background failure, or nil.
func (ix *Index) failure() error {
	if p := ix.bg.Load(); p != nil {
		return *p
	}
	return nil
}

// Failure returns the background failure that stopped the index, or nil.
func (ix *Index) Failure() error { return ix.failure() }

// Failed returns a channel closed when Pebble reports a background failure.
func (ix *Index) Failed() <-chan struct{} { return ix.bgFired }

// pebbleLogger sends Pebble's messages to the engine's logger. Pebble calls
// Fatalf when it cannot go on (a MANIFEST write that failed on a full disk,
// an invariant violation) and expects it not to return. While opening,
// Fatalf panics (openPebble turns that into Open's error); once open, it
// stops the index (ErrBackground: every later Apply, Get and Flush fails,
// so the engine stops with ErrFailed) and parks the calling goroutine for
// good, so that a disk error in a background goroutine never takes down
// the host process, and Pebble never runs the cleanup that would follow.
// Iterator invariant violations (bugs, on the caller's goroutine) still
// panic.
type pebbleLogger struct {
	l      *slog.Logger
	ix     *Index
	opened atomic.Bool
	opener atomic.Int64 // the goroutine running pebble.Open (its id)
}

func (p *pebbleLogger) Infof(format string, args ...any) {
	p.l.Debug(fmt.Sprintf(format, args...), "component", "pebble")
}
func (p *pebbleLogger) Errorf(format string, args ...any) {
	p.l.Error(fmt.Sprintf(format, args...), "component", "pebble")
}
func (p *pebbleLogger) Fatalf(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	p.l.Error(msg, "component", "pebble", "fatal", true)
	if p.opening() || iteratorInvariant(msg) {
		panic(msg) // openRecover recovers it; an iterator bug panics its caller
	}
	p.ix.fail(newFatalError(msg, args))
	p.park()
}

// fatalError is the failure a Fatalf records: its message, wrapping the
// errors among Fatalf's arguments, so that the engine's ErrFailed still
// says what the disk reported (errors.Is(err, syscall.ENOSPC) on a full
// disk).
type fatalError struct {
	msg    string
	causes []error
}

func newFatalError(msg string, args []any) *fatalError {
	e := &fatalError{msg: msg}
	for _, a := range args {
		if err, ok := a.(error); ok {
			e.causes = append(e.causes, err)
		}
	}
	return e
}

func (e *fatalError) Error() string   { return "pebble fatal error: " + e.msg }
func (e *fatalError) Unwrap() []error { return e.causes }

// opening says whether this is the opener goroutine while pebble.Open runs.
func (p *pebbleLogger) opening() bool {
	return !p.opened.Load() && goroutineID() == p.opener.Load()
}

// fatalDirSync handles a failed directory fsync in Marker.Move (see
// dirSyncFS): on the opener while Open runs it returns (Move panics with
// the error, and openRecover recovers it); elsewhere it stops the index and
// parks, as Fatalf does.
func (p *pebbleLogger) fatalDirSync(dir string, err error) {
	p.l.Error("index: fsync of Pebble's directory failed while moving a marker", "dir", dir, "error", err, "component", "pebble", "fatal", true)
	if p.opening() {
		return
	}
	p.ix.fail(fmt.Errorf("pebble: fsync of directory %s failed: %w", dir, err))
	p.park()
}

// park blocks the calling Pebble goroutine for good.
func (p *pebbleLogger) park() {
	// Pebble must not go on: after a MANIFEST write or sync that failed it
	// would delete the tables the (possibly durable) MANIFEST record names,
	// leaving an index that cannot be opened. Park this goroutine instead,
	// holding what it holds: the index has stopped, the engine is failed,
	// and Close gives Pebble a bounded time. The files on disk stay as a
	// crash would leave them, which Open recovers.
	select {}
}

// goroutineID is the current goroutine's id, read from its stack header
// ("goroutine 123 [..."); only the fatal path uses it.
func goroutineID() int64 {
	var buf [64]byte
	b := buf[:runtime.Stack(buf[:], false)]
	b = bytes.TrimPrefix(b, []byte("goroutine "))
	var id int64
	for _, c := range b {
		if c < '0' || c > '9' {
			break
		}
		id = id*10 + int64(c-'0')
	}
	return id
}

// iteratorInvariant says whether a fatal message is one of Pebble's
// iterator invariant checks: a bug met on the caller's goroutine, which
// panics there as Pebble intends (parking it would hang the caller).
func iteratorInvariant(msg string) bool {
	for _, p := range []string{"pebble: invariant violation", "pebble: prefix violation", "levelIter", "mergingIter"} {
		if strings.HasPrefix(msg, p) {
			return true
		}
	}
	return false
}

// dirSyncFS hands Pebble directory handles whose failed fsync, when Pebble
// moves one of its markers (atomicfs.Marker.Move: the marker naming the
// current MANIFEST, or the format version), stops the index the way
// pebbleLogger.Fatalf does instead of panicking. Marker.Move panics on a
// failed directory fsync ("fsync errors are unrecoverable", pebble v2.1.7,
// vfs/atomicfs/marker.go); on a flush or compaction goroutine that panic
// cannot be recovered and took the host process down (found by the index
// fault sweep). Moving the MANIFEST marker is part of a MANIFEST update,
// whose every other failure Pebble reports through Fatalf, so the same
// handling applies: on the opener goroutine while Open runs the error is
// returned (Move then panics, and openRecover turns that into Open's
// error); on any other goroutine the failure is recorded (ErrBackground)
// and the goroutine parks for good, before Pebble acts on a marker whose
// move may not be durable.
//
// Pebble's other directory fsyncs (after creating an sstable, the OPTIONS
// file or a WAL file) return their error to the flush, compaction, ingest
// or Open that made them, which already fail; they are left alone.
type dirSyncFS struct {
	vfs.FS
	log *pebbleLogger
}

// Unwrap returns the wrapped FS.
func (fs dirSyncFS) Unwrap() vfs.FS { return fs.FS }

func (fs dirSyncFS) OpenDir(name string) (vfs.File, error) {
	f, err := fs.FS.OpenDir(name)
	if err != nil {
		return nil, err
	}
	return &dirSyncFile{File: f, name: name, log: fs.log}, nil
}

type dirSyncFile struct {
	vfs.File
	name string
	log  *pebbleLogger
}

func (f *dirSyncFile) Sync() error {
	err := f.File.Sync()
	if err != nil && calledFromMarkerMove() {
		f.log.fatalDirSync(f.name, err)
	}
	return err
}

// markerMove is the function whose failed directory fsync panics.
const markerMove = "github.com/cockroachdb/pebble/v2/vfs/atomicfs.(*Marker).Move"

// calledFromMarkerMove says whether Sync's caller is Marker.Move (only
// asked on a failed fsync). If a Pebble upgrade renames or moves it,
// TestOpenReturnsAfterFatalOnPebbleGoroutine's directory fsync case fails
// with Pebble's panic.
func calledFromMarkerMove() bool {
	var pcs [4]uintptr
	n := runtime.Callers(3, pcs[:]) // skip Callers, this function, Sync
	frames := runtime.CallersFrames(pcs[:n])
	for {
		fr, more := frames.Next()
		if fr.Function == markerMove {
			return true
		}
		if !more {
			return false
		}
	}
}
