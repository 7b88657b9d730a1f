package idem

import (
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/index"
)

// TestClaimIntoEvictedSlot: a Begin that acks an id of its own shard
// loads the acked id's slot after its own, and that load may evict its own
// slot (clean and empty: the id is new). The claim must then go into the
// key's slot in the table, not into the evicted one that Begin holds, or the
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

// TestNewIDReadsNoIndex: once the key filter is ready, a Begin or a Lookup
// of an id never stored installs or answers it under the shard's lock it
// took to probe the table: no read of the index, which lockSlot otherwise
// makes without the lock (testHookUnlockedRead counts those). A stored id
// whose slot was evicted is still read from the index.
func TestNewIDReadsNoIndex(t *testing.T) {
	e := openMem(t, vfs.NewMem(), &Options{CacheSize: 1}) // every load evicts what it can
	defer e.Close()
	for deadline := time.Now().Add(10 * time.Second); !e.ix.FilterReady(); {
		if time.Now().After(deadline) {
			t.Fatal("the key filter was not built in 10s")
		}
		time.Sleep(time.Millisecond)
	}
	var reads atomic.Int64
	testHookUnlockedRead = func([]byte) { reads.Add(1) }
	defer func() { testHookUnlockedRead = nil }()
	const n = 1000 // about 4 per shard
	for i := range n {
		if l, err := e.Lookup(bg, Request{ID: id(fmt.Sprint("new-", i))}); err != nil || l.Status != Absent {
			t.Fatalf("lookup: %v %v", l.Status, err)
		}
		commitID(t, e, Request{ID: id(fmt.Sprint("new-", i))}, "r")
	}
	if r := reads.Load(); r != 0 {
		t.Fatalf("%d reads of the index for %d new ids (a lookup and a claim each)", r, n)
	}
	// Once they are applied (clean), claims of other new ids evict their
	// slots (a one-byte table keeps only the slot just installed in a
	// shard), so the first ids are read from the index again.
	waitApplied(t, e)
	for i := range n {
		commitID(t, e, Request{ID: id(fmt.Sprint("other-", i))}, "r")
	}
	for i := range n {
		mustBegin(t, e, Request{ID: id(fmt.Sprint("new-", i))}, Done)
	}
	if reads.Load() == 0 {
		t.Fatal("no stored id was read from the index: the hook counts nothing")
	}
}

// TestEvictionKeepsShardsWithinTheirShare: the applier unpins the slots
// of what it applied (unpinSlots, grouped by shard), and eviction then
// finds them. After many requests, all applied, loading stored ids (each
// load runs an eviction pass) brings every shard back to its share of
// CacheSize: no slot of a request was left pinned.
func TestEvictionKeepsShardsWithinTheirShare(t *testing.T) {
	const perShard = 2048
	e := openMem(t, vfs.NewMem(), &Options{CacheSize: perShard * numShards})
	defer e.Close()
	const n = 40 * numShards // about 40 slots of ~200 bytes per shard: 4x its share
	for i := range n {
		r := mustBegin(t, e, Request{ID: id(fmt.Sprint("req-", i))}, Fresh)
		if err := r.Claim.Commit(bg, id("reply")); err != nil {
			t.Fatal(err)
		}
	}
	waitApplied(t, e)
	// The applier unpins a batch's slots after it applied it: wait until
	// no slot is dirty.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		dirty := 0
		for i := range e.shards {
			sh := &e.shards[i]
			sh.mu.Lock()
			for _, sl := range sh.slab {
				if sl != nil && sl.dirty != 0 {
					dirty++
				}
			}
			sh.mu.Unlock()
		}
		if dirty == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d slots still dirty after 10s", dirty)
		}
	}
	// Lookups of stored ids: each one whose slot was evicted loads it,
	// and that load's eviction pass runs on its shard.
	for i := range n {
		if l, err := e.Lookup(bg, Request{ID: id(fmt.Sprint("req-", i))}); err != nil || l.Status != Done {
			t.Fatalf("lookup req-%d: %v %v", i, l.Status, err)
		}
	}
	over := 0
	for i := range e.shards {
		sh := &e.shards[i]
		sh.mu.Lock()
		if sh.bytes > perShard+512 { // its share, plus at most the slot just loaded
			over++
			if over <= 3 {
				t.Errorf("shard %d holds %d bytes in %d slots, its share is %d", i, sh.bytes, sh.n, perShard)
			}
		}
		sh.mu.Unlock()
	}
	if over > 0 {
		t.Fatalf("%d of %d shards over their share", over, numShards)
	}
}

