package wal

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/idemdb/idem/internal/vfstest"
)

// countingFS counts the bytes read from segment files through it.
type countingFS struct {
	vfs.FS
	read atomic.Int64
}

type countingFile struct {
	vfs.File
	fs *countingFS
}

func (fs *countingFS) Open(name string, opts ...vfs.OpenOption) (vfs.File, error) {
	f, err := fs.FS.Open(name, opts...)
	if err != nil || !strings.HasSuffix(name, segmentSuffix) {
		return f, err
	}
	return &countingFile{File: f, fs: fs}, nil
}

func (fs *countingFS) OpenReadWrite(name string, c vfs.DiskWriteCategory, opts ...vfs.OpenOption) (vfs.File, error) {
	f, err := fs.FS.OpenReadWrite(name, c, opts...)
	if err != nil || !strings.HasSuffix(name, segmentSuffix) {
		return f, err
	}
	return &countingFile{File: f, fs: fs}, nil
}

func (f *countingFile) Read(p []byte) (int, error) {
	n, err := f.File.Read(p)
	f.fs.read.Add(int64(n))
	return n, err
}

func (f *countingFile) ReadAt(p []byte, off int64) (int, error) {
	n, err := f.File.ReadAt(p, off)
	f.fs.read.Add(int64(n))
	return n, err
}

// TestReopenReadsOnlyUnapplied: Open with after = the last LSN reads almost
// nothing after a clean Close (headers and the frame the close hint names),
// and after a crash only the segment holding after+1 onwards; records after
// after are still delivered, and the log continues correctly.
func TestReopenReadsOnlyUnapplied(t *testing.T) {
	mem := vfs.NewCrashableMem()
	cfs := &countingFS{FS: mem}
	o := testOptions(cfs)
	o.SegmentSize = 64 << 10
	w, _ := mustOpen(t, o, 0, nil)
	appendWait(t, w, 3000, 10)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	segs := segmentNames(t, mem, testDir)
	if len(segs) < 8 {
		t.Fatalf("only %d segments", len(segs))
	}
	var total int64
	for _, s := range segs {
		st, err := mem.Stat(mem.PathJoin(testDir, s))
		if err != nil {
			t.Fatal(err)
		}
		total += st.Size()
	}

	// Clean reopen, everything applied.
	cfs.read.Store(0)
	var recs []gotRecord
	w, res := mustOpen(t, o, 3000, collect(&recs))
	if got := cfs.read.Load(); got > 8<<10 {
		t.Fatalf("clean reopen read %d of %d segment bytes (%+v)", got, total, res)
	}
	if len(recs) != 0 || res.LastLSN != 3000 || res.SkippedBytes < total/2 {
		t.Fatalf("clean reopen: %d records, last %d, skipped %d of %d", len(recs), res.LastLSN, res.SkippedBytes, total)
	}
	appendWait(t, w, 50, 10)
	// Crash (no Close, so no hint): the index applied up to 3000.
	crashed := mem.CrashClone(vfs.CrashCloneCfg{})
	_ = w.Close()
	cfs2 := &countingFS{FS: crashed}
	o.FS = cfs2
	w, res = mustOpen(t, o, 3000, collect(&recs))
	checkRecs(t, recs, 3001, 3050)
	lastSegs := res.Segments[len(res.Segments)-2:]
	if got, bound := cfs2.read.Load(), lastSegs[0].Allocated+lastSegs[1].Allocated+8<<10; got > bound {
		t.Fatalf("reopen after a crash read %d bytes; the segments that can hold LSN 3001.. are %d bytes", got, bound)
	}
	appendWait(t, w, 10, 5)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	// Everything is still there, checked frame by frame.
	all, sres := scanAll(t, crashed, testDir)
	checkRecs(t, all, 1, 3060)
	if sres.TornTail != nil {
		t.Fatalf("torn tail %+v", sres.TornTail)
	}
	// after = 0 reads everything, as before.
	recs = recs[:0]
	w, _ = mustOpen(t, o, 0, collect(&recs))
	checkRecs(t, recs, 1, 3060)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestCloseHintNeverStale: a hint left by Close is removed (durably) by the
// next Open, so records appended after it survive a crash; a damaged or
// mismatched hint only makes Open read the segment.
func TestCloseHintNeverStale(t *testing.T) {
	mem := vfs.NewCrashableMem()
	o := testOptions(mem)
	o.SegmentSize = 1 << 20
	w, _ := mustOpen(t, o, 0, nil)
	appendWait(t, w, 100, 10)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	hintPath := mem.PathJoin(testDir, hintName)
	if _, err := mem.Stat(hintPath); err != nil {
		t.Fatalf("no close hint after Close: %v", err)
	}
	w, _ = mustOpen(t, o, 100, nil)
	if _, err := mem.Stat(hintPath); err == nil {
		t.Fatal("the close hint survived Open")
	}
	appendWait(t, w, 20, 5)
	crashed := mem.CrashClone(vfs.CrashCloneCfg{})
	_ = w.Close()
	o.FS = crashed
	var recs []gotRecord
	w, _ = mustOpen(t, o, 100, collect(&recs))
	checkRecs(t, recs, 101, 120)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}

	for _, damage := range []struct {
		name string
		fn   func(b []byte) []byte
	}{
		{"torn", func(b []byte) []byte { return b[:20] }},
		{"bad crc", func(b []byte) []byte { b[30] ^= 1; return b }},
		{"wrong last frame offset", func(b []byte) []byte {
			h := decodeHint(b)
			h.lastOff -= 8
			return h.encode()
		}},
		{"end beyond the frames", func(b []byte) []byte {
			h := decodeHint(b)
			h.end += 64
			return h.encode()
		}},
		{"other segment", func(b []byte) []byte {
			h := decodeHint(b)
			h.first = 99
			h.segment = segmentName(99)
			return h.encode()
		}},
	} {
		t.Run(damage.name, func(t *testing.T) {
			fs := vfs.NewMem()
			if err := fs.MkdirAll(testDir, 0o755); err != nil {
				t.Fatal(err)
			}
			for _, n := range listDir(t, crashed, testDir) {
				vfstest.WriteFile(t, fs, fs.PathJoin(testDir, n), vfstest.ReadFile(t, crashed, crashed.PathJoin(testDir, n)))
			}
			b := vfstest.ReadFile(t, fs, fs.PathJoin(testDir, hintName))
			vfstest.WriteFile(t, fs, fs.PathJoin(testDir, hintName), damage.fn(b))
			o := testOptions(fs)
			o.SegmentSize = 1 << 20
			var recs []gotRecord
			w, res := mustOpen(t, o, 50, collect(&recs))
			checkRecs(t, recs, 51, 120)
			if res.LastLSN != 120 {
				t.Fatalf("last LSN %d", res.LastLSN)
			}
			appendWait(t, w, 5, 5)
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
			all, _ := scanAll(t, fs, testDir)
			checkRecs(t, all, 1, 125)
		})
	}
}

