package snapshot

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"strings"
	"testing"
	"testing/iotest"
	"time"
)

var testHeader = Header{
	LSN:          12345,
	Created:      time.Unix(1_760_000_000, 123456789).UTC(),
	ForgetBefore: 1_759_000_000_000_000_000,
	ForgetLSN:    12000,
}

// writeSnapshot writes entries with Writer and returns the bytes.
func writeSnapshot(t testing.TB, h Header, entries []testEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	w, err := NewWriter(&buf, h)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if err := w.Add(e.key, e.value); err != nil {
			t.Fatal(err)
		}
	}
	tr, err := w.Close()
	if err != nil {
		t.Fatal(err)
	}
	if tr.Count != uint64(len(entries)) {
		t.Fatalf("trailer count %d, want %d", tr.Count, len(entries))
	}
	if want := crc32.Checksum(buf.Bytes()[:buf.Len()-trailerSize], castagnoli); tr.Checksum != want {
		t.Fatalf("trailer checksum %08x, want %08x", tr.Checksum, want)
	}
	return buf.Bytes()
}

// readSnapshot reads a whole stream. It returns the entries read before
// the error (copied), and the error (nil when the stream ended with
// io.EOF).
func readSnapshot(r io.Reader) (Header, []testEntry, Trailer, error) {
	sr, err := NewReader(r)
	if err != nil {
		return Header{}, nil, Trailer{}, err
	}
	var out []testEntry
	for {
		k, v, err := sr.Next()
		if err == io.EOF {
			// Sticky.
			if _, _, err2 := sr.Next(); err2 != io.EOF {
				return sr.Header(), out, Trailer{}, fmt.Errorf("Next after io.EOF: %v", err2)
			}
			return sr.Header(), out, sr.Trailer(), nil
		}
		if err != nil {
			if _, _, err2 := sr.Next(); err2 != err {
				return sr.Header(), out, Trailer{}, fmt.Errorf("error not sticky: %v then %v", err, err2)
			}
			return sr.Header(), out, Trailer{}, err
		}
		out = append(out, testEntry{bytes.Clone(k), bytes.Clone(v)})
	}
}

func sameHeaders(t *testing.T, got, want Header) {
	t.Helper()
	if want.Version == 0 {
		want.Version = formatVersion
	}
	if !sameHeader(got, want) {
		t.Fatalf("header %+v, want %+v", got, want)
	}
}

func sameEntries(t *testing.T, got, want []testEntry) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%d entries, want %d", len(got), len(want))
	}
	for i := range want {
		if !bytes.Equal(got[i].key, want[i].key) || !bytes.Equal(got[i].value, want[i].value) {
			t.Fatalf("entry %d: got %x=%x, want %x=%x", i, got[i].key, got[i].value, want[i].key, want[i].value)
		}
	}
}

// sizedEntries returns entries with increasing keys and values of the given
// sizes, exercising every bin width and one-entry chunks.
func sizedEntries(sizes ...int) []testEntry {
	out := make([]testEntry, len(sizes))
	for i, n := range sizes {
		v := make([]byte, n)
		for j := range v {
			v[j] = byte(i*7 + j*13 + j>>8)
		}
		out[i] = testEntry{key: fmt.Appendf(nil, "\x01key-%06d", i), value: v}
	}
	return out
}

func TestRoundTrip(t *testing.T) {
	cases := []struct {
		name    string
		h       Header
		entries []testEntry
	}{
		{"empty", testHeader, nil},
		{"zero header", Header{}, nil},
		{"one", testHeader, realisticEntries(1, 1, false)},
		{"100k", testHeader, realisticEntries(2, 100_000, false)},
		{"100k random replies", testHeader, realisticEntries(3, 100_000, true)},
		{"sizes", testHeader, sizedEntries(0, 1, 255, 256, 65535, 65536, 70_000, 3, 300_000, 1<<20, 5)},
		{"empty key first", testHeader, []testEntry{{nil, []byte("v")}, {[]byte{0}, nil}, {[]byte{0, 0}, []byte{}}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b := writeSnapshot(t, tc.h, tc.entries)
			for _, rd := range []struct {
				name string
				r    func() io.Reader
			}{
				{"bytes", func() io.Reader { return bytes.NewReader(b) }},
				{"one byte at a time", func() io.Reader { return iotest.OneByteReader(bytes.NewReader(b)) }},
				{"data with EOF", func() io.Reader { return iotest.DataErrReader(bytes.NewReader(b)) }},
			} {
				if rd.name != "bytes" && len(tc.entries) > 1000 {
					continue
				}
				h, got, tr, err := readSnapshot(rd.r())
				if err != nil {
					t.Fatalf("%s: %v", rd.name, err)
				}
				sameHeaders(t, h, tc.h)
				sameEntries(t, got, tc.entries)
				if tr.Count != uint64(len(tc.entries)) {
					t.Fatalf("trailer count %d", tr.Count)
				}
			}
			if len(tc.entries) == 100_000 {
				t.Logf("%d entries: %d bytes (%.1f per entry)", len(tc.entries), len(b), float64(len(b))/float64(len(tc.entries)))
			}
		})
	}
}

