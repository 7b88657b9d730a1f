package idem

import (
	"fmt"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestBatchSlotsEvictedByApplier: the slots that a batch's run and
// LookupHint install for the records of its Puts are evicted by the
// applier once it applied those records (installForBatchLocked leaves
// that eviction to it, off the batch's thread): once every record is
// applied, each shard holds no more than its share of CacheSize, and
// every request answers as its batch left it.
func TestBatchSlotsEvictedByApplier(t *testing.T) {
	const share = 4 << 10 // about 20 slots of these requests per shard
	e := openMem(t, vfs.NewMem(), &Options{CacheSize: numShards * share})
	defer e.Close()
	const rounds, per = 40, 512 // 80 requests per shard
	reply := func(i int) string { return fmt.Sprint("reply", i%2) }
	for r := range rounds {
		b := e.NewBatch()
		hints := make([]PutHint, per)
		for i := range per {
			req := Request{ID: fmt.Appendf(nil, "r%d-%d", r, i)}
			if i%2 == 0 {
				b.Put(req, []byte(reply(i)))
				continue
			}
			res, err := e.LookupHint(bg, req, &hints[i])
			if err != nil || res.Status != Absent {
				t.Fatalf("round %d: LookupHint of item %d: %v %v, want absent", r, i, res.Status, err)
			}
			hints[i].Put(b, []byte(reply(i)))
		}
		out, err := b.Run(bg)
		if err != nil {
			t.Fatal(err)
		}
		for i, o := range out {
			if o.Err != nil || o.Result.Status != Fresh {
				t.Fatalf("round %d item %d: %v %v, want fresh", r, i, o.Result.Status, o.Err)
			}
		}
	}
	waitUnpinned(t, e)
	over := 0
	for i := range e.shards {
		sh := &e.shards[i]
		sh.mu.Lock()
		bytes, n := sh.bytes, sh.n
		sh.mu.Unlock()
		if bytes > share {
			if over++; over <= 3 {
				t.Errorf("shard %d holds %d bytes in %d slots once every record is applied, past its share of %d", i, bytes, n, share)
			}
		}
	}
	if over > 0 {
		t.Fatalf("%d of %d shards past their share of CacheSize", over, numShards)
	}
	for r := range rounds {
		for i := range per {
			res, err := e.Lookup(bg, Request{ID: fmt.Appendf(nil, "r%d-%d", r, i)})
			if err != nil || res.Status != Done || string(res.Reply) != reply(i) {
				t.Fatalf("Lookup of round %d item %d: %v %q %v, want done %q", r, i, res.Status, res.Reply, err, reply(i))
			}
		}
	}
}
