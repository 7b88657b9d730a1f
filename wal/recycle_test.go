package wal

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/idemdb/idem/internal/vfstest"
)

// recycleSegSize is small enough for many rotations per test, and holds
// about 200 payloadFor records: several pages of stale frames follow the
// log of a recycled segment.
const recycleSegSize = 32 << 10

// appendTruncating appends n payloadFor records, waiting for durability
// every every records, and after each wait removes every segment through the
// synced LSN (truncation keeping up, as the engine's index does). It
// returns the last LSN passed to RemoveSegmentsThrough.
func appendTruncating(t testing.TB, w *WAL, n, every int) LSN {
	t.Helper()
	var through LSN
	for i := 0; i < n; i += every {
		appendWait(t, w, min(every, n-i), every)
		through = w.SyncedLSN()
		if _, _, err := w.RemoveSegmentsThrough(through); err != nil {
			t.Fatalf("RemoveSegmentsThrough(%d): %v", through, err)
		}
	}
	return through
}

// segmentVersionOf returns the header version of a segment file.
func segmentVersionOf(t testing.TB, fs vfs.FS, name string) uint16 {
	t.Helper()
	f, err := fs.Open(fs.PathJoin(testDir, name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, segmentHeaderSize)
	if _, err := f.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	_, v, reason := decodeSegmentHeader(b)
	if reason != "" {
		t.Fatalf("%s: %s", name, reason)
	}
	return v
}

// staleFrames counts the valid frames in [from, EOF) of a segment whose LSN
// is below first: frames of the file's older segment.
func staleFrames(t testing.TB, fs vfs.FS, name string, from int64, first LSN) int {
	t.Helper()
	f, err := fs.Open(fs.PathJoin(testDir, name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, st.Size())
	if _, err := f.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	n := 0
	for off := (from + frameAlign - 1) &^ (frameAlign - 1); off < int64(len(b)); off += frameAlign {
		if lsn, _, _, _, err := DecodeFrame(b[off:], 0); err == nil && lsn < first {
			n++
		}
	}
	return n
}

func tornFiles(t testing.TB, fs vfs.FS) []string {
	var torn []string
	for _, n := range listDir(t, fs, testDir) {
		if strings.HasSuffix(n, tornSuffix) {
			torn = append(torn, n)
		}
	}
	return torn
}

// TestRecycleSegments: with truncation keeping up, old segments become the
// next segments (version 3) and no spare file is zero-filled any more; the
// log reads back whole, with no torn tail, by Scan and by Open (also
// through the close hint), and the directory keeps at most one recycled
// file besides the spare. Old code: every segment is version 2 and every
// spare file is zero-filled.
func TestRecycleSegments(t *testing.T) {
	mem := vfs.NewMem()
	var zeroWrites atomic.Int64
	fs := errorfs.Wrap(mem, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if op.Kind == errorfs.OpFileWrite && strings.HasSuffix(op.Path, preallocSuffix) {
			zeroWrites.Add(1)
		}
		return nil
	}))
	o := testOptions(fs)
	o.SegmentSize = recycleSegSize
	w, _ := mustOpen(t, o, 0, nil)
	through := appendTruncating(t, w, 1200, 5) // about 6 segments: warm-up
	warm := zeroWrites.Load()
	firstRecycled := LSN(0)
	for round := 0; round < 10; round++ {
		through = appendTruncating(t, w, 240, 5)
		segs := w.Segments()
		active := segs[len(segs)-1]
		if segmentVersionOf(t, mem, active.Name) == segmentVersionRecycled && firstRecycled == 0 {
			firstRecycled = active.FirstLSN
		}
	}
	if firstRecycled == 0 {
		t.Fatalf("no segment was recycled: %v", listDir(t, mem, testDir))
	}
	if got := zeroWrites.Load() - warm; got != 0 {
		t.Errorf("%d zero-fill writes after the warm-up: spare files are still zero-filled", got)
	}
	if st := w.Stats(); st.SegmentsRecycled < 10 || st.SparesRecycled < 10 {
		t.Errorf("Stats: %d segments recycled, %d spare files recycled", st.SegmentsRecycled, st.SparesRecycled)
	}
	names := listDir(t, mem, testDir)
	spares := 0
	for _, n := range names {
		if strings.HasSuffix(n, preallocSuffix) {
			spares++
		}
	}
	if spares > 2 {
		t.Errorf("%d spare files: %v", spares, names)
	}
	last := w.LastLSN()
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	recs, res := scanAll(t, mem, testDir)
	if res.TornTail != nil {
		t.Fatalf("torn tail after a clean Close: %+v", res.TornTail)
	}
	checkRecs(t, recs, res.Segments[0].FirstLSN, last)
	if res.Segments[0].FirstLSN > through+1 {
		t.Fatalf("log starts at %d, records after %d were removed", res.Segments[0].FirstLSN, through)
	}
	// The close hint: Open reads a few headers, one frame and the padding,
	// not the stale bytes after it.
	minSkipped := int64(0)
	for i, s := range res.Segments {
		if i < len(res.Segments)-1 {
			minSkipped += s.Allocated - segmentHeaderSize
		} else {
			minSkipped += s.Allocated - segmentHeaderSize - hintZeroCheck
		}
	}
	w, res = mustOpen(t, o, last, nil)
	if res.TornTail != nil || res.LastLSN != last || res.SkippedBytes < minSkipped {
		t.Fatalf("reopen at the end: torn %+v, last %d (want %d), skipped %d (want >= %d: the close hint)",
			res.TornTail, res.LastLSN, last, res.SkippedBytes, minSkipped)
	}
	appendTruncating(t, w, 40, 5)
	last = w.LastLSN()
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	var orecs []gotRecord
	o.CheckApplied = true
	w, res = mustOpen(t, o, 0, collect(&orecs))
	if res.TornTail != nil || w.Stats().TornTailsCut != 0 {
		t.Fatalf("full reopen: torn %+v", res.TornTail)
	}
	checkRecs(t, orecs, res.Segments[0].FirstLSN, last)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
}

