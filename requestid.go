package idem

import (
	"crypto/rand"
	"encoding/base32"
	"encoding/binary"
	"fmt"
	"time"
)

// RequestID is a request id made of 8 bytes of time (microseconds since the
// Unix epoch, big-endian) followed by 8 random bytes: ids made by any number
// of processes and restarts do not collide (64 random bits per microsecond),
// and they sort by the time they were made.
//
// Its text form (String, MarshalText) is 26 characters of the base32hex
// alphabet of RFC 4648 ("0"-"9" then "A"-"V"), without padding: the 128 bits
// read five at a time from the most significant, the last character holding
// the final 3 bits followed by two zero bits. It is a valid HTTP
// Idempotency-Key (1-255 characters of [A-Za-z0-9_-]), URL-safe, and it
// sorts (byte-wise, as strings) in the same order as the ids themselves, so
// by time. ParseRequestID accepts exactly this canonical form.
//
// The zero RequestID is not a valid id made by NewRequestID; use IsZero to
// test for it.
type RequestID [16]byte

// RequestIDTextLen is the length of a RequestID's text form.
const RequestIDTextLen = 26

var requestIDEncoding = base32.HexEncoding.WithPadding(base32.NoPadding)

// NewRequestID returns a new id for the current time: 8 bytes of Unix time
// in microseconds and 8 bytes from crypto/rand.
func NewRequestID() RequestID {
	var id RequestID
	binary.BigEndian.PutUint64(id[:8], uint64(time.Now().UnixMicro()))
	_, _ = rand.Read(id[8:]) // never fails (crypto/rand crashes the program if it cannot read)
	return id
}

// ParseRequestID parses the text form written by String. It accepts only
// the canonical form: 26 characters of 0-9 and A-V (upper case), the last
// one with its two low bits clear.
func ParseRequestID(s string) (RequestID, error) {
	var id RequestID
	if len(s) != RequestIDTextLen {
		return id, fmt.Errorf("idem: request id %q: %d characters, want %d", clipRequestIDText(s), len(s), RequestIDTextLen)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= '0' && c <= '9' || c >= 'A' && c <= 'V') {
			return id, fmt.Errorf("idem: request id %q: character %q at offset %d is not one of 0-9, A-V", s, c, i)
		}
	}
	n, err := requestIDEncoding.Decode(id[:], []byte(s))
	if err != nil || n != len(id) {
		return RequestID{}, fmt.Errorf("idem: request id %q: %v", s, err)
	}
	if requestIDEncoding.EncodeToString(id[:]) != s {
		return RequestID{}, fmt.Errorf("idem: request id %q: not canonical (the last character's two low bits must be zero)", s)
	}
	return id, nil
}

// clipRequestIDText shortens s for an error message.
func clipRequestIDText(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}

// String returns the 26-character text form (see RequestID).
func (id RequestID) String() string { return requestIDEncoding.EncodeToString(id[:]) }

// Time returns the time the id was made, to the microsecond.
func (id RequestID) Time() time.Time {
	return time.UnixMicro(int64(binary.BigEndian.Uint64(id[:8])))
}

// Bytes returns the 16 bytes of the id (a copy), as used for Request.ID.
func (id RequestID) Bytes() []byte {
	b := make([]byte, len(id))
	copy(b, id[:])
	return b
}

// IsZero reports whether id is the zero RequestID.
func (id RequestID) IsZero() bool { return id == RequestID{} }

// MarshalText returns the text form (encoding.TextMarshaler).
func (id RequestID) MarshalText() ([]byte, error) {
	b := make([]byte, RequestIDTextLen)
	requestIDEncoding.Encode(b, id[:])
	return b, nil
}

// UnmarshalText parses the text form (encoding.TextUnmarshaler). On error
// the id is left unchanged.
func (id *RequestID) UnmarshalText(b []byte) error {
	v, err := ParseRequestID(string(b))
	if err != nil {
		return err
	}
	*id = v
	return nil
}
