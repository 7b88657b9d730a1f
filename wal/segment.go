package wal

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// Wire format constants. They are frozen: changing any of them changes the
// on-disk format (see doc.go).
const (
	segmentMagic = "IDEMWAL1"
	// segmentVersion is the version written into new zero-filled (or
	// growing) segments. Version 1 segments (frames without the synced LSN)
	// are still read.
	segmentVersion  = 2
	segmentVersion1 = 1
	// segmentVersionRecycled marks a recycled segment: version 2 frames in
	// a file that held an older segment, whose bytes after the log may be
	// stale (frames with LSNs below the header's first LSN, remnants of
	// them). Every write ends with zero padding up to padEnd (see
	// "Recycling" in doc.go).
	segmentVersionRecycled = 3
	segmentHeaderSize      = 32
	// segmentHeaderCRCOffset is where the header checksum lives; it covers
	// bytes [0, segmentHeaderCRCOffset).
	segmentHeaderCRCOffset = 28

	segmentSuffix  = ".wal"
	segmentNameLen = 20 + len(segmentSuffix)
	tornSuffix     = ".torn"
	preallocSuffix = ".prealloc"

	// minPad is the least number of zero bytes that follow the log in a
	// recycled segment: a frame never begins with 8 zero bytes.
	minPad = 8
	// padAlign: the padding of a write into a recycled segment runs up to
	// a multiple of it, the page size, so that no write leaves a page
	// partly written: the kernel would first read such a page from the
	// disk if the recycled file's page is no longer cached (the first page
	// of a write was just written by the one before, and is cached).
	padAlign = 4096

	// frameHeaderSize is the header of a version 2 frame: crc(4) +
	// length(4) + lsn(8) + synced LSN(8) + type(1).
	frameHeaderSize = 25
	// frameHeaderSizeV1 is the header of a version 1 frame: crc(4) +
	// length(4) + lsn(8) + type(1).
	frameHeaderSizeV1 = 17
	// frameAlign is the alignment of every frame start (and so of frame sizes).
	frameAlign = 8

	// sectorSize is the granularity at which a crash hole is recognised (see
	// the torn-tail rules in doc.go).
	sectorSize = 512
)

