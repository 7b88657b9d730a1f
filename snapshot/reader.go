package snapshot

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"
)

// Reader reads a snapshot written by Writer, checking everything: the
// header, every chunk (checksum, bounds, declared sizes and counts, key
// order), and the trailer (entry count, checksum of the whole stream, end
// magic, nothing after it). It is not safe for concurrent use.
//
// Entries are returned as they are read, before the trailer is checked: a
// caller that rebuilds an index from a snapshot must not make the result
// visible until Next has returned io.EOF. Any damage, truncation included,
// yields an error wrapping ErrCorrupt (a *CorruptError); a chunk is only
// handed out after its checksum matched, so corruption never shows as a
// wrong entry.
//
// Memory is bounded by the format's limits: the reader allocates a chunk's
// compressed bytes as they arrive (so a truncated stream that claims a
// large chunk costs what it holds, not what it claims), and its raw size
// only after the checksum and the codec's own length agree with the chunk
// header.
type Reader struct {
	r   io.Reader
	h   Header
	off int64  // bytes consumed so far
	crc uint32 // CRC-32C of the bytes consumed so far

	chunk      int    // index of the current chunk; -1 while in the header
	chunkStart int64  // offset of the current chunk's header
	started    bool   // a chunk header has been read
	comp       []byte // compressed bytes of the current chunk, reused
	raw        []byte // raw bytes of the current chunk, reused
	rest       []byte // unparsed pairs of the current chunk
	left       int    // pairs left in rest
	pairs      uint64 // entries returned so far
	hdr        [chunkHeaderSize]byte

	prev    []byte // last key returned; aliases raw or prevBuf
	prevBuf []byte // owned copy of prev across chunk boundaries
	hasPrev bool

	trailer Trailer
	err     error // sticky; io.EOF once the trailer checked OK
}

// NewReader reads and checks the header. Errors about the stream's content
// wrap ErrCorrupt; errors of r are returned as they are (wrapped with the
// offset).
func NewReader(r io.Reader) (*Reader, error) {
	sr := &Reader{r: r, chunk: -1}
	if err := sr.readHeader(); err != nil {
		return nil, err
	}
	sr.chunk = 0
	return sr, nil
}

// Header returns the snapshot's header.
func (r *Reader) Header() Header { return r.h }

// Trailer returns the trailer once Next has returned io.EOF (the zero
// Trailer before).
func (r *Reader) Trailer() Trailer { return r.trailer }

// Next returns the next entry. key and value alias the reader's buffers and
// are valid until the next call. After the last entry Next checks the
// trailer and returns io.EOF if it is sound; every later call returns the
// same io.EOF or error.
func (r *Reader) Next() (key, value []byte, err error) {
	if r.err != nil {
		return nil, nil, r.err
	}
	for r.left == 0 {
		if len(r.rest) != 0 {
			return nil, nil, r.fail(r.chunkStart, "%d bytes after the last entry of the chunk", len(r.rest))
		}
		if err := r.readChunk(); err != nil {
			return nil, nil, err // readChunk set r.err (io.EOF at the trailer)
		}
	}
	var ok bool
	var n int
	rest := r.rest
	if len(rest) == 0 || rest[0] != mpFixArray2 {
		return nil, nil, r.fail(r.chunkStart, "entry %d is not a 2-element array", r.pairs)
	}
	rest = rest[1:]
	if key, n, ok = parseBin(rest); !ok {
		return nil, nil, r.fail(r.chunkStart, "bad key encoding in entry %d", r.pairs)
	}
	rest = rest[n:]
	if value, n, ok = parseBin(rest); !ok {
		return nil, nil, r.fail(r.chunkStart, "bad value encoding in entry %d", r.pairs)
	}
	if r.hasPrev && bytes.Compare(key, r.prev) <= 0 {
		return nil, nil, r.fail(r.chunkStart, "key %x of entry %d does not follow %x (keys must be strictly increasing)", key, r.pairs, r.prev)
	}
	r.rest = rest[n:]
	r.left--
	r.pairs++
	r.prev, r.hasPrev = key, true
	return key, value, nil
}

func (r *Reader) readHeader() error {
	var fixed [headerFixedSize]byte
	if err := r.readFull(fixed[:]); err != nil {
		return err
	}
	if string(fixed[:8]) != headerMagic {
		return r.fail(0, "bad magic %q, want %q", fixed[:8], headerMagic)
	}
	if v := binary.LittleEndian.Uint16(fixed[8:]); v != formatVersion {
		return r.fail(8, "unsupported format version %d (this build reads version %d)", v, formatVersion)
	}
	n := binary.LittleEndian.Uint32(fixed[10:])
	if n > maxHeaderBody {
		return r.fail(10, "header body length %d exceeds %d", n, maxHeaderBody)
	}
	body := make([]byte, n+headerCRCSize)
	if err := r.readFull(body); err != nil {
		return err
	}
	want := binary.LittleEndian.Uint32(body[n:])
	got := crc32.Update(crc32.Checksum(fixed[:], castagnoli), castagnoli, body[:n])
	if got != want {
		return r.fail(headerFixedSize+int64(n), "header checksum %08x, want %08x", got, want)
	}
	h, err := decodeHeaderBody(body[:n])
	if err != nil {
		return r.fail(headerFixedSize, "header body: %v", err)
	}
	r.h = h
	return nil
}