// recycledLog writes through enough segments, truncating, that the active
// segment is a recycled one holding some frames with stale frames after
// them; it returns the open WAL and its active segment.
func recycledLog(t *testing.T, fs vfs.FS, o Options) (*WAL, SegmentInfo) {
	t.Helper()
	w, _ := mustOpen(t, o, 0, nil)
	for i := 0; i < 400; i++ {
		appendTruncating(t, w, 10, 1)
		segs := w.Segments()
		a := segs[len(segs)-1]
		if segmentVersionOf(t, fs, a.Name) == segmentVersionRecycled && a.LastLSN >= a.FirstLSN+8 &&
			staleFrames(t, fs, a.Name, padEnd(a.Size), a.FirstLSN) > 0 {
			return w, a
		}
	}
	t.Fatal("no recycled active segment with stale frames after its log")
	return nil, SegmentInfo{}
}

// TestRecycledCleanCrash: a crash that keeps exactly what was fsynced, with
// a recycled active segment whose stale frames follow the log, is a clean
// end: no torn tail reported or cut, no .torn file, every record there.
// Old code: no recycled segment (and, with recycling but the old tail rules,
// the stale bytes are a torn tail of almost a whole segment).
func TestRecycledCleanCrash(t *testing.T) {
	mem := vfs.NewCrashableMem()
	o := testOptions(mem)
	o.SegmentSize = recycleSegSize
	w, a := recycledLog(t, mem, o)
	crashed := mem.CrashClone(vfs.CrashCloneCfg{})
	_ = w.Close()

	recs, res := scanAll(t, crashed, testDir)
	if res.TornTail != nil {
		t.Fatalf("Scan after a clean crash: torn tail %+v", res.TornTail)
	}
	checkRecs(t, recs, res.Segments[0].FirstLSN, a.LastLSN)
	o.FS = crashed
	var orecs []gotRecord
	w, res = mustOpen(t, o, 0, collect(&orecs))
	if res.TornTail != nil || w.Stats().TornTailsCut != 0 {
		t.Fatalf("Open after a clean crash: torn tail %+v, cut %d", res.TornTail, w.Stats().TornTailsCut)
	}
	if torn := tornFiles(t, crashed); len(torn) > 0 {
		t.Fatalf("files saved: %v", torn)
	}
	checkRecs(t, orecs, res.Segments[0].FirstLSN, a.LastLSN)
	// Appends continue the recycled segment, over its padding.
	appendTruncating(t, w, 30, 3)
	last := w.LastLSN()
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	recs, res = scanAll(t, crashed, testDir)
	if res.TornTail != nil {
		t.Fatalf("torn tail %+v", res.TornTail)
	}
	checkRecs(t, recs, res.Segments[0].FirstLSN, last)
}

