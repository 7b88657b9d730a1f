package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"unsafe"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestCommitReplySizes: a committed reply of every size around the sizes
// that newCommitEntry allocates with its entry (entryWithRoom's rooms, 8
// to 264 bytes; longer ones apart) reads back whole, in the table and after a reopen,
// and a reply handed out has no spare capacity shared with the next
// reader's: appending to one never changes another.
func TestCommitReplySizes(t *testing.T) {
	fs := vfs.NewMem()
	e := openMem(t, fs, nil)
	ctx := context.Background()
	sizes := []int{0, 1, 8, 9, 24, 25, 40, 41, 56, 57, 63, 64, 65, 72, 73, 104, 105, 127, 128, 129, 136, 137, 200, 201, 255, 256, 257, 264, 265, 1000}
	want := func(n int) []byte { return bytes.Repeat([]byte{byte('a' + n%26)}, n) }
	for _, n := range sizes {
		id := []byte(fmt.Sprintf("r%d", n))
		res, err := e.Begin(ctx, Request{ID: id})
		if err != nil || res.Status != Fresh {
			t.Fatalf("begin %d: %v %v", n, res.Status, err)
		}
		buf := want(n)
		if err := res.Claim.Commit(ctx, buf); err != nil {
			t.Fatalf("commit %d: %v", n, err)
		}
		for i := range buf {
			buf[i] = 'X' // the caller's buffer is its own again
		}
	}
	// A batch's Put stores its reply the same way (batchRun.finishOp),
	// with its fingerprint when the two fit together.
	b := e.NewBatch()
	putSizes := []int{1, 40, 232, 233, 264, 265, 300}
	for _, n := range putSizes {
		b.Put(Request{ID: []byte(fmt.Sprintf("p%d", n)), Fingerprint: putFP(n)}, want(n))
	}
	if _, err := b.Run(ctx); err != nil {
		t.Fatal(err)
	}
	check := func(when string, e *Engine) {
		t.Helper()
		ids := map[string]int{}
		for _, n := range putSizes {
			ids[fmt.Sprintf("p%d", n)] = n
		}
		for _, n := range sizes {
			ids[fmt.Sprintf("r%d", n)] = n
		}
		for sid, n := range ids {
			id := []byte(sid)
			r1, err := e.Begin(ctx, Request{ID: id})
			if err != nil || r1.Status != Done || !bytes.Equal(r1.Reply, want(n)) {
				t.Fatalf("%s: reply of %d bytes: %v %q %v", when, n, r1.Status, r1.Reply, err)
			}
			r2, err := e.Lookup(ctx, Request{ID: id})
			if err != nil || !bytes.Equal(r2.Reply, want(n)) {
				t.Fatalf("%s: lookup of %d bytes: %q %v", when, n, r2.Reply, err)
			}
			a := append(r1.Reply, '1')
			b := append(r2.Reply, '2')
			if a[n] != '1' || b[n] != '2' {
				t.Fatalf("%s: %s, reply of %d bytes: two readers' appends share memory (%q, %q)", when, sid, n, a[n], b[n])
			}
		}
	}
	checkFP := func(when string, e *Engine) {
		t.Helper()
		for _, n := range putSizes {
			id := []byte(fmt.Sprintf("p%d", n))
			if r, err := e.Begin(ctx, Request{ID: id, Fingerprint: putFP(n)}); err != nil || r.Status != Done || !bytes.Equal(r.Reply, want(n)) {
				t.Fatalf("%s: put of %d bytes, same fingerprint: %v %v", when, n, r.Status, err)
			}
			if _, err := e.Begin(ctx, Request{ID: id, Fingerprint: putFP(n + 1)}); !errors.Is(err, ErrConflict) {
				t.Fatalf("%s: put of %d bytes, another fingerprint: %v, want ErrConflict", when, n, err)
			}
		}
	}
	check("live", e)
	checkFP("live", e)
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	e2 := openMem(t, fs, nil)
	check("reopened", e2)
	checkFP("reopened", e2)
}

// putFP is a 32-byte fingerprint that differs for every n.
func putFP(n int) []byte {
	fp := bytes.Repeat([]byte{byte(n)}, 32)
	fp[0] = byte(n >> 8)
	return fp
}

// TestEntryRoomSizeClasses: every object entryWithRoom allocates is
// exactly one of the allocator's size classes (runtime.MemStats.BySize),
// so that the room it gives is all the memory the object takes; an
// index.Entry that changes size fails it until the rooms follow.
func TestEntryRoomSizeClasses(t *testing.T) {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	classes := map[uint32]bool{}
	for _, c := range ms.BySize {
		classes[c.Size] = true
	}
	for _, c := range []struct {
		room int
		size uintptr
	}{
		{8, unsafe.Sizeof(entryRoom8{})},
		{24, unsafe.Sizeof(entryRoom24{})},
		{40, unsafe.Sizeof(entryRoom40{})},
		{56, unsafe.Sizeof(entryRoom56{})},
		{72, unsafe.Sizeof(entryRoom72{})},
		{104, unsafe.Sizeof(entryRoom104{})},
		{136, unsafe.Sizeof(entryRoom136{})},
		{200, unsafe.Sizeof(entryRoom200{})},
		{maxEntryRoom, unsafe.Sizeof(entryRoom264{})},
	} {
		if !classes[uint32(c.size)] {
			t.Errorf("an entry with %d bytes of room is %d bytes, not a size class", c.room, c.size)
		}
		if _, room := entryWithRoom(c.room); len(room) != c.room {
			t.Errorf("entryWithRoom(%d) gave %d bytes of room", c.room, len(room))
		}
		if _, room := entryWithRoom(c.room + 1); len(room) <= c.room && c.room < maxEntryRoom {
			t.Errorf("entryWithRoom(%d) gave %d bytes of room", c.room+1, len(room))
		}
	}
}
