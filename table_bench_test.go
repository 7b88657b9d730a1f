package idem

import (
	"fmt"
	"runtime"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/internal/cputime"
)

// BenchmarkTableSlot measures the in-memory table alone: lockSlot of keys
// that no index holds (the key filter answers at once), so each op is a
// shard probe and an insertion, and, with the table full, an eviction;
// "hit" locks keys that already have slots (64Ki, cycled). One thread, no WAL record,
// so its run-cpu-ns/op (the thread's CPU) is the table's own cost, not the machine's noise.
func BenchmarkTableSlot(b *testing.B) {
	for _, tc := range []struct {
		name  string
		cache int64
		hit   bool
	}{
		{"insert-evict", 4 << 20, false},
		{"insert-noevict", 1 << 30, false},
		{"hit", 1 << 30, true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			e := openMem(b, vfs.NewMem(), &Options{CacheSize: tc.cache, Sync: SyncNever})
			defer e.Close()
			n := b.N // every insertion is of a new key
			if tc.hit {
				n = min(b.N, 1<<16)
			}
			keys := make([][]byte, n)
			for i := range keys {
				keys[i] = index.EntryKey(nil, "", index.ModeID, fmt.Appendf(nil, "bench-table-%09d", i))
			}
			if tc.hit {
				for _, k := range keys {
					_, unlock, err := e.lockSlot(k)
					if err != nil {
						b.Fatal(err)
					}
					unlock()
				}
			}
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			b.ResetTimer()
			tcpu0 := cputime.Thread()
			for i := range b.N {
				k := keys[i%len(keys)]
				_, unlock, err := e.lockSlot(k)
				if err != nil {
					b.Fatal(err)
				}
				unlock()
			}
			b.ReportMetric(float64((cputime.Thread()-tcpu0).Nanoseconds())/float64(b.N), "run-cpu-ns/op")
		})
	}
}