func TestHeaderCreatedZero(t *testing.T) {
	b := writeSnapshot(t, Header{LSN: 7}, nil)
	h, _, _, err := readSnapshot(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	if !h.Created.IsZero() || h.LSN != 7 || h.Version != 1 {
		t.Fatalf("header %+v", h)
	}
}

func TestArrayHeader(t *testing.T) {
	for _, n := range []int{0, 1, 15, 16, 65535, 65536, 1 << 31} {
		var room [arrayHeaderRoom]byte
		start := putArrayHeader(room[:], n)
		got, size, ok := parseArrayHeader(room[start:])
		if !ok || got != n || size != arrayHeaderRoom-start {
			t.Fatalf("n=%d: parsed %d, size %d, ok %v", n, got, size, ok)
		}
	}
}

func TestWriterRejects(t *testing.T) {
	cases := []struct {
		name string
		run  func(w *Writer) error
		want string
	}{
		{"out of order", func(w *Writer) error {
			_ = w.Add([]byte("b"), nil)
			return w.Add([]byte("a"), nil)
		}, "strictly increasing"},
		{"duplicate", func(w *Writer) error {
			_ = w.Add([]byte("a"), nil)
			return w.Add([]byte("a"), nil)
		}, "strictly increasing"},
		{"duplicate across chunks", func(w *Writer) error {
			_ = w.Add([]byte("a"), make([]byte, chunkTarget))
			return w.Add([]byte("a"), nil)
		}, "strictly increasing"},
		{"too large", func(w *Writer) error {
			return w.Add([]byte("a"), make([]byte, MaxEntrySize))
		}, "MaxEntrySize"},
		{"add after close", func(w *Writer) error {
			_, _ = w.Close()
			return w.Add([]byte("a"), nil)
		}, "closed"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			w, err := NewWriter(io.Discard, Header{})
			if err != nil {
				t.Fatal(err)
			}
			err = tc.run(w)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
			if _, cerr := w.Close(); cerr == nil {
				t.Fatal("Close succeeded after a failed Add")
			}
		})
	}
	if _, err := NewWriter(io.Discard, Header{Version: 2}); err == nil {
		t.Fatal("NewWriter accepted version 2")
	}
}

// TestMaxEntrySize checks that the largest entry fits the compressed bound
// even when it does not compress.
func TestMaxEntrySize(t *testing.T) {
	if n := len(compress(nil, make([]byte, 0))); n == 0 {
		t.Fatal("compress of nothing is empty")
	}
	worst := MaxEntrySize + maxPairOverhead + arrayHeaderRoom + chunkTarget
	if got := maxCompressedLen(worst); got > maxCompressed {
		t.Fatalf("worst-case chunk compresses to %d bytes > %d", got, maxCompressed)
	}
	// And a real incompressible maximal entry goes through.
	v := make([]byte, MaxEntrySize-1)
	for i := range v {
		v[i] = byte(i*2654435761>>13) ^ byte(i>>7)
	}
	var buf bytes.Buffer
	w, _ := NewWriter(&buf, Header{})
	if err := w.Add([]byte("a"), make([]byte, 100)); err != nil {
		t.Fatal(err)
	}
	if err := w.Add([]byte("b"), v); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Close(); err != nil {
		t.Fatal(err)
	}
	_, got, _, err := readSnapshot(bytes.NewReader(buf.Bytes()))
	if err != nil || len(got) != 2 || !bytes.Equal(got[1].value, v) {
		t.Fatalf("read back: %d entries, %v", len(got), err)
	}
}

