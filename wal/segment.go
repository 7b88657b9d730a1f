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
	// segmentVersion is the version written into new segments. Version 1
	// segments (frames without the synced LSN) are still read.
	segmentVersion    = 2
	segmentVersion1   = 1
	segmentHeaderSize = 32
	// segmentHeaderCRCOffset is where the header checksum lives; it covers
	// bytes [0, segmentHeaderCRCOffset).
	segmentHeaderCRCOffset = 28

	segmentSuffix  = ".wal"
	segmentNameLen = 20 + len(segmentSuffix)
	tornSuffix     = ".torn"
	preallocSuffix = ".prealloc"

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
// and version (1 or 2). It returns a non-empty reason when the header is
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
	if v != segmentVersion && v != segmentVersion1 {
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
// SegmentSize before any frame goes into it, so frames overwrite zeros at the
// logical end and a flush is made durable with fdatasync (SyncData), which
// then has no file-size change to commit. A write past the allocated size
// just extends the file (see doc.go).
type segFile struct {
	f     vfs.File
	name  string // base name
	first LSN
	end   int64 // logical end: offset of the next frame (header plus frames written)
	alloc int64 // file size; >= end
	// lastOff is the offset of the last frame written (0: none yet) and
	// lastLSN its LSN (first-1 when none), for the close hint.
	lastOff int64
	lastLSN LSN
}

// write writes p at the logical end.
func (s *segFile) write(p []byte) error {
	n, err := s.f.WriteAt(p, s.end)
	s.end += int64(n)
	s.alloc = max(s.alloc, s.end)
	if err == nil && n != len(p) {
		err = io.ErrShortWrite
	}
	return err
}

// preallocName is the base name of the spare segment file: zero-filled and
// fsynced ahead of time (by a background goroutine), it becomes the next
// segment at rotation by being renamed. It is not a segment name, so Scan
// ignores it.
const preallocName = "next" + preallocSuffix

// preparePrealloc makes sure that the spare file preallocName exists, is
// size bytes long, is all zero (a segment header in its first 32 bytes is
// tolerated: activateSegment overwrites it) and is fsynced. A leftover of the
// right size (from a clean Close or a crash) is checked and reused; anything
// else is replaced by a new file, zero-filled with real writes in
// zeroChunkSize chunks and fsynced. The directory is not fsynced: the spare
// file only matters once activateSegment renamed it, which fsyncs the
// directory.
func preparePrealloc(fs vfs.FS, dir string, size int64) error {
	path := fs.PathJoin(dir, preallocName)
	switch st, err := fs.Stat(path); {
	case err == nil:
		if st.Size() == size {
			ok, err := reusePrealloc(fs, path, size)
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

// reusePrealloc checks a leftover spare file: it is reusable when bytes
// [segmentHeaderSize, size) are all zero. It is fsynced before being reused
// (a crash may have interrupted its creation before the fsync).
func reusePrealloc(fs vfs.FS, path string, size int64) (bool, error) {
	f, err := fs.OpenReadWrite(path, vfs.WriteCategoryUnspecified)
	if err != nil {
		return false, err
	}
	defer f.Close()
	r := segReader{f: f, name: preallocName, size: size}
	nz, err := r.anyNonZero(min(segmentHeaderSize, size), size)
	if err != nil || nz {
		return false, err
	}
	return true, f.Sync()
}

// activateSegment turns the spare file into the segment starting at first:
// it renames it, writes the segment header over its first bytes, fsyncs it
// and fsyncs the directory, so that the new (empty) segment survives a crash
// before any record is written into it. The file is reopened under its new
// name.
func activateSegment(fs vfs.FS, dir string, first LSN) (*segFile, error) {
	name := segmentName(first)
	path := fs.PathJoin(dir, name)
	if err := fs.Rename(fs.PathJoin(dir, preallocName), path); err != nil {
		return nil, err
	}
	f, err := fs.OpenReadWrite(path, vfs.WriteCategoryUnspecified)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, err
	}
	s := &segFile{f: f, name: name, first: first, alloc: st.Size(), lastLSN: first - 1}
	if err := s.write(encodeSegmentHeader(first)); err != nil {
		_ = f.Close()
		return nil, err
	}
	if err := f.Sync(); err != nil {
		_ = f.Close()
		return nil, err
	}
	if err := SyncDir(fs, dir); err != nil {
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
// end; the file is alloc bytes long and bytes [end, alloc) are zero.
func openSegmentForAppend(fs vfs.FS, dir, name string, first LSN, end, alloc int64) (*segFile, error) {
	f, err := fs.OpenReadWrite(fs.PathJoin(dir, name), vfs.WriteCategoryUnspecified)
	if err != nil {
		return nil, err
	}
	return &segFile{f: f, name: name, first: first, end: end, alloc: alloc}, nil
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
