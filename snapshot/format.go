package snapshot

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"time"

	"github.com/idemdb/idem/wal"
	"github.com/klauspost/compress/s2"
	"github.com/vmihailenco/msgpack/v5"
)

// Wire format constants. They are frozen: changing any of them changes the
// snapshot format (see doc.go).
const (
	headerMagic   = "IDEMSNP1"
	trailerMagic  = "IDEMEND1"
	formatVersion = 1

	// headerFixedSize is magic(8) + version(2) + body length(4).
	headerFixedSize = 14
	// headerCRCSize is the header checksum that follows the body.
	headerCRCSize = 4
	// maxHeaderBody bounds the msgpack header body. The body holds four
	// integers today (at most 4*9+1 bytes); the rest is room for appended
	// fields.
	maxHeaderBody = 4 << 10
	// headerFields is the number of header body fields this version writes
	// and needs; a reader skips fields appended after them.
	headerFields = 4

	// chunkHeaderSize is compressed length(4) + raw length(4) + entry
	// count(4) + crc of the compressed bytes(4).
	chunkHeaderSize = 16
	// trailerSize is the end marker (a chunk header of zeros) + entry
	// count(8) + checksum(4) + magic(8).
	trailerSize = chunkHeaderSize + 8 + 4 + len(trailerMagic)

	// maxCompressed and maxRaw bound the lengths of a chunk header. A reader
	// rejects larger values before allocating anything.
	maxCompressed = 16 << 20
	maxRaw        = 64 << 20

	// minPairSize is the smallest encoded [key, value] pair: fixarray(2)
	// marker + two empty bin8 strings. It bounds the entry count of a chunk
	// by its raw length.
	minPairSize = 1 + 2 + 2
	// maxPairOverhead is the largest msgpack overhead of one pair: fixarray
	// marker + two bin32 headers.
	maxPairOverhead = 1 + 5 + 5
	// arrayHeaderRoom is what the writer reserves in front of a chunk for
	// its msgpack array header (array32 is 5 bytes).
	arrayHeaderRoom = 5
)

// Tunables (not wire format: a reader accepts any chunk within the bounds
// above).
const (
	// chunkTarget is the raw size at which the writer cuts a chunk: a chunk
	// is closed before an entry that would take it past chunkTarget, so
	// chunks hold at most chunkTarget raw bytes unless a single entry is
	// bigger (it then gets a chunk of its own).
	chunkTarget = 64 << 10
)

// MaxEntrySize is the largest len(key)+len(value) that Writer.Add accepts.
// It is chosen so that a chunk holding one such entry stays under the
// compressed-length bound even if it does not compress at all (S2 stores
// incompressible input as literals: at most s2.MaxEncodedLen(n) bytes).
const MaxEntrySize = 13 << 20

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// ErrCorrupt is wrapped by every *CorruptError.
var ErrCorrupt = errors.New("snapshot: corrupt")

// CorruptError says where a snapshot stream stopped making sense. A
// truncated stream is a CorruptError too: the reader only reports io.EOF
// after it has checked the trailer.
type CorruptError struct {
	// Offset is the byte offset in the stream of the structure that is bad
	// (for a truncation: the offset at which the stream ended).
	Offset int64
	// Chunk is the 0-based index of the chunk being read; -1 in the header.
	// The trailer's end marker has the index of the chunk it takes the
	// place of (the number of data chunks).
	Chunk  int
	Reason string
}

func (e *CorruptError) Error() string {
	if e.Chunk < 0 {
		return fmt.Sprintf("%v: header, offset %d: %s", ErrCorrupt, e.Offset, e.Reason)
	}
	return fmt.Sprintf("%v: chunk %d, offset %d: %s", ErrCorrupt, e.Chunk, e.Offset, e.Reason)
}

// Unwrap returns ErrCorrupt.
func (e *CorruptError) Unwrap() error { return ErrCorrupt }

// Header describes a snapshot: the dedup set as of LSN.
type Header struct {
	// Version of the format; NewWriter writes formatVersion (1) and accepts
	// 0 as "current". A Reader only accepts 1.
	Version uint16
	// LSN is the last WAL record reflected in the snapshot.
	LSN uint64
	// Created is when the snapshot was taken, stored as Unix nanoseconds.
	// The zero Time is stored as 0 and read back as the zero Time; other
	// times are read back in UTC.
	Created time.Time
	// ForgetBefore and ForgetLSN are the newest forget mark (index.Mark)
	// as of LSN.
	ForgetBefore int64
	ForgetLSN    uint64
}

// Trailer closes a snapshot.
type Trailer struct {
	// Count is the number of entries.
	Count uint64
	// Checksum is the CRC-32C of every byte before the trailer.
	Checksum uint32
}

// encodeHeader returns the complete header bytes for h.
func encodeHeader(h Header) ([]byte, error) {
	var body bytes.Buffer
	enc := msgpack.NewEncoder(&body)
	var created int64
	if !h.Created.IsZero() {
		created = h.Created.UnixNano()
	}
	// Encoding into a bytes.Buffer cannot fail.
	_ = enc.EncodeArrayLen(headerFields)
	_ = enc.EncodeUint(h.LSN)
	_ = enc.EncodeInt(created)
	_ = enc.EncodeInt(h.ForgetBefore)
	_ = enc.EncodeUint(h.ForgetLSN)
	if body.Len() > maxHeaderBody {
		return nil, fmt.Errorf("snapshot: header body of %d bytes exceeds %d", body.Len(), maxHeaderBody)
	}
	b := make([]byte, 0, headerFixedSize+body.Len()+headerCRCSize)
	b = append(b, headerMagic...)
	b = binary.LittleEndian.AppendUint16(b, formatVersion)
	b = binary.LittleEndian.AppendUint32(b, uint32(body.Len()))
	b = append(b, body.Bytes()...)
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli)), nil
}