// TestVersion1SegmentsAreRead: segments written in the version 1 format
// (frames without the synced LSN) are read; Open never appends to one.
func TestVersion1SegmentsAreRead(t *testing.T) {
	v1seg := func(first LSN, n int) []byte {
		b := encodeSegmentHeaderVersion(first, segmentVersion1)
		for lsn := first; lsn < first+LSN(n); lsn++ {
			p := payloadFor(lsn)
			fr := make([]byte, frameSizeHdr(frameHeaderSizeV1, len(p)))
			putFrameV1(fr, lsn, kindFor(lsn), p)
			b = append(b, fr...)
		}
		return append(b, make([]byte, 3000)...) // preallocated zeros
	}
	for _, tc := range []struct {
		name string
		segs map[LSN]int // first LSN -> records
		last LSN
	}{
		{"two segments", map[LSN]int{1: 30, 31: 12}, 42},
		{"empty last segment", map[LSN]int{1: 30, 31: 0}, 30},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := vfs.NewMem()
			if err := fs.MkdirAll(testDir, 0o755); err != nil {
				t.Fatal(err)
			}
			for first, n := range tc.segs {
				vfstest.WriteFile(t, fs, fs.PathJoin(testDir, segmentName(first)), v1seg(first, n))
			}
			all, res := scanAll(t, fs, testDir)
			checkRecs(t, all, 1, tc.last)
			if res.TornTail != nil {
				t.Fatalf("torn tail %+v", res.TornTail)
			}
			o := testOptions(fs)
			o.SegmentSize = 1 << 20
			var recs []gotRecord
			w, _ := mustOpen(t, o, 0, collect(&recs))
			checkRecs(t, recs, 1, tc.last)
			appendWait(t, w, 10, 5)
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
			all, res = scanAll(t, fs, testDir)
			checkRecs(t, all, 1, tc.last+10)
			if res.TornTail != nil {
				t.Fatalf("torn tail %+v", res.TornTail)
			}
			// The new records are in a version 2 segment.
			lastSeg := res.Segments[len(res.Segments)-1]
			hdr := vfstest.ReadFile(t, fs, fs.PathJoin(testDir, lastSeg.Name))[:segmentHeaderSize]
			if _, v, bad := decodeSegmentHeader(hdr); bad != "" || v != segmentVersion || lastSeg.FirstLSN > tc.last+1 {
				t.Fatalf("last segment %+v: version %d %s", lastSeg, v, bad)
			}
			if tc.segs[31] > 0 && lastSeg.FirstLSN != tc.last+1 {
				t.Fatalf("records appended to the version 1 segment: %+v", res.Segments)
			}
		})
	}
}

