package idem

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// tableSlots returns the number of slots in the table and the number
// ever installed.
func tableSlots(e *Engine) (slots int, installs uint64) {
	for i := range e.shards {
		sh := &e.shards[i]
		sh.mu.Lock()
		slots += sh.n
		installs += sh.installs
		sh.mu.Unlock()
	}
	return slots, installs
}

// TestAbsentReadInstallsNoSlot: Lookup, Wait and ClientState of an id or
// client the engine does not hold answer without installing a slot (a
// slot costs a table insert and, past CacheSize, an eviction: the reads
// idemraft's replicas and idemstream's two-phase commit make of every new
// id before putting it), while a read of a stored id that is only in the
// index (evicted) is installed and answered as before.
func TestAbsentReadInstallsNoSlot(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	commitID(t, e, Request{ID: id("stored")}, "reply")
	waitApplied(t, e)
	slots0, installs0 := tableSlots(e)
	for i := range 200 {
		r := Request{ID: id(fmt.Sprint("absent-", i))}
		if l, err := e.Lookup(bg, r); err != nil || l.Status != Absent {
			t.Fatalf("lookup: %v %v", l.Status, err)
		}
		if l, err := e.Wait(bg, r); err != nil || l.Status != Absent {
			t.Fatalf("wait: %v %v", l.Status, err)
		}
		if l, err := e.Lookup(bg, Request{Client: fmt.Sprint("client-", i), Seq: 1}); err != nil || l.Status != Absent || l.Seq != 1 {
			t.Fatalf("lookup client: %+v %v", l, err)
		}
		if seq, err := e.ClientState(bg, "", fmt.Sprint("client-", i)); err != nil || seq != 0 {
			t.Fatalf("client state: %d %v", seq, err)
		}
	}
	if slots, installs := tableSlots(e); slots != slots0 || installs != installs0 {
		t.Fatalf("absent reads installed slots: %d slots (%d before), %d installs (%d before)", slots, slots0, installs, installs0)
	}
	// A stored id whose slot was evicted is read from the index, installed
	// and answered Done.
	evictSlot(e, e.mustKey(t, Request{ID: id("stored")}))
	if l, err := e.Lookup(bg, Request{ID: id("stored")}); err != nil || l.Status != Done || string(l.Reply) != "reply" {
		t.Fatalf("lookup of an evicted id: %v %q %v", l.Status, l.Reply, err)
	}
	if _, installs := tableSlots(e); installs != installs0+1 {
		t.Fatalf("the stored id's read installed %d slots, want 1", installs-installs0)
	}
}

// evictSlot drops key's slot from the table as eviction does (the slot
// must be clean: its changes applied to the index).
func evictSlot(e *Engine, key []byte) {
	sh := e.shardOf(key)
	sh.mu.Lock()
	if sl := sh.get(key); sl != nil {
		sh.remove(sl)
		sl.evicted = true
		sh.gen++
		sh.bytes -= sl.size
	}
	sh.mu.Unlock()
}

// mustKey returns r's index entry key.
func (e *Engine) mustKey(t testing.TB, r Request) []byte {
	t.Helper()
	k, err := e.validate(&r)
	if err != nil {
		t.Fatal(err)
	}
	return k.key
}

