package wal

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"slices"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// Record is one record delivered by Scan or Open.
type Record struct {
	LSN  LSN
	Type byte
	// Payload aliases a read buffer: it is only valid during the callback.
	Payload []byte
	// Segment is the base name of the segment file holding the record.
	Segment string
	// Offset is the byte offset of the record's frame in the segment.
	Offset int64
}

// TornTail describes bytes at the end of the last segment that do not form
// valid frames and were (Open) or would be (Scan) cut off.
type TornTail struct {
	Segment string // segment base name
	Offset  int64  // where the cut starts (end of the last valid frame; 0 for a torn header)
	// Bytes is the number of bytes cut: from Offset to the end of the last
	// non-zero byte of the file (the zeros after it are the preallocated
	// space, kept as they are).
	Bytes int64
	// SavedAs is the base name of the file, in the WAL directory, holding the
	// cut bytes; "" when nothing was saved (Scan is read-only).
	SavedAs string
}

// SegmentInfo describes one segment.
type SegmentInfo struct {
	Name     string // base name, fmt.Sprintf("%020d.wal", FirstLSN)
	FirstLSN LSN
	LastLSN  LSN   // FirstLSN-1 when the segment holds no record
	Size     int64 // bytes of valid data: header plus complete frames (the logical end)
	// Allocated is the file size: Size plus the zero-filled space
	// preallocated after the valid data (plus, in the last segment, a torn
	// tail that Scan reports and Open cuts by zeroing it).
	Allocated int64
}

// ScanResult summarises a scan.
type ScanResult struct {
	Segments []SegmentInfo // valid segments, oldest first
	// LastLSN is the LSN of the last valid record (0 if the directory holds
	// no segment; FirstLSN-1 of the first segment if it holds no record).
	LastLSN LSN
	// TornTail is non-nil when non-zero bytes follow the last valid frame of
	// the last segment (or the last segment's header is torn). Trailing zero
	// bytes alone (the preallocated space) are a clean end and are not
	// reported.
	TornTail *TornTail
	// SkippedBytes is, for Open, the number of segment bytes it did not
	// read: records at or below its after argument (see
	// Options.CheckApplied) and, after a clean Close, the preallocated zeros
	// at the end of the last segment. Always 0 for Scan.
	SkippedBytes int64
}

// ErrCorrupt is wrapped by every *CorruptError.
var ErrCorrupt = errors.New("wal: corrupt")

// CorruptError reports bytes that cannot be a crash artifact: a bad frame in a
// segment other than the last one (other than the zero tail of a segment
// followed by its LSN successor), a bad frame followed by valid frames
// without a crash hole in between, an LSN gap between segments, and so on.
type CorruptError struct {
	Segment string // segment base name ("" from DecodeFrame)
	Offset  int64  // byte offset in the segment
	Reason  string
}

func (e *CorruptError) Error() string {
	if e.Segment == "" {
		return fmt.Sprintf("%v: offset %d: %s", ErrCorrupt, e.Offset, e.Reason)
	}
	return fmt.Sprintf("%v: segment %s, offset %d: %s", ErrCorrupt, e.Segment, e.Offset, e.Reason)
}

// Unwrap returns ErrCorrupt.
func (e *CorruptError) Unwrap() error { return ErrCorrupt }

// Scan reads dir read-only (it never creates, modifies or removes
// anything), validates every frame of every segment and calls fn for each
// record with LSN > after, in LSN order. A torn tail in the last segment is
// reported in ScanResult.TornTail and is not an error; any other invalid
// byte yields a *CorruptError. An error returned by fn aborts the scan and
// is returned as is. maxRecordSize <= 0 means the default (64 MiB); a frame
// length above it is corruption.
func Scan(fs vfs.FS, dir string, after LSN, maxRecordSize int, fn func(Record) error) (ScanResult, error) {
	if fs == nil {
		return ScanResult{}, errors.New("wal: Scan: nil vfs.FS")
	}
	o, err := scanDir(fs, fs.PathJoin(dir), after, normMaxRecordSize(maxRecordSize), fn)
	return o.result(), err
}