// TestOpenOnSmallDisk: the first segment's preallocation does not fit on
// the disk: Open falls back to a growing segment (logged), leaves no spare
// file behind, and the log works until the disk is really full.
func TestOpenOnSmallDisk(t *testing.T) {
	mem := vfs.NewMem()
	var written atomic.Int64
	const capacity = 256 << 10 // "free space"
	fs := errorfs.Wrap(mem, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if op.Kind == errorfs.OpFileWrite || op.Kind == errorfs.OpFileWriteAt {
			// Writes are charged before they happen; the injector only
			// sees the kind, so count chunks of the zero fill.
			if strings.HasSuffix(op.Path, preallocSuffix) && written.Add(zeroChunkSize) > capacity {
				return &noSpaceErr{op.Path}
			}
		}
		return nil
	}))
	var logs strings.Builder
	var logMu sync.Mutex
	o := testOptions(fs)
	o.SegmentSize = 4 << 20
	o.Logger = newTestLogger(&logs, &logMu)
	w, _ := mustOpen(t, o, 0, nil)
	appendWait(t, w, 200, 20)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	logMu.Lock()
	if !strings.Contains(logs.String(), "no space to preallocate") {
		t.Errorf("fallback not logged: %s", logs.String())
	}
	logMu.Unlock()
	for _, n := range listDir(t, mem, testDir) {
		st, err := mem.Stat(mem.PathJoin(testDir, n))
		if err != nil {
			t.Fatal(err)
		}
		if st.Size() > 1<<20 {
			t.Errorf("%s is %d bytes: a preallocation was left behind", n, st.Size())
		}
	}
	all, _ := scanAll(t, mem, testDir)
	checkRecs(t, all, 1, 200)
}

type noSpaceErr struct{ path string }

func (e *noSpaceErr) Error() string { return "write " + e.path + ": no space left on device" }
func (e *noSpaceErr) Unwrap() error { return syscall.ENOSPC }

