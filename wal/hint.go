package wal

import (
	"encoding/binary"
	"errors"
	"hash/crc32"
	"io"
	"os"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// The close hint lets Open after a clean Close start at the end of the log
// instead of reading the last segment from its start (see "Close hint" in
// doc.go). It is only a hint: when it is missing, torn or does not match
// the segment, Open reads the segment as it always did.
const (
	hintName  = "close.hint"
	hintMagic = "IDEMWCLS"
	// hintSize: magic(8) version(2) reserved(6) segment first LSN(8)
	// last frame offset(8) last LSN(8) end(8) crc32c of the rest(4).
	hintSize    = 52
	hintVersion = 1
)

// closeHint says: segment (named by first LSN) holds valid, fsynced frames
// up to end, the last of them at lastOff (0: none) with LSN lastLSN, and
// nothing was written after end since.
type closeHint struct {
	segment string
	first   LSN
	lastOff int64
	lastLSN LSN
	end     int64
}

func (h *closeHint) encode() []byte {
	b := make([]byte, hintSize)
	copy(b, hintMagic)
	binary.LittleEndian.PutUint16(b[8:], hintVersion)
	binary.LittleEndian.PutUint64(b[16:], uint64(h.first))
	binary.LittleEndian.PutUint64(b[24:], uint64(h.lastOff))
	binary.LittleEndian.PutUint64(b[32:], uint64(h.lastLSN))
	binary.LittleEndian.PutUint64(b[40:], uint64(h.end))
	binary.LittleEndian.PutUint32(b[48:], crc32.Checksum(b[:48], castagnoli))
	return b
}

func decodeHint(b []byte) *closeHint {
	if len(b) != hintSize || string(b[:8]) != hintMagic ||
		binary.LittleEndian.Uint16(b[8:]) != hintVersion ||
		crc32.Checksum(b[:48], castagnoli) != binary.LittleEndian.Uint32(b[48:]) {
		return nil
	}
	h := &closeHint{
		first:   LSN(binary.LittleEndian.Uint64(b[16:])),
		lastOff: int64(binary.LittleEndian.Uint64(b[24:])),
		lastLSN: LSN(binary.LittleEndian.Uint64(b[32:])),
		end:     int64(binary.LittleEndian.Uint64(b[40:])),
	}
	if h.first == 0 || h.lastOff < 0 || h.end < segmentHeaderSize {
		return nil
	}
	h.segment = segmentName(h.first)
	return h
}

// readHint returns the close hint in dir, or nil (missing, unreadable or
// invalid: a hint is never needed). present reports whether the file exists.
func readHint(fs vfs.FS, dir string) (h *closeHint, present bool) {
	f, err := fs.Open(fs.PathJoin(dir, hintName))
	if err != nil {
		return nil, !errors.Is(err, os.ErrNotExist)
	}
	defer f.Close()
	b := make([]byte, hintSize+1)
	n, err := io.ReadFull(f, b)
	if err != io.ErrUnexpectedEOF || n != hintSize {
		return nil, true
	}
	return decodeHint(b[:n]), true
}

// writeHint writes the close hint through a temporary file and a rename.
// Neither is fsynced: a hint lost or torn by a crash is ignored by Open.
func writeHint(fs vfs.FS, dir string, h *closeHint) error {
	tmp := fs.PathJoin(dir, hintName+".tmp")
	f, err := fs.Create(tmp, vfs.WriteCategoryUnspecified)
	if err != nil {
		return err
	}
	_, err = f.Write(h.encode())
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = fs.Rename(tmp, fs.PathJoin(dir, hintName))
	}
	if err != nil {
		_ = fs.Remove(tmp)
	}
	return err
}

// removeHint removes the close hint (and a leftover temporary file). Open
// calls it before anything is appended; the directory fsync that follows
// makes the removal durable, so a stale hint can never describe a log that
// has grown since.
func removeHint(fs vfs.FS, dir string) error {
	for _, n := range []string{hintName, hintName + ".tmp"} {
		if err := fs.Remove(fs.PathJoin(dir, n)); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	return nil
}

// Position hints let Open after a crash start reading the segment that
// holds the first record the caller has not applied near that record,
// instead of at the segment's start (see "Reopen" in doc.go). The file
// holds up to maxPositions entries, each a frame boundary that was fsynced
// when the entry was made: segment first LSN, frame offset, frame LSN.
const (
	positionsName    = "positions.hint"
	positionsMagic   = "IDEMWPOS"
	positionsVersion = 1
	maxPositions     = 32
	positionSize     = 24
)

// position is a fsynced frame boundary: the frame at off in the segment
// starting at first has LSN lsn.
type position struct {
	first LSN
	off   int64
	lsn   LSN
}

func encodePositions(ps []position) []byte {
	b := make([]byte, 16, 16+len(ps)*positionSize+4)
	copy(b, positionsMagic)
	binary.LittleEndian.PutUint16(b[8:], positionsVersion)
	binary.LittleEndian.PutUint16(b[10:], uint16(len(ps)))
	for _, p := range ps {
		b = binary.LittleEndian.AppendUint64(b, uint64(p.first))
		b = binary.LittleEndian.AppendUint64(b, uint64(p.off))
		b = binary.LittleEndian.AppendUint64(b, uint64(p.lsn))
	}
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
}

func decodePositions(b []byte) []position {
	if len(b) < 20 || string(b[:8]) != positionsMagic || binary.LittleEndian.Uint16(b[8:]) != positionsVersion {
		return nil
	}
	n := int(binary.LittleEndian.Uint16(b[10:]))
	if n > maxPositions || len(b) != 16+n*positionSize+4 ||
		crc32.Checksum(b[:len(b)-4], castagnoli) != binary.LittleEndian.Uint32(b[len(b)-4:]) {
		return nil
	}
	ps := make([]position, n)
	for i := range ps {
		e := b[16+i*positionSize:]
		ps[i] = position{first: LSN(binary.LittleEndian.Uint64(e)), off: int64(binary.LittleEndian.Uint64(e[8:])),
			lsn: LSN(binary.LittleEndian.Uint64(e[16:]))}
	}
	return ps
}

// readPositions returns the position hints in dir (nil if none or invalid).
func readPositions(fs vfs.FS, dir string) []position {
	f, err := fs.Open(fs.PathJoin(dir, positionsName))
	if err != nil {
		return nil
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, 16+maxPositions*positionSize+4+1))
	if err != nil {
		return nil
	}
	return decodePositions(b)
}

// writePositions replaces the position hints file: a temporary file,
// fsynced, renamed, and the directory fsynced, so that the hints survive
// the crash they are for. It runs in the background, off the commit path;
// every entry names a frame that was fsynced before the entry was made, and
// a lost or torn file only costs a longer Open.
func writePositions(fs vfs.FS, dir string, ps []position) error {
	tmp := fs.PathJoin(dir, positionsName+".tmp")
	f, err := fs.Create(tmp, vfs.WriteCategoryUnspecified)
	if err != nil {
		return err
	}
	_, err = f.Write(encodePositions(ps))
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = fs.Rename(tmp, fs.PathJoin(dir, positionsName))
	}
	if err == nil {
		err = SyncDir(fs, dir)
	}
	if err != nil {
		_ = fs.Remove(tmp)
	}
	return err
}