// tailState classifies what follows the valid data of the last segment.
type tailState uint8

const (
	tailClean      tailState = iota // the file ends right after the last valid frame
	tailZeros                       // only zero bytes follow (a clean end too: the preallocated space)
	tailTorn                        // non-zero bytes that form no acknowledged frame follow
	tailTornHeader                  // the header itself is torn; the segment holds nothing
)

// scanOutcome is what scanDir learned; Open uses it to repair.
type scanOutcome struct {
	segs    []SegmentInfo // valid segments, oldest first (a torn-header segment is not one)
	lastLSN LSN
	// lastOff is the offset of the last valid frame of the last segment (0
	// if it holds none).
	lastOff int64
	// lastVersion is the header version of the last segment with a valid
	// header (the active segment after repair, unless repair creates one).
	lastVersion uint16
	// skipped counts the segment bytes Open did not read.
	skipped int64
	// The remaining fields describe the last segment file; they are only
	// meaningful when tail != tailClean.
	tail      tailState
	tailSeg   string // its base name
	tailFirst LSN    // the LSN its name encodes
	cut       int64  // where its valid data ends (0 for a torn header)
	fileSize  int64  // its size
	// nzEnd is the offset just past the last non-zero byte of [cut,
	// fileSize), or cut when those bytes are all zero.
	nzEnd int64
}

// nonZero reports whether non-zero bytes follow the valid data of the last
// segment.
func (o *scanOutcome) nonZero() bool { return o.nzEnd > o.cut }

func (o *scanOutcome) result() ScanResult {
	r := ScanResult{Segments: o.segs, LastLSN: o.lastLSN}
	if (o.tail == tailTorn || o.tail == tailTornHeader) && o.nonZero() {
		r.TornTail = &TornTail{Segment: o.tailSeg, Offset: o.cut, Bytes: o.nzEnd - o.cut}
	}
	return r
}

type segEntry struct {
	name  string
	first LSN
}

// listSegments returns the segment files of dir ordered by first LSN. Other
// files (e.g. *.torn, the spare *.prealloc) are ignored.
func listSegments(fs vfs.FS, dir string) ([]segEntry, error) {
	names, err := fs.List(dir)
	if err != nil {
		return nil, err
	}
	var segs []segEntry
	for _, n := range names {
		if first, ok := ParseSegmentName(n); ok {
			segs = append(segs, segEntry{name: n, first: first})
		}
	}
	slices.SortFunc(segs, func(a, b segEntry) int { return cmp.Compare(a.first, b.first) })
	return segs, nil
}

type scanner struct {
	fs     vfs.FS
	dir    string
	after  LSN
	maxRec int
	fn     func(Record) error
	// skipApplied: segments all of whose records are <= after (the next
	// segment starts at or below after+1) are not read beyond their header
	// (Open; Scan reads everything).
	skipApplied bool
	// hint is the close hint found by Open (nil if none or for Scan).
	hint *closeHint
	// positions are the position hints found by Open (nil for Scan).
	positions []position
	r         segReader
	lastSeg   bool
	hdr       int // frame header size of the segment being scanned
	// recycled: the segment being scanned is a recycled one (version 3).
	recycled bool
	// zeroTail is set when the previous segment (not the last) ends with
	// zeros after its last valid frame, at zeroTailOff: acceptable only if
	// the next segment continues the LSN sequence.
	zeroTail    bool
	zeroTailSeg string
	zeroTailOff int64
	// bytesSkipped counts segment bytes Open did not read (skipApplied and
	// the close hint), for tests and logs.
	bytesSkipped int64
}

func scanDir(fs vfs.FS, dir string, after LSN, maxRec int, fn func(Record) error) (scanOutcome, error) {
	s := &scanner{fs: fs, dir: dir, after: after, maxRec: maxRec, fn: fn}
	return s.run()
}

