package idem

import (
	"fmt"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestEvictLockedSparesPinnedSlots: evictLocked, which loads its
// candidates in runs before deciding on them, drops only clean slots that
// nobody waits on, never an in-flight one nor the slot it keeps; it looks
// at no more than evictScan slots per pass, stops once the shard is at its
// target, and keeps the shard's accounting (bytes, gen, evicted) true.
func TestEvictLockedSparesPinnedSlots(t *testing.T) {
	const share = 16 << 10
	e := openMem(t, vfs.NewMem(), &Options{CacheSize: numShards * share})
	defer e.Close()
	target := int64(share - share/8)
	for _, tc := range []struct {
		name  string
		n     int
		clean func(i int) bool // else pinned by i%4: dirty, waited on, in flight (3: left clean)
	}{
		{"all clean", 300, func(int) bool { return true }},
		{"one in three clean", 300, func(i int) bool { return i%3 == 0 }},
		{"none clean", 300, func(int) bool { return false }},
		{"few slots", 5, func(i int) bool { return i != 2 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sh := &e.shards[7]
			sh.mu.Lock()
			defer sh.mu.Unlock()
			sh.slab, sh.free, sh.tab, sh.n, sh.evictAt = nil, nil, nil, 0, 0
			sh.bytes, sh.gen = 0, 0
			slots := make([]*slot, tc.n)
			for i := range slots {
				key := fmt.Appendf(nil, "key-%04d", i)
				_, tag := e.keyTag(key)
				sl := e.insertLocked(sh, key, tag, nil, false)
				sl.size = 2 * share / int64(tc.n) // the shard at twice its share
				if tc.n < 10 {
					sl.size = share / 2 // each slot alone is a quarter of what must go
				}
				if !tc.clean(i) {
					switch i % 4 {
					case 0:
						sl.dirty = 9
					case 1:
						sl.waiters = make(chan struct{})
					case 2:
						sl.inFlight = true
					}
				}
				slots[i] = sl
			}
			var keep *slot
			if tc.clean(tc.n - 1) {
				keep = slots[tc.n-1]
			}
			bytes := int64(0)
			for _, sl := range slots {
				bytes += sl.size
			}
			sh.bytes = bytes
			e.evictLocked(sh, keep)
			gone, left := 0, int64(0)
			for i, sl := range slots {
				in := sh.get(fmt.Appendf(nil, "key-%04d", i)) != nil
				if in == sl.evicted {
					t.Fatalf("slot %d: in the table %v, evicted %v", i, in, sl.evicted)
				}
				if !sl.evicted {
					left += sl.size
					continue
				}
				gone++
				if !tc.clean(i) && i%4 != 3 || sl == keep {
					t.Fatalf("slot %d evicted though pinned (dirty %d, waiters %v, in flight %v, kept %v)", i, sl.dirty, sl.waiters != nil, sl.inFlight, sl == keep)
				}
			}
			if sh.bytes != left || sh.gen != uint64(gone) {
				t.Fatalf("shard accounts %d bytes and %d evictions; its slots hold %d bytes, %d were evicted", sh.bytes, sh.gen, left, gone)
			}
			if gone > evictScan {
				t.Fatalf("%d slots evicted in one pass, which looks at %d", gone, evictScan)
			}
			if gone > 0 && sh.bytes+slots[0].size <= target {
				t.Fatalf("evicted down to %d bytes, past the target %d by more than a slot", sh.bytes, target)
			}
			evictable := 0
			for i := range slots {
				if (tc.clean(i) || i%4 == 3) && slots[i] != keep {
					evictable++
				}
			}
			if evictable == len(slots) && sh.bytes > target {
				t.Fatalf("every slot evictable, yet the shard holds %d bytes after a pass, over its target %d", sh.bytes, target)
			}
		})
	}
}
