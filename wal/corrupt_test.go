package wal

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/vfstest"
)

// refLog is a log written by the WAL, captured as raw segment bytes.
type refLog struct {
	names  []string           // segment names, oldest first
	data   map[string][]byte  // segment bytes (the whole file: frames, then the preallocated zeros)
	ends   map[string]int64   // logical end (valid data) per segment
	frames map[string][]int64 // frame offsets per segment
	lsns   map[string][]LSN   // LSN per frame
	last   LSN
}

// buildRefLog writes n records (payloadFor) with the given segment size,
// waiting for each record so that segments rotate as soon as they fill.
func buildRefLog(t *testing.T, n int, segmentSize int64) *refLog {
	t.Helper()
	return buildRefLogMode(t, n, segmentSize, SyncAlways)
}

// buildRefLogMode is buildRefLog with a sync mode. With SyncNever nothing is
// fsynced before Close, so every frame records synced LSN 0 (FirstLSN-1):
// no frame proves that an earlier one was fsynced, as for frames appended
// while the flush before them was still in flight.
func buildRefLogMode(t *testing.T, n int, segmentSize int64, mode SyncMode) *refLog {
	t.Helper()
	fs := vfs.NewMem()
	o := testOptions(fs)
	o.SegmentSize = segmentSize
	o.SyncMode = mode
	w, _ := mustOpen(t, o, 0, nil)
	appendWait(t, w, n, 1)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	l := &refLog{data: map[string][]byte{}, ends: map[string]int64{}, frames: map[string][]int64{}, lsns: map[string][]LSN{}, last: LSN(n)}
	res, err := Scan(fs, testDir, 0, 0, func(r Record) error {
		l.frames[r.Segment] = append(l.frames[r.Segment], r.Offset)
		l.lsns[r.Segment] = append(l.lsns[r.Segment], r.LSN)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, seg := range res.Segments {
		l.ends[seg.Name] = seg.Size
	}
	for _, name := range listDir(t, fs, testDir) {
		if _, ok := ParseSegmentName(name); !ok {
			continue // the spare next.prealloc
		}
		l.names = append(l.names, name)
		l.data[name] = vfstest.ReadFile(t, fs, fs.PathJoin(testDir, name))
	}
	return l
}

// allZero reports whether b holds only zero bytes.
func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// nonZeroEnd returns the index just past the last non-zero byte of b, or 0.
func nonZeroEnd(b []byte) int {
	for i := len(b) - 1; i >= 0; i-- {
		if b[i] != 0 {
			return i + 1
		}
	}
	return 0
}

// install writes the log into a fresh MemFS, passing segment seg through
// corrupt (a nil result removes the file).
func (l *refLog) install(t *testing.T, seg string, corrupt func([]byte) []byte) *vfs.MemFS {
	t.Helper()
	fs := vfs.NewMem()
	if err := fs.MkdirAll(testDir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range l.names {
		b := slices.Clone(l.data[name])
		if name == seg {
			if b = corrupt(b); b == nil {
				continue
			}
		}
		vfstest.WriteFile(t, fs, fs.PathJoin(testDir, name), b)
	}
	return fs
}

// reCRC recomputes the checksum of the frame at off (after a deliberate
// change that must be caught by something else than the CRC).
func reCRC(b []byte, off int64) {
	l := int64(binary.LittleEndian.Uint32(b[off+4:]))
	binary.LittleEndian.PutUint32(b[off:], crc32.Update(0, castagnoli, b[off+4:off+frameHeaderSize+l]))
}

// frameWith returns the index of the first frame at or after from whose
// payload is at least minLen bytes and whose padding is non-empty if pad.
func (l *refLog) frameWith(t *testing.T, seg string, from, minLen int, pad bool) int {
	t.Helper()
	for i := from; i < len(l.frames[seg]); i++ {
		n := len(payloadFor(l.lsns[seg][i]))
		if n >= minLen && (!pad || frameSize(n) > frameHeaderSize+n) {
			return i
		}
	}
	t.Fatalf("no suitable frame in %s", seg)
	return 0
}

type corruptCase struct {
	name    string
	seg     string              // segment to corrupt
	corrupt func([]byte) []byte // nil result removes the segment
	// Expectations. wantCorrupt: a *CorruptError in wantSeg at wantOff.
	// Otherwise the log must open with records 1..wantLast, and a TornTail
	// at wantOff (in wantSeg) when wantTorn.
	wantCorrupt bool
	wantTorn    bool
	wantSeg     string
	wantOff     int64
	wantLast    LSN
}

func runCorruptCase(t *testing.T, l *refLog, tc corruptCase) {
	fs := l.install(t, tc.seg, tc.corrupt)
	before := map[string][]byte{}
	for _, name := range listDir(t, fs, testDir) {
		before[name] = vfstest.ReadFile(t, fs, fs.PathJoin(testDir, name))
	}
	var recs []gotRecord
	res, err := Scan(fs, testDir, 0, 0, collect(&recs))
	// Scan is read-only, whatever it found.
	after := listDir(t, fs, testDir)
	if len(after) != len(before) {
		t.Fatalf("Scan changed the directory: %v", after)
	}
	for _, name := range after {
		if !bytes.Equal(before[name], vfstest.ReadFile(t, fs, fs.PathJoin(testDir, name))) {
			t.Fatalf("Scan modified %s", name)
		}
	}
	if tc.wantCorrupt {
		var ce *CorruptError
		if !errors.Is(err, ErrCorrupt) || !errors.As(err, &ce) {
			t.Fatalf("Scan: got %v (result %+v), want a CorruptError", err, res)
		}
		if ce.Segment != tc.wantSeg || ce.Offset != tc.wantOff {
			t.Fatalf("Scan: %v; want segment %s offset %d", err, tc.wantSeg, tc.wantOff)
		}
		_, _, err = Open(testOptions(fs), 0, nil)
		if !errors.As(err, &ce) || ce.Segment != tc.wantSeg || ce.Offset != tc.wantOff {
			t.Fatalf("Open: %v; want a CorruptError at %s:%d", err, tc.wantSeg, tc.wantOff)
		}
		for _, name := range listDir(t, fs, testDir) {
			if !bytes.Equal(before[name], vfstest.ReadFile(t, fs, fs.PathJoin(testDir, name))) {
				t.Fatalf("a failed Open modified %s", name)
			}
		}
		return
	}
	if err != nil {
		t.Fatalf("Scan: %v", err)
	}
	checkRecs(t, recs, 1, tc.wantLast)
	if res.LastLSN != tc.wantLast {
		t.Fatalf("Scan LastLSN %d, want %d", res.LastLSN, tc.wantLast)
	}
	if tc.wantTorn {
		tt := res.TornTail
		if tt == nil || tt.Segment != tc.wantSeg || tt.Offset != tc.wantOff || tt.SavedAs != "" {
			t.Fatalf("Scan TornTail %+v, want %s:%d", tt, tc.wantSeg, tc.wantOff)
		}
	} else if res.TornTail != nil {
		t.Fatalf("unexpected TornTail %+v", res.TornTail)
	}

	o := testOptions(fs)
	recs = recs[:0]
	w, ores, err := Open(o, 0, collect(&recs))
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	checkRecs(t, recs, 1, tc.wantLast)
	if tc.wantTorn {
		tt := ores.TornTail
		if tt == nil || tt.SavedAs == "" || w.Stats().TornTailsCut != 1 {
			t.Fatalf("Open TornTail %+v, cut %d", tt, w.Stats().TornTailsCut)
		}
		// The cut bytes run from Offset to the last non-zero byte; only
		// zeros follow them.
		saved := vfstest.ReadFile(t, fs, fs.PathJoin(testDir, tt.SavedAs))
		orig := before[tt.Segment]
		wantEnd := int64(nonZeroEnd(orig))
		if !bytes.Equal(saved, orig[tt.Offset:wantEnd]) || int64(len(saved)) != tt.Bytes {
			t.Fatalf("saved %d bytes (Bytes %d), want the %d bytes [%d, %d)", len(saved), tt.Bytes, wantEnd-tt.Offset, tt.Offset, wantEnd)
		}
	}
	// The repaired active segment keeps its file size (unless it was
	// recreated after a torn header); only zeros follow its valid data.
	segs := w.Segments()
	act := segs[len(segs)-1]
	got := vfstest.ReadFile(t, fs, fs.PathJoin(testDir, act.Name))
	if int64(len(got)) != act.Allocated || act.Allocated < act.Size || !allZero(got[act.Size:]) {
		t.Fatalf("active segment %s: %d bytes, Allocated %d, valid data %d, zeros after it: %v",
			act.Name, len(got), act.Allocated, act.Size, allZero(got[min(int64(len(got)), act.Size):]))
	}
	if orig, ok := before[act.Name]; ok && len(orig) >= segmentHeaderSize {
		if _, _, bad := decodeSegmentHeader(orig); bad == "" && len(got) != len(orig) {
			t.Fatalf("active segment %s: %d bytes after Open, %d before", act.Name, len(got), len(orig))
		}
	}
	appendN(t, w, 3)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	all, res2 := scanAll(t, fs, testDir)
	checkRecs(t, all, 1, tc.wantLast+3)
	if res2.TornTail != nil {
		t.Fatalf("torn tail after repair: %+v", res2.TornTail)
	}
}

func TestCorruptionSingleSegment(t *testing.T) {
	l := buildRefLog(t, 40, 1<<20)
	if len(l.names) != 1 {
		t.Fatalf("%d segments", len(l.names))
	}
	seg := l.names[0]
	offs := l.frames[seg]
	end := int64(len(l.data[seg])) // file size (preallocated)
	lend := l.ends[seg]            // logical end
	if end != 1<<20 || lend >= end {
		t.Fatalf("segment of %d bytes, logical end %d: not preallocated", end, lend)
	}
	n := LSN(len(offs))
	mid := l.frameWith(t, seg, 10, 16, false)
	padded := l.frameWith(t, seg, 10, 0, true)
	// For the hole cases: a frame starting past the first sectors, not
	// sector aligned, followed by valid frames more than a sector later.
	holeFrame := 0
	for i := 3; i < len(offs)-5; i++ {
		if offs[i]%sectorSize != 0 && offs[i]%sectorSize < sectorSize-16 {
			holeFrame = i
			break
		}
	}
	nextSector := func(off int64) int64 { return (off/sectorSize + 1) * sectorSize }
	frameAt := func(off int64) int { // index of the frame containing off
		i, found := slices.BinarySearch(offs, off)
		if found {
			return i
		}
		return i - 1
	}

	cases := []corruptCase{
		{name: "intact", corrupt: func(b []byte) []byte { return b }, wantLast: n},
		{name: "flip payload byte in a middle frame", corrupt: func(b []byte) []byte {
			b[offs[mid]+frameHeaderSize+3] ^= 0x10
			return b
		}, wantCorrupt: true, wantOff: offs[mid]},
		{name: "flip crc byte in a middle frame", corrupt: func(b []byte) []byte {
			b[offs[mid]+1] ^= 0x01
			return b
		}, wantCorrupt: true, wantOff: offs[mid]},
		{name: "huge length in a middle frame", corrupt: func(b []byte) []byte {
			b[offs[mid]+7] = 0x7f
			return b
		}, wantCorrupt: true, wantOff: offs[mid]},
		{name: "length past EOF in a middle frame", corrupt: func(b []byte) []byte {
			binary.LittleEndian.PutUint32(b[offs[mid]+4:], uint32(end))
			return b
		}, wantCorrupt: true, wantOff: offs[mid]},
		{name: "wrong LSN with valid crc in a middle frame", corrupt: func(b []byte) []byte {
			binary.LittleEndian.PutUint64(b[offs[mid]+8:], 7777)
			reCRC(b, offs[mid])
			return b
		}, wantCorrupt: true, wantOff: offs[mid]},
		{name: "zero type with valid crc in a middle frame", corrupt: func(b []byte) []byte {
			b[offs[mid]+frameHeaderSize-1] = 0
			reCRC(b, offs[mid])
			return b
		}, wantCorrupt: true, wantOff: offs[mid]},
		{name: "non-zero padding in a middle frame", corrupt: func(b []byte) []byte {
			b[offs[padded+1]-1] = 0xaa
			return b
		}, wantCorrupt: true, wantOff: offs[padded]},
		{name: "zeroed frame header in the middle, no aligned zero sector", corrupt: func(b []byte) []byte {
			clear(b[offs[mid]+8 : offs[mid]+frameHeaderSize])
			return b
		}, wantCorrupt: true, wantOff: offs[mid]},
		{name: "zeros mid-frame up to a sector boundary (not a crash hole)", corrupt: func(b []byte) []byte {
			clear(b[offs[holeFrame]+8 : nextSector(offs[holeFrame]+8)])
			return b
		}, wantCorrupt: true, wantOff: offs[holeFrame]},
		{name: "bad header magic with frames following", corrupt: func(b []byte) []byte {
			b[0] ^= 0xff
			return b
		}, wantCorrupt: true, wantOff: 0},
		{name: "header LSN differs from the name", corrupt: func(b []byte) []byte {
			copy(b, encodeSegmentHeader(5))
			return b
		}, wantCorrupt: true, wantOff: 0},

		{name: "flip byte in the last frame", corrupt: func(b []byte) []byte {
			b[offs[n-1]+frameHeaderSize-1] ^= 0x04
			return b
		}, wantTorn: true, wantOff: offs[n-1], wantLast: n - 1},
		{name: "last frame cut short", corrupt: func(b []byte) []byte {
			return b[:offs[n-1]+10]
		}, wantTorn: true, wantOff: offs[n-1], wantLast: n - 1},
		{name: "last frame header cut short", corrupt: func(b []byte) []byte {
			return b[:offs[n-1]+3]
		}, wantTorn: true, wantOff: offs[n-1], wantLast: n - 1},
		{name: "garbage right after the valid data", corrupt: func(b []byte) []byte {
			copy(b[lend:], []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13})
			return b
		}, wantTorn: true, wantOff: lend, wantLast: n},
		{name: "garbage at the end of the preallocated space", corrupt: func(b []byte) []byte {
			copy(b[end-20:], []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13})
			return b
		}, wantTorn: true, wantOff: lend, wantLast: n},
		{name: "trailing garbage past the preallocated space", corrupt: func(b []byte) []byte {
			return append(b, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)
		}, wantTorn: true, wantOff: lend, wantLast: n},
		{name: "trailing zeros are a clean end", corrupt: func(b []byte) []byte {
			return append(b, make([]byte, 5000)...)
		}, wantLast: n},
		{name: "no preallocated zeros (old format) is a clean end", corrupt: func(b []byte) []byte {
			return b[:lend]
		}, wantLast: n},
		{name: "zero tail from a middle frame is a clean end", corrupt: func(b []byte) []byte {
			clear(b[offs[mid]:])
			return b
		}, wantLast: LSN(mid)},
		// Every frame here was appended after the one before it was
		// fsynced, and says so: a hole followed by such frames lost
		// fsynced data (TestCorruptionUnsyncedHoles has the torn tails).
		{name: "aligned zero sector in the middle, fsynced frames after", corrupt: func(b []byte) []byte {
			s := nextSector(offs[holeFrame])
			clear(b[s : s+sectorSize])
			return b
		}, wantCorrupt: true, wantOff: offs[frameAt(nextSector(offs[holeFrame]))]},
		{name: "hole from a frame boundary to the next sector, fsynced frames after", corrupt: func(b []byte) []byte {
			clear(b[offs[holeFrame]:nextSector(offs[holeFrame])])
			return b
		}, wantCorrupt: true, wantOff: offs[holeFrame]},
		{name: "zeroed region of several fsynced frames, fsynced frames after", corrupt: func(b []byte) []byte {
			clear(b[offs[holeFrame] : offs[holeFrame]+3*sectorSize])
			return b
		}, wantCorrupt: true, wantOff: offs[holeFrame]},
		{name: "stale LSN: a frame repeated after a hole", corrupt: func(b []byte) []byte {
			// A kept block holding an older frame is not "valid" (LSN not
			// above the last good one): plain torn tail.
			s := nextSector(offs[holeFrame])
			clear(b[offs[holeFrame]:])
			b = b[:s+2*sectorSize]
			copy(b[s:], l.data[seg][offs[1]:offs[2]])
			return b
		}, wantTorn: true, wantOff: offs[holeFrame], wantLast: LSN(holeFrame)},
		{name: "header cut short", corrupt: func(b []byte) []byte {
			return b[:20]
		}, wantTorn: true, wantOff: 0, wantLast: 0},
		{name: "empty segment file", corrupt: func(b []byte) []byte {
			return b[:0]
		}, wantLast: 0},
		{name: "zero-filled header, nothing else", corrupt: func(b []byte) []byte {
			return make([]byte, 4096)
		}, wantLast: 0},
		{name: "header only", corrupt: func(b []byte) []byte {
			return b[:segmentHeaderSize]
		}, wantLast: 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.seg = seg
			if tc.wantSeg == "" {
				tc.wantSeg = seg
			}
			runCorruptCase(t, l, tc)
		})
	}
}