// decodeHeaderBody parses the msgpack header body (already checksummed).
func decodeHeaderBody(body []byte) (Header, error) {
	br := bytes.NewReader(body)
	d := msgpack.NewDecoder(br)
	n, err := d.DecodeArrayLen()
	if err != nil {
		return Header{}, err
	}
	if n < headerFields || n > len(body) {
		return Header{}, fmt.Errorf("%d header fields, want at least %d", n, headerFields)
	}
	h := Header{Version: formatVersion}
	if h.LSN, err = d.DecodeUint64(); err != nil {
		return Header{}, err
	}
	created, err := d.DecodeInt64()
	if err != nil {
		return Header{}, err
	}
	if created != 0 {
		h.Created = time.Unix(0, created).UTC()
	}
	if h.ForgetBefore, err = d.DecodeInt64(); err != nil {
		return Header{}, err
	}
	if h.ForgetLSN, err = d.DecodeUint64(); err != nil {
		return Header{}, err
	}
	// Fields appended by later writers of the same version.
	for i := headerFields; i < n; i++ {
		if err := wal.SkipBounded(d, br, 0); err != nil {
			return Header{}, err
		}
	}
	if br.Len() != 0 {
		return Header{}, errors.New("bytes after the header fields")
	}
	return h, nil
}

// Chunk payload (raw, before compression): one msgpack array of pairs, each
// pair a 2-element array of bin strings. The writer and reader encode and
// parse this subset of msgpack directly (no reflection, no copies).
const (
	mpFixArray2 = 0x92
	mpFixArray  = 0x90 // | n for n < 16
	mpArray16   = 0xdc
	mpArray32   = 0xdd
	mpBin8      = 0xc4
	mpBin16     = 0xc5
	mpBin32     = 0xc6
)

// appendBin appends b as a msgpack bin string.
func appendBin(dst, b []byte) []byte {
	switch n := len(b); {
	case n <= 0xff:
		dst = append(dst, mpBin8, byte(n))
	case n <= 0xffff:
		dst = append(dst, mpBin16)
		dst = binary.BigEndian.AppendUint16(dst, uint16(n))
	default:
		dst = append(dst, mpBin32)
		dst = binary.BigEndian.AppendUint32(dst, uint32(n))
	}
	return append(dst, b...)
}

// putArrayHeader writes the msgpack array header for n elements at the end
// of room (len(room) == arrayHeaderRoom) and returns where it starts.
func putArrayHeader(room []byte, n int) int {
	switch {
	case n < 16:
		room[4] = mpFixArray | byte(n)
		return 4
	case n <= 0xffff:
		room[2] = mpArray16
		binary.BigEndian.PutUint16(room[3:], uint16(n))
		return 2
	default:
		room[0] = mpArray32
		binary.BigEndian.PutUint32(room[1:], uint32(n))
		return 0
	}
}

// parseArrayHeader parses a msgpack array header at the start of b.
func parseArrayHeader(b []byte) (n int, size int, ok bool) {
	if len(b) == 0 {
		return 0, 0, false
	}
	switch c := b[0]; {
	case c&0xf0 == mpFixArray:
		return int(c & 0x0f), 1, true
	case c == mpArray16 && len(b) >= 3:
		return int(binary.BigEndian.Uint16(b[1:])), 3, true
	case c == mpArray32 && len(b) >= 5:
		return int(binary.BigEndian.Uint32(b[1:])), 5, true
	}
	return 0, 0, false
}

// parseBin parses a msgpack bin string at the start of b; v aliases b.
func parseBin(b []byte) (v []byte, size int, ok bool) {
	if len(b) < 2 {
		return nil, 0, false
	}
	var n, h int
	switch b[0] {
	case mpBin8:
		n, h = int(b[1]), 2
	case mpBin16:
		if len(b) < 3 {
			return nil, 0, false
		}
		n, h = int(binary.BigEndian.Uint16(b[1:])), 3
	case mpBin32:
		if len(b) < 5 {
			return nil, 0, false
		}
		n, h = int(binary.BigEndian.Uint32(b[1:])), 5
	default:
		return nil, 0, false
	}
	if n > len(b)-h {
		return nil, 0, false
	}
	return b[h : h+n : h+n], h + n, true
}

// Chunk compression is S2 block format (see doc.go for why).
func compress(dst, src []byte) []byte { return s2.Encode(dst, src) }

// maxCompressedLen bounds len(compress(nil, src)) for len(src) == n.
func maxCompressedLen(n int) int { return s2.MaxEncodedLen(n) }

// decompressedLen is the raw length the compressed block declares.
func decompressedLen(src []byte) (int, error) { return s2.DecodedLen(src) }

// decompress decodes src into dst, which has exactly the declared length.
func decompress(dst, src []byte) error {
	out, err := s2.Decode(dst, src)
	if err == nil && (len(out) != len(dst) || (len(out) > 0 && &out[0] != &dst[0])) {
		err = errors.New("decoded size mismatch")
	}
	return err
}
