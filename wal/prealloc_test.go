package wal

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/idemdb/idem/internal/vfstest"
)

// crashPoint names a file-system operation before which the file system is
// crash-cloned: the nth operation of that kind on a path ending with suffix,
// counted from Open (atOpen) or from just after Open.
type crashPoint struct {
	name   string
	kind   errorfs.OpKind
	suffix string
	nth    int
	atOpen bool
}

// crashAt runs a single writer (payloadFor records in batches of batch
// records, each batch waited for in SyncAlways mode) until the crash point
// was reached and a few more batches were appended. It returns the crash
// clone and the SyncedLSN observed right before it was taken (every record
// up to it must survive).
func crashAt(t *testing.T, cp crashPoint, cfg vfs.CrashCloneCfg, segSize int64, batch int) (*vfs.MemFS, LSN) {
	t.Helper()
	mem := vfs.NewCrashableMem()
	var (
		armed   atomic.Bool
		count   atomic.Int32
		wp      atomic.Pointer[WAL]
		cloneMu sync.Mutex
		clone   *vfs.MemFS
		synced  LSN
	)
	fs := errorfs.Wrap(mem, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if !armed.Load() || op.Kind != cp.kind || !strings.HasSuffix(op.Path, cp.suffix) {
			return nil
		}
		if int(count.Add(1)) != cp.nth {
			return nil
		}
		var s LSN
		if w := wp.Load(); w != nil {
			s = w.SyncedLSN() // read before cloning: all of it is in the clone
		}
		c := mem.CrashClone(cfg)
		cloneMu.Lock()
		clone, synced = c, s
		cloneMu.Unlock()
		return nil
	}))
	o := testOptions(fs)
	o.SegmentSize = segSize
	armed.Store(cp.atOpen)
	w, _ := mustOpen(t, o, 0, nil)
	wp.Store(w)
	armed.Store(true)
	taken := func() bool {
		cloneMu.Lock()
		defer cloneMu.Unlock()
		return clone != nil
	}
	deadline := time.Now().Add(10 * time.Second)
	extra := 0
	for extra < 5 {
		if taken() {
			extra++
		}
		if time.Now().After(deadline) {
			t.Fatalf("crash point %s never reached", cp.name)
		}
		appendN(t, w, batch)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return clone, synced
}

// checkCrashRecovery opens a crashed file system written by crashAt: the log
// must be a dense prefix of payloadFor records holding everything synced,
// and it must keep working (appends through two rotations, reopen, repair
// durable).
func checkCrashRecovery(t *testing.T, fs *vfs.MemFS, synced LSN, segSize int64, every int) {
	t.Helper()
	if names, err := fs.List(testDir); err == nil {
		t.Logf("after the crash: %v", names)
	}
	recs, _ := scanAll(t, fs, testDir) // Scan ignores the spare file
	o := testOptions(fs)
	o.SegmentSize = segSize
	var orecs []gotRecord
	w, res := mustOpen(t, o, 0, collect(&orecs))
	last := res.LastLSN
	if last < synced {
		t.Fatalf("recovered up to LSN %d, but LSN %d was synced before the crash", last, synced)
	}
	checkRecs(t, orecs, 1, last)
	if len(recs) < len(orecs) {
		t.Fatalf("Scan found %d records, Open %d", len(recs), len(orecs))
	}
	// Keep going: enough to rotate at least twice (using the spare file the
	// crash may have left behind).
	n := int(2*segSize/150) + 10
	appendWait(t, w, n, every)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	total := last + LSN(n)
	all, res2 := scanAll(t, fs, testDir)
	checkRecs(t, all, 1, total)
	if res2.TornTail != nil || len(res2.Segments) < 3 {
		t.Fatalf("after recovery and appends: %d segments, torn %+v", len(res2.Segments), res2.TornTail)
	}
	// Everything Close synced survives another crash.
	again, _ := scanAll(t, fs.CrashClone(vfs.CrashCloneCfg{}), testDir)
	checkRecs(t, again, 1, total)
}