type failWriter struct {
	n   int // bytes accepted before failing
	err error
}

func (f *failWriter) Write(p []byte) (int, error) {
	if len(p) <= f.n {
		f.n -= len(p)
		return len(p), nil
	}
	n := f.n
	f.n = 0
	return n, f.err
}

func TestWriterIOErrorSticky(t *testing.T) {
	boom := errors.New("boom")
	entries := realisticEntries(4, 2000, false)
	full := writeSnapshot(t, testHeader, entries)
	for _, n := range []int{0, 10, 100, 1000, len(full) / 2, len(full) - 1} {
		fw := &failWriter{n: n, err: boom}
		var err error
		w, err := NewWriter(fw, testHeader)
		if err == nil {
			for _, e := range entries {
				if err = w.Add(e.key, e.value); err != nil {
					break
				}
			}
			if err == nil {
				_, err = w.Close()
			}
			if _, err2 := w.Close(); err2 == nil {
				t.Fatalf("n=%d: second Close succeeded", n)
			}
		}
		if !errors.Is(err, boom) {
			t.Fatalf("n=%d: got %v, want boom", n, err)
		}
	}
}

// smallSnapshot has a few entries over three chunks (the second entry is
// large enough to need a chunk of its own).
func smallSnapshot(t testing.TB) ([]byte, []testEntry) {
	entries := sizedEntries(3, chunkTarget-20, 20, 7, 0)
	entries[1].value = bytes.Repeat([]byte("x"), len(entries[1].value)) // compresses well: keeps the sweep small
	b := writeSnapshot(t, testHeader, entries)
	r, _ := NewReader(bytes.NewReader(b))
	for {
		if _, _, err := r.Next(); err != nil {
			break
		}
	}
	if r.chunk != 3 {
		t.Fatalf("small snapshot has %d chunks, want 3", r.chunk)
	}
	return b, entries
}

func TestTruncation(t *testing.T) {
	b, _ := smallSnapshot(t)
	for n := 0; n < len(b); n++ {
		_, _, _, err := readSnapshot(bytes.NewReader(b[:n]))
		var ce *CorruptError
		if !errors.Is(err, ErrCorrupt) || !errors.As(err, &ce) {
			t.Fatalf("truncated to %d of %d bytes: got %v, want a CorruptError", n, len(b), err)
		}
		if ce.Offset != int64(n) || !strings.Contains(ce.Reason, fmt.Sprintf("truncated at offset %d", n)) {
			t.Fatalf("truncated to %d: %v", n, err)
		}
	}
}

// TestByteFlips damages every byte of a small snapshot in several ways: the
// reader must fail with ErrCorrupt, and every entry it handed out before
// must be right.
func TestByteFlips(t *testing.T) {
	b, entries := smallSnapshot(t)
	d := make([]byte, len(b))
	for i := range b {
		for _, x := range []byte{0x01, 0x80, 0xff} {
			copy(d, b)
			d[i] ^= x
			_, got, _, err := readSnapshot(bytes.NewReader(d))
			var ce *CorruptError
			if !errors.Is(err, ErrCorrupt) || !errors.As(err, &ce) {
				t.Fatalf("byte %d ^ %#x: got %v, want a CorruptError", i, x, err)
			}
			if len(got) > len(entries) {
				t.Fatalf("byte %d ^ %#x: %d entries", i, x, len(got))
			}
			sameEntries(t, got, entries[:len(got)])
		}
	}
}

// rawStream builds a snapshot stream by hand, without the Writer's checks:
// chunks hold the given pairs, with correct checksums everywhere unless
// edit changes something afterwards.
func rawStream(h Header, chunks ...[]testEntry) []byte {
	b, _ := encodeHeader(h)
	var count uint64
	for _, c := range chunks {
		raw := make([]byte, arrayHeaderRoom)
		for _, e := range c {
			raw = append(raw, mpFixArray2)
			raw = appendBin(raw, e.key)
			raw = appendBin(raw, e.value)
		}
		raw = raw[putArrayHeader(raw[:arrayHeaderRoom], len(c)):]
		comp := compress(nil, raw)
		b = binary.LittleEndian.AppendUint32(b, uint32(len(comp)))
		b = binary.LittleEndian.AppendUint32(b, uint32(len(raw)))
		b = binary.LittleEndian.AppendUint32(b, uint32(len(c)))
		b = binary.LittleEndian.AppendUint32(b, crc32.Checksum(comp, castagnoli))
		b = append(b, comp...)
		count += uint64(len(c))
	}
	return appendTrailer(b, count)
}

