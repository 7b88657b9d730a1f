package snapshot

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
)

// ErrClosed is returned by Add and Close after Close.
var ErrClosed = errors.New("snapshot: writer closed")

// Writer streams a snapshot to an io.Writer: the header at NewWriter,
// chunks of entries as they fill up, the trailer at Close. It is not safe
// for concurrent use.
//
// A Writer fails for good: after an error from the underlying writer or from
// Add, every later call returns the same error, and what was written must be
// discarded (WriteFile does so).
type Writer struct {
	w     io.Writer
	off   int64  // bytes written so far
	crc   uint32 // CRC-32C of everything written so far
	count uint64 // entries added (all chunks)
	chunk int    // index of the next chunk

	raw  []byte // arrayHeaderRoom bytes, then the encoded pairs of the open chunk
	n    int    // pairs in raw
	comp []byte // compression buffer, reused
	hdr  [chunkHeaderSize]byte

	last    []byte // last key added (owned copy)
	hasLast bool

	err    error // sticky
	closed bool
}

// NewWriter writes the header for h to w and returns a Writer for the
// entries. h.Version must be 0 (meaning the current version) or 1.
func NewWriter(w io.Writer, h Header) (*Writer, error) {
	if h.Version != 0 && h.Version != formatVersion {
		return nil, fmt.Errorf("snapshot: cannot write format version %d (this build writes %d)", h.Version, formatVersion)
	}
	b, err := encodeHeader(h)
	if err != nil {
		return nil, err
	}
	sw := &Writer{w: w, raw: make([]byte, arrayHeaderRoom, arrayHeaderRoom+chunkTarget)}
	if err := sw.write(b); err != nil {
		return nil, err
	}
	return sw, nil
}

// Add appends one entry. Keys must be strictly increasing (bytes.Compare);
// key is an index entry key and value its index.EncodeEntry bytes, but Add
// treats both as opaque. len(key)+len(value) must not exceed MaxEntrySize.
// Add copies key and value; the caller may reuse them.
func (w *Writer) Add(key, value []byte) error {
	if w.err != nil {
		return w.err
	}
	if w.closed {
		return ErrClosed
	}
	if w.hasLast && bytes.Compare(key, w.last) <= 0 {
		w.err = fmt.Errorf("snapshot: key %x added after %x: keys must be strictly increasing", key, w.last)
		return w.err
	}
	size := len(key) + len(value)
	if size > MaxEntrySize {
		w.err = fmt.Errorf("snapshot: entry %x of %d bytes exceeds MaxEntrySize (%d)", key, size, MaxEntrySize)
		return w.err
	}
	if w.n > 0 && len(w.raw)-arrayHeaderRoom+size+maxPairOverhead > chunkTarget {
		if err := w.flush(); err != nil {
			return err
		}
	}
	w.raw = append(w.raw, mpFixArray2)
	w.raw = appendBin(w.raw, key)
	w.raw = appendBin(w.raw, value)
	w.n++
	w.count++
	w.last = append(w.last[:0], key...)
	w.hasLast = true
	return nil
}

// Close writes the last chunk and the trailer and returns the trailer. It
// does not close the underlying writer (nor flush or sync it).
func (w *Writer) Close() (Trailer, error) {
	if w.err != nil {
		return Trailer{}, w.err
	}
	if w.closed {
		return Trailer{}, ErrClosed
	}
	w.closed = true
	if w.n > 0 {
		if err := w.flush(); err != nil {
			return Trailer{}, err
		}
	}
	t := Trailer{Count: w.count, Checksum: w.crc}
	var b [trailerSize]byte // starts with the end marker: a chunk header of zeros
	binary.LittleEndian.PutUint64(b[chunkHeaderSize:], t.Count)
	binary.LittleEndian.PutUint32(b[chunkHeaderSize+8:], t.Checksum)
	copy(b[chunkHeaderSize+12:], trailerMagic)
	if err := w.write(b[:]); err != nil {
		return Trailer{}, err
	}
	return t, nil
}

// flush compresses and writes the open chunk (w.n > 0).
func (w *Writer) flush() error {
	start := putArrayHeader(w.raw[:arrayHeaderRoom], w.n)
	raw := w.raw[start:]
	w.comp = compress(w.comp, raw)
	if len(w.comp) > maxCompressed || len(raw) > maxRaw {
		// Cannot happen with MaxEntrySize; checked so that a writer bug
		// never produces a snapshot its reader rejects.
		w.err = fmt.Errorf("snapshot: chunk %d: %d bytes compressed, %d raw: over the format bounds", w.chunk, len(w.comp), len(raw))
		return w.err
	}
	binary.LittleEndian.PutUint32(w.hdr[0:], uint32(len(w.comp)))
	binary.LittleEndian.PutUint32(w.hdr[4:], uint32(len(raw)))
	binary.LittleEndian.PutUint32(w.hdr[8:], uint32(w.n))
	binary.LittleEndian.PutUint32(w.hdr[12:], crc32.Checksum(w.comp, castagnoli))
	if err := w.write(w.hdr[:]); err != nil {
		return err
	}
	if err := w.write(w.comp); err != nil {
		return err
	}
	w.raw, w.n = w.raw[:arrayHeaderRoom], 0
	w.chunk++
	return nil
}

func (w *Writer) write(b []byte) error {
	n, err := w.w.Write(b)
	if err == nil && n != len(b) {
		err = io.ErrShortWrite
	}
	if err != nil {
		w.err = fmt.Errorf("snapshot: write at offset %d: %w", w.off+int64(n), err)
		return w.err
	}
	w.crc = crc32.Update(w.crc, castagnoli, b)
	w.off += int64(n)
	return nil
}

// WriteStream writes a whole snapshot to w: the header h, every entry each
// passes to add (in strictly increasing key order), and the trailer. It
// returns the trailer and the bytes written.
func WriteStream(w io.Writer, h Header, each func(add func(key, value []byte) error) error) (Trailer, int64, error) {
	cw := &countingWriter{w: w}
	sw, err := NewWriter(cw, h)
	if err != nil {
		return Trailer{}, cw.n, err
	}
	if err := each(sw.Add); err != nil {
		return Trailer{}, cw.n, err
	}
	tr, err := sw.Close()
	return tr, cw.n, err
}

// countingWriter counts the bytes written through it.
type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(b []byte) (int, error) {
	n, err := c.w.Write(b)
	c.n += int64(n)
	return n, err
}