// TestCrashAroundRotation crashes at every step of starting a segment from
// the spare file, and while the spare file is prepared, keeping only synced
// data (0%) or half of the unsynced blocks and directory entries (50%).
func TestCrashAroundRotation(t *testing.T) {
	const small = 8 << 10
	var points []crashPoint
	for k := 1; k <= 2; k++ {
		points = append(points,
			crashPoint{name: fmt.Sprintf("rotation %d: before the rename", k), kind: errorfs.OpRename, suffix: preallocSuffix, nth: k},
			crashPoint{name: fmt.Sprintf("rotation %d: right after the rename", k), kind: errorfs.OpOpen, suffix: segmentSuffix, nth: k},
			crashPoint{name: fmt.Sprintf("rotation %d: header written, not fsynced", k), kind: errorfs.OpFileSync, suffix: segmentSuffix, nth: k},
			crashPoint{name: fmt.Sprintf("rotation %d: header fsynced, before the directory fsync", k), kind: errorfs.OpOpenDir, suffix: "wal", nth: k},
			crashPoint{name: fmt.Sprintf("spare %d: before its zero-fill", k+1), kind: errorfs.OpFileWrite, suffix: preallocSuffix, nth: k},
			crashPoint{name: fmt.Sprintf("spare %d: zero-filled, before its fsync", k+1), kind: errorfs.OpFileSync, suffix: preallocSuffix, nth: k},
		)
	}
	cfgs := []func() vfs.CrashCloneCfg{func() vfs.CrashCloneCfg { return vfs.CrashCloneCfg{} }}
	for seed := uint64(1); seed <= 4; seed++ {
		cfgs = append(cfgs, func() vfs.CrashCloneCfg {
			return vfs.CrashCloneCfg{UnsyncedDataPercent: 50, RNG: rand.New(rand.NewPCG(seed, 7))}
		})
	}
	for _, cp := range points {
		t.Run(cp.name, func(t *testing.T) {
			for i, cfg := range cfgs {
				t.Run(fmt.Sprintf("cfg%d", i), func(t *testing.T) {
					crashed, synced := crashAt(t, cp, cfg(), small, 1)
					checkCrashRecovery(t, crashed, synced, small, 7)
				})
			}
		})
	}
}

// TestCrashWhileZeroFilling crashes in the middle of zero-filling a spare
// file (segments of several zeroChunkSize chunks): the first one, created by
// Open on an empty directory, and the next one, prepared in the background
// while records are appended.
func TestCrashWhileZeroFilling(t *testing.T) {
	if testing.Short() {
		t.Skip()
	}
	const size = 2*zeroChunkSize + zeroChunkSize/2 // three Write calls
	points := []crashPoint{
		{name: "first segment, second chunk", kind: errorfs.OpFileWrite, suffix: preallocSuffix, nth: 2, atOpen: true},
		{name: "first segment, before its fsync", kind: errorfs.OpFileSync, suffix: preallocSuffix, nth: 1, atOpen: true},
		{name: "background spare, second chunk", kind: errorfs.OpFileWrite, suffix: preallocSuffix, nth: 5, atOpen: true},
		{name: "background spare, third chunk", kind: errorfs.OpFileWrite, suffix: preallocSuffix, nth: 6, atOpen: true},
	}
	for _, cp := range points {
		t.Run(cp.name, func(t *testing.T) {
			for seed := uint64(0); seed <= 3; seed++ {
				cfg := vfs.CrashCloneCfg{}
				if seed > 0 {
					cfg = vfs.CrashCloneCfg{UnsyncedDataPercent: 50, RNG: rand.New(rand.NewPCG(seed, 11))}
				}
				crashed, synced := crashAt(t, cp, cfg, size, 500)
				// Large batches: every fsync of a crashable MemFS copies
				// the whole file.
				checkCrashRecovery(t, crashed, synced, size, 2000)
			}
		})
	}
}

// TestCrashConcurrentPreallocated is TestCrashUnsyncedBlocks with large
// preallocated segments and concurrent appenders: crashes land inside the
// preallocated space (holes are zeros that were already there) rather than
// past the end of the file.
func TestCrashConcurrentPreallocated(t *testing.T) {
	for seed := uint64(1); seed <= 6; seed++ {
		fs := vfs.NewCrashableMem()
		o := testOptions(fs)
		o.SegmentSize = 96 << 10
		cfg := vfs.CrashCloneCfg{}
		if seed%3 != 0 {
			cfg = vfs.CrashCloneCfg{UnsyncedDataPercent: 50, RNG: rand.New(rand.NewPCG(seed, seed))}
		}
		crashed, acked, synced := crashWhileAppending(t, fs, o, cfg, LSN(300*seed))
		o.FS = crashed
		checkRecovered(t, o, acked, synced)
	}
}