// TestCorruptionUnsyncedHoles: the crash-hole rules for frames that do not
// prove that the records before them were fsynced (all written by one
// flush, or appended while the previous flush was in flight): a zero hole
// followed by valid frames is a torn tail, cut with everything after it.
func TestCorruptionUnsyncedHoles(t *testing.T) {
	l := buildRefLogMode(t, 40, 1<<20, SyncNever)
	seg := l.names[0]
	offs := l.frames[seg]
	holeFrame := 0
	for i := 3; i < len(offs)-5; i++ {
		if offs[i]%sectorSize != 0 && offs[i]%sectorSize < sectorSize-16 {
			holeFrame = i
			break
		}
	}
	nextSector := func(off int64) int64 { return (off/sectorSize + 1) * sectorSize }
	frameAt := func(off int64) int {
		i, found := slices.BinarySearch(offs, off)
		if found {
			return i
		}
		return i - 1
	}
	cases := []corruptCase{
		{name: "aligned zero sector in the middle, valid frames after", corrupt: func(b []byte) []byte {
			s := nextSector(offs[holeFrame])
			clear(b[s : s+sectorSize])
			return b
		}, wantTorn: true, wantOff: offs[frameAt(nextSector(offs[holeFrame]))], wantLast: LSN(frameAt(nextSector(offs[holeFrame])))},
		{name: "hole from a frame boundary to the next sector, valid frames after", corrupt: func(b []byte) []byte {
			clear(b[offs[holeFrame]:nextSector(offs[holeFrame])])
			return b
		}, wantTorn: true, wantOff: offs[holeFrame], wantLast: LSN(holeFrame)},
		{name: "zeros mid-frame up to a sector boundary (not a crash hole)", corrupt: func(b []byte) []byte {
			clear(b[offs[holeFrame]+8 : nextSector(offs[holeFrame]+8)])
			return b
		}, wantCorrupt: true, wantOff: offs[holeFrame]},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.seg, tc.wantSeg = seg, seg
			runCorruptCase(t, l, tc)
		})
	}
}

