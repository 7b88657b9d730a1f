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