// TestRecycledCorrupt: in a recycled active segment, a damaged fsynced
// frame followed by valid frames written after it was fsynced is
// corruption (Open and Scan fail with ErrCorrupt), not a torn tail; a
// damaged last frame is a torn tail, cut up to its end only. Mutating
// tailRecycled to skip the synced proof makes the first case a torn tail.
func TestRecycledCorrupt(t *testing.T) {
	for _, tc := range []struct {
		name    string
		victim  func(recs []Record) Record // the frame to damage
		corrupt bool
	}{
		{"middle", func(recs []Record) Record { return recs[len(recs)-5] }, true},
		{"last", func(recs []Record) Record { return recs[len(recs)-1] }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mem := vfs.NewMem()
			o := testOptions(mem)
			o.SegmentSize = recycleSegSize
			w, a := recycledLog(t, mem, o)
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
			var recs []Record
			if _, err := Scan(mem, testDir, a.FirstLSN-1, 0, func(r Record) error {
				if r.Segment == a.Name {
					r.Payload = nil
					recs = append(recs, r)
				}
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			v := tc.victim(recs)
			f, err := mem.OpenReadWrite(mem.PathJoin(testDir, a.Name), vfs.WriteCategoryUnspecified)
			if err != nil {
				t.Fatal(err)
			}
			b := make([]byte, 4)
			if _, err := f.ReadAt(b, v.Offset+4); err != nil {
				t.Fatal(err)
			}
			binary.LittleEndian.PutUint32(b, binary.LittleEndian.Uint32(b)^0x10000) // the length
			if _, err := f.WriteAt(b, v.Offset+4); err != nil {
				t.Fatal(err)
			}
			_ = f.Close()
			_ = mem.Remove(mem.PathJoin(testDir, hintName))

			_, serr := Scan(mem, testDir, 0, 0, nil)
			_, res, oerr := Open(o, 0, nil)
			if tc.corrupt {
				var ce *CorruptError
				if !errors.As(oerr, &ce) || ce.Segment != a.Name || ce.Offset != v.Offset || !errors.Is(serr, ErrCorrupt) {
					t.Fatalf("damaged LSN %d at %d: Open: %v; Scan: %v", v.LSN, v.Offset, oerr, serr)
				}
				return
			}
			if oerr != nil || serr != nil {
				t.Fatalf("Open: %v; Scan: %v", oerr, serr)
			}
			if res.TornTail == nil || res.TornTail.Offset != v.Offset || res.TornTail.Bytes > recycleSegSize/4 || res.LastLSN != v.LSN-1 {
				t.Fatalf("torn tail %+v, last %d; want a cut at %d (LSN %d)", res.TornTail, res.LastLSN, v.Offset, v.LSN)
			}
		})
	}
}

// TestCrashRecycled crashes at every file-system operation (a sweep) of a
// writer whose segments are recycled, keeping only fsynced data or half of
// the unsynced blocks and directory entries: renames of old segments to the
// recycled file and its directory fsync, the spare header, the activation
// of a recycled spare (header, rename, directory fsync), frames written
// over stale frames. After each crash the log must hold every record that
// was fsynced and not truncated, nothing but payloadFor records, a dense
// LSN run; with only fsynced data kept, no torn tail and no .torn file.
// Then it must keep working through more recycling and another crash.
func TestCrashRecycled(t *testing.T) {
	const warm, run, every = 1200, 600, 8
	cfgs := []func() vfs.CrashCloneCfg{func() vfs.CrashCloneCfg { return vfs.CrashCloneCfg{} }}
	for seed := uint64(1); seed <= 2; seed++ {
		cfgs = append(cfgs, func() vfs.CrashCloneCfg {
			return vfs.CrashCloneCfg{UnsyncedDataPercent: 50, RNG: rand.New(rand.NewPCG(seed, 13))}
		})
	}
	var kinds sync.Map // op kinds crashed before, for the log
	step := 1
	if testing.Short() {
		step = 7
	}
	for ci, cfg := range cfgs {
		for k := 1; ; k += step {
			crashed, synced, through, ok := crashRecycledAt(t, k, cfg(), warm, run, every, &kinds)
			if !ok {
				t.Logf("cfg%d: %d crash points", ci, k-1)
				break
			}
			t.Run(fmt.Sprintf("cfg%d/op%d", ci, k), func(t *testing.T) {
				checkRecycledRecovery(t, crashed, synced, through, ci == 0)
			})
			if t.Failed() {
				return
			}
		}
	}
	var seen []string
	kinds.Range(func(k, _ any) bool { seen = append(seen, k.(string)); return true })
	t.Logf("crashed before: %v", seen)
}

// crashRecycledAt warms up (recycling going), then crash-clones before the
// kth file-system operation in the WAL directory. It returns the clone, the
// synced LSN and the last truncation point before it, and false when the
// run ended before k operations.
func crashRecycledAt(t *testing.T, k int, cfg vfs.CrashCloneCfg, warm, run, every int, kinds *sync.Map) (*vfs.MemFS, LSN, LSN, bool) {
	mem := vfs.NewCrashableMem()
	var (
		armed   atomic.Bool
		count   atomic.Int32
		wp      atomic.Pointer[WAL]
		through atomic.Uint64
		mu      sync.Mutex
		clone   *vfs.MemFS
		synced  LSN
		tr      LSN
	)
	fs := errorfs.Wrap(mem, errorfs.InjectorFunc(func(op errorfs.Op) error {
		if !armed.Load() || !strings.Contains(op.Path, testDir) || op.Kind == errorfs.OpFileStat ||
			op.Kind == errorfs.OpStat || op.Kind == errorfs.OpList || op.Kind == errorfs.OpFileRead || op.Kind == errorfs.OpFileReadAt ||
			op.Kind == errorfs.OpFileClose || strings.HasSuffix(op.Path, ".hint") || strings.Contains(op.Path, ".tmp") {
			return nil
		}
		if int(count.Add(1)) != k {
			return nil
		}
		s := wp.Load().SyncedLSN() // before cloning: all of it is in the clone
		tt := LSN(through.Load())
		c := mem.CrashClone(cfg)
		kinds.Store(fmt.Sprintf("%v %s", op.Kind, mem.PathBase(op.Path)), true)
		mu.Lock()
		clone, synced, tr = c, s, tt
		mu.Unlock()
		return nil
	}))
	o := testOptions(fs)
	o.SegmentSize = recycleSegSize
	w, _ := mustOpen(t, o, 0, nil)
	wp.Store(w)
	through.Store(uint64(appendTruncating(t, w, warm, every)))
	armed.Store(true)
	for i := 0; i < run; i += every {
		appendWait(t, w, every, every)
		s := w.SyncedLSN()
		through.Store(uint64(s)) // a crash during the call may have removed through s
		if _, _, err := w.RemoveSegmentsThrough(s); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	return clone, synced, tr, clone != nil
}

func checkRecycledRecovery(t *testing.T, fs *vfs.MemFS, synced, through LSN, onlySynced bool) {
	t.Helper()
	o := testOptions(fs)
	o.SegmentSize = recycleSegSize
	recs, sres := scanAll(t, fs, testDir)
	var orecs []gotRecord
	w, res := mustOpen(t, o, 0, collect(&orecs))
	if len(res.Segments) == 0 {
		t.Fatal("no segment")
	}
	first := res.Segments[0].FirstLSN
	if first > through+1 {
		t.Fatalf("log starts at LSN %d, but only records through %d were truncated", first, through)
	}
	if res.LastLSN < synced {
		t.Fatalf("recovered up to LSN %d, but LSN %d was synced before the crash", res.LastLSN, synced)
	}
	checkRecs(t, orecs, first, res.LastLSN)
	if len(recs) < len(orecs) {
		t.Fatalf("Scan found %d records, Open %d", len(recs), len(orecs))
	}
	if onlySynced {
		if sres.TornTail != nil || res.TornTail != nil || w.Stats().TornTailsCut != 0 {
			t.Fatalf("only fsynced data kept, yet a torn tail: Scan %+v, Open %+v", sres.TornTail, res.TornTail)
		}
		if torn := tornFiles(t, fs); len(torn) > 0 {
			t.Fatalf("files saved: %v", torn)
		}
	}
	// Keep going through more recycling.
	appendTruncating(t, w, 480, 8)
	last := w.LastLSN()
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	all, res2 := scanAll(t, fs, testDir)
	if res2.TornTail != nil {
		t.Fatalf("after recovery and appends: torn %+v", res2.TornTail)
	}
	checkRecs(t, all, res2.Segments[0].FirstLSN, last)
	// Everything Close synced survives another crash.
	again, res3 := scanAll(t, fs.CrashClone(vfs.CrashCloneCfg{}), testDir)
	checkRecs(t, again, res3.Segments[0].FirstLSN, last)
}

// TestRecycledSpareBound: a recycled spare file whose frames come from a log
// with higher LSNs (its bound is above the new segment's first LSN: here a
// log started over at LSN 1 next to the spare file of another) is not
// recycled: its frames would pass for records of the new log. Without the
// bound check, Scan finds them after the new records and fails with
// ErrCorrupt (their synced LSNs are above the log's end).
func TestRecycledSpareBound(t *testing.T) {
	mem := vfs.NewMem()
	o := testOptions(mem)
	o.SegmentSize = recycleSegSize
	if err := EnsureDir(mem, testDir); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, recycleSegSize)
	copy(b, encodeSegmentHeaderVersion(401, segmentVersionRecycled))
	off := segmentHeaderSize
	for lsn := LSN(1); lsn <= 400; lsn++ { // about 25 KiB
		p := []byte(fmt.Sprintf("a record of another log, LSN %d", lsn))
		n := frameSize(len(p))
		putFrame(b[off:off+n], lsn, lsn-1, 1, p)
		off += n
	}
	vfstest.WriteFile(t, mem, mem.PathJoin(testDir, recycledName(0)), b)
	w, _ := mustOpen(t, o, 0, nil)
	appendWait(t, w, 5, 1)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	recs, res := scanAll(t, mem, testDir)
	if res.TornTail != nil {
		t.Fatalf("torn tail %+v", res.TornTail)
	}
	checkRecs(t, recs, 1, 5)
}

// TestCrashRecycledConcurrent: 16 appenders (each waiting for its record)
// and a truncator keeping up, crashed once the log went through about 30
// recycled segments, keeping only fsynced data or half of the rest. Every
// acknowledged record that was not truncated is there with its payload,
// the log is a dense run of self-checking payloads, and with only fsynced
// data kept nothing is reported torn.
func TestCrashRecycledConcurrent(t *testing.T) {
	for seed := uint64(1); seed <= 6; seed++ {
		mem := vfs.NewCrashableMem()
		o := testOptions(mem)
		o.SegmentSize = recycleSegSize
		cfg := vfs.CrashCloneCfg{}
		if seed%3 != 0 {
			cfg = vfs.CrashCloneCfg{UnsyncedDataPercent: 50, RNG: rand.New(rand.NewPCG(seed, 17))}
		}
		w, _ := mustOpen(t, o, 0, nil)
		acks := &durableLog{seeds: make(map[LSN]uint64)}
		var stop atomic.Bool
		var through atomic.Uint64
		var wg sync.WaitGroup
		for g := 0; g < 16; g++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; !stop.Load(); i++ {
					s := uint64(g)<<32 | uint64(i)
					lsn, err := w.Append(1, selfPayload(s), nil)
					if err == nil {
						err = w.WaitDurable(lsn)
					}
					if err != nil {
						return
					}
					acks.add(lsn, s)
				}
			}()
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !stop.Load() {
				s := w.SyncedLSN()
				through.Store(uint64(s)) // before: a crash during the call may have removed through s
				if _, _, err := w.RemoveSegmentsThrough(s); err != nil {
					return
				}
				time.Sleep(50 * time.Microsecond)
			}
		}()
		minSynced := LSN(30 * recycleSegSize / 150 * int(seed%2+1))
		deadline := time.Now().Add(20 * time.Second)
		for w.SyncedLSN() < minSynced && time.Now().Before(deadline) {
			time.Sleep(100 * time.Microsecond)
		}
		acked := acks.snapshot()
		synced, tr := w.SyncedLSN(), LSN(through.Load())
		crashed := mem.CrashClone(cfg)
		stop.Store(true)
		wg.Wait()
		recycled := w.Stats().SparesRecycled
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		if recycled < 10 {
			t.Fatalf("seed %d: only %d segments started from recycled files", seed, recycled)
		}

		o.FS = crashed
		var recs []gotRecord
		w, res := mustOpen(t, o, 0, collect(&recs))
		first := res.Segments[0].FirstLSN
		if first > tr+1 {
			t.Fatalf("seed %d: log starts at %d, truncated only through %d", seed, first, tr)
		}
		for i, r := range recs {
			if r.LSN != first+LSN(i) {
				t.Fatalf("seed %d: record %d has LSN %d", seed, i, r.LSN)
			}
			if err := checkSelfPayload(r.Payload); err != nil {
				t.Fatalf("seed %d: LSN %d: %v", seed, r.LSN, err)
			}
			if s, ok := acked[r.LSN]; ok && s != binary.LittleEndian.Uint64(r.Payload) {
				t.Fatalf("seed %d: LSN %d holds another payload than acknowledged", seed, r.LSN)
			}
		}
		last := res.LastLSN
		if last < synced {
			t.Fatalf("seed %d: recovered up to %d, synced %d", seed, last, synced)
		}
		for lsn := range acked {
			if lsn > last {
				t.Fatalf("seed %d: LSN %d acknowledged, recovered up to %d", seed, lsn, last)
			}
		}
		if cfg.UnsyncedDataPercent == 0 && (res.TornTail != nil || len(tornFiles(t, crashed)) > 0) {
			t.Fatalf("seed %d: only fsynced data kept, torn tail %+v", seed, res.TornTail)
		}
		appendTruncating(t, w, 400, 8)
		last = w.LastLSN()
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		all, res2 := scanAll(t, crashed, testDir)
		if res2.TornTail != nil || res2.LastLSN != last {
			t.Fatalf("seed %d: after recovery: torn %+v, last %d, want %d", seed, res2.TornTail, res2.LastLSN, last)
		}
		checkRecs(t, all, res2.Segments[0].FirstLSN, last) // appendTruncating's payloads
	}
}