func (s *scanner) run() (o scanOutcome, err error) {
	defer func() { o.skipped = s.bytesSkipped }()
	segs, err := listSegments(s.fs, s.dir)
	if err != nil {
		return o, err
	}
	// keepFrom: segments from this index on are read in full. If the last
	// segment's header is torn, Open removes it and appends to the one
	// before, whose logical end it must then know.
	keepFrom := len(segs) - 1
	if s.skipApplied && len(segs) >= 2 {
		ok, err := s.headerValid(segs[len(segs)-1])
		if err != nil {
			return o, err
		}
		if !ok {
			keepFrom--
		}
	}
	for i, seg := range segs {
		if i > 0 && seg.first != o.lastLSN+1 {
			if s.zeroTail {
				// Frames may have been lost to zeros: name the place.
				return o, &CorruptError{Segment: s.zeroTailSeg, Offset: s.zeroTailOff, Reason: fmt.Sprintf(
					"only zero bytes follow the last valid frame (LSN %d), but the next segment %s starts at LSN %d, not %d (records lost to zeros, or a missing segment)",
					o.lastLSN, seg.name, seg.first, o.lastLSN+1)}
			}
			return o, &CorruptError{Segment: seg.name, Reason: fmt.Sprintf(
				"segment starts at LSN %d but the previous one ends at LSN %d (missing or extra segment)",
				seg.first, o.lastLSN)}
		}
		s.zeroTail = false
		s.lastSeg = i == len(segs)-1
		if s.skipApplied && i < keepFrom && segs[i+1].first <= s.after+1 {
			// Every record of this segment is at or below after: Open
			// checks its header and name only (idem verify and Scan read
			// every frame).
			if err := s.headerOnly(&o, seg, segs[i+1].first-1); err != nil {
				return o, err
			}
			continue
		}
		// The segment holding after+1 may be entered at a position hint.
		holdsNext := seg.first <= s.after+1 && (s.lastSeg || segs[i+1].first > s.after+1)
		if err := s.segmentFrom(&o, seg, s.skipApplied && holdsNext); err != nil {
			return o, err
		}
	}
	return o, nil
}

// headerValid reports whether seg has a valid header.
func (s *scanner) headerValid(seg segEntry) (bool, error) {
	f, err := s.fs.Open(s.fs.PathJoin(s.dir, seg.name))
	if err != nil {
		return false, err
	}
	defer f.Close()
	b := make([]byte, segmentHeaderSize)
	if n, err := f.ReadAt(b, 0); n < segmentHeaderSize {
		if err == io.EOF || err == nil {
			return false, nil
		}
		return false, fmt.Errorf("wal: reading segment %s header: %w", seg.name, err)
	}
	first, _, reason := decodeSegmentHeader(b)
	return reason == "" && first == seg.first, nil
}

// headerOnly checks the header of a segment whose records Open need not
// read, and records it as holding LSNs up to last (the next segment's first
// LSN minus one). Its Size is taken to be its file size.
func (s *scanner) headerOnly(o *scanOutcome, seg segEntry, last LSN) error {
	f, err := s.fs.Open(s.fs.PathJoin(s.dir, seg.name))
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	reason := "truncated segment header"
	if st.Size() >= segmentHeaderSize {
		b := make([]byte, segmentHeaderSize)
		if _, err := f.ReadAt(b, 0); err != nil {
			return fmt.Errorf("wal: reading segment %s header: %w", seg.name, err)
		}
		var first LSN
		first, _, reason = decodeSegmentHeader(b)
		if reason == "" && first != seg.first {
			reason = fmt.Sprintf("header first LSN %d does not match the file name", first)
		}
	}
	if reason != "" {
		return &CorruptError{Segment: seg.name, Offset: 0, Reason: reason}
	}
	o.segs = append(o.segs, SegmentInfo{Name: seg.name, FirstLSN: seg.first, LastLSN: last, Size: st.Size(), Allocated: st.Size()})
	o.lastVersion = 0 // never the active segment: see run
	o.lastLSN = last
	s.bytesSkipped += st.Size() - segmentHeaderSize
	return nil
}