func TestCorruptionMultiSegment(t *testing.T) {
	l := buildRefLog(t, 120, 2048)
	if len(l.names) < 4 {
		t.Fatalf("%d segments", len(l.names))
	}
	first, second, lastSeg := l.names[0], l.names[1], l.names[len(l.names)-1]
	firstOffs := l.frames[first]
	firstEnd := int64(len(l.data[first]))
	if firstEnd != l.ends[first] {
		// A rotated segment was extended by its last batch: no zero tail.
		t.Fatalf("first segment: %d bytes, logical end %d", firstEnd, l.ends[first])
	}
	lastEnd := l.ends[lastSeg]
	lastFirstLSN, _ := ParseSegmentName(lastSeg)
	cases := []corruptCase{
		{name: "flip byte in the last frame of a non-last segment", seg: first, corrupt: func(b []byte) []byte {
			b[len(b)-9] ^= 0x20
			return b
		}, wantCorrupt: true, wantSeg: first, wantOff: firstOffs[len(firstOffs)-1]},
		{name: "non-last segment cut mid-frame", seg: first, corrupt: func(b []byte) []byte {
			return b[:len(b)-5]
		}, wantCorrupt: true, wantSeg: first, wantOff: firstOffs[len(firstOffs)-1]},
		{name: "zero tail in a non-last segment, next segment continues", seg: first, corrupt: func(b []byte) []byte {
			return append(b, make([]byte, 5000)...)
		}, wantLast: l.last},
		{name: "zero tail hiding lost frames in a non-last segment", seg: first, corrupt: func(b []byte) []byte {
			clear(b[firstOffs[len(firstOffs)-2]:])
			return append(b, make([]byte, 1000)...)
		}, wantCorrupt: true, wantSeg: first, wantOff: firstOffs[len(firstOffs)-2]},
		{name: "zero tail hiding the last frame of a non-last segment (no preallocated space)", seg: first, corrupt: func(b []byte) []byte {
			clear(b[firstOffs[len(firstOffs)-1]:])
			return b
		}, wantCorrupt: true, wantSeg: first, wantOff: firstOffs[len(firstOffs)-1]},
		{name: "zeroed frame in a non-last segment, valid frames after", seg: first, corrupt: func(b []byte) []byte {
			clear(b[firstOffs[2]:firstOffs[3]])
			return b
		}, wantCorrupt: true, wantSeg: first, wantOff: firstOffs[2]},
		{name: "zero tail then garbage in a non-last segment", seg: first, corrupt: func(b []byte) []byte {
			b = append(b, make([]byte, 3000)...)
			b[len(b)-1] = 1
			return b
		}, wantCorrupt: true, wantSeg: first, wantOff: firstEnd},
		{name: "trailing garbage in a non-last segment", seg: first, corrupt: func(b []byte) []byte {
			return append(b, 0xde, 0xad)
		}, wantCorrupt: true, wantSeg: first, wantOff: firstEnd},
		{name: "bad header in a non-last segment", seg: second, corrupt: func(b []byte) []byte {
			b[30] ^= 1
			return b
		}, wantCorrupt: true, wantSeg: second, wantOff: 0},
		{name: "missing middle segment", seg: second, corrupt: func([]byte) []byte { return nil },
			wantCorrupt: true, wantSeg: l.names[2], wantOff: 0},
		{name: "missing first segment is fine", seg: first, corrupt: func([]byte) []byte { return nil },
			wantLast: 0 /* set below */},
		{name: "torn header of the last segment", seg: lastSeg, corrupt: func(b []byte) []byte {
			return b[:11]
		}, wantTorn: true, wantSeg: lastSeg, wantOff: 0, wantLast: lastFirstLSN - 1},
		{name: "empty last segment", seg: lastSeg, corrupt: func(b []byte) []byte {
			return b[:0]
		}, wantLast: lastFirstLSN - 1},
		{name: "torn tail in the last segment", seg: lastSeg, corrupt: func(b []byte) []byte {
			return b[:lastEnd-3]
		}, wantTorn: true, wantSeg: lastSeg, wantOff: l.frames[lastSeg][len(l.frames[lastSeg])-1], wantLast: l.last - 1},
		{name: "torn tail in the preallocated last segment", seg: lastSeg, corrupt: func(b []byte) []byte {
			if int64(len(b)) < lastEnd+200 {
				b = append(b, make([]byte, lastEnd+200-int64(len(b)))...)
			}
			b[l.frames[lastSeg][len(l.frames[lastSeg])-1]+1] ^= 1 // the last frame's CRC
			b[lastEnd+100] = 7
			return b
		}, wantTorn: true, wantSeg: lastSeg, wantOff: l.frames[lastSeg][len(l.frames[lastSeg])-1], wantLast: l.last - 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.name == "missing first segment is fine" {
				// Records start after the first segment: check by hand.
				fs := l.install(t, tc.seg, tc.corrupt)
				recs, res := scanAll(t, fs, testDir)
				startLSN, _ := ParseSegmentName(second)
				checkRecs(t, recs, startLSN, l.last)
				if res.Segments[0].Name != second || res.TornTail != nil {
					t.Fatalf("%+v", res)
				}
				return
			}
			runCorruptCase(t, l, tc)
		})
	}
	t.Run("zero tail, then a missing segment", func(t *testing.T) {
		// The first segment ends with zeros and the second is gone: the
		// zeros may hide the lost records, so the error names the first
		// segment where its zeros start.
		fs := l.install(t, second, func([]byte) []byte { return nil })
		f, err := fs.OpenReadWrite(fs.PathJoin(testDir, first), vfs.WriteCategoryUnspecified)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt(make([]byte, 4096), firstEnd); err != nil {
			t.Fatal(err)
		}
		f.Close()
		var ce *CorruptError
		_, err = Scan(fs, testDir, 0, 0, nil)
		if !errors.As(err, &ce) || ce.Segment != first || ce.Offset != firstEnd {
			t.Fatalf("Scan: %v; want a CorruptError at %s:%d", err, first, firstEnd)
		}
		if _, _, err := Open(testOptions(fs), 0, nil); !errors.As(err, &ce) || ce.Segment != first {
			t.Fatalf("Open: %v", err)
		}
	})
}

