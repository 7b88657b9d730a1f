package fuzz

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/internal/vfstest"
	"github.com/idemdb/idem/wal"
)

// TestLostSyncedRegionIsNotATornTail: a disk that drops a region of fsynced
// WAL frames and keeps the frames fsynced after it. Every reply was
// acknowledged (SyncAlways), so the zeroed region held durable records:
// Open must refuse with ErrCorrupt naming the segment and the offset, not
// cut the region and every later record as a torn tail. A torn tail of
// frames that were never fsynced is still cut.
func TestLostSyncedRegionIsNotATornTail(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	mem := vfs.NewCrashableMem()
	opts := &idem.Options{FS: mem, SegmentSize: 1 << 20}
	e, err := idem.Open(dbDir, opts)
	if err != nil {
		t.Fatal(err)
	}
	const n = 200
	for i := 0; i < n; i++ {
		id := []byte(fmt.Sprintf("req-%03d", i))
		if _, err := e.Do(ctx, idem.Request{ID: id}, func(context.Context) ([]byte, error) {
			return []byte("reply-" + string(id)), nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	// A machine crash: every fsynced byte survives; the index has applied
	// nothing durable yet, so Open replays the whole WAL.
	img := mem.CrashClone(vfs.CrashCloneCfg{})
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	segs := walSegments(t, img)
	if len(segs) != 1 {
		t.Fatalf("segments %v", segs)
	}
	orig := vfstest.ReadFile(t, img, segs[0])
	end := walValidEnd(orig)
	if end < 16<<10 {
		t.Fatalf("only %d bytes of frames", end)
	}

	// Frame offsets, from a scan of the intact image.
	var offs []int64
	if _, err := wal.Scan(img, dbDir+"/wal", 0, 0, func(r wal.Record) error {
		offs = append(offs, r.Offset)
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	// Zero 4 KiB of fsynced frames in the middle: the records after it
	// were written after those frames were fsynced, and say so.
	holeFrom := offs[len(offs)/3]
	lost := vfs.NewCrashableMem()
	copyTree(t, img, lost, dbDir)
	b := append([]byte(nil), orig...)
	clear(b[holeFrom : holeFrom+4096])
	vfstest.WriteFile(t, lost, segs[0], bytes.Clone(b)) // Write may scramble its input (race builds)
	_, err = idem.Open(dbDir, &idem.Options{FS: lost, SegmentSize: 1 << 20})
	var ce *wal.CorruptError
	if !errors.Is(err, idem.ErrCorrupt) || !errors.As(err, &ce) {
		t.Fatalf("Open over a lost fsynced region: %v, want ErrCorrupt", err)
	}
	if !strings.HasSuffix(segs[0], ce.Segment) || ce.Offset != holeFrom || !strings.Contains(err.Error(), "fsynced") {
		t.Fatalf("Open: %v; want segment %s offset %d", err, segs[0], holeFrom)
	}
	// Nothing was cut or saved.
	if got := vfstest.ReadFile(t, lost, segs[0]); string(got) != string(b) {
		t.Fatalf("a refused Open changed the segment: %d bytes, was %d; first difference at %d\n%x\n%x", len(got), len(b), firstDiff(got, b), got[:48], b[:48])
	}

	// The same bytes garbled at the end only (the last frames, as an
	// unsynced write would leave them): a torn tail, cut, and Open works.
	torn := vfs.NewCrashableMem()
	copyTree(t, img, torn, dbDir)
	b = append([]byte(nil), orig...)
	last := offs[len(offs)-1]
	for i := last + 8; i < int64(end); i++ {
		b[i] ^= 0x5a
	}
	vfstest.WriteFile(t, torn, segs[0], bytes.Clone(b))
	e, err = idem.Open(dbDir, &idem.Options{FS: torn, SegmentSize: 1 << 20})
	if err != nil {
		t.Fatalf("Open with a torn last frame: %v", err)
	}
	if st := e.Stats(); st.TornTailsCut != 1 {
		t.Errorf("TornTailsCut %d, want 1", st.TornTailsCut)
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
}

func walSegments(t *testing.T, fs vfs.FS) []string {
	t.Helper()
	names, err := fs.List(dbDir + "/wal")
	if err != nil {
		t.Fatal(err)
	}
	var segs []string
	for _, n := range names {
		if _, ok := wal.ParseSegmentName(n); ok {
			segs = append(segs, dbDir+"/wal/"+n)
		}
	}
	return segs
}

// copyTree copies every file under dir from src to dst.
func copyTree(t *testing.T, src, dst vfs.FS, dir string) {
	t.Helper()
	names, err := src.List(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := dst.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		p := src.PathJoin(dir, n)
		st, err := src.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if st.IsDir() {
			copyTree(t, src, dst, p)
			continue
		}
		vfstest.WriteFile(t, dst, p, vfstest.ReadFile(t, src, p))
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}