// segment validates one segment file, delivering its records.
func (s *scanner) segment(o *scanOutcome, seg segEntry) error { return s.segmentFrom(o, seg, false) }

// segmentFrom is segment; usePositions lets it start at the best position
// hint at or below after+1 (Open, for the segment holding after+1).
func (s *scanner) segmentFrom(o *scanOutcome, seg segEntry, usePositions bool) error {
	f, err := s.fs.Open(s.fs.PathJoin(s.dir, seg.name))
	if err != nil {
		return err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return err
	}
	r := &s.r
	r.reset(f, seg.name, st.Size())
	defer r.reset(nil, "", 0)
	corrupt := func(off int64, reason string) error {
		return &CorruptError{Segment: seg.name, Offset: off, Reason: reason}
	}

	var first LSN
	var version uint16
	hdrReason := "truncated segment header"
	if r.size >= segmentHeaderSize {
		if s.skipApplied {
			r.chunk = segmentHeaderSize // a hint may spare the rest
		}
		b, err := r.at(0, segmentHeaderSize)
		r.chunk = readChunk
		if err != nil {
			return err
		}
		first, version, hdrReason = decodeSegmentHeader(b)
		if hdrReason == "" && first != seg.first {
			hdrReason = fmt.Sprintf("header first LSN %d does not match the file name", first)
		}
	}
	if hdrReason != "" {
		if !s.lastSeg {
			return corrupt(0, hdrReason)
		}
		// The header is fsynced before any frame is written into the
		// segment, so a crash can tear the header only while the segment has
		// no frame. A bad header followed by a valid frame (of either
		// version) is corruption.
		nzEnd, err := r.nonZeroEnd(0, r.size)
		if err != nil {
			return err
		}
		for _, hdr := range []int{frameHeaderSize, frameHeaderSizeV1} {
			s.hdr = hdr
			y, _, err := s.findValidFrame(segmentHeaderSize, segmentHeaderSize, nzEnd, seg.first-1)
			if err != nil {
				return err
			}
			if y >= 0 {
				return corrupt(0, fmt.Sprintf("%s, yet a valid frame follows at offset %d", hdrReason, y))
			}
		}
		o.lastLSN = seg.first - 1
		o.tail, o.tailSeg, o.tailFirst, o.cut, o.fileSize, o.nzEnd = tailTornHeader, seg.name, seg.first, 0, r.size, nzEnd
		return nil
	}
	s.hdr = frameHeaderFor(version)
	s.recycled = version == segmentVersionRecycled
	o.lastVersion = version

	info := SegmentInfo{Name: seg.name, FirstLSN: first, LastLSN: first - 1, Size: segmentHeaderSize, Allocated: r.size}
	off := int64(segmentHeaderSize)
	o.lastOff = 0
	if s.lastSeg && s.hint != nil {
		// Small reads: the hint names one frame and a few zeros to check.
		r.chunk = hintZeroCheck + frameSizeHdr(s.hdr, 0)
		end, last, ok, err := s.useHint(seg, version)
		if err != nil {
			return err
		}
		if ok {
			s.bytesSkipped += end - segmentHeaderSize
			off, info.LastLSN, info.Size = end, last, end
			o.lastOff = s.hint.lastOff
			clean, err := s.zeroAfterHint(end)
			if err != nil {
				return err
			}
			r.chunk = readChunk
			if clean {
				// The close hint says nothing was written after end since
				// the clean close, and the first bytes there are zero:
				// the log ends cleanly at end (idem verify reads the rest).
				s.bytesSkipped += r.size - min(r.size, end+hintZeroCheck)
				o.segs = append(o.segs, info)
				o.lastLSN = info.LastLSN
				o.tail, o.tailSeg, o.tailFirst, o.cut, o.fileSize, o.nzEnd = tailZeros, info.Name, info.FirstLSN, end, r.size, end
				return nil
			}
		}
		r.chunk = readChunk
	}
	if usePositions && off == segmentHeaderSize {
		p, ok, err := s.usePosition(seg)
		if err != nil {
			return err
		}
		if ok {
			s.bytesSkipped += p.off - segmentHeaderSize
			off, info.LastLSN = p.off, p.lsn-1
		}
	}
	for off < r.size {
		fr, err := s.frameAt(off, info.LastLSN+1)
		if err != nil {
			return err
		}
		if fr.code != frameOK {
			reason := fr.reason(info.LastLSN+1, r.size-off, s.maxRec)
			if !s.lastSeg {
				// Only zeros may follow the frames of a segment that is not
				// the last (preallocated space left when it was rotated),
				// and only if the next segment continues the LSN sequence
				// (checked by run): zeros cannot hide lost frames then. In a
				// recycled segment, only the zero padding of the last write
				// is checked: stale bytes of the file's older segment follow
				// it, and continuity is the proof there too.
				to := r.size
				if s.recycled {
					to = min(padEnd(off), r.size)
				}
				nz, err := r.anyNonZero(off, to)
				if err != nil {
					return err
				}
				if nz {
					return corrupt(off, reason)
				}
				s.zeroTail, s.zeroTailSeg, s.zeroTailOff = true, seg.name, off
				break
			}
			if s.recycled {
				return s.tailRecycled(o, info, off, reason)
			}
			return s.tail(o, info, off, reason)
		}
		if fr.lsn > s.after && s.fn != nil {
			if err := s.fn(Record{LSN: fr.lsn, Type: fr.typ, Payload: fr.payload, Segment: seg.name, Offset: off}); err != nil {
				return err
			}
		}
		o.lastOff = off
		info.LastLSN = fr.lsn
		off += int64(fr.n)
		info.Size = off
	}
	o.segs = append(o.segs, info)
	o.lastLSN = info.LastLSN
	return nil
}