// TestDiskFullWhileWriting: ENOSPC on every write path of the WAL (frame
// writes, syncs, segment creation and preallocation at rotation): requests
// fail with ErrFailed naming the file and ENOSPC, Close returns, and a
// reopen on the underlying filesystem has every acknowledged record.
func TestDiskFullWhileWriting(t *testing.T) {
	kinds := map[string]errorfs.OpKind{"WriteAt": errorfs.OpFileWriteAt, "Write": errorfs.OpFileWrite,
		"SyncData": errorfs.OpFileSyncData, "Sync": errorfs.OpFileSync, "Create": errorfs.OpCreate, "Rename": errorfs.OpRename}
	for name, kind := range kinds {
		t.Run(name, func(t *testing.T) {
			mem := vfs.NewCrashableMem()
			var full atomic.Bool
			fs := errorfs.Wrap(mem, errorfs.InjectorFunc(func(op errorfs.Op) error {
				if full.Load() && op.Kind == kind {
					return &noSpaceErr{op.Path}
				}
				return nil
			}))
			o := testOptions(fs)
			o.SegmentSize = 16 << 10
			w, _ := mustOpen(t, o, 0, nil)
			appendWait(t, w, 100, 10)
			acked := w.SyncedLSN()
			full.Store(true)
			// Keep appending (rotations included) until the WAL fails.
			var failErr error
			for i := 0; i < 5000 && failErr == nil; i++ {
				lsn, err := w.Append(kindFor(w.LastLSN()+1), payloadFor(w.LastLSN()+1), nil)
				if err == nil {
					err = w.WaitDurable(lsn)
					if err == nil {
						acked = lsn
					}
				}
				failErr = err
			}
			if kind == errorfs.OpFileWrite {
				// Write is only used to zero-fill spare files: their
				// preallocation falls back to none, and the log goes on.
				if failErr != nil {
					t.Fatalf("a failed preallocation failed the log: %v", failErr)
				}
				if err := w.Close(); err != nil {
					t.Fatal(err)
				}
				all, _ := scanAll(t, mem, testDir)
				checkRecs(t, all, 1, acked)
				return
			}
			if !errors.Is(failErr, ErrFailed) || !errors.Is(failErr, syscall.ENOSPC) {
				t.Fatalf("error %v: want ErrFailed wrapping ENOSPC", failErr)
			}
			if !strings.Contains(failErr.Error(), ".wal") && !strings.Contains(failErr.Error(), preallocName) {
				t.Errorf("error %q does not name the file", failErr)
			}
			if err := w.Close(); !errors.Is(err, ErrFailed) {
				t.Fatalf("Close: %v", err)
			}
			// Space freed: reopen on the underlying filesystem (as it is
			// after a machine crash, too).
			for _, m := range []*vfs.MemFS{mem, mem.CrashClone(vfs.CrashCloneCfg{})} {
				o := testOptions(m)
				o.SegmentSize = 16 << 10
				var recs []gotRecord
				w, _ := mustOpen(t, o, 0, collect(&recs))
				if len(recs) < int(acked) {
					t.Fatalf("reopen has %d records, %d were acknowledged", len(recs), acked)
				}
				checkRecs(t, recs[:acked], 1, acked)
				appendWait(t, w, 10, 5)
				if err := w.Close(); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// lockedWriter serialises writes to a strings.Builder.
type lockedWriter struct {
	b  *strings.Builder
	mu *sync.Mutex
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func newTestLogger(b *strings.Builder, mu *sync.Mutex) *slog.Logger {
	return slog.New(slog.NewTextHandler(lockedWriter{b, mu}, nil))
}

// smallDiskFS reports little free space.
type smallDiskFS struct {
	vfs.FS
	avail uint64
}

func (fs smallDiskFS) GetDiskUsage(string) (vfs.DiskUsage, error) {
	return vfs.DiskUsage{AvailBytes: fs.avail, TotalBytes: 40 << 20}, nil
}

// TestNoPreallocationWhenSpaceIsShort: with less than two segments of free
// space, segments are not preallocated at all (zero-filling to ENOSPC
// would fill the disk for everyone else), and the log works.
func TestNoPreallocationWhenSpaceIsShort(t *testing.T) {
	mem := vfs.NewMem()
	var logs strings.Builder
	var logMu sync.Mutex
	o := testOptions(smallDiskFS{FS: mem, avail: 40 << 20})
	o.SegmentSize = 32 << 20
	o.Logger = newTestLogger(&logs, &logMu)
	w, _ := mustOpen(t, o, 0, nil)
	appendWait(t, w, 100, 10)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	for _, n := range listDir(t, mem, testDir) {
		st, err := mem.Stat(mem.PathJoin(testDir, n))
		if err != nil {
			t.Fatal(err)
		}
		if st.Size() > 1<<20 {
			t.Errorf("%s is %d bytes on a disk with 40 MiB free", n, st.Size())
		}
	}
	logMu.Lock()
	if !strings.Contains(logs.String(), "little free space") {
		t.Errorf("not logged: %s", logs.String())
	}
	logMu.Unlock()
	all, _ := scanAll(t, mem, testDir)
	checkRecs(t, all, 1, 100)
}

// TestReopenAfterCrashStartsNearApplied: after a crash (no close hint),
// Open enters the segment holding after+1 at the last position hint at or
// below it, so it reads the WAL written since after (plus at most one hint
// interval), not the segment from its start; the records are all there,
// and a damaged position file only makes Open read more.
func TestReopenAfterCrashStartsNearApplied(t *testing.T) {
	mem := vfs.NewCrashableMem()
	o := testOptions(mem)
	o.SegmentSize = 4 << 20
	w, _ := mustOpen(t, o, 0, nil)
	appendWait(t, w, 20000, 50)
	// The hints that the last fsyncs recorded are written by a goroutine
	// of their own: wait for it (on a loaded machine it may still be
	// writing, and the image would then hold older hints only).
	w.pos.wg.Wait()
	crashed := mem.CrashClone(vfs.CrashCloneCfg{})
	_ = w.Close()
	const after = 19000
	var offAfter, end int64
	if _, err := Scan(crashed, testDir, 0, 0, func(r Record) error {
		if r.LSN == after+1 {
			offAfter = r.Offset
		}
		end = r.Offset + int64(frameSize(len(r.Payload)))
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if offAfter < 2<<20 {
		t.Fatalf("LSN %d at offset %d: the test needs it deep in the segment", after+1, offAfter)
	}
	for _, damaged := range []bool{false, true} {
		fs := vfs.NewMem()
		if err := fs.MkdirAll(testDir, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, n := range listDir(t, crashed, testDir) {
			vfstest.WriteFile(t, fs, fs.PathJoin(testDir, n), vfstest.ReadFile(t, crashed, crashed.PathJoin(testDir, n)))
		}
		if damaged {
			vfstest.WriteFile(t, fs, fs.PathJoin(testDir, positionsName), []byte("IDEMWPOS garbage"))
		}
		cfs := &countingFS{FS: fs}
		o := testOptions(cfs)
		o.SegmentSize = 4 << 20
		var recs []gotRecord
		w, res := mustOpen(t, o, after, collect(&recs))
		checkRecs(t, recs, after+1, 20000)
		got := cfs.read.Load()
		size := res.Segments[len(res.Segments)-1].Allocated
		bound := size - offAfter + o.SegmentSize/16 + 64<<10
		t.Logf("damaged %v: read %d bytes (LSN %d at offset %d, frames end at %d, file %d)", damaged, got, after+1, offAfter, end, size)
		if !damaged && got > bound {
			t.Fatalf("read %d bytes, want at most %d", got, bound)
		}
		if damaged && got < size-segmentHeaderSize {
			t.Fatalf("read only %d bytes without position hints", got)
		}
		appendWait(t, w, 10, 5)
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		all, _ := scanAll(t, fs, testDir)
		checkRecs(t, all, 1, 20010)
	}
}

// TestLostRegionProvedByALaterFrame: the first valid frame after a hole may
// have been appended while the flush before it was in flight (its synced
// LSN proves nothing); a later frame that does prove the hole was fsynced
// still makes it corruption. Without such a frame it is a torn tail.
func TestLostRegionProvedByALaterFrame(t *testing.T) {
	build := func(lastSynced LSN) []byte {
		b := encodeSegmentHeader(1)
		add := func(lsn, synced LSN) {
			p := payloadFor(lsn)
			fr := make([]byte, frameSize(len(p)))
			putFrame(fr, lsn, synced, kindFor(lsn), p)
			b = append(b, fr...)
		}
		for lsn := LSN(1); lsn <= 10; lsn++ {
			add(lsn, lsn-1) // each fsynced before the next
		}
		// LSN 11..14: the hole (zeroed below). 15 was appended while
		// 11..14 were being fsynced (synced 10); 16 after (lastSynced).
		holeFrom := len(b)
		for lsn := LSN(11); lsn <= 14; lsn++ {
			add(lsn, 10)
		}
		b = append(b, make([]byte, (sectorSize-len(b)%sectorSize)+sectorSize)...) // a whole zero sector
		clear(b[holeFrom:])
		add(15, 10)
		add(16, lastSynced)
		return append(b, make([]byte, 2048)...)
	}
	for _, tc := range []struct {
		lastSynced LSN
		corrupt    bool
	}{{14, true}, {11, true}, {10, false}} {
		t.Run(fmt.Sprint(tc.lastSynced), func(t *testing.T) {
			fs := vfs.NewMem()
			if err := fs.MkdirAll(testDir, 0o755); err != nil {
				t.Fatal(err)
			}
			vfstest.WriteFile(t, fs, fs.PathJoin(testDir, segmentName(1)), build(tc.lastSynced))
			var recs []gotRecord
			res, err := Scan(fs, testDir, 0, 0, collect(&recs))
			var ce *CorruptError
			if tc.corrupt {
				if !errors.As(err, &ce) || !strings.Contains(ce.Reason, "fsynced records were lost") {
					t.Fatalf("Scan: %v, want a CorruptError about lost fsynced records", err)
				}
				return
			}
			if err != nil || res.TornTail == nil || res.LastLSN != 10 {
				t.Fatalf("Scan: %v, torn tail %+v, last %d: want a torn tail after LSN 10", err, res.TornTail, res.LastLSN)
			}
			checkRecs(t, recs, 1, 10)
		})
	}
}