// TestTornTailEveryLength cuts a small log at every length: Scan and Open
// must always succeed, keep exactly the complete frames, report a torn tail
// whenever bytes are cut, and save them.
func TestTornTailEveryLength(t *testing.T) {
	l := buildRefLog(t, 12, 1<<20)
	seg := l.names[0]
	lend := l.ends[seg]
	full := l.data[seg][:lend+100] // the frames and some preallocated zeros
	l.data[seg] = full             // (install copies it for every cut)
	offs := l.frames[seg]
	for cut := 0; cut <= len(full); cut++ {
		complete := 0 // frames entirely within [0, cut)
		validEnd := int64(segmentHeaderSize)
		for i := range offs {
			end := lend
			if i+1 < len(offs) {
				end = offs[i+1]
			}
			if end <= int64(cut) {
				complete, validEnd = i+1, end
			}
		}
		if cut < segmentHeaderSize {
			validEnd = 0
		}
		fs := l.install(t, seg, func(b []byte) []byte { return b[:cut] })
		var recs []gotRecord
		res, err := Scan(fs, testDir, 0, 0, collect(&recs))
		if err != nil {
			t.Fatalf("cut %d: Scan: %v", cut, err)
		}
		checkRecs(t, recs, 1, LSN(complete))
		// What follows the valid data is torn if it holds a non-zero byte;
		// the cut extends to the last one.
		nzEnd := validEnd
		if int64(cut) > validEnd {
			nzEnd = validEnd + int64(nonZeroEnd(full[validEnd:cut]))
		}
		wantTorn := nzEnd > validEnd
		if (res.TornTail != nil) != wantTorn ||
			(wantTorn && (res.TornTail.Offset != validEnd || res.TornTail.Bytes != nzEnd-validEnd)) {
			t.Fatalf("cut %d: TornTail %+v, want torn=%v at %d, %d bytes", cut, res.TornTail, wantTorn, validEnd, nzEnd-validEnd)
		}

		recs = recs[:0]
		w, ores, err := Open(testOptions(fs), 0, collect(&recs))
		if err != nil {
			t.Fatalf("cut %d: Open: %v", cut, err)
		}
		checkRecs(t, recs, 1, LSN(complete))
		if wantTorn {
			saved := vfstest.ReadFile(t, fs, fs.PathJoin(testDir, ores.TornTail.SavedAs))
			if !bytes.Equal(saved, full[validEnd:nzEnd]) {
				t.Fatalf("cut %d: saved bytes differ", cut)
			}
		}
		appendN(t, w, 1)
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		all, res2 := scanAll(t, fs, testDir)
		checkRecs(t, all, 1, LSN(complete)+1)
		if res2.TornTail != nil {
			t.Fatalf("cut %d: torn tail after repair", cut)
		}
	}
}