// TestFreshClaimsAreNotShared: Begin takes its claim from a pool before
// the shard's lock and puts it back when the request claims nothing
// (InFlight, Done, an error); a claim handed out is never put back, so no
// two live claims share an object, and each commits its own reply.
func TestFreshClaimsAreNotShared(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	held := map[*Claim]string{}
	for i := range 50 {
		a := fmt.Sprint("a-", i)
		r := mustBegin(t, e, Request{ID: id(a)}, Fresh)
		if other, ok := held[r.Claim]; ok {
			t.Fatalf("%s got the claim object of %s, still in flight", a, other)
		}
		held[r.Claim] = a
		mustBegin(t, e, Request{ID: id(a)}, InFlight) // claims nothing: its claim goes back
		if i > 0 {
			mustBegin(t, e, Request{ID: id("a-0")}, InFlight)
		}
	}
	for c, a := range held {
		if err := c.Commit(bg, id("reply of "+a)); err != nil {
			t.Fatalf("commit %s: %v", a, err)
		}
	}
	for _, a := range held {
		if d := mustBegin(t, e, Request{ID: id(a)}, Done); string(d.Reply) != "reply of "+a {
			t.Fatalf("%s: reply %q", a, d.Reply)
		}
	}
}

// TestShardTable: a shard's table (slab and open-addressing index) agrees
// with a map through random insertions and removals, past several
// doublings and with probe runs that wrap around the index's end, and every
// removal leaves each remaining key findable (backward shift deletion) and
// its position free for the next slot.
func TestShardTable(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(uint64(seed), 0))
	sh := &e.shards[3]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	sh.slab, sh.free, sh.tab, sh.n, sh.evictAt = nil, nil, nil, 0, 0
	model := map[string]*slot{}
	check := func(step int) {
		t.Helper()
		if sh.n != len(model) {
			t.Fatalf("step %d: table holds %d slots, model %d", step, sh.n, len(model))
		}
		if sh.n*8 > len(sh.tab)*7 {
			t.Fatalf("step %d: %d slots in an index of %d", step, sh.n, len(sh.tab))
		}
		for k, want := range model {
			if got := sh.get([]byte(k)); got != want {
				t.Fatalf("step %d: key %q found %p, want %p", step, k, got, want)
			}
		}
		used := 0
		for pos, sl := range sh.slab {
			if sl != nil {
				used++
				if int(sl.pos) != pos || model[sl.key] != sl {
					t.Fatalf("step %d: slab position %d holds key %q at pos %d", step, pos, sl.key, sl.pos)
				}
			}
		}
		if used != sh.n || len(sh.slab)-used != len(sh.free) {
			t.Fatalf("step %d: slab of %d with %d slots and %d free positions", step, len(sh.slab), used, len(sh.free))
		}
	}
	for step := range 4000 {
		key := fmt.Appendf(nil, "k%d", rng.IntN(600))
		if sl := sh.get(key); sl != nil {
			if model[string(key)] != sl {
				t.Fatalf("step %d: key %q found but not in the model", step, key)
			}
			if rng.IntN(3) > 0 {
				sh.remove(sl)
				delete(model, string(key))
			}
		} else {
			if model[string(key)] != nil {
				t.Fatalf("step %d: key %q in the model but not found", step, key)
			}
			_, tag := e.keyTag(key)
			if sh.find(key, tag) != nil {
				t.Fatalf("step %d: lookup of absent %q found a slot", step, key)
			}
			model[string(key)] = e.insertLocked(sh, key, tag, nil, false)
		}
		if step%97 == 0 {
			check(step)
		}
	}
	check(4000)
	for k, sl := range model {
		sh.remove(sl)
		delete(model, k)
	}
	check(4001)
	for i, v := range sh.tab {
		if v != 0 {
			t.Fatalf("index entry %d = %#x once every slot is removed", i, v)
		}
	}
	sh.bytes = 0
}

