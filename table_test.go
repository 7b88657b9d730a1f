package idem

import (
	"fmt"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/index"
)

// TestClaimIntoEvictedSlot: a Begin that acks an id of its own shard
// loads the acked id's slot after its own, and that load may evict its own
// slot (clean and empty: the id is new). The claim must then go into the
// key's slot in the map, not into the evicted one that Begin holds, or the
// claim is invisible and the id can be claimed twice.
func TestClaimIntoEvictedSlot(t *testing.T) {
	e := openMem(t, vfs.NewMem(), &Options{CacheSize: 1}) // every load evicts what it can
	defer e.Close()
	k := id("request")
	shard := e.shardIdx(index.EntryKey(nil, "", index.ModeID, k))
	var ack []byte
	for n := 0; ack == nil; n++ {
		if a := id(fmt.Sprint("acked-", n)); e.shardIdx(index.EntryKey(nil, "", index.ModeID, a)) == shard {
			ack = a
		}
	}
	first := mustBegin(t, e, Request{ID: k, Acked: [][]byte{ack}}, Fresh)
	mustBegin(t, e, Request{ID: k}, InFlight)
	if err := first.Claim.Commit(bg, id("reply")); err != nil {
		t.Fatal(err)
	}
	if d := mustBegin(t, e, Request{ID: k}, Done); string(d.Reply) != "reply" {
		t.Fatalf("reply %q", d.Reply)
	}
}