// Defaults and limits for Options.
const (
	defaultSegmentSize   = 64 << 20
	defaultMaxRecordSize = 64 << 20
	defaultSyncInterval  = 100 * time.Millisecond
	// maxRecordSizeLimit bounds MaxRecordSize so that frame sizes always fit
	// the uint32 length field and int arithmetic on every platform.
	maxRecordSizeLimit = 1 << 30
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// normMaxRecordSize applies the default to n <= 0 and clamps it to the limit.
func normMaxRecordSize(n int) int {
	if n <= 0 {
		return defaultMaxRecordSize
	}
	return min(n, maxRecordSizeLimit)
}

// segmentName returns the file name of the segment whose first record has
// LSN first.
func segmentName(first LSN) string { return fmt.Sprintf("%020d%s", uint64(first), segmentSuffix) }

// ParseSegmentName reports whether name is a segment file name and, if so,
// the LSN it encodes. Only exactly 20 decimal digits followed by ".wal" are
// accepted; LSN 0 is never used and so is not a segment.
func ParseSegmentName(name string) (LSN, bool) {
	if len(name) != segmentNameLen || !strings.HasSuffix(name, segmentSuffix) {
		return 0, false
	}
	digits := name[:20]
	for i := 0; i < len(digits); i++ {
		if digits[i] < '0' || digits[i] > '9' {
			return 0, false
		}
	}
	v, err := strconv.ParseUint(digits, 10, 64)
	if err != nil || v == 0 {
		return 0, false
	}
	return LSN(v), true
}

// frameSize returns the on-disk size of a (version 2) frame carrying
// payloadLen bytes.
func frameSize(payloadLen int) int { return frameSizeHdr(frameHeaderSize, payloadLen) }

// frameSizeHdr returns the on-disk size of a frame whose header is hdr bytes
// (frameHeaderSize or frameHeaderSizeV1) carrying payloadLen bytes.
func frameSizeHdr(hdr, payloadLen int) int {
	return (hdr + payloadLen + frameAlign - 1) &^ (frameAlign - 1)
}

// padEnd is where the zero padding after a write ending at end stops in a
// recycled segment: at least minPad bytes, up to a padAlign boundary.
func padEnd(end int64) int64 { return (end + minPad + padAlign - 1) &^ (padAlign - 1) }

// frameHeaderFor returns the frame header size of a segment version.
func frameHeaderFor(version uint16) int {
	if version == segmentVersion1 {
		return frameHeaderSizeV1
	}
	return frameHeaderSize
}

// encodeSegmentHeader returns the 32-byte header of a segment starting at
// first.
func encodeSegmentHeader(first LSN) []byte {
	b := make([]byte, segmentHeaderSize)
	copy(b, segmentMagic)
	binary.LittleEndian.PutUint16(b[8:], segmentVersion)
	binary.LittleEndian.PutUint64(b[16:], uint64(first))
	binary.LittleEndian.PutUint32(b[segmentHeaderCRCOffset:], crc32.Checksum(b[:segmentHeaderCRCOffset], castagnoli))
	return b
}

// encodeSegmentHeaderVersion is encodeSegmentHeader for a given version
// (tests write version 1 segments with it).
func encodeSegmentHeaderVersion(first LSN, version uint16) []byte {
	b := encodeSegmentHeader(first)
	binary.LittleEndian.PutUint16(b[8:], version)
	binary.LittleEndian.PutUint32(b[segmentHeaderCRCOffset:], crc32.Checksum(b[:segmentHeaderCRCOffset], castagnoli))
	return b
}

// decodeSegmentHeader validates a segment header and returns its first LSN
// and version (1, 2 or 3). It returns a non-empty reason when the header is
// invalid.
func decodeSegmentHeader(b []byte) (LSN, uint16, string) {
	if len(b) < segmentHeaderSize {
		return 0, 0, "truncated segment header"
	}
	if string(b[:8]) != segmentMagic {
		return 0, 0, "bad segment magic"
	}
	if crc32.Checksum(b[:segmentHeaderCRCOffset], castagnoli) != binary.LittleEndian.Uint32(b[segmentHeaderCRCOffset:]) {
		return 0, 0, "bad segment header checksum"
	}
	v := binary.LittleEndian.Uint16(b[8:])
	if v != segmentVersion && v != segmentVersion1 && v != segmentVersionRecycled {
		return 0, 0, fmt.Sprintf("unsupported segment version %d", v)
	}
	first := LSN(binary.LittleEndian.Uint64(b[16:]))
	if first == 0 {
		return 0, 0, "segment header first LSN is 0"
	}
	return first, v, ""
}

// putFrame encodes one version 2 frame into dst, which must be exactly
// frameSize(len(payload)) bytes long. synced is the last LSN known to be
// fsynced when the frame was encoded (below lsn). It zeroes the padding
// because dst is usually a recycled buffer.
func putFrame(dst []byte, lsn, synced LSN, typ byte, payload []byte) {
	end := frameHeaderSize + len(payload)
	binary.LittleEndian.PutUint32(dst[4:], uint32(len(payload)))
	binary.LittleEndian.PutUint64(dst[8:], uint64(lsn))
	binary.LittleEndian.PutUint64(dst[16:], uint64(synced))
	dst[24] = typ
	copy(dst[frameHeaderSize:], payload)
	clear(dst[end:])
	binary.LittleEndian.PutUint32(dst[0:], crc32.Update(0, castagnoli, dst[4:end]))
}

// putFrameV1 encodes one version 1 frame (no synced LSN), for tests of the
// old format.
func putFrameV1(dst []byte, lsn LSN, typ byte, payload []byte) {
	end := frameHeaderSizeV1 + len(payload)
	binary.LittleEndian.PutUint32(dst[4:], uint32(len(payload)))
	binary.LittleEndian.PutUint64(dst[8:], uint64(lsn))
	dst[16] = typ
	copy(dst[frameHeaderSizeV1:], payload)
	clear(dst[end:])
	binary.LittleEndian.PutUint32(dst[0:], crc32.Update(0, castagnoli, dst[4:end]))
}

// frameCode classifies why bytes are not a valid frame. The hot paths work
// with codes; human-readable reasons are only built for errors.
type frameCode uint8

const (
	frameOK frameCode = iota
	frameTruncatedHeader
	frameTooLong
	framePastEOF
	frameBadCRC
	frameZeroLSN
	frameZeroType
	frameBadPadding
	frameBadSynced
)

func (c frameCode) String() string {
	switch c {
	case frameOK:
		return "ok"
	case frameTruncatedHeader:
		return "truncated frame header"
	case frameTooLong:
		return "frame length exceeds the maximum record size"
	case framePastEOF:
		return "frame extends past the end of the file"
	case frameBadCRC:
		return "frame checksum mismatch"
	case frameZeroLSN:
		return "frame LSN is 0"
	case frameZeroType:
		return "frame type is 0"
	case frameBadPadding:
		return "non-zero frame padding"
	case frameBadSynced:
		return "frame synced LSN is not below its LSN"
	default:
		return "unknown frame error"
	}
}

// frameLength reads the payload length of the frame header hdr (at least 8
// bytes) of a frame whose header is hdrSize bytes, and bounds it by
// maxRecordSize and by avail, the number of bytes from the frame start to the
// end of the file. It returns the payload length and the full frame size.
// Nothing is allocated: callers allocate or read only after this check
// passed.
func frameLength(hdr []byte, hdrSize int, avail int64, maxRecordSize int) (int, int, frameCode) {
	l := binary.LittleEndian.Uint32(hdr[4:])
	if uint64(l) > uint64(maxRecordSize) {
		return 0, 0, frameTooLong
	}
	n := frameSizeHdr(hdrSize, int(l))
	if int64(n) > avail {
		return 0, 0, framePastEOF
	}
	return int(l), n, frameOK
}

// decodedFrame is a frame verifyFrame accepted.
type decodedFrame struct {
	lsn     LSN
	synced  LSN // 0 in version 1 frames (which do not record it)
	typ     byte
	payload []byte
}

// verifyFrame checks a complete frame (exactly frameSizeHdr(hdrSize, length)
// bytes) whose length was validated by frameLength. hdrSize selects the
// layout: frameHeaderSize (version 2) or frameHeaderSizeV1.
func verifyFrame(frame []byte, hdrSize, length int) (decodedFrame, frameCode) {
	end := hdrSize + length
	if crc32.Update(0, castagnoli, frame[4:end]) != binary.LittleEndian.Uint32(frame) {
		return decodedFrame{}, frameBadCRC
	}
	d := decodedFrame{lsn: LSN(binary.LittleEndian.Uint64(frame[8:])), typ: frame[hdrSize-1]}
	if d.lsn == 0 {
		return decodedFrame{}, frameZeroLSN
	}
	if d.typ == 0 {
		return decodedFrame{}, frameZeroType
	}
	if hdrSize == frameHeaderSize {
		d.synced = LSN(binary.LittleEndian.Uint64(frame[16:]))
		if d.synced >= d.lsn {
			return decodedFrame{}, frameBadSynced
		}
	}
	for _, c := range frame[end:] {
		if c != 0 {
			return decodedFrame{}, frameBadPadding
		}
	}
	d.payload = frame[hdrSize:end]
	return d, frameOK
}

// DecodeFrame parses exactly one frame of the current format (version 2) at
// the start of b. It returns the record, the number of bytes the frame
// occupies (including padding) or an error wrapping ErrCorrupt. payload
// aliases b. It never panics and never allocates more than a small error
// value. A maxRecordSize <= 0 means the default (64 MiB).
func DecodeFrame(b []byte, maxRecordSize int) (lsn LSN, typ byte, payload []byte, n int, err error) {
	maxRecordSize = normMaxRecordSize(maxRecordSize)
	if len(b) < frameHeaderSize {
		return 0, 0, nil, 0, &CorruptError{Reason: frameTruncatedHeader.String()}
	}
	length, n, code := frameLength(b, frameHeaderSize, int64(len(b)), maxRecordSize)
	if code != frameOK {
		return 0, 0, nil, 0, &CorruptError{Reason: code.String()}
	}
	d, code := verifyFrame(b[:n], frameHeaderSize, length)
	if code != frameOK {
		return 0, 0, nil, 0, &CorruptError{Reason: code.String()}
	}
	return d.lsn, d.typ, d.payload, n, nil
}

// segFile is the active segment, open for appending. After Open it is owned
// by the flusher goroutine (and by Close once the flusher has exited).
//
// The file is normally preallocated: zero-filled and fsynced up to about
// SegmentSize before any frame goes into it, or recycled from an old
// segment, so frames overwrite allocated blocks at the logical end and a
// flush is made durable with fdatasync (SyncData), which then has no
// file-size change to commit. A write past the allocated size just extends
// the file (see doc.go).
type segFile struct {
	f     vfs.File
	name  string // base name
	first LSN
	end   int64 // logical end: offset of the next frame (header plus frames written)
	alloc int64 // file size; >= end
	// recycled: a version 3 segment, whose every write is followed by
	// zeros up to padEnd (the bytes after them may be stale).
	recycled bool
	// lastOff is the offset of the last frame written (0: none yet) and
	// lastLSN its LSN (first-1 when none), for the close hint.
	lastOff int64
	lastLSN LSN
}

// write writes p at the logical end (in a recycled segment followed by its
// zero padding, in the same WriteAt; p's capacity may be used for it).
func (s *segFile) write(p []byte) error {
	n := len(p)
	if s.recycled {
		pad := int(padEnd(s.end+int64(n)) - s.end - int64(n))
		p = append(p, zeroPad[:pad]...) // copies: WriteAt may modify its input
	}
	m, err := s.f.WriteAt(p, s.end)
	s.alloc = max(s.alloc, s.end+int64(m))
	s.end += int64(min(m, n))
	if err == nil && m != len(p) {
		err = io.ErrShortWrite
	}
	return err
}

// zeroPad is the source of the zero padding of recycled segments.
var zeroPad [padAlign + minPad]byte

// preallocName is the base name of the spare segment file: zero-filled and
// fsynced ahead of time (by a background goroutine), or a recycled old
// segment, it becomes the next segment at rotation by being renamed. It is
// not a segment name, so Scan ignores it.
const preallocName = "next" + preallocSuffix

// recycledName returns the base name of the ith kept recycled file
// ("recycled0.prealloc", ...): an old segment released by
// RemoveSegmentsThrough and kept for reuse (at most maxRecycled of them).
// The next preparation of the spare file takes one (renames it to
// preallocName) instead of zero-filling a new one. Its header is a spare
// header (below).
func recycledName(i int) string { return fmt.Sprintf("recycled%d%s", i, preallocSuffix) }

// maxRecycled bounds the recycled files kept: the engine removes segments in
// groups (a compaction every CompactWALBytes, two segments by default), and
// each of them should become a later segment.
const maxRecycled = 2

// removeRecycled removes the recycled files an earlier run kept (Open
// without Preallocate, which never takes them: a log reopened with
// preallocation off, or under SyncNever, would keep up to maxRecycled
// segments' worth of disk for nothing). A failure is logged, not
// returned: the file is only unused space, and the next Open tries again.
// No directory fsync: a removal lost in a crash is redone then.
func (w *WAL) removeRecycled() {
	fs, dir := w.opts.FS, w.opts.Dir
	for i := range maxRecycled {
		p := fs.PathJoin(dir, recycledName(i))
		if err := fs.Remove(p); err == nil {
			w.logger.Info("wal: removed a recycled segment kept by an earlier run (preallocation is off)", "file", p)
		} else if !errors.Is(err, os.ErrNotExist) {
			w.logger.Warn("wal: could not remove a recycled segment kept by an earlier run", "file", p, "error", err)
		}
	}
}

// A recycled spare file (a recycledName, or preallocName once taken) starts
// with a spare header: a version 3 segment header whose first LSN is a
// bound B such that every valid frame anywhere in the file has an LSN below
// B. It becomes a segment only for a first LSN >= B, so the stale frames of
// a recycled segment are exactly those below its first LSN. A spare file
// left with the version 3 header of a segment whose activation was
// interrupted (see activateSegment) is a spare header too.

// spareBound returns the bound of the recycled spare file f (whose size is
// size), and whether f is one: its first bytes are a valid version 3
// header.
func spareBound(f vfs.File, size int64) (LSN, bool, error) {
	if size < segmentHeaderSize {
		return 0, false, nil
	}
	b := make([]byte, segmentHeaderSize)
	if _, err := f.ReadAt(b, 0); err != nil {
		return 0, false, err
	}
	first, v, reason := decodeSegmentHeader(b)
	if reason != "" || v != segmentVersionRecycled {
		return 0, false, nil
	}
	return first, true, nil
}

// recycleSegment turns the old segment name (whose records all have LSNs
// below bound) into a recycled file, if fewer than slots are kept: it
// renames it to a free recycledName, fsyncs the directory (so that the
// segment can never reappear once its header is overwritten: a crash before
// leaves the segment, which is removed again later, or an unusable spare
// file that is replaced), then writes the spare header over the segment
// header and fsyncs the file. It reports false, having done nothing, when
// slots recycled files are kept already.
func recycleSegment(fs vfs.FS, dir, name string, bound LSN, slots int) (bool, error) {
	path := ""
	for i := range slots {
		p := fs.PathJoin(dir, recycledName(i))
		if _, err := fs.Stat(p); errors.Is(err, os.ErrNotExist) {
			path = p
			break
		} else if err != nil {
			return false, err
		}
	}
	if path == "" {
		return false, nil
	}
	if err := fs.Rename(fs.PathJoin(dir, name), path); err != nil {
		return false, err
	}
	if err := SyncDir(fs, dir); err != nil {
		return true, err
	}
	f, err := fs.OpenReadWrite(path, vfs.WriteCategoryUnspecified)
	if err != nil {
		return true, err
	}
	_, err = f.WriteAt(encodeSegmentHeaderVersion(bound, segmentVersionRecycled), 0)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return true, err
}

// takeRecycled renames a kept recycled file, if any, to the spare file name
// when there is no spare file. The directory is not fsynced: either name
// is recognised after a crash, and activateSegment's rename is followed by
// a directory fsync.
func takeRecycled(fs vfs.FS, dir string) error {
	spare := fs.PathJoin(dir, preallocName)
	if _, err := fs.Stat(spare); err == nil {
		return nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	for i := range maxRecycled {
		err := fs.Rename(fs.PathJoin(dir, recycledName(i)), spare)
		if !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	return nil
}

// preparePrealloc makes sure that the spare file preallocName exists, is
// size bytes long, is all zero (a segment header in its first 32 bytes is
// tolerated: activateSegment overwrites it) and is fsynced. With
// acceptRecycled, a recycled spare file (spareBound) of at least size bytes
// is fine too. A leftover (from a clean Close or a crash) is checked and
// reused; anything else is replaced by a new file, zero-filled with real
// writes in zeroChunkSize chunks and fsynced. The directory is not fsynced:
// the spare file only matters once activateSegment renamed it, which fsyncs
// the directory.
func preparePrealloc(fs vfs.FS, dir string, size int64, acceptRecycled bool) error {
	path := fs.PathJoin(dir, preallocName)
	switch st, err := fs.Stat(path); {
	case err == nil:
		if (acceptRecycled && st.Size() >= size) || st.Size() == size {
			ok, err := reusePrealloc(fs, path, st.Size(), size, acceptRecycled)
			if err != nil || ok {
				return err
			}
		}
		if err := fs.Remove(path); err != nil {
			return err
		}
	case !errors.Is(err, os.ErrNotExist):
		return err
	}
	f, err := fs.Create(path, vfs.WriteCategoryUnspecified)
	if err != nil {
		return err
	}
	err = writeZeros(f, size)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		// Never leave a partly zero-filled file taking the space (on a
		// full disk it holds whatever was free).
		if rerr := fs.Remove(path); rerr != nil && !errors.Is(rerr, os.ErrNotExist) {
			err = fmt.Errorf("%w (and removing the partial %s: %v)", err, preallocName, rerr)
		}
	}
	return err
}

// isNoSpace reports whether err says the disk (or the user's quota, or the
// file size limit) is full.
func isNoSpace(err error) bool {
	return errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EDQUOT) || errors.Is(err, syscall.EFBIG)
}

// reusePrealloc checks a leftover spare file of have bytes: it is reusable
// when it is a recycled spare (with acceptRecycled), or when it is want
// bytes long and bytes [segmentHeaderSize, want) are all zero. It is
// fsynced before being reused (a crash may have interrupted its creation
// before the fsync).
func reusePrealloc(fs vfs.FS, path string, have, want int64, acceptRecycled bool) (bool, error) {
	f, err := fs.OpenReadWrite(path, vfs.WriteCategoryUnspecified)
	if err != nil {
		return false, err
	}
	defer f.Close()
	ok := false
	if acceptRecycled {
		if _, ok, err = spareBound(f, have); err != nil {
			return false, err
		}
	}
	if !ok && have == want {
		r := segReader{f: f, name: preallocName, size: have}
		nz, err := r.anyNonZero(min(segmentHeaderSize, have), have)
		if err != nil {
			return false, err
		}
		ok = !nz
	}
	if !ok {
		return false, nil
	}
	return true, f.Sync()
}

// activateSegment turns the spare file into the segment starting at first,
// so that the new (empty) segment, with its header, survives a crash before
// any record is written into it.
//
// A zero-filled (or empty) spare file is renamed, the segment header is
// written over its first bytes, the file fsynced and the directory fsynced;
// a crash between the rename and the header's fsync leaves a torn header
// over an empty segment, which Open removes.
//
// A recycled spare file (spareBound) becomes a version 3 segment, and in the
// other order: its header, followed by zeros up to padEnd, is written and
// fsynced before the rename, then the directory is fsynced. A torn header
// over a recycled file could not be told from a segment's torn first
// frames as cheaply, and a crash before the rename leaves a spare file with
// the new header, which is still a spare header. It is used only if first is
// at least its bound (otherwise, which only a directory whose log was
// replaced can cause, it is replaced by an empty spare file first).
func activateSegment(fs vfs.FS, dir string, first LSN) (*segFile, error) {
	spare := fs.PathJoin(dir, preallocName)
	name := segmentName(first)
	path := fs.PathJoin(dir, name)
	f, err := fs.OpenReadWrite(spare, vfs.WriteCategoryUnspecified)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	bound, recycled, err := spareBound(f, st.Size())
	if err == nil && recycled {
		if first < bound {
			_ = f.Close()
			if err := preparePrealloc(fs, dir, 0, false); err != nil {
				return nil, err
			}
			return activateSegment(fs, dir, first)
		}
		hdr := append(encodeSegmentHeaderVersion(first, segmentVersionRecycled), make([]byte, padEnd(segmentHeaderSize)-segmentHeaderSize)...)
		_, err = f.WriteAt(hdr, 0)
		if err == nil {
			err = f.Sync()
		}
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	if err := fs.Rename(spare, path); err != nil {
		return nil, err
	}
	if f, err = fs.OpenReadWrite(path, vfs.WriteCategoryUnspecified); err != nil {
		return nil, err
	}
	s := &segFile{f: f, name: name, first: first, end: segmentHeaderSize, alloc: max(st.Size(), padEnd(segmentHeaderSize)),
		recycled: true, lastLSN: first - 1}
	if !recycled {
		s.end, s.alloc, s.recycled = 0, st.Size(), false
		err = s.write(encodeSegmentHeader(first))
		if err == nil {
			err = f.Sync()
		}
	}
	if err == nil {
		err = SyncDir(fs, dir)
	}
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	return s, nil
}

// SyncDir fsyncs a directory so that entries created, renamed or removed in it
// are durable.
func SyncDir(fs vfs.FS, dir string) error {
	d, err := fs.OpenDir(dir)
	if err != nil {
		return err
	}
	if err := d.Sync(); err != nil {
		_ = d.Close()
		return err
	}
	return d.Close()
}

// EnsureDir creates dir if it is missing and fsyncs the parent of every
// directory it created, so the new directory survives a crash.
func EnsureDir(fs vfs.FS, dir string) error {
	if _, err := fs.Stat(dir); err == nil {
		return nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	// Collect the missing directories, deepest first.
	var missing []string
	for d := dir; ; {
		if _, err := fs.Stat(d); err == nil {
			break
		} else if !errors.Is(err, os.ErrNotExist) {
			return err
		}
		missing = append(missing, d)
		parent := fs.PathDir(d)
		if parent == d || parent == "" {
			break
		}
		d = parent
	}
	if err := fs.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	// Sync parents top-down: a child's entry is only useful once the
	// parent's own entry is durable.
	for i := len(missing) - 1; i >= 0; i-- {
		parent := fs.PathDir(missing[i])
		if parent == missing[i] || parent == "" {
			continue
		}
		if err := SyncDir(fs, parent); err != nil {
			return err
		}
	}
	return nil
}

// copyRange copies bytes [from, to) of src into dst (appending with Write).
func copyRange(dst, src vfs.File, from, to int64) error {
	buf := make([]byte, min(to-from, 1<<20))
	for off := from; off < to; {
		n := int(min(int64(len(buf)), to-off))
		m, err := src.ReadAt(buf[:n], off)
		if m < n {
			if err == nil || err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return err
		}
		if _, err := dst.Write(buf[:n]); err != nil {
			return err
		}
		off += int64(n)
	}
	return nil
}

// openSegmentForAppend reopens the last segment, whose valid data ends at
// end; the file is alloc bytes long and bytes [end, alloc) are zero (in a
// recycled segment: zero up to padEnd(end), stale after).
func openSegmentForAppend(fs vfs.FS, dir, name string, first LSN, end, alloc int64, recycled bool) (*segFile, error) {
	f, err := fs.OpenReadWrite(fs.PathJoin(dir, name), vfs.WriteCategoryUnspecified)
	if err != nil {
		return nil, err
	}
	return &segFile{f: f, name: name, first: first, end: end, alloc: alloc, recycled: recycled}, nil
}

// saveTorn copies bytes [from, to) of the segment into a new file next to it
// ("<segment>.torn", or "<segment>.<n>.torn" if that exists already), fsyncs
// it and the directory, and returns the new file's base name.
func saveTorn(fs vfs.FS, dir, name string, from, to int64) (string, error) {
	saved := name + tornSuffix
	for i := 1; ; i++ {
		if _, err := fs.Stat(fs.PathJoin(dir, saved)); errors.Is(err, os.ErrNotExist) {
			break
		} else if err != nil {
			return "", err
		}
		saved = fmt.Sprintf("%s.%d%s", name, i, tornSuffix)
	}
	src, err := fs.Open(fs.PathJoin(dir, name))
	if err != nil {
		return "", err
	}
	defer src.Close()
	dst, err := fs.Create(fs.PathJoin(dir, saved), vfs.WriteCategoryUnspecified)
	if err != nil {
		return "", err
	}
	err = copyRange(dst, src, from, to)
	if err == nil {
		err = dst.Sync()
	}
	if cerr := dst.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = SyncDir(fs, dir)
	}
	if err != nil {
		return "", err
	}
	return saved, nil
}

// zeroChunkSize is the size of the writes that zero-fill files.
const zeroChunkSize = 1 << 20

// writeZeros writes n zero bytes with Write (at the file position: the start
// of a newly created file), in zeroChunkSize chunks. Real zero blocks are
// written, not fallocate'd: an unwritten extent would still need a metadata
// update (and so a journal commit in fdatasync) on its first write.
func writeZeros(f vfs.File, n int64) error {
	buf := make([]byte, min(n, zeroChunkSize))
	for n > 0 {
		k := int(min(int64(len(buf)), n))
		clear(buf[:k]) // vfs.File.Write may modify its input
		if _, err := f.Write(buf[:k]); err != nil {
			return err
		}
		n -= int64(k)
	}
	return nil
}

// zeroRange overwrites bytes [from, to) of f with zeros, with WriteAt.
func zeroRange(f vfs.File, from, to int64) error {
	buf := make([]byte, min(max(to-from, 0), zeroChunkSize))
	for off := from; off < to; {
		k := int(min(int64(len(buf)), to-off))
		clear(buf[:k])
		if _, err := f.WriteAt(buf[:k], off); err != nil {
			return err
		}
		off += int64(k)
	}
	return nil
}
