package index

import (
	"strings"
	"sync"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// Pebble reads and writes an sstable one block at a time: a compaction
// reads its inputs with one pread per data block (about 4 KiB, or less
// compressed) and writes its output with one write per block (through a
// 4 KiB bufio.Writer, which a full block passes straight through), and so
// does the index's own ingest writer. Those calls were about a tenth of
// index.BenchmarkApplyFresh's CPU on the development machine (a virtual
// machine, where a system call costs several microseconds: 128 MiB
// written 4 KiB at a time took 240 ms of CPU against 45-55 ms 256 KiB at
// a time, and read back 4 KiB at a time 125-155 ms against 10-12 ms).
// ioBufFS puts a larger buffer under both, for the files that are read
// and written sequentially only:
//
//   - sstables being written (Create of a name ending in ".sst": Pebble's
//     flushes and compactions, and the index's ingests, which write their
//     tables through the same wrapper, see writeSSTs): writes collect in
//     a buffer of ioBufSize bytes handed to the file when full, and
//     before anything else that touches the file (Sync, SyncTo,
//     SyncData, Stat, ReadAt, WriteAt, Close). Nothing is durable before
//     its Sync either way, and Pebble syncs every table before it refers
//     to it; a write's error comes back from the write that flushes it
//     or from the Sync or Close after it, and is sticky.
//   - sstables opened for sequential reading (Open with
//     vfs.SequentialReadsOption: a compaction's inputs, which Pebble reads
//     block by block from the start): a ReadAt outside what the buffer
//     holds reads ioBufSize bytes from there, and the blocks after it are
//     copied from the buffer. An sstable never changes once written, so
//     what the buffer holds stays true.
//
// The bytes on disk are the same: only the size of the calls changes.
// Lookups open no file sequentially and are not affected. Each buffer is
// ioBufSize bytes while its file is open (one per sstable being written, one
// per compaction input being read: a compaction of L0 into the base level
// reads one table per L0 sublevel and one of the base level at a time),
// taken from a pool.
type ioBufFS struct {
	vfs.FS
}

// ioBufSize is the size of ioBufFS's buffers.
const ioBufSize = 256 << 10

var ioBufPool = sync.Pool{New: func() any { b := make([]byte, ioBufSize); return &b }}

// Unwrap returns the wrapped FS.
func (fs ioBufFS) Unwrap() vfs.FS { return fs.FS }

func (fs ioBufFS) Create(name string, category vfs.DiskWriteCategory) (vfs.File, error) {
	f, err := fs.FS.Create(name, category)
	if err != nil || !strings.HasSuffix(name, ".sst") {
		return f, err
	}
	return newBufWriteFile(f), nil
}

func (fs ioBufFS) Open(name string, opts ...vfs.OpenOption) (vfs.File, error) {
	f, err := fs.FS.Open(name, opts...)
	if err != nil || !strings.HasSuffix(name, ".sst") {
		return f, err
	}
	for _, o := range opts {
		if o == vfs.SequentialReadsOption {
			return &bufReadFile{File: f}, nil
		}
	}
	return f, nil
}

// bufWriteFile is a file being written whose writes are buffered (ioBufFS).
type bufWriteFile struct {
	vfs.File
	mu  sync.Mutex // guards the fields below and the order of the writes
	buf *[]byte    // pending bytes: (*buf)[:n]; nil once closed
	n   int
	err error // the first failed write: every later call returns it
}

func newBufWriteFile(f vfs.File) *bufWriteFile {
	return &bufWriteFile{File: f, buf: ioBufPool.Get().(*[]byte)}
}

// flushLocked hands the buffered bytes to the file.
func (f *bufWriteFile) flushLocked() error {
	if f.err == nil && f.n > 0 {
		if _, err := f.File.Write((*f.buf)[:f.n]); err != nil {
			f.err = err
		}
		f.n = 0
	}
	return f.err
}

func (f *bufWriteFile) Write(p []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return 0, f.err
	}
	if f.n+len(p) > ioBufSize {
		if err := f.flushLocked(); err != nil {
			return 0, err
		}
		if len(p) >= ioBufSize {
			if _, err := f.File.Write(p); err != nil {
				f.err = err
				return 0, err
			}
			return len(p), nil
		}
	}
	f.n += copy((*f.buf)[f.n:], p)
	return len(p), nil
}

// flushed runs op after the buffered bytes reached the file.
func (f *bufWriteFile) flushed(op func() error) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.flushLocked(); err != nil {
		return err
	}
	return op()
}

func (f *bufWriteFile) Sync() error     { return f.flushed(f.File.Sync) }
func (f *bufWriteFile) SyncData() error { return f.flushed(f.File.SyncData) }

func (f *bufWriteFile) SyncTo(length int64) (fullSync bool, err error) {
	err = f.flushed(func() error {
		var err error
		fullSync, err = f.File.SyncTo(length)
		return err
	})
	return fullSync, err
}

func (f *bufWriteFile) Stat() (fi vfs.FileInfo, err error) {
	err = f.flushed(func() error {
		var err error
		fi, err = f.File.Stat()
		return err
	})
	return fi, err
}

func (f *bufWriteFile) ReadAt(p []byte, off int64) (n int, err error) {
	err = f.flushed(func() error {
		var err error
		n, err = f.File.ReadAt(p, off)
		return err
	})
	return n, err
}

func (f *bufWriteFile) WriteAt(p []byte, off int64) (n int, err error) {
	err = f.flushed(func() error {
		var err error
		n, err = f.File.WriteAt(p, off)
		return err
	})
	return n, err
}

func (f *bufWriteFile) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.buf == nil {
		return f.File.Close()
	}
	err := f.flushLocked()
	ioBufPool.Put(f.buf)
	f.buf = nil
	if cerr := f.File.Close(); err == nil {
		err = cerr
	}
	return err
}

// bufReadFile is an sstable opened for sequential reading whose reads are
// served from a buffer of ioBufSize bytes read ahead (ioBufFS).
type bufReadFile struct {
	vfs.File
	mu  sync.Mutex // guards the fields below
	buf *[]byte    // the file's bytes [off, off+n); nil before the first read and once closed
	off int64
	n   int
}

func (f *bufReadFile) ReadAt(p []byte, off int64) (int, error) {
	if len(p) > ioBufSize/2 {
		return f.File.ReadAt(p, off)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.buf != nil && off >= f.off && off+int64(len(p)) <= f.off+int64(f.n) {
		return copy(p, (*f.buf)[off-f.off:]), nil
	}
	if f.buf == nil {
		f.buf = ioBufPool.Get().(*[]byte)
	}
	// Fill from off. Near the end of the file the fill is short (io.EOF):
	// it served p if it covered p; if not, p passes the end of the file
	// (or the read failed), and p gets what the file gave and its error,
	// as a read of p alone would have.
	n, err := f.File.ReadAt(*f.buf, off)
	n = max(n, 0)
	f.off, f.n = off, n
	if n >= len(p) {
		return copy(p, (*f.buf)[:len(p)]), nil
	}
	return copy(p, (*f.buf)[:n]), err
}

func (f *bufReadFile) Close() error {
	f.mu.Lock()
	if f.buf != nil {
		ioBufPool.Put(f.buf)
		f.buf = nil
	}
	f.n = 0
	f.mu.Unlock()
	return f.File.Close()
}
