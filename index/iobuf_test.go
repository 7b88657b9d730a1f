package index

import (
	"bytes"
	"crypto/rand"
	"errors"
	mrand "math/rand/v2"
	"strings"
	"sync"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestSSTableIOInLargePieces: the sstables the index ingests and the
// ones Pebble's compactions write reach the file system in pieces of
// ioBufSize, not block by block, and a compaction reads its inputs in
// such pieces too (iobuf.go); and what was written so reads back whole.
// On the old code: "ix/ingest/000001-0.sst: 1135565 bytes in 278
// writes" and "ix/000011.sst: compaction read 3375183 bytes in 858 reads"
// (about 4 KiB each).
func TestSSTableIOInLargePieces(t *testing.T) {
	const sets, per, replyLen = 4, 2000, 512
	fs := &ioCountFS{FS: vfs.NewMem(), files: map[string]*ioCount{}}
	ix, err := Open(Options{FS: fs, Dir: "ix", IngestBytes: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close(false)
	want := ingestSets(t, ix, sets, per, func() []byte {
		reply := make([]byte, replyLen) // incompressible: tables of about 1 MiB
		_, _ = rand.Read(reply)
		return reply
	})
	if err := ix.db.Compact(t.Context(), []byte{0}, []byte{0xff}, false); err != nil {
		t.Fatal(err)
	}
	// Pieces of at least 64 KiB on average (a table's last piece is
	// smaller), where block by block they were about 4 KiB.
	const minPiece = 64 << 10
	written, read := 0, 0
	fs.mu.Lock()
	for name, c := range fs.files {
		if c.writeBytes >= 4*minPiece {
			written++
			if c.writeBytes/c.writes < minPiece {
				t.Errorf("%s: %d bytes in %d writes", name, c.writeBytes, c.writes)
			}
		}
		if c.seqReadBytes >= 4*minPiece {
			read++
			if c.seqReadBytes/c.seqReads < minPiece {
				t.Errorf("%s: compaction read %d bytes in %d reads", name, c.seqReadBytes, c.seqReads)
			}
		}
	}
	fs.mu.Unlock()
	if written < sets+1 || read < sets {
		t.Fatalf("%d large tables written, %d read sequentially: want the %d ingested and the compaction's output, and its inputs", written, read, sets)
	}
	for k, reply := range want {
		e, err := ix.Get([]byte(k))
		if err != nil || e == nil || string(e.Reply) != string(reply) {
			t.Fatalf("Get %x after the compaction: %v, %v", k, e, err)
		}
	}
}

// ioCountFS counts the writes to each sstable and its reads through
// handles opened for sequential reading.
type ioCountFS struct {
	vfs.FS
	mu    sync.Mutex
	files map[string]*ioCount // by name; guarded by mu, as the counts are
}

type ioCount struct {
	writes, writeBytes     int
	seqReads, seqReadBytes int
}

func (fs *ioCountFS) Unwrap() vfs.FS { return fs.FS }

func (fs *ioCountFS) count(name string) *ioCount {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	c := fs.files[name]
	if c == nil {
		c = &ioCount{}
		fs.files[name] = c
	}
	return c
}

func (fs *ioCountFS) Create(name string, cat vfs.DiskWriteCategory) (vfs.File, error) {
	f, err := fs.FS.Create(name, cat)
	if err != nil || !strings.HasSuffix(name, ".sst") {
		return f, err
	}
	return &ioCountFile{File: f, fs: fs, c: fs.count(name)}, nil
}

func (fs *ioCountFS) Open(name string, opts ...vfs.OpenOption) (vfs.File, error) {
	f, err := fs.FS.Open(name, opts...)
	if err != nil || !strings.HasSuffix(name, ".sst") {
		return f, err
	}
	for _, o := range opts {
		if o == vfs.SequentialReadsOption {
			return &ioCountFile{File: f, fs: fs, c: fs.count(name), seq: true}, nil
		}
	}
	return f, nil
}

type ioCountFile struct {
	vfs.File
	fs  *ioCountFS
	c   *ioCount
	seq bool
}

func (f *ioCountFile) Write(p []byte) (int, error) {
	f.fs.mu.Lock()
	f.c.writes++
	f.c.writeBytes += len(p)
	f.fs.mu.Unlock()
	return f.File.Write(p)
}

func (f *ioCountFile) ReadAt(p []byte, off int64) (int, error) {
	n, err := f.File.ReadAt(p, off)
	if f.seq {
		f.fs.mu.Lock()
		f.c.seqReads++
		f.c.seqReadBytes += n
		f.fs.mu.Unlock()
	}
	return n, err
}

// TestIOBufFiles: what goes through ioBufFS's buffers reaches the file
// whole and in order, reads through a sequential handle return what the
// file holds (near its end as the file does: short, with io.EOF), and a
// failed write comes back from the Sync after it and from every call after
// that.
func TestIOBufFiles(t *testing.T) {
	mem := vfs.NewMem()
	fs := ioBufFS{mem}
	rng := mrand.New(mrand.NewPCG(3, 4))
	data := make([]byte, 3*ioBufSize+12345)
	_, _ = rand.Read(data)
	f, err := fs.Create("t.sst", vfs.WriteCategoryUnspecified)
	if err != nil {
		t.Fatal(err)
	}
	for at := 0; at < len(data); {
		n := 1 + rng.IntN(9000)
		if rng.IntN(20) == 0 {
			n = ioBufSize + 1 // larger than the buffer: written through
		}
		n = min(n, len(data)-at)
		// A copy: MemFS overwrites what it was given in invariants
		// builds (-race), as a file may.
		if _, err := f.Write(bytes.Clone(data[at : at+n])); err != nil {
			t.Fatal(err)
		}
		at += n
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	raw, err := mem.Open("t.sst")
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	got := make([]byte, len(data)+1)
	if n, _ := raw.ReadAt(got, 0); n != len(data) || !bytes.Equal(got[:n], data) {
		t.Fatalf("the file holds %d bytes, not the %d written (or other bytes)", n, len(data))
	}

	r, err := fs.Open("t.sst", vfs.SequentialReadsOption)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if _, ok := r.(*bufReadFile); !ok {
		t.Fatalf("a sequential handle is a %T", r)
	}
	for i := range 2000 {
		off := rng.IntN(len(data) + 10)
		if i%3 == 0 && i > 0 { // mostly onwards, as a compaction reads
			off = min(len(data), off/8+i*1500)
		}
		p := make([]byte, 1+rng.IntN(8000))
		n, err := r.ReadAt(p, int64(off))
		want := max(0, min(len(p), len(data)-off))
		if n != want || !bytes.Equal(p[:n], data[off:off+n]) {
			t.Fatalf("ReadAt(%d bytes, %d) = %d bytes (want %d) or other bytes", len(p), off, n, want)
		}
		if (n < len(p)) != (err != nil) {
			t.Fatalf("ReadAt(%d bytes, %d) = %d, %v: an error exactly when short", len(p), off, n, err)
		}
	}

	// A write that fails in the file.
	ff, err := fs.Create("f.sst", vfs.WriteCategoryUnspecified)
	if err != nil {
		t.Fatal(err)
	}
	bf := ff.(*bufWriteFile)
	errDisk := errors.New("disk full")
	bf.File = failingWriteFile{bf.File, errDisk}
	if _, err := bf.Write(data[:100]); err != nil {
		t.Fatalf("a buffered write: %v", err)
	}
	if err := bf.Sync(); !errors.Is(err, errDisk) {
		t.Fatalf("Sync after a failed write = %v, want %v", err, errDisk)
	}
	if _, err := bf.Write(data[:100]); !errors.Is(err, errDisk) {
		t.Fatalf("Write after a failed write = %v, want %v", err, errDisk)
	}
	if err := bf.Close(); !errors.Is(err, errDisk) {
		t.Fatalf("Close after a failed write = %v, want %v", err, errDisk)
	}
}

type failingWriteFile struct {
	vfs.File
	err error
}

func (f failingWriteFile) Write(p []byte) (int, error) { return 0, f.err }