// usePosition returns the position hint with the highest LSN at or below
// after+1 in seg whose frame is valid and carries that LSN.
func (s *scanner) usePosition(seg segEntry) (position, bool, error) {
	var best position
	for _, p := range s.positions {
		if p.first == seg.first && p.lsn <= s.after+1 && p.lsn > best.lsn && p.lsn >= seg.first &&
			p.off > segmentHeaderSize && p.off%frameAlign == 0 && p.off < s.r.size {
			best = p
		}
	}
	if best.lsn == 0 {
		return best, false, nil
	}
	fr, err := s.frameAt(best.off, best.lsn)
	if err != nil || fr.code != frameOK {
		return best, false, err
	}
	return best, true, nil
}

// hintZeroCheck is how many bytes after the end named by a close hint Open
// checks to be zero before trusting the hint that the log ends there.
const hintZeroCheck = 4096

// useHint checks the close hint against the last segment: it must name this
// segment, its last LSN must be at or below after (Open need not deliver the
// records before it), and the frame it names must be valid, carry that LSN
// and end where the hint says. It returns the end and last LSN to resume
// from.
func (s *scanner) useHint(seg segEntry, version uint16) (int64, LSN, bool, error) {
	h := s.hint
	if h.segment != seg.name || h.lastLSN > s.after || h.end > s.r.size {
		return 0, 0, false, nil
	}
	if h.lastOff == 0 {
		return h.end, h.lastLSN, h.end == segmentHeaderSize && h.lastLSN == seg.first-1, nil
	}
	if h.lastOff < segmentHeaderSize || h.lastOff%frameAlign != 0 || h.lastOff >= h.end || h.lastLSN < seg.first {
		return 0, 0, false, nil
	}
	fr, err := s.frameAt(h.lastOff, h.lastLSN)
	if err != nil {
		return 0, 0, false, err
	}
	if fr.code != frameOK || h.lastOff+int64(fr.n) != h.end {
		return 0, 0, false, nil
	}
	return h.end, h.lastLSN, true, nil
}

// zeroAfterHint reports whether the first hintZeroCheck bytes at end (or
// up to the end of the file) are zero.
func (s *scanner) zeroAfterHint(end int64) (bool, error) {
	to := end + hintZeroCheck
	if s.recycled {
		to = padEnd(end) // stale bytes follow the padding
	}
	nz, err := s.r.anyNonZero(end, min(s.r.size, to))
	return !nz, err
}

