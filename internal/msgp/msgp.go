// Package msgp appends msgpack values to a byte slice, byte for byte as
// github.com/vmihailenco/msgpack/v5's Encoder writes them (the tests check
// it against that encoder). The record and entry encoders are on the path
// of every request and every index row; appending directly skips the
// Encoder's io.Writer calls and its bytes.Buffer. Decoding stays with the
// library.
package msgp

import (
	"encoding/binary"
	"math"
)

// Type codes (the msgpack specification; msgpack/v5's msgpcode).
const (
	codeNil     = 0xc0
	codeBin8    = 0xc4
	codeBin16   = 0xc5
	codeBin32   = 0xc6
	codeUint8   = 0xcc
	codeUint16  = 0xcd
	codeUint32  = 0xce
	codeUint64  = 0xcf
	codeInt8    = 0xd0
	codeInt16   = 0xd1
	codeInt32   = 0xd2
	codeInt64   = 0xd3
	codeStr8    = 0xd9
	codeStr16   = 0xda
	codeStr32   = 0xdb
	codeArray16 = 0xdc
	codeArray32 = 0xdd
	fixArrayLow = 0x90
	fixStrLow   = 0xa0
)

// AppendArrayLen appends an array header of n elements.
func AppendArrayLen(b []byte, n int) []byte {
	switch {
	case n < 16:
		return append(b, fixArrayLow|byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, codeArray16), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, codeArray32), uint32(n))
}

// AppendUint appends n in its shortest form.
func AppendUint(b []byte, n uint64) []byte {
	switch {
	case n <= math.MaxInt8:
		return append(b, byte(n))
	case n <= math.MaxUint8:
		return append(b, codeUint8, byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, codeUint16), uint16(n))
	case n <= math.MaxUint32:
		return binary.BigEndian.AppendUint32(append(b, codeUint32), uint32(n))
	}
	return binary.BigEndian.AppendUint64(append(b, codeUint64), n)
}

// AppendInt appends n in its shortest form (unsigned forms when n >= 0).
func AppendInt(b []byte, n int64) []byte {
	switch {
	case n >= 0:
		return AppendUint(b, uint64(n))
	case n >= -32: // negative fixint (0xe0 | n)
		return append(b, byte(n))
	case n >= math.MinInt8:
		return append(b, codeInt8, byte(n))
	case n >= math.MinInt16:
		return binary.BigEndian.AppendUint16(append(b, codeInt16), uint16(n))
	case n >= math.MinInt32:
		return binary.BigEndian.AppendUint32(append(b, codeInt32), uint32(n))
	}
	return binary.BigEndian.AppendUint64(append(b, codeInt64), uint64(n))
}

// AppendBytes appends v as bin; nil as nil (an empty slice is an empty bin).
func AppendBytes(b []byte, v []byte) []byte {
	if v == nil {
		return append(b, codeNil)
	}
	return append(appendLen(b, len(v), codeBin8, codeBin16, codeBin32), v...)
}

// AppendString appends s as str.
func AppendString(b []byte, s string) []byte {
	if n := len(s); n < 32 {
		b = append(b, fixStrLow|byte(n))
	} else {
		b = appendLen(b, n, codeStr8, codeStr16, codeStr32)
	}
	return append(b, s...)
}

// appendLen appends the header of a bin or str of n bytes in its shortest
// 8-, 16- or 32-bit form.
func appendLen(b []byte, n int, c8, c16, c32 byte) []byte {
	switch {
	case n < 256:
		return append(b, c8, byte(n))
	case n <= math.MaxUint16:
		return binary.BigEndian.AppendUint16(append(b, c16), uint16(n))
	}
	return binary.BigEndian.AppendUint32(append(b, c32), uint32(n))
}