func appendTrailer(b []byte, count uint64) []byte {
	sum := crc32.Checksum(b, castagnoli)
	b = append(b, make([]byte, chunkHeaderSize)...)
	b = binary.LittleEndian.AppendUint64(b, count)
	b = binary.LittleEndian.AppendUint32(b, sum)
	return append(b, trailerMagic...)
}

// reframe replaces the compressed data of the chunk at off with comp (raw
// length rawLen, count n), fixing the chunk and whole-stream checksums.
func reframe(b []byte, off int, comp []byte, rawLen, n uint32) []byte {
	out := append([]byte(nil), b[:off]...)
	out = binary.LittleEndian.AppendUint32(out, uint32(len(comp)))
	out = binary.LittleEndian.AppendUint32(out, rawLen)
	out = binary.LittleEndian.AppendUint32(out, n)
	out = binary.LittleEndian.AppendUint32(out, crc32.Checksum(comp, castagnoli))
	out = append(out, comp...)
	return appendTrailer(out, uint64(n))
}

func TestReaderRejects(t *testing.T) {
	hdr, _ := encodeHeader(testHeader)
	chunk0 := len(hdr) // offset of the first chunk
	two := []testEntry{{[]byte("a"), []byte("1")}, {[]byte("b"), []byte("2")}}
	good := rawStream(testHeader, two)
	trailer := len(good) - trailerSize
	le32 := func(b []byte, off int, v uint32) []byte {
		b = bytes.Clone(b)
		binary.LittleEndian.PutUint32(b[off:], v)
		return b
	}
	// A chunk whose raw bytes are given verbatim (compressed and framed
	// with correct checksums).
	rawChunk := func(raw []byte, n uint32) []byte {
		return reframe(hdr, chunk0, compress(nil, raw), uint32(len(raw)), n)
	}
	cases := []struct {
		name    string
		stream  []byte
		wantOff int
		want    string
	}{
		{"bad magic", append([]byte("IDEMSNP2"), good[8:]...), 0, "bad magic"},
		{"unknown version", func() []byte { b := bytes.Clone(good); b[8] = 2; return b }(), 8, "unsupported format version 2"},
		{"header body too long", le32(good, 10, maxHeaderBody+1), 10, "header body length"},
		{"header checksum", func() []byte { b := bytes.Clone(good); b[15] ^= 1; return b }(), chunk0 - 4, "header checksum"},
		{"header body not msgpack", func() []byte {
			b := append([]byte(headerMagic), 1, 0, 1, 0, 0, 0, 0xc1)
			b = binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
			return appendTrailer(b, 0)
		}(), headerFixedSize, "header body"},
		{"chunk checksum", le32(good, chunk0+12, 0xdeadbeef), chunk0, "chunk checksum"},
		{"compressed length too large", le32(good, chunk0, maxCompressed+1), chunk0, "compressed length"},
		{"raw length too large", le32(good, chunk0+4, maxRaw+1), chunk0, "raw length"},
		{"raw length differs from the codec's", le32(good, chunk0+4, 100), chunk0, "declares"},
		{"zero count", le32(good, chunk0+8, 0), chunk0, "no entries"},
		{"count cannot fit", le32(good, chunk0+8, 1000), chunk0, "cannot fit"},
		{"count mismatch", le32(good, chunk0+8, 3), chunk0, "chunk holds 2 entries"},
		{"trailer count", le32(good, trailer+chunkHeaderSize, 3), trailer + chunkHeaderSize, "trailer counts 3"},
		{"stream checksum", le32(good, trailer+chunkHeaderSize+8, 1), trailer + chunkHeaderSize + 8, "stream checksum"},
		{"trailer magic", append(bytes.Clone(good[:len(good)-1]), '2'), trailer + chunkHeaderSize + 12, "trailer magic"},
		{"end marker not zero", le32(good, trailer+8, 1), trailer, "end marker"},
		{"trailing garbage", append(bytes.Clone(good), 0), len(good), "trailing bytes"},
		{"trailing second snapshot", append(bytes.Clone(good), good...), len(good), "trailing bytes"},
		{"keys out of order", rawStream(testHeader, []testEntry{{[]byte("b"), nil}, {[]byte("a"), nil}}), chunk0, "strictly increasing"},
		{"duplicate key", rawStream(testHeader, []testEntry{{[]byte("a"), nil}, {[]byte("a"), nil}}), chunk0, "strictly increasing"},
		{"keys out of order across chunks", rawStream(testHeader, two, []testEntry{{[]byte("b"), nil}}), -1, "strictly increasing"},
		{"not a pair", rawChunk([]byte{0x91, 0x93, mpBin8, 0, mpBin8, 0, mpBin8, 0}, 1), chunk0, "not a 2-element array"},
		{"key not bin", rawChunk([]byte{0x91, mpFixArray2, 0xa1, 'k', mpBin8, 0}, 1), chunk0, "bad key"},
		{"value past the end", rawChunk([]byte{0x91, mpFixArray2, mpBin8, 0, mpBin8, 5, 1}, 1), chunk0, "bad value"},
		{"bytes after the pairs", rawChunk([]byte{0x91, mpFixArray2, mpBin8, 0, mpBin8, 0, 0}, 1), -1, "after the last entry"},
		{"not an array", rawChunk([]byte{0xc0, mpFixArray2, mpBin8, 0, mpBin8, 0}, 1), chunk0, "array header"},
		{"undecodable S2", reframe(hdr, chunk0, []byte{10, 0xff, 0xff, 0xff, 0xff, 0xff}, 10, 1), chunk0, "decompress"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, _, _, err := readSnapshot(bytes.NewReader(tc.stream))
			var ce *CorruptError
			if !errors.Is(err, ErrCorrupt) || !errors.As(err, &ce) {
				t.Fatalf("got %v, want a CorruptError", err)
			}
			if !strings.Contains(ce.Reason, tc.want) || (tc.wantOff >= 0 && ce.Offset != int64(tc.wantOff)) {
				t.Fatalf("got %v, want %q at offset %d", err, tc.want, tc.wantOff)
			}
			if msg := err.Error(); !strings.Contains(msg, fmt.Sprintf("offset %d", ce.Offset)) ||
				(ce.Chunk >= 0) != strings.Contains(msg, fmt.Sprintf("chunk %d", ce.Chunk)) {
				t.Fatalf("message %q does not say where", msg)
			}
		})
	}
}