// tail classifies the bytes from x (the first invalid frame of the last
// segment) to the end of the file; see "Torn tail vs corruption" in doc.go.
func (s *scanner) tail(o *scanOutcome, info SegmentInfo, x int64, reason string) error {
	r := &s.r
	nzEnd, err := r.nonZeroEnd(x, r.size)
	if err != nil {
		return err
	}
	state := tailZeros
	if nzEnd > x {
		state = tailTorn
		// Every valid frame after x: if one was written when a record
		// after the last good one was already fsynced, the bytes at x held
		// fsynced frames, lost by the storage, not a torn write.
		first := int64(-1)
		for from := x + frameAlign; from < nzEnd; {
			y, fr, err := s.findValidFrame(from, x, nzEnd, info.LastLSN)
			if err != nil {
				return err
			}
			if y < 0 {
				break
			}
			if first < 0 {
				first = y
			}
			if fr.synced > info.LastLSN {
				return &CorruptError{Segment: info.Name, Offset: x, Reason: fmt.Sprintf(
					"%s after LSN %d, yet the valid frame at offset %d (LSN %d) was written after LSN %d had been fsynced: fsynced records were lost, this is not a torn tail",
					reason, info.LastLSN, y, fr.lsn, fr.synced)}
			}
			from = y + int64(fr.n)
		}
		if first >= 0 {
			hole, err := r.hasHole(x, first)
			if err != nil {
				return err
			}
			if !hole {
				return &CorruptError{Segment: info.Name, Offset: x, Reason: fmt.Sprintf(
					"%s, yet a valid frame follows at offset %d with no crash hole in between", reason, first)}
			}
		}
	}
	o.segs = append(o.segs, info)
	o.lastLSN = info.LastLSN
	o.tail, o.tailSeg, o.tailFirst, o.cut, o.fileSize, o.nzEnd = state, info.Name, info.FirstLSN, x, r.size, nzEnd
	return nil
}

// tailRecycled is tail for the last segment when it is a recycled one: the
// bytes after the log are the zero padding of the last write, then stale
// bytes of the file's older segment (frames with LSNs below the segment's
// first, remnants of them), which are no torn tail; see "Recycling" in
// doc.go for the rules.
func (s *scanner) tailRecycled(o *scanOutcome, info SegmentInfo, x int64, reason string) error {
	r := &s.r
	pz := min(padEnd(x), r.size)
	nz, err := r.anyNonZero(x, pz)
	if err != nil {
		return err
	}
	end := x // the torn bytes are [x, end)
	if nz {
		// The padding was fsynced with the last frame before x: non-zero
		// bytes there were written after it, and never fsynced.
		end = pz
		if x+int64(s.hdr) <= r.size {
			hdr, err := r.at(x, s.hdr)
			if err != nil {
				return err
			}
			if LSN(binary.LittleEndian.Uint64(hdr[8:])) == info.LastLSN+1 {
				// The head of the next frame of this log, torn.
				if _, n, code := frameLength(hdr, s.hdr, r.size-x, s.maxRec); code == frameOK {
					end = max(end, x+int64(n))
				}
			}
		}
	}
	// Valid frames of this log after x (stale frames have lower LSNs):
	// the synced proof as in tail; with none of them proving anything, they
	// are a torn tail whatever lies between (a block lost by the crash
	// reads as stale bytes here, not as zeros, so there is no hole rule).
	for from := x + frameAlign; from < r.size; {
		y, fr, err := s.findValidFrame(from, x, r.size, info.LastLSN)
		if err != nil {
			return err
		}
		if y < 0 {
			break
		}
		if fr.synced > info.LastLSN {
			return &CorruptError{Segment: info.Name, Offset: x, Reason: fmt.Sprintf(
				"%s after LSN %d, yet the valid frame at offset %d (LSN %d) was written after LSN %d had been fsynced: fsynced records were lost, this is not a torn tail",
				reason, info.LastLSN, y, fr.lsn, fr.synced)}
		}
		end = max(end, y+int64(fr.n), pz)
		from = y + int64(fr.n)
	}
	state := tailZeros
	if end > x {
		state = tailTorn
	}
	o.segs = append(o.segs, info)
	o.lastLSN = info.LastLSN
	o.tail, o.tailSeg, o.tailFirst, o.cut, o.fileSize, o.nzEnd = state, info.Name, info.FirstLSN, x, r.size, end
	return nil
}

