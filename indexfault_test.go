package idem

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
)

// TestIndexDiskFullStopsEngineNotProcess: writes and syncs under the index
// directory fail with ENOSPC (Pebble's MANIFEST writes, flushes and
// compactions, and the engine's ingests) while requests go on. Pebble's
// background failures used to panic the host process (its Fatalf); now the
// engine stops with ErrFailed, Compact and Close return within a bound, and
// a restart (a crash image of the disk: what a new process finds, since a
// parked Pebble keeps its directory lock in this one) recovers every
// acknowledged reply.
func TestIndexDiskFullStopsEngineNotProcess(t *testing.T) {
	for _, c := range []struct {
		name  string
		match func(path string) bool
	}{
		{"every index file", func(p string) bool { return strings.Contains(p, "index") }},
		{"MANIFEST only", func(p string) bool { return strings.Contains(p, "MANIFEST") }},
		{"Pebble's tables, not the ingests", func(p string) bool {
			return strings.Contains(p, "index") && !strings.Contains(p, "ingest") && strings.HasSuffix(p, ".sst")
		}},
	} {
		t.Run(c.name, func(t *testing.T) { testIndexDiskFull(t, c.match) })
	}
}

func testIndexDiskFull(t *testing.T, match func(string) bool) {
	mem := vfs.NewCrashableMem()
	var full atomic.Bool
	inj := errorfs.InjectorFunc(func(op errorfs.Op) error {
		if full.Load() && match(op.Path) && op.Kind.ReadOrWrite() == errorfs.OpIsWrite {
			return fmt.Errorf("%w: %s", syscall.ENOSPC, op.Path)
		}
		return nil
	})
	e := openMem(t, errorfs.Wrap(mem, inj), &Options{IndexIngestBytes: 64 << 10})
	acked := map[string]bool{}
	for i := range 200 {
		k := fmt.Sprint("before-", i)
		commitID(t, e, Request{ID: []byte(k)}, k)
		acked[k] = true
	}
	full.Store(true)
	var firstErr error
	for i := 0; i < 20000 && firstErr == nil; i++ {
		k := fmt.Sprint("during-", i)
		_, err := e.Do(bg, Request{ID: []byte(k)}, func(context.Context) ([]byte, error) { return []byte(k), nil })
		if err != nil {
			firstErr = err
			break
		}
		acked[k] = true
		if i%500 == 499 {
			if _, err := e.Compact(bg); err != nil {
				firstErr = err
			}
		}
	}
	if !errors.Is(firstErr, ErrFailed) {
		t.Fatalf("with a full index disk: %v (want ErrFailed)", firstErr)
	}
	t.Logf("engine stopped after %d acknowledged requests: %v", len(acked), firstErr)
	start := time.Now()
	if _, err := e.Compact(bg); !errors.Is(err, ErrFailed) {
		t.Fatalf("compact on a stopped engine: %v", err)
	}
	_ = e.Close()
	if d := time.Since(start); d > 30*time.Second {
		t.Fatalf("Compact and Close took %v", d)
	}
	full.Store(false)
	e = openMem(t, mem.CrashClone(vfs.CrashCloneCfg{}), nil)
	defer e.Close()
	for k := range acked {
		l, err := e.Lookup(context.Background(), Request{Scope: "", ID: []byte(k)})
		if err != nil || l.Status != Done || string(l.Reply) != k {
			t.Fatalf("%s after reopen: %v %q %v", k, l.Status, l.Reply, err)
		}
	}
}
