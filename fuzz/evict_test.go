package fuzz

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/internal/testclock"
	"github.com/idemdb/idem/internal/vfstest"
)

// TestMaxEntriesEvictionCrash covers what FuzzCrashRecovery leaves out:
// Options.MaxEntries, whose evictions happen in the background and make
// the set of kept replies uncertain for the oldest entries. Ids are
// committed one per second (so commit time orders them), some acked; a
// crash image is taken at every fsync. Each image, recovered, must hold:
// only exact replies; no acked id; among the ids committed before the
// image, kept ones form a newest-first run (eviction never drops a newer
// reply and keeps an older one); and after a Compact no more than
// MaxEntries replies.
func TestMaxEntriesEvictionCrash(t *testing.T) {
	const maxEntries, ids = 20, 120
	type image struct {
		fs        *vfs.MemFS
		committed int // ids 0..committed-1 were committed before the image
		acked     map[int]bool
		acking    int // an Ack in progress: that id may or may not be gone
	}
	var (
		mu        sync.Mutex
		images    []image
		committed int
		acked     = map[int]bool{}
		acking    = -1
	)
	mem := vfs.NewCrashableMem()
	rng := rand.New(rand.NewPCG(3, 4))
	hfs := &vfstest.SyncHookFS{FS: mem}
	syncs := 0
	hfs.Hook = func() {
		mu.Lock()
		defer mu.Unlock()
		if syncs++; syncs%2 == 0 || len(images) >= 200 {
			return
		}
		cfg := vfs.CrashCloneCfg{}
		if len(images)%2 == 1 {
			cfg = vfs.CrashCloneCfg{UnsyncedDataPercent: 50, RNG: rand.New(rand.NewPCG(uint64(len(images)), 5))}
		}
		ackedCopy := map[int]bool{}
		for k := range acked {
			ackedCopy[k] = true
		}
		images = append(images, image{mem.CrashClone(cfg), committed, ackedCopy, acking})
	}
	clk := testclock.New()
	opts := func(fs vfs.FS) *idem.Options {
		return &idem.Options{FS: fs, Clock: clk.Now, MaxEntries: maxEntries, SegmentSize: 4 << 10,
			CleanupInterval: time.Hour, CompactInterval: time.Hour}
	}
	e, err := idem.Open(dbDir, opts(hfs))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	reply := func(i int) []byte { return []byte(fmt.Sprint("evict-reply-", i)) }
	idOf := func(i int) []byte { return []byte(fmt.Sprint("ev-", i)) }
	for i := 0; i < ids; i++ {
		clk.Advance(time.Second)
		if _, err := e.Do(ctx, idem.Request{ID: idOf(i)}, func(context.Context) ([]byte, error) { return reply(i), nil }); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		committed = i + 1
		mu.Unlock()
		if i > 5 && rng.IntN(6) == 0 {
			a := i - 1 - rng.IntN(5)
			mu.Lock()
			acking = a
			mu.Unlock()
			if err := e.Ack(ctx, "", idOf(a)); err != nil {
				t.Fatal(err)
			}
			mu.Lock()
			acked[a], acking = true, -1
			mu.Unlock()
		}
		if i%40 == 39 {
			if _, err := e.Compact(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	imgs := images
	mu.Unlock()
	check := func(n int, img image, e *idem.Engine, after string) {
		kept := map[int]bool{}
		for i := 0; i < ids; i++ {
			l, err := e.Lookup(context.Background(), idem.Request{Scope: "", ID: idOf(i)})
			if err != nil {
				t.Fatalf("image %d %s: %v", n, after, err)
			}
			switch l.Status {
			case idem.Done:
				if !bytes.Equal(l.Reply, reply(i)) {
					t.Fatalf("image %d %s: id %d reply %q", n, after, i, l.Reply)
				}
				if img.acked[i] {
					t.Fatalf("image %d %s: acked id %d came back", n, after, i)
				}
				if i > img.committed { // at most the one in progress may be there
					t.Fatalf("image %d %s: id %d Done, only %d committed", n, after, i, img.committed)
				}
				kept[i] = true
			case idem.InFlight:
				if i != img.committed {
					t.Fatalf("image %d %s: id %d in flight (committed %d)", n, after, i, img.committed)
				}
			}
		}
		// Newest first: once a committed, unacked id is kept, every newer
		// committed, unacked id is kept too.
		seen := false
		for i := 0; i < img.committed; i++ {
			if img.acked[i] || i == img.acking {
				continue
			}
			if kept[i] {
				seen = true
			} else if seen {
				t.Fatalf("image %d %s: id %d evicted while an older one is kept (kept %v)", n, after, i, kept)
			}
		}
	}
	for n, img := range imgs {
		e, err := idem.Open(dbDir, opts(img.fs))
		if err != nil {
			t.Fatalf("image %d: open: %v", n, err)
		}
		check(n, img, e, "on recovery")
		if _, err := e.Compact(ctx); err != nil {
			t.Fatalf("image %d: compact: %v", n, err)
		}
		check(n, img, e, "after compact")
		if st := e.Stats(); st.Replies > maxEntries {
			t.Fatalf("image %d: %d replies kept after Compact, MaxEntries %d", n, st.Replies, maxEntries)
		}
		e.Close()
	}
	t.Logf("TestMaxEntriesEvictionCrash: %d fsyncs, %d crash images recovered and checked, 0 violations", syncs, len(imgs))
}
