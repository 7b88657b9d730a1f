package fuzz

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/idemdb/idem"
)

type enospc struct{ op string }

func (e *enospc) Error() string { return e.op + ": no space left on device" }
func (e *enospc) Unwrap() error { return syscall.ENOSPC }

// writeOp reports whether op can need disk space.
func writeOp(k errorfs.OpKind) bool {
	switch k {
	case errorfs.OpCreate, errorfs.OpLink, errorfs.OpRename, errorfs.OpReuseForWrite, errorfs.OpMkdirAll,
		errorfs.OpFilePreallocate, errorfs.OpFileWrite, errorfs.OpFileWriteAt, errorfs.OpFileSync,
		errorfs.OpFileSyncData, errorfs.OpFileSyncTo, errorfs.OpFileFlush:
		return true
	}
	return false
}

// TestDiskFull fills the disk (every operation that can need space fails
// with ENOSPC) under the WAL, the index, the snapshots, or all of them,
// while requests run; then Compact and Close must return within a bound,
// requests fail with an error wrapping ENOSPC, and once space is back a
// reopen on the underlying filesystem has every acknowledged reply.
//
// Under the index, Pebble reports the failure in the background (and
// retries a failed flush for as long as the disk is full): the index stops
// (ErrBackground) and bounds every wait on Pebble, so the engine stops with
// ErrFailed instead of hanging or panicking. When a MANIFEST write failed,
// Pebble is parked and keeps its lock, so the reopen is of a crash image
// (what a new process finds).
func TestDiskFull(t *testing.T) {
	for _, where := range []string{"/wal/", "/index/", "/snapshot/", "/"} {
		name := strings.Trim(where, "/") + "-full"
		if name == "-full" {
			name = "all-full"
		}
		t.Run(name, func(t *testing.T) {
			mem := vfs.NewCrashableMem()
			var full atomic.Bool
			var injected atomic.Int64
			fs := errorfs.Wrap(mem, errorfs.InjectorFunc(func(op errorfs.Op) error {
				if full.Load() && writeOp(op.Kind) && strings.Contains(op.Path, where) {
					injected.Add(1)
					return &enospc{fmt.Sprintf("%v %s", op.Kind, op.Path)}
				}
				return nil
			}))
			opts := func(fs vfs.FS) *idem.Options {
				return &idem.Options{FS: fs, SegmentSize: 64 << 10, IndexIngestBytes: 64 << 10, KeepSnapshots: 1}
			}
			e, err := idem.Open(dbDir, opts(fs))
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			acked := map[string]string{}
			do := func(i int) error {
				id := fmt.Sprintf("req-%05d", i)
				reply := strings.Repeat("r", 100) + id
				_, err := e.Do(ctx, idem.Request{ID: []byte(id)}, func(context.Context) ([]byte, error) { return []byte(reply), nil })
				if err == nil {
					acked[id] = reply
				}
				return err
			}
			for i := 0; i < 300; i++ {
				if err := do(i); err != nil {
					t.Fatal(err)
				}
			}
			full.Store(true)
			var reqErr error
			for i := 300; i < 3000 && reqErr == nil; i++ {
				reqErr = do(i)
			}
			t.Logf("after the disk filled: %d acknowledged, request error: %v", len(acked), reqErr)
			bounded := func(what string, f func() error) error {
				done := make(chan error, 1)
				go func() { done <- f() }()
				select {
				case err := <-done:
					return err
				case <-time.After(20 * time.Second):
					t.Fatalf("%s did not return within 20s on a full disk", what)
					return nil
				}
			}
			cerr := bounded("Compact", func() error { _, err := e.Compact(ctx); return err })
			t.Logf("Compact: %v", cerr)
			if where == "/wal/" && (!errors.Is(reqErr, syscall.ENOSPC) || !errors.Is(reqErr, idem.ErrFailed) || !strings.Contains(reqErr.Error(), ".wal")) {
				t.Errorf("request error %v: want ErrFailed wrapping ENOSPC and naming the segment", reqErr)
			}
			if reqErr != nil && !errors.Is(reqErr, syscall.ENOSPC) {
				t.Errorf("request error %v does not wrap ENOSPC", reqErr)
			}
			clerr := bounded("Close", e.Close)
			t.Logf("Close: %v (%d operations failed with ENOSPC)", clerr, injected.Load())

			full.Store(false)
			e, err = idem.Open(dbDir, opts(mem))
			if errors.Is(err, idem.ErrLocked) && where != "/wal/" && where != "/snapshot/" {
				// A MANIFEST write failed: Pebble parked itself and keeps
				// its directory lock in this process (docs/design.md,
				// durability contract). A new process finds the files as
				// a crash leaves them: check that instead.
				t.Logf("reopen in this process: %v; reopening a crash image", err)
				e, err = idem.Open(dbDir, opts(mem.CrashClone(vfs.CrashCloneCfg{})))
			}
			if err != nil {
				t.Fatalf("reopen after space came back: %v", err)
			}
			defer e.Close()
			for id, reply := range acked {
				res, err := e.Begin(ctx, idem.Request{ID: []byte(id)})
				if err != nil || res.Status != idem.Done || string(res.Reply) != reply {
					t.Fatalf("%s after reopen: %v %v %q", id, res.Status, err, res.Reply)
				}
			}
		})
	}
}
