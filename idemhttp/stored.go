package idemhttp

import (
	"bytes"
	"errors"
	"fmt"
	"net/http"
	"slices"

	"github.com/vmihailenco/msgpack/v5"
)

// StoredResponse is what the middleware commits to the store for a key:
// the handler's response, replayed byte for byte to every retry.
//
// The store keeps it as the reply of the key, encoded by Encode (a msgpack
// array: format version, status, header, body, trailer, flags; fields are
// only ever appended, and Decode skips fields it does not know).
type StoredResponse struct {
	Status int
	// Header is the header the handler had set when it wrote the status
	// (net/http sends those; later changes are ignored but for trailers).
	Header http.Header
	Body   []byte
	// Trailer holds the trailers: values of names announced in the
	// "Trailer" header, and keys prefixed with http.TrailerPrefix.
	Trailer http.Header
	// NotStored marks a response that was larger than the size limit: it
	// went to the first client only, only Status is kept, and a retry gets
	// the IDEMPOTENCY_RESPONSE_NOT_STORED error instead of a replay.
	NotStored bool
}

const (
	storedVersion = 1
	flagNotStored = 1 << 0
)

// Encode returns the reply to commit for r (use it to resolve an in-doubt
// claim with Claim.Commit; see the package documentation).
func (r *StoredResponse) Encode() ([]byte, error) {
	if r.Status < 100 || r.Status > 999 {
		return nil, fmt.Errorf("idemhttp: cannot store a response with status %d", r.Status)
	}
	var buf bytes.Buffer
	buf.Grow(len(r.Body) + 64 + 32*len(r.Header))
	enc := msgpack.GetEncoder()
	defer msgpack.PutEncoder(enc)
	enc.Reset(&buf)
	var flags uint64
	if r.NotStored {
		flags |= flagNotStored
	}
	err := errors.Join(
		enc.EncodeArrayLen(6),
		enc.EncodeUint(storedVersion),
		enc.EncodeInt(int64(r.Status)),
		encodeHeader(enc, r.Header),
		enc.EncodeBytes(r.Body),
		encodeHeader(enc, r.Trailer),
		enc.EncodeUint(flags),
	)
	if err != nil {
		return nil, fmt.Errorf("idemhttp: encoding the stored response: %w", err)
	}
	return buf.Bytes(), nil
}

// encodeHeader writes h as a map of arrays of strings, keys sorted (so one
// response always encodes the same way).
func encodeHeader(enc *msgpack.Encoder, h http.Header) error {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	if err := enc.EncodeMapLen(len(keys)); err != nil {
		return err
	}
	for _, k := range keys {
		if err := enc.EncodeString(k); err != nil {
			return err
		}
		vs := h[k]
		if err := enc.EncodeArrayLen(len(vs)); err != nil {
			return err
		}
		for _, v := range vs {
			if err := enc.EncodeString(v); err != nil {
				return err
			}
		}
	}
	return nil
}

// DecodeStoredResponse decodes a reply written by Encode. A reply that is
// not one (another application's reply in the same scope, or a newer
// format) is an error saying so.
func DecodeStoredResponse(b []byte) (*StoredResponse, error) {
	r, err := decodeStored(b)
	if err != nil {
		return nil, fmt.Errorf("idemhttp: stored reply of %d bytes is not a stored HTTP response: %w", len(b), err)
	}
	return r, nil
}

func decodeStored(b []byte) (*StoredResponse, error) {
	dec := msgpack.GetDecoder()
	defer msgpack.PutDecoder(dec)
	rd := bytes.NewReader(b)
	dec.Reset(rd)
	n, err := dec.DecodeArrayLen()
	if err != nil {
		return nil, err
	}
	if n < 6 {
		return nil, fmt.Errorf("array of %d fields, want at least 6", n)
	}
	v, err := dec.DecodeUint64()
	if err != nil {
		return nil, fmt.Errorf("version: %w", err)
	}
	if v != storedVersion {
		return nil, fmt.Errorf("format version %d, this package reads %d", v, storedVersion)
	}
	var r StoredResponse
	st, err := dec.DecodeInt64()
	if err != nil {
		return nil, fmt.Errorf("status: %w", err)
	}
	if st < 100 || st > 999 {
		return nil, fmt.Errorf("status %d", st)
	}
	r.Status = int(st)
	if r.Header, err = decodeHeader(dec); err != nil {
		return nil, fmt.Errorf("header: %w", err)
	}
	if r.Body, err = dec.DecodeBytes(); err != nil {
		return nil, fmt.Errorf("body: %w", err)
	}
	if r.Trailer, err = decodeHeader(dec); err != nil {
		return nil, fmt.Errorf("trailer: %w", err)
	}
	flags, err := dec.DecodeUint64()
	if err != nil {
		return nil, fmt.Errorf("flags: %w", err)
	}
	r.NotStored = flags&flagNotStored != 0
	for i := 6; i < n; i++ { // fields of a later format version
		if err := dec.Skip(); err != nil {
			return nil, fmt.Errorf("field %d: %w", i, err)
		}
	}
	if rd.Len() != 0 {
		return nil, fmt.Errorf("%d trailing bytes", rd.Len())
	}
	return &r, nil
}

func decodeHeader(dec *msgpack.Decoder) (http.Header, error) {
	n, err := dec.DecodeMapLen()
	if err != nil {
		return nil, err
	}
	if n < 0 {
		return nil, nil
	}
	h := make(http.Header, min(n, 64))
	for range n {
		k, err := dec.DecodeString()
		if err != nil {
			return nil, err
		}
		m, err := dec.DecodeArrayLen()
		if err != nil {
			return nil, err
		}
		if m < 0 {
			h[k] = nil
			continue
		}
		vs := make([]string, 0, min(m, 64))
		for range m {
			v, err := dec.DecodeString()
			if err != nil {
				return nil, err
			}
			vs = append(vs, v)
		}
		h[k] = vs
	}
	return h, nil
}