func TestTornFileNamesDoNotCollide(t *testing.T) {
	l := buildRefLog(t, 5, 1<<20)
	seg := l.names[0]
	lend := l.ends[seg]
	fs := l.install(t, seg, func(b []byte) []byte { copy(b[lend:], []byte{1, 2, 3}); return b })
	o := testOptions(fs)
	w, res := mustOpen(t, o, 0, nil)
	if res.TornTail == nil || res.TornTail.SavedAs != seg+tornSuffix {
		t.Fatalf("%+v", res.TornTail)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	// Tear it again: the second cut is saved under another name.
	f, err := fs.OpenReadWrite(fs.PathJoin(testDir, seg), vfs.WriteCategoryUnspecified)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte{9, 9}, lend); err != nil {
		t.Fatal(err)
	}
	f.Close()
	w, res = mustOpen(t, o, 0, nil)
	defer w.Close()
	if res.TornTail == nil || res.TornTail.SavedAs != seg+".1"+tornSuffix {
		t.Fatalf("%+v", res.TornTail)
	}
	if got := vfstest.ReadFile(t, fs, fs.PathJoin(testDir, seg+tornSuffix)); !bytes.Equal(got, []byte{1, 2, 3}) {
		t.Fatalf("first .torn file overwritten: %v", got)
	}
	if got := vfstest.ReadFile(t, fs, fs.PathJoin(testDir, seg+".1"+tornSuffix)); !bytes.Equal(got, []byte{9, 9}) {
		t.Fatalf("second .torn file: %v", got)
	}
}