// frame is a decoded frame or the reason it is not one.
type frame struct {
	code    frameCode
	lsn     LSN
	synced  LSN
	typ     byte
	payload []byte
	n       int    // frame size including padding
	length  uint32 // raw length field (for error messages)
}

// frameLSNMismatch extends frameCode for scans: a valid frame whose LSN is not
// the next one.
const frameLSNMismatch frameCode = 255

func (f *frame) reason(want LSN, avail int64, maxRec int) string {
	switch f.code {
	case frameLSNMismatch:
		return fmt.Sprintf("frame LSN %d, want %d", f.lsn, want)
	case frameTooLong:
		return fmt.Sprintf("frame length %d exceeds the maximum record size %d", f.length, maxRec)
	case framePastEOF:
		return fmt.Sprintf("frame of %d payload bytes extends past the end of the file (%d bytes left)", f.length, avail)
	case frameTruncatedHeader:
		return fmt.Sprintf("truncated frame header (%d bytes left)", avail)
	}
	return f.code.String()
}

// frameAt decodes the frame at off, expecting LSN want. Errors are I/O
// errors; invalid bytes are reported through frame.code.
func (s *scanner) frameAt(off int64, want LSN) (frame, error) {
	r := &s.r
	avail := r.size - off
	if avail < int64(s.hdr) {
		return frame{code: frameTruncatedHeader}, nil
	}
	hdr, err := r.at(off, s.hdr)
	if err != nil {
		return frame{}, err
	}
	fr := frame{length: binary.LittleEndian.Uint32(hdr[4:])}
	length, n, code := frameLength(hdr, s.hdr, avail, s.maxRec)
	if code != frameOK {
		fr.code = code
		return fr, nil
	}
	b, err := r.at(off, n)
	if err != nil {
		return frame{}, err
	}
	d, code := verifyFrame(b, s.hdr, length)
	fr.lsn, fr.synced, fr.typ, fr.payload, fr.code = d.lsn, d.synced, d.typ, d.payload, code
	fr.n = n
	if fr.code == frameOK && fr.lsn != want {
		fr.code = frameLSNMismatch
	}
	return fr, nil
}

// findValidFrame returns the first 8-aligned offset y >= from holding a valid
// frame (of the segment's frame version) whose LSN is above lastGood, and
// that frame; or -1. base is where the frames after
// lastGood start: a frame we wrote at y can carry LSN lastGood+k only if the
// k-1 frames before it fit in [base, y), which rules out almost every
// garbage offset before the checksum is computed. Only offsets below nzEnd
// (the end of the non-zero bytes) are tried: a frame header is never all
// zero, so no frame starts in the zeros after them.
func (s *scanner) findValidFrame(from, base, nzEnd int64, lastGood LSN) (int64, frame, error) {
	r := &s.r
	minFrame := uint64(frameSizeHdr(s.hdr, 0))
	for y := from; y < nzEnd && y+int64(s.hdr) <= r.size; y += frameAlign {
		hdr, err := r.at(y, s.hdr)
		if err != nil {
			return -1, frame{}, err
		}
		lsn := LSN(binary.LittleEndian.Uint64(hdr[8:]))
		if lsn <= lastGood || uint64(lsn-lastGood-1) > uint64(y-base)/minFrame {
			continue
		}
		length, n, code := frameLength(hdr, s.hdr, r.size-y, s.maxRec)
		if code != frameOK {
			continue
		}
		b, err := r.at(y, n)
		if err != nil {
			return -1, frame{}, err
		}
		if d, code := verifyFrame(b, s.hdr, length); code == frameOK {
			return y, frame{lsn: d.lsn, synced: d.synced, typ: d.typ, n: n}, nil
		}
	}
	return -1, frame{}, nil
}