// TestSegmentsArePreallocated checks the file layout: every segment file is
// at least SegmentSize bytes, the valid data is followed by zeros, appends
// after a reopen continue at the logical end, and the stats tell logical and
// allocated bytes apart.
func TestSegmentsArePreallocated(t *testing.T) {
	fs := vfs.NewCrashableMem()
	o := testOptions(fs)
	o.SegmentSize = 16 << 10
	w, res := mustOpen(t, o, 0, nil)
	if s := res.Segments[0]; s.Size != segmentHeaderSize || s.Allocated != o.SegmentSize {
		t.Fatalf("new segment: %+v", s)
	}
	// The new segment and its zeros are durable before any record.
	if b := vfstest.ReadFile(t, fs.CrashClone(vfs.CrashCloneCfg{}), fs.PathJoin(testDir, segmentName(1))); int64(len(b)) != o.SegmentSize {
		t.Fatalf("new segment after a crash: %d bytes", len(b))
	}
	appendWait(t, w, 400, 10)
	settle(t, w)
	st := w.Stats()
	segs := w.Segments()
	if len(segs) < 3 {
		t.Fatalf("%d segments", len(segs))
	}
	var bytes, alloc int64
	for i, s := range segs {
		bytes += s.Size
		alloc += s.Allocated
		b := vfstest.ReadFile(t, fs, fs.PathJoin(testDir, s.Name))
		if int64(len(b)) != s.Allocated || s.Allocated < o.SegmentSize || !allZero(b[s.Size:]) {
			t.Fatalf("segment %d %+v: %d bytes", i, s, len(b))
		}
	}
	if st.Bytes != bytes || st.AllocatedBytes != alloc || alloc <= bytes {
		t.Fatalf("stats: Bytes %d AllocatedBytes %d; segments: %d %d", st.Bytes, st.AllocatedBytes, bytes, alloc)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	// The spare file is ready for the next rotation (Close waited for its
	// preparation); it is no segment.
	if b := vfstest.ReadFile(t, fs, fs.PathJoin(testDir, preallocName)); int64(len(b)) != o.SegmentSize || !allZero(b) {
		t.Fatalf("spare file: %d bytes, all zero %v", len(b), allZero(b))
	}
	_, sres := scanAll(t, fs, testDir)
	if !slices.Equal(sres.Segments, segs) {
		t.Fatalf("Scan: %+v\nWAL: %+v", sres.Segments, segs)
	}
	// Reopen: the active segment keeps its zeros; appends overwrite them.
	last := segs[len(segs)-1]
	w, res = mustOpen(t, o, 0, nil)
	if got := res.Segments[len(res.Segments)-1]; got != last {
		t.Fatalf("reopened active segment %+v, was %+v", got, last)
	}
	appendWait(t, w, 5, 5)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	b := vfstest.ReadFile(t, fs, fs.PathJoin(testDir, last.Name))
	if int64(len(b)) != last.Allocated {
		t.Fatalf("active segment grew from %d to %d bytes", last.Allocated, len(b))
	}
	recs, _ := scanAll(t, fs, testDir)
	checkRecs(t, recs, 1, 405)
}

// TestZeroTailInNonLastSegment makes a non-last segment with a zero tail the
// natural way (the segment size shrinks between two runs, so the active
// segment is rotated long before its preallocated space is used), checks
// that it opens, and that zeroing its last frame (records lost, continuity
// broken) is corruption.
func TestZeroTailInNonLastSegment(t *testing.T) {
	fs := vfs.NewMem()
	o := testOptions(fs)
	o.SegmentSize = 64 << 10
	w, _ := mustOpen(t, o, 0, nil)
	appendWait(t, w, 20, 5)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	o.SegmentSize = 4 << 10
	w, _ = mustOpen(t, o, 0, nil)
	appendWait(t, w, 60, 5)
	settle(t, w)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	segs := w.Segments()
	first := segs[0]
	if len(segs) < 2 || first.Allocated != 64<<10 || first.Size >= first.Allocated {
		t.Fatalf("first segment %+v (of %d)", first, len(segs))
	}
	var recs []gotRecord
	w, res := mustOpen(t, o, 0, collect(&recs))
	checkRecs(t, recs, 1, 80)
	if !slices.Equal(res.Segments, segs) || res.TornTail != nil {
		t.Fatalf("%+v", res)
	}
	if st := w.Stats(); st.AllocatedBytes-st.Bytes < 32<<10 {
		t.Fatalf("stats %+v", st)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}

	// Zero the last frame of the first segment: its records are gone, the
	// zeros look like a clean end, but the next segment does not continue
	// the LSN sequence.
	var lastOff int64
	if _, err := Scan(fs, testDir, 0, 0, func(r Record) error {
		if r.Segment == first.Name {
			lastOff = r.Offset
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	f, err := fs.OpenReadWrite(fs.PathJoin(testDir, first.Name), vfs.WriteCategoryUnspecified)
	if err != nil {
		t.Fatal(err)
	}
	if err := zeroRange(f, lastOff, first.Size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	var ce *CorruptError
	if _, err := Scan(fs, testDir, 0, 0, nil); !errors.As(err, &ce) || ce.Segment != first.Name || ce.Offset != lastOff {
		t.Fatalf("Scan: %v; want a CorruptError at %s:%d", err, first.Name, lastOff)
	}
	if _, _, err := Open(o, 0, nil); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Open: %v", err)
	}
}

// TestTornTailInPreallocatedSegment tears the end of a preallocated last
// segment the way a crash does (a partial frame at the logical end, and a
// kept block further on) and checks that Open cuts it by zeroing, keeps the
// file size, and that appends continue correctly, through a rotation and
// across reopens and a crash.
func TestTornTailInPreallocatedSegment(t *testing.T) {
	fs := vfs.NewCrashableMem()
	o := testOptions(fs)
	o.SegmentSize = 32 << 10
	w, _ := mustOpen(t, o, 0, nil)
	appendWait(t, w, 30, 3)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	last := w.Segments()[0]
	path := fs.PathJoin(testDir, last.Name)
	f, err := fs.OpenReadWrite(path, vfs.WriteCategoryUnspecified)
	if err != nil {
		t.Fatal(err)
	}
	// A frame header claiming 40 bytes with half of its payload, and a
	// stray block 10 KiB further.
	part := make([]byte, frameSize(40))
	putFrame(part, 31, 0, 1, payloadFor(7)[:40])
	if _, err := f.WriteAt(part[:30], last.Size); err != nil {
		t.Fatal(err)
	}
	stray := last.Size + 10<<10
	if _, err := f.WriteAt([]byte("stray block"), stray); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()

	var recs []gotRecord
	w, res := mustOpen(t, o, 0, collect(&recs))
	checkRecs(t, recs, 1, 30)
	tt := res.TornTail
	if tt == nil || tt.Offset != last.Size || tt.Bytes != stray+11-last.Size || tt.SavedAs == "" {
		t.Fatalf("TornTail %+v", tt)
	}
	// Cut by zeroing, durably: the file keeps its size.
	b := vfstest.ReadFile(t, fs.CrashClone(vfs.CrashCloneCfg{}), path)
	if int64(len(b)) != last.Allocated || !allZero(b[last.Size:]) {
		t.Fatalf("after the cut: %d bytes (was %d), zeros after the data: %v", len(b), last.Allocated, allZero(b[last.Size:]))
	}
	if saved := vfstest.ReadFile(t, fs, fs.PathJoin(testDir, tt.SavedAs)); int64(len(saved)) != tt.Bytes {
		t.Fatalf("saved %d bytes", len(saved))
	}
	// Appends overwrite the zeroed region (the stray block's place too) and
	// go on into the next segment.
	appendWait(t, w, 300, 4)
	settle(t, w)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	recs, res = scanAll(t, fs, testDir)
	checkRecs(t, recs, 1, 330)
	if res.TornTail != nil || len(res.Segments) < 2 {
		t.Fatalf("%+v", res)
	}
	w, _ = mustOpen(t, o, 0, nil)
	appendN(t, w, 3)
	crashed := fs.CrashClone(vfs.CrashCloneCfg{})
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	recs, _ = scanAll(t, crashed, testDir)
	checkRecs(t, recs, 1, 333)
}

// TestSpareFileReuse checks how Open treats a leftover spare file: reused
// when intact (a header in its first bytes, left by a crash between the
// rename and the directory fsync, is fine), replaced when it holds anything
// else or has the wrong size; Scan ignores it either way.
func TestSpareFileReuse(t *testing.T) {
	cases := []struct {
		name   string
		mangle func(t *testing.T, fs vfs.FS, path string)
	}{
		{name: "intact", mangle: func(*testing.T, vfs.FS, string) {}},
		{name: "header left by a crash", mangle: func(t *testing.T, fs vfs.FS, path string) {
			writeAt(t, fs, path, encodeSegmentHeader(12345), 0)
		}},
		{name: "garbage", mangle: func(t *testing.T, fs vfs.FS, path string) {
			writeAt(t, fs, path, []byte("garbage"), 5000)
		}},
		{name: "short", mangle: func(t *testing.T, fs vfs.FS, path string) {
			vfstest.WriteFile(t, fs, path, make([]byte, 100))
		}},
		{name: "long", mangle: func(t *testing.T, fs vfs.FS, path string) {
			vfstest.WriteFile(t, fs, path, make([]byte, 20000))
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fs := vfs.NewMem()
			o := testOptions(fs)
			o.SegmentSize = 8 << 10
			w, _ := mustOpen(t, o, 0, nil)
			appendWait(t, w, 100, 5) // rotations: a spare file is prepared after each
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
			spare := fs.PathJoin(testDir, preallocName)
			if b := vfstest.ReadFile(t, fs, spare); int64(len(b)) != o.SegmentSize || !allZero(b) {
				t.Fatalf("spare file after Close: %d bytes, all zero %v", len(b), allZero(b))
			}
			tc.mangle(t, fs, spare)
			if recs, _ := scanAll(t, fs, testDir); len(recs) != 100 {
				t.Fatalf("Scan: %d records", len(recs))
			}
			w, _ = mustOpen(t, o, 0, nil)
			appendWait(t, w, 200, 5) // several rotations
			settle(t, w)
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
			recs, res := scanAll(t, fs, testDir)
			checkRecs(t, recs, 1, 300)
			if res.TornTail != nil || len(res.Segments) < 3 {
				t.Fatalf("%+v", res)
			}
			for _, s := range res.Segments {
				b := vfstest.ReadFile(t, fs, fs.PathJoin(testDir, s.Name))
				if !allZero(b[s.Size:]) {
					t.Fatalf("segment %s: non-zero bytes after its data", s.Name)
				}
			}
		})
	}
}

func writeAt(t *testing.T, fs vfs.FS, path string, b []byte, off int64) {
	t.Helper()
	f, err := fs.OpenReadWrite(path, vfs.WriteCategoryUnspecified)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestSpareFileFailures injects failures into the preparation of the spare
// file: a background failure is retried by the rotation; when the retry
// fails too, the rotation fails and the WAL fails for good (after having
// synced everything before it); on an empty directory, Open fails.
func TestSpareFileFailures(t *testing.T) {
	setup := func(failCreate func(n int) bool) (*vfs.MemFS, vfs.FS) {
		mem := vfs.NewCrashableMem()
		var creates atomic.Int32
		return mem, errorfs.Wrap(mem, errorfs.InjectorFunc(func(op errorfs.Op) error {
			if op.Kind == errorfs.OpCreate && strings.HasSuffix(op.Path, preallocSuffix) &&
				failCreate(int(creates.Add(1))) {
				return errorfs.ErrInjected
			}
			return nil
		}))
	}
	t.Run("background failure, retry succeeds", func(t *testing.T) {
		// Create 1: the first segment (in Open); 2: the background spare
		// (started when the first segment is half full).
		_, fs := setup(func(n int) bool { return n == 2 })
		o := testOptions(fs)
		w, _ := mustOpen(t, o, 0, nil)
		appendWait(t, w, 200, 5)
		settle(t, w)
		if len(w.Segments()) < 3 {
			t.Fatalf("%d segments", len(w.Segments()))
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		recs, _ := scanAll(t, fs, testDir)
		checkRecs(t, recs, 1, 200)
	})
	t.Run("background failure and retry failure", func(t *testing.T) {
		mem, fs := setup(func(n int) bool { return n >= 2 })
		o := testOptions(fs)
		w, _ := mustOpen(t, o, 0, nil)
		var err error
		var lsn LSN
		for i := 0; i < 1000 && err == nil; i++ {
			if lsn, err = w.Append(1, make([]byte, 100), nil); err == nil {
				err = w.WaitDurable(lsn)
			}
		}
		if !errors.Is(err, ErrFailed) || !errors.Is(err, errorfs.ErrInjected) {
			t.Fatalf("appends across a failed rotation: %v", err)
		}
		synced := w.SyncedLSN()
		if synced == 0 {
			t.Fatal("nothing synced before the failed rotation")
		}
		if err := w.Close(); !errors.Is(err, ErrFailed) {
			t.Fatalf("Close: %v", err)
		}
		recs, _ := scanAll(t, mem.CrashClone(vfs.CrashCloneCfg{}), testDir)
		if LSN(len(recs)) < synced {
			t.Fatalf("%d records survive, %d were synced", len(recs), synced)
		}
	})
	t.Run("first segment", func(t *testing.T) {
		_, fs := setup(func(int) bool { return true })
		if _, _, err := Open(testOptions(fs), 0, nil); !errors.Is(err, errorfs.ErrInjected) {
			t.Fatalf("Open: %v", err)
		}
	})
}

// TestRemoveSegmentsWithSpare runs RemoveSegmentsThrough while spare files
// come and go: removal counts file sizes, never touches the spare file, and
// the log keeps rotating afterwards.
func TestRemoveSegmentsWithSpare(t *testing.T) {
	fs := vfs.NewCrashableMem()
	o := testOptions(fs)
	o.SegmentSize = 8 << 10
	w, _ := mustOpen(t, o, 0, nil)
	defer w.Close()
	var removed int
	for round := 0; round < 5; round++ {
		appendWait(t, w, 150, 5)
		settle(t, w)
		segs := w.Segments()
		var want int64
		for _, s := range segs[:len(segs)-1] {
			want += s.Allocated
		}
		n, b, err := w.RemoveSegmentsThrough(w.SyncedLSN())
		if err != nil || n != len(segs)-1 || b != want {
			t.Fatalf("round %d: removed %d segments, %d bytes (want %d, %d): %v", round, n, b, len(segs)-1, want, err)
		}
		removed += n
	}
	if err := w.Sync(); err != nil {
		t.Fatal(err)
	}
	crashed := fs.CrashClone(vfs.CrashCloneCfg{})
	recs, res := scanAll(t, crashed, testDir)
	if len(res.Segments) != 1 || res.LastLSN != 750 {
		t.Fatalf("after %d removals: %+v", removed, res)
	}
	checkRecs(t, recs, res.Segments[0].FirstLSN, 750)
}

// TestSpareFileIsLazy checks when the spare file is prepared: not by Open,
// but once the active segment is half full (and right after every rotation).
func TestSpareFileIsLazy(t *testing.T) {
	fs := vfs.NewMem()
	o := testOptions(fs)
	o.SegmentSize = 16 << 10
	hasSpare := func() bool { return slices.Contains(listDir(t, fs, testDir), preallocName) }
	w, _ := mustOpen(t, o, 0, nil)
	appendN(t, w, 3)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if hasSpare() {
		t.Fatal("spare file prepared for a log written little")
	}
	w, _ = mustOpen(t, o, 0, nil)
	for w.Segments()[0].Size < o.SegmentSize/2 {
		appendN(t, w, 5)
	}
	if err := w.Close(); err != nil { // waits for the preparation
		t.Fatal(err)
	}
	if !hasSpare() || len(w.Segments()) != 1 {
		t.Fatalf("no spare file with a half-full segment: %v", listDir(t, fs, testDir))
	}
	if err := fs.Remove(fs.PathJoin(testDir, preallocName)); err != nil {
		t.Fatal(err)
	}
	// One record larger than the (now smaller) segment: the spare file is
	// prepared right before the rotation, which waits for it.
	o.SegmentSize = 4 << 10
	w, _ = mustOpen(t, o, 0, nil)
	lsn, err := w.Append(1, make([]byte, 20<<10), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.WaitDurable(lsn); err != nil {
		t.Fatal(err)
	}
	appendN(t, w, 3)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	recs, res := scanAll(t, fs, testDir)
	if len(res.Segments) != 2 || res.LastLSN != LSN(len(recs)) || res.Segments[1].Allocated != o.SegmentSize {
		t.Fatalf("%+v", res)
	}
}
