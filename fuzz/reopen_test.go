package fuzz

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
)

// walReadFS counts the bytes read from WAL segment files.
type walReadFS struct {
	vfs.FS
	read atomic.Int64
}

type walReadFile struct {
	vfs.File
	n *atomic.Int64
}

func (fs *walReadFS) wrap(name string, f vfs.File, err error) (vfs.File, error) {
	if err != nil || !strings.HasSuffix(name, ".wal") {
		return f, err
	}
	return &walReadFile{File: f, n: &fs.read}, nil
}

func (fs *walReadFS) Open(name string, opts ...vfs.OpenOption) (vfs.File, error) {
	f, err := fs.FS.Open(name, opts...)
	return fs.wrap(name, f, err)
}

func (fs *walReadFS) OpenReadWrite(name string, c vfs.DiskWriteCategory, opts ...vfs.OpenOption) (vfs.File, error) {
	f, err := fs.FS.OpenReadWrite(name, c, opts...)
	return fs.wrap(name, f, err)
}

func (f *walReadFile) Read(p []byte) (int, error) {
	n, err := f.File.Read(p)
	f.n.Add(int64(n))
	return n, err
}

func (f *walReadFile) ReadAt(p []byte, off int64) (int, error) {
	n, err := f.File.ReadAt(p, off)
	f.n.Add(int64(n))
	return n, err
}

// TestReopenReadsNoAppliedWAL: after a clean Close the index has applied
// every record, and Open reads almost nothing of the WAL (segment headers
// and the last frame, through the close hint), however long the retained
// history; the state is all there.
func TestReopenReadsNoAppliedWAL(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	fs := &walReadFS{FS: vfs.NewMem()}
	opts := &idem.Options{FS: fs, SegmentSize: 32 << 10, CompactInterval: time.Hour, CompactWALBytes: -1}
	e, err := idem.Open(dbDir, opts)
	if err != nil {
		t.Fatal(err)
	}
	const n = 2000
	for i := 0; i < n; i++ {
		id := []byte(fmt.Sprintf("req-%05d", i))
		if _, err := e.Do(ctx, idem.Request{ID: id}, func(context.Context) ([]byte, error) { return append([]byte("reply-"), id...), nil }); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	for round := 0; round < 2; round++ {
		fs.read.Store(0)
		e, err = idem.Open(dbDir, opts)
		if err != nil {
			t.Fatal(err)
		}
		st := e.Stats()
		if got := fs.read.Load(); got > 16<<10 || st.WALBytes < 200<<10 {
			t.Fatalf("reopen %d read %d bytes of a %d-byte WAL (%d segments)", round, got, st.WALBytes, st.WALSegments)
		}
		t.Logf("reopen %d: read %d bytes of a %d-byte WAL in %d segments", round, fs.read.Load(), st.WALBytes, st.WALSegments)
		for _, i := range []int{0, n / 2, n - 1} {
			id := []byte(fmt.Sprintf("req-%05d", i))
			res, err := e.Begin(ctx, idem.Request{ID: id})
			if err != nil || res.Status != idem.Done || string(res.Reply) != "reply-"+string(id) {
				t.Fatalf("%s: %v %v %q", id, res.Status, err, res.Reply)
			}
		}
		if err := e.Close(); err != nil {
			t.Fatal(err)
		}
	}
}
