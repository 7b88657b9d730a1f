package snapshot

import (
	"bytes"
	"errors"
	"io"
	"testing"

	"github.com/idemdb/idem/internal/alloctest"
)

// FuzzReader feeds arbitrary bytes to the Reader: it must never panic,
// never return an entry out of key order, end only with io.EOF (after a
// trailer whose count matches) or an error, and never allocate beyond the
// format's bounds (one maximal raw chunk plus a small multiple of the
// input).
func FuzzReader(f *testing.F) {
	small, _ := smallSnapshot(f)
	f.Add(small)
	f.Add(writeSnapshot(f, testHeader, nil))
	f.Add(writeSnapshot(f, Header{}, realisticEntries(1, 1, false)))
	f.Add(writeSnapshot(f, testHeader, realisticEntries(2, 40, true)))
	f.Add(rawStream(testHeader, []testEntry{{[]byte("b"), nil}, {[]byte("a"), nil}}))
	f.Add(small[:len(small)/2])
	f.Add([]byte(headerMagic))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		alloctest.Check(t, "Reader", uint64(maxRaw+8*len(data)+1<<20), func() {
			r, err := NewReader(bytes.NewReader(data))
			if err != nil {
				if !errors.Is(err, ErrCorrupt) {
					t.Fatalf("NewReader: %v is not ErrCorrupt", err)
				}
				return
			}
			var prev []byte
			var n uint64
			for {
				k, _, err := r.Next()
				if err == io.EOF {
					if r.Trailer().Count != n {
						t.Fatalf("trailer count %d, read %d", r.Trailer().Count, n)
					}
					return
				}
				if err != nil {
					if !errors.Is(err, ErrCorrupt) {
						t.Fatalf("Next: %v is not ErrCorrupt", err)
					}
					return
				}
				if n > 0 && bytes.Compare(k, prev) <= 0 {
					t.Fatalf("key %x after %x", k, prev)
				}
				prev = append(prev[:0], k...)
				n++
			}
		})
	})
}