// readChunk reads the next chunk header and either the chunk (leaving its
// pairs in r.rest) or, at the end marker, the trailer (setting r.err to
// io.EOF when it checks out).
func (r *Reader) readChunk() error {
	if r.started {
		r.chunk++
	}
	r.started = true
	if r.hasPrev {
		// r.prev aliases r.raw, which the next chunk overwrites.
		r.prevBuf = append(r.prevBuf[:0], r.prev...)
		r.prev = r.prevBuf
	}
	start := r.off
	r.chunkStart = start
	crcBefore := r.crc
	if err := r.readFull(r.hdr[:]); err != nil {
		return err
	}
	compLen := binary.LittleEndian.Uint32(r.hdr[0:])
	rawLen := binary.LittleEndian.Uint32(r.hdr[4:])
	count := binary.LittleEndian.Uint32(r.hdr[8:])
	sum := binary.LittleEndian.Uint32(r.hdr[12:])
	if compLen == 0 {
		return r.readTrailer(start, crcBefore)
	}
	switch {
	case compLen > maxCompressed:
		return r.fail(start, "compressed length %d exceeds %d", compLen, maxCompressed)
	case rawLen > maxRaw:
		return r.fail(start, "raw length %d exceeds %d", rawLen, maxRaw)
	case count == 0:
		return r.fail(start, "chunk with no entries")
	case uint64(count)*minPairSize > uint64(rawLen):
		return r.fail(start, "%d entries cannot fit in %d raw bytes", count, rawLen)
	}
	var err error
	if r.comp, err = r.readGrow(r.comp, int(compLen)); err != nil {
		return err
	}
	if got := crc32.Checksum(r.comp, castagnoli); got != sum {
		return r.fail(start, "chunk checksum %08x, want %08x", got, sum)
	}
	declared, err := decompressedLen(r.comp)
	if err != nil || declared != int(rawLen) {
		return r.fail(start, "compressed data declares %d raw bytes (err %v), header says %d", declared, err, rawLen)
	}
	if cap(r.raw) < int(rawLen) {
		r.raw = make([]byte, rawLen)
	}
	r.raw = r.raw[:rawLen]
	if err := decompress(r.raw, r.comp); err != nil {
		return r.fail(start, "decompress: %v", err)
	}
	n, size, ok := parseArrayHeader(r.raw)
	if !ok || n != int(count) {
		return r.fail(start, "chunk holds %d entries (array header ok=%v), header says %d", n, ok, count)
	}
	r.rest, r.left = r.raw[size:], n
	return nil
}

// readTrailer reads the rest of the trailer after its end marker, whose
// header started at start; crc is the checksum of everything before it.
func (r *Reader) readTrailer(start int64, crc uint32) error {
	for i := 4; i < chunkHeaderSize; i++ {
		if r.hdr[i] != 0 {
			return r.fail(start, "end marker (compressed length 0) with non-zero fields")
		}
	}
	var b [trailerSize - chunkHeaderSize]byte
	if err := r.readFull(b[:]); err != nil {
		return err
	}
	t := Trailer{Count: binary.LittleEndian.Uint64(b[0:]), Checksum: binary.LittleEndian.Uint32(b[8:])}
	switch {
	case string(b[12:]) != trailerMagic:
		return r.fail(start+chunkHeaderSize+12, "bad trailer magic %q, want %q", b[12:], trailerMagic)
	case t.Count != r.pairs:
		return r.fail(start+chunkHeaderSize, "trailer counts %d entries, the chunks hold %d", t.Count, r.pairs)
	case t.Checksum != crc:
		return r.fail(start+chunkHeaderSize+8, "stream checksum %08x, trailer says %08x", crc, t.Checksum)
	}
	// Nothing may follow the trailer.
	var one [1]byte
	n, err := io.ReadAtLeast(r.r, one[:], 1)
	switch {
	case n > 0:
		return r.fail(r.off, "trailing bytes after the trailer")
	case err != io.EOF && err != io.ErrUnexpectedEOF:
		return r.ioErr(err)
	}
	r.trailer = t
	r.err = io.EOF
	return io.EOF
}

// readFull fills b from the stream; a short stream is corruption
// ("truncated at offset N").
func (r *Reader) readFull(b []byte) error {
	n, err := io.ReadFull(r.r, b)
	r.crc = crc32.Update(r.crc, castagnoli, b[:n])
	r.off += int64(n)
	if err == io.EOF || err == io.ErrUnexpectedEOF {
		return r.fail(r.off, "truncated at offset %d", r.off)
	}
	if err != nil {
		return r.ioErr(err)
	}
	return nil
}

// readGrow reads n bytes into buf (reused if big enough), growing it in
// steps as the bytes arrive, so that a length field never makes the reader
// allocate more than about twice what the stream holds.
func (r *Reader) readGrow(buf []byte, n int) ([]byte, error) {
	if cap(buf) >= n {
		buf = buf[:n]
		return buf, r.readFull(buf)
	}
	buf = buf[:0]
	for len(buf) < n {
		step := min(n-len(buf), max(64<<10, len(buf)))
		if cap(buf)-len(buf) < step {
			nb := make([]byte, len(buf), len(buf)+step)
			copy(nb, buf)
			buf = nb
		}
		if err := r.readFull(buf[len(buf) : len(buf)+step]); err != nil {
			return buf, err
		}
		buf = buf[:len(buf)+step]
	}
	return buf, nil
}

func (r *Reader) fail(off int64, format string, args ...any) error {
	r.err = &CorruptError{Offset: off, Chunk: r.chunk, Reason: fmt.Sprintf(format, args...)}
	return r.err
}

func (r *Reader) ioErr(err error) error {
	r.err = fmt.Errorf("snapshot: read at offset %d: %w", r.off, err)
	return r.err
}