// segReader reads a segment through a sliding window. Every request is
// bounded by the file size before anything is allocated.
type segReader struct {
	f     vfs.File
	name  string
	chunk int    // minimum read size; readChunk unless set after reset
	size  int64  // file size when the scan started
	buf   []byte // holds file bytes [off, off+len(buf))
	off   int64
}

// readChunk is the minimum window size.
const readChunk = 1 << 20

func (r *segReader) reset(f vfs.File, name string, size int64) {
	r.f, r.name, r.size, r.off, r.chunk = f, name, size, 0, readChunk
	r.buf = r.buf[:0]
	if cap(r.buf) > 8*readChunk {
		r.buf = nil // do not pin a huge window (from a huge record) across segments
	}
}

// at returns file bytes [off, off+n); the caller guarantees off+n <= size.
// The slice is valid until the next call.
func (r *segReader) at(off int64, n int) ([]byte, error) {
	if off >= r.off && off+int64(n) <= r.off+int64(len(r.buf)) {
		return r.buf[off-r.off : off-r.off+int64(n)], nil
	}
	if off < 0 || n < 0 || off+int64(n) > r.size {
		return nil, fmt.Errorf("wal: internal error: read [%d,+%d) outside segment %s of %d bytes", off, n, r.name, r.size)
	}
	want := int(min(max(int64(n), int64(r.chunk)), r.size-off))
	if cap(r.buf) < want {
		r.buf = make([]byte, want)
	}
	r.buf = r.buf[:want]
	m, err := r.f.ReadAt(r.buf, off)
	if m < n {
		if err == nil || err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		r.buf = r.buf[:0]
		return nil, fmt.Errorf("wal: reading segment %s at offset %d: %w", r.name, off, err)
	}
	r.buf, r.off = r.buf[:m], off
	return r.buf[:n], nil
}

var zeroBlock [4096]byte

// anyNonZero reports whether bytes [from, to) contain a non-zero byte.
func (r *segReader) anyNonZero(from, to int64) (bool, error) {
	for off := from; off < to; {
		n := int(min(to-off, readChunk))
		b, err := r.at(off, n)
		if err != nil {
			return false, err
		}
		for len(b) > 0 {
			k := min(len(b), len(zeroBlock))
			if !bytes.Equal(b[:k], zeroBlock[:k]) {
				return true, nil
			}
			b = b[k:]
		}
		off += int64(n)
	}
	return false, nil
}

// nonZeroEnd returns the offset just past the last non-zero byte in [from,
// to), or from if those bytes are all zero. It reads the whole range once.
func (r *segReader) nonZeroEnd(from, to int64) (int64, error) {
	end := from
	for off := from; off < to; {
		n := int(min(to-off, readChunk))
		b, err := r.at(off, n)
		if err != nil {
			return 0, err
		}
		for i := 0; i < len(b); {
			k := min(len(b)-i, len(zeroBlock))
			if blk := b[i : i+k]; !bytes.Equal(blk, zeroBlock[:k]) {
				j := k - 1
				for blk[j] == 0 {
					j--
				}
				end = off + int64(i+j+1)
			}
			i += k
		}
		off += int64(n)
	}
	return end, nil
}

// hasHole reports whether [x, y) contains a crash hole: a zero-filled
// 512-byte sector at a 512-aligned offset, or zeros from x up to the next
// sector boundary (a crash drops whole blocks, and the first unsynced write
// starts exactly at the frame boundary x, which need not be sector aligned).
func (r *segReader) hasHole(x, y int64) (bool, error) {
	for s := (x/sectorSize + 1) * sectorSize; s <= y; s += sectorSize {
		from := s - sectorSize
		if from < x {
			from = x // the partial first sector: zeros from x to its end
		}
		nz, err := r.anyNonZero(from, s)
		if err != nil {
			return false, err
		}
		if !nz {
			return true, nil
		}
	}
	return false, nil
}