// TestAbsentReadLinearizable races Lookup and Wait of ids against callers
// that claim and commit them, in a table of one byte (every install
// evicts the shard's clean slots, so reads keep going to the index
// without the shard's lock, with the hook widening that window). Each
// answer must be linearizable: a read that starts after a commit returned
// is Done with its reply; a read that ends before a claim or a commit
// began never shows it; and one reader's answers about one id never go
// back (Absent, then InFlight, then Done).
func TestAbsentReadLinearizable(t *testing.T) {
	e := openMem(t, vfs.NewMem(), &Options{CacheSize: 1, Lease: time.Hour})
	defer e.Close()
	var hooked atomic.Int64
	testHookUnlockedRead = func([]byte) {
		hooked.Add(1)
		runtime.Gosched()
	}
	defer func() { testHookUnlockedRead = nil }()
	const ids, writers, readers = 400, 2, 4
	// Per id: 1 once its Begin was called, 2 once its Commit was called,
	// 3 once its Commit returned.
	var phase [ids]atomic.Int32
	name := func(i int) []byte { return []byte(fmt.Sprint("id-", i)) }
	var wg, wgW sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		wgW.Add(1)
		go func() {
			defer wg.Done()
			defer wgW.Done()
			for i := w; i < ids; i += writers {
				phase[i].Store(1)
				res, err := e.Begin(bg, Request{ID: name(i)})
				if err != nil || res.Status != Fresh {
					t.Errorf("begin %d: %v %v", i, res.Status, err)
					return
				}
				runtime.Gosched()
				phase[i].Store(2)
				if err := res.Claim.Commit(bg, name(i)); err != nil {
					t.Errorf("commit %d: %v", i, err)
					return
				}
				phase[i].Store(3)
			}
		}()
	}
	// Once the writers are done, more new ids (bounded) while no read
	// went to the index without the lock: their installs evict the
	// writers' slots, which a slow applier can have kept pinned past
	// every install the writers made.
	writersDone := make(chan struct{})
	go func() { wgW.Wait(); close(writersDone) }()
	deadline := time.Now().Add(20 * time.Second)
	var fillers sync.WaitGroup
	fillers.Add(1)
	go func() {
		defer fillers.Done()
		<-writersDone
		for k := 0; hooked.Load() == 0 && time.Now().Before(deadline); k++ {
			id := []byte(fmt.Sprint("filler-", k))
			res, err := e.Begin(bg, Request{ID: id})
			if err != nil || res.Status != Fresh {
				t.Errorf("begin %s: %v %v", id, res.Status, err)
				return
			}
			if err := res.Claim.Commit(bg, id); err != nil {
				t.Errorf("commit %s: %v", id, err)
				return
			}
		}
	}()
	rank := map[Status]int32{Absent: 0, InFlight: 1, Done: 2}
	for r := range readers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(r), 24))
			seen := make([]int32, ids) // highest rank seen per id
			// 5,000 reads, then more (bounded) until one went to the
			// index without the lock: under load the writers can be
			// slow enough that no committed id was evicted yet.
			for n := 0; n < 5000 || (hooked.Load() == 0 && time.Now().Before(deadline)); n++ {
				i := rng.IntN(ids)
				before := phase[i].Load()
				var l Result
				var err error
				if r%2 == 0 || before < 2 {
					l, err = e.Lookup(bg, Request{ID: name(i)})
				} else {
					// The commit is under way: Wait returns once it
					// is done (bounded, so that a lost wakeup fails).
					ctx, cancel := context.WithTimeout(bg, time.Minute)
					l, err = e.Wait(ctx, Request{ID: name(i)})
					cancel()
				}
				after := phase[i].Load()
				if err != nil {
					t.Errorf("read %d: %v", i, err)
					return
				}
				got, ok := rank[l.Status]
				switch {
				case !ok:
					t.Errorf("read %d: status %v", i, l.Status)
				case before == 3 && l.Status != Done:
					t.Errorf("read %d after its commit returned: %v", i, l.Status)
				case l.Status == Done && string(l.Reply) != string(name(i)):
					t.Errorf("read %d: reply %q", i, l.Reply)
				case got > after:
					t.Errorf("read %d: %v before the call that makes it (phase %d)", i, l.Status, after)
				case got < seen[i]:
					t.Errorf("read %d: %v after this reader saw rank %d", i, l.Status, seen[i])
				}
				seen[i] = max(seen[i], got)
			}
		}()
	}
	wg.Wait()
	fillers.Wait()
	if hooked.Load() == 0 {
		t.Fatal("no read went to the index without its lock: the test covers nothing")
	}
}