func TestDecodeFrame(t *testing.T) {
	// Round trip.
	for _, n := range []int{0, 1, 7, 8, 100, 1000} {
		p := payloadFor(LSN(n + 3))[:0]
		for i := 0; i < n; i++ {
			p = append(p, byte(i))
		}
		b := make([]byte, frameSize(n)+5)
		putFrame(b[:frameSize(n)], 42, 0, 9, p)
		lsn, typ, payload, size, err := DecodeFrame(b, 0)
		if err != nil || lsn != 42 || typ != 9 || !bytes.Equal(payload, p) || size != frameSize(n) {
			t.Fatalf("n=%d: %d %d %d %v", n, lsn, typ, size, err)
		}
		if _, _, _, _, err := DecodeFrame(b, n-1); n > 1 && !errors.Is(err, ErrCorrupt) {
			t.Fatalf("n=%d: over maxRecordSize accepted: %v", n, err)
		}
		if _, _, _, _, err := DecodeFrame(b[:frameSize(n)-1], 0); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("n=%d: short buffer accepted: %v", n, err)
		}
	}
	if _, _, _, _, err := DecodeFrame(make([]byte, 64), 0); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("all-zero frame accepted: %v", err)
	}
	// Random bytes and mutated frames never panic, and whatever decodes
	// stays within the input.
	rng := rand.New(rand.NewPCG(1, 2))
	valid := make([]byte, frameSize(50))
	putFrame(valid, 7, 0, 3, bytes.Repeat([]byte{0xab}, 50))
	for i := 0; i < 50000; i++ {
		var b []byte
		if i%2 == 0 {
			b = make([]byte, rng.IntN(120))
			for j := range b {
				b[j] = byte(rng.Uint32())
			}
		} else {
			b = slices.Clone(valid)
			for k := rng.IntN(3) + 1; k > 0; k-- {
				b[rng.IntN(len(b))] ^= byte(1 << rng.IntN(8))
			}
			b = b[:rng.IntN(len(b)+1)]
		}
		_, _, payload, n, err := DecodeFrame(b, 1+rng.IntN(200))
		if err == nil && (n > len(b) || len(payload) > n) {
			t.Fatalf("decoded beyond the input: n=%d len=%d", n, len(b))
		}
	}
}