// TestRecycledRemovedWithoutPreallocation: a log reopened with
// preallocation off (or under SyncNever) never takes the recycled files an
// earlier run kept, so Open removes them instead of leaving up to two
// segments' worth of disk in use for nothing; with preallocation on they
// stay for reuse (one may become the spare file at once).
func TestRecycledRemovedWithoutPreallocation(t *testing.T) {
	for _, prealloc := range []bool{false, true} {
		mem := vfs.NewMem()
		o := testOptions(mem)
		o.SegmentSize = recycleSegSize
		o.Preallocate = prealloc
		if err := EnsureDir(mem, testDir); err != nil {
			t.Fatal(err)
		}
		b := make([]byte, recycleSegSize)
		copy(b, encodeSegmentHeaderVersion(401, segmentVersionRecycled))
		for i := range maxRecycled {
			vfstest.WriteFile(t, mem, mem.PathJoin(testDir, recycledName(i)), b)
		}
		w, _ := mustOpen(t, o, 0, nil)
		appendWait(t, w, 3, 1)
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		kept := 0
		for i := range maxRecycled {
			if _, err := mem.Stat(mem.PathJoin(testDir, recycledName(i))); err == nil {
				kept++
			}
		}
		// With preallocation one may have become the spare file.
		if !prealloc && kept != 0 || prealloc && kept == 0 {
			t.Errorf("Preallocate %v: %d recycled files left after Open and Close", prealloc, kept)
		}
	}
}