// TestSlotSize pins what slotSize counts per slot to what the allocator
// hands out: a slot and an index.Entry rounded up to their size classes.
// The slot grew from the 48- to the 80-byte class (its key, tag and
// position moved into it) while the accounting kept counting the old
// sizes; now a field that moves either struct to another class fails
// here until slotBytes or entryBytes follows.
func TestSlotSize(t *testing.T) {
	for _, c := range []struct {
		name    string
		size    uintptr
		counted int64
	}{
		{"slot", unsafe.Sizeof(slot{}), slotBytes},
		{"index.Entry", unsafe.Sizeof(index.Entry{}), entryBytes},
	} {
		if got := sizeClass(c.size); got != c.counted {
			t.Errorf("%s is %d bytes, allocated in the %d-byte size class, but slotSize counts %d", c.name, c.size, got, c.counted)
		}
	}
	key := []byte("a key of 20 bytes...")
	en := &index.Entry{Reply: make([]byte, 100), Fingerprint: make([]byte, 32)}
	if got, want := slotSize(key, nil), int64(20+slotBytes+tableBytesPerSlot); got != want {
		t.Errorf("slotSize of an absent key = %d, want %d", got, want)
	}
	if got, want := slotSize(key, en), int64(20+slotBytes+tableBytesPerSlot+entryBytes+132); got != want {
		t.Errorf("slotSize of an entry = %d, want %d", got, want)
	}
}

// sizeClass is the size of the block that Go's allocator gives an object
// of n bytes, up to 256 (runtime/sizeclasses.go).
func sizeClass(n uintptr) int64 {
	for _, c := range []int64{8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256} {
		if int64(n) <= c {
			return c
		}
	}
	return -1 // past this table: add the classes above 256
}

// get is key's slot in sh, or nil; sh's lock is held. Tests put keys into
// shards other than their own: a key's tag does not depend on its shard.
func (sh *shard) get(key []byte) *slot {
	_, tag := sh.e.keyTag(key)
	return sh.find(key, tag)
}

// TestKeyTag: a key's shard and table tag come from one hash (its shard
// index the low bits, its tag the high bits), except that a client's
// older sequence keys, which share the client key's shard, get tags of
// their own: with the client's hash as their tag, a window of 100,000
// kept replies would be one probe run of the table.
func TestKeyTag(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	for _, k := range [][]byte{
		index.EntryKey(nil, "s", index.ModeID, []byte("an-id")),
		index.EntryKey(nil, "s", index.ModeClient, []byte("a-client")),
	} {
		h := index.ShardHash(e.seed, k)
		if sh, tag := e.keyTag(k); sh.idx != int(h%numShards) || tag != uint32(h>>32) {
			t.Fatalf("keyTag(%x) = shard %d tag %x, want %d and %x (ShardHash's)", k, sh.idx, tag, h%numShards, uint32(h>>32))
		}
	}
	client := e.shardOf(index.EntryKey(nil, "s", index.ModeClient, []byte("a-client")))
	tags := map[uint32]bool{}
	const n = 1000
	for seq := range uint64(n) {
		sh, tag := e.keyTag(index.SeqKey(nil, "s", []byte("a-client"), seq+1))
		if sh != client {
			t.Fatalf("sequence key %d in shard %d, its client's in %d", seq+1, sh.idx, client.idx)
		}
		tags[tag] = true
	}
	if len(tags) < n/2 {
		t.Fatalf("%d sequence keys of one client have %d distinct tags", n, len(tags))
	}
}