func FuzzDecodeFrame(f *testing.F) {
	valid := make([]byte, frameSize(5))
	putFrame(valid, 1, 0, 1, []byte("hello"))
	f.Add(valid, 100)
	f.Add([]byte{}, 0)
	f.Add(make([]byte, 24), 10)
	f.Fuzz(func(t *testing.T, b []byte, maxRecordSize int) {
		_, _, payload, n, err := DecodeFrame(b, maxRecordSize)
		if err == nil && (n > len(b) || len(payload) > n || n%frameAlign != 0) {
			t.Fatalf("n=%d len=%d payload=%d", n, len(b), len(payload))
		}
	})
}

// FuzzScanSegment feeds arbitrary bytes as the only segment: Scan never
// panics; when Scan accepts the bytes, Open does too (with the same records)
// and leaves a log that rescans cleanly; when Scan reports corruption, Open
// refuses as well.
func FuzzScanSegment(f *testing.F) {
	fs := vfs.NewMem()
	o := testOptions(fs)
	o.SegmentSize = 1 << 20
	w, _, err := Open(o, 0, nil)
	if err != nil {
		f.Fatal(err)
	}
	for i := 1; i <= 6; i++ {
		if _, err := w.Append(kindFor(LSN(i)), payloadFor(LSN(i))[:i*3], nil); err != nil {
			f.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		f.Fatal(err)
	}
	segs := w.Segments()
	file := vfstest.ReadFile(f, fs, fs.PathJoin(testDir, segmentName(1)))
	valid := file[:segs[0].Size] // without the preallocated zeros
	f.Add(valid)
	f.Add(valid[:len(valid)-3])
	f.Add(append(slices.Clone(valid), 0, 0, 0, 1))
	f.Add(valid[:20])
	f.Add(append(slices.Clone(valid), make([]byte, 600)...)) // preallocated
	withTorn := append(slices.Clone(valid), make([]byte, 600)...)
	withTorn[len(valid)+513] = 1
	f.Add(withTorn)
	f.Fuzz(func(t *testing.T, seg []byte) {
		fs := vfs.NewMem()
		if err := fs.MkdirAll(testDir, 0o755); err != nil {
			t.Fatal(err)
		}
		vfstest.WriteFile(t, fs, fs.PathJoin(testDir, segmentName(1)), seg)
		var recs []gotRecord
		res, err := Scan(fs, testDir, 0, 1000, collect(&recs))
		o := testOptions(fs)
		o.MaxRecordSize = 1000
		var orecs []gotRecord
		w, _, oerr := Open(o, 0, collect(&orecs))
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Scan: non-corruption error %v", err)
			}
			if !errors.Is(oerr, ErrCorrupt) {
				t.Fatalf("Scan: %v, but Open: %v", err, oerr)
			}
			return
		}
		if oerr != nil {
			t.Fatalf("Scan accepted (%+v) but Open: %v", res, oerr)
		}
		defer w.Close()
		if len(orecs) != len(recs) || w.LastLSN() != res.LastLSN {
			t.Fatalf("Open replayed %d records (last %d), Scan %d (last %d)", len(orecs), w.LastLSN(), len(recs), res.LastLSN)
		}
		if _, err := w.Append(1, []byte("z"), nil); err != nil {
			t.Fatal(err)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		again, res2 := scanAll(t, fs, testDir)
		if len(again) != len(recs)+1 || res2.TornTail != nil {
			t.Fatalf("after repair: %d records, torn %+v", len(again), res2.TornTail)
		}
	})
}