// TestReaderIOError: an error of the underlying reader is passed on, not
// reported as corruption.
func TestReaderIOError(t *testing.T) {
	b, _ := smallSnapshot(t)
	boom := errors.New("boom")
	for _, n := range []int{0, 5, 30, len(b) / 2, len(b) - 1, len(b)} {
		r := io.MultiReader(bytes.NewReader(b[:n]), iotest.ErrReader(boom))
		_, _, _, err := readSnapshot(r)
		if !errors.Is(err, boom) || errors.Is(err, ErrCorrupt) {
			t.Fatalf("n=%d: got %v, want boom", n, err)
		}
	}
}

// TestHeaderAppendedFields: a header body with fields appended by a later
// writer of the same version is read, the extra fields skipped.
func TestHeaderAppendedFields(t *testing.T) {
	body := []byte{0x96, 7, 0, 0, 0, 0x92, 1, 2, 0xa3, 'n', 'e', 'w'} // [7, 0, 0, 0, [1, 2], "new"]
	b := append([]byte(headerMagic), 1, 0)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(body)))
	b = append(b, body...)
	b = binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
	h, got, _, err := readSnapshot(bytes.NewReader(appendTrailer(b, 0)))
	if err != nil || h.LSN != 7 || len(got) != 0 {
		t.Fatalf("got %+v, %v", h, err)
	}
	// Fewer fields than version 1 has is corruption.
	b = append([]byte(headerMagic), 1, 0, 4, 0, 0, 0, 0x93, 7, 0, 0)
	b = binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
	if _, _, _, err := readSnapshot(bytes.NewReader(appendTrailer(b, 0))); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("3 header fields: %v", err)
	}
}
