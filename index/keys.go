package index

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Key layout of the Pebble store (frozen; see docs/design.md):
//
//	meta      0x00 name                                  -> value (see meta*)
//	entry     0x01 uvarint(len scope) scope mode uvarint(len ident) ident -> EncodeEntry
//	time      0x02 be64(commitTime^signbit) entryKey     -> empty
//	in-doubt  0x03 entryKey                              -> empty
//	expiry    0x04 be64(expiresAt^signbit) entryKey      -> empty
//
// mode is 'i' for an id (ident = the request id) and 'c' for a sequence-mode
// client (ident = the client name). Scope and ident are length-prefixed so
// that no two (scope, mode, ident) triples share an encoding. The time index
// holds one row per entry that keeps a committed reply, ordered by commit
// time, so forget and expiry find what they remove with a range scan and
// delete it with range deletes, never by scanning all entries. The in-doubt
// index lists in-flight claims, so Open finds them without a full scan. The
// expiry index holds one row per kept reply with a per-request TTL, ordered
// by when it runs out, so the TTL cleanup reads only what it removes.
const (
	prefixMeta    = 0x00
	prefixEntry   = 0x01
	prefixTime    = 0x02
	prefixInDoubt = 0x03
	prefixExpiry  = 0x04
)

// Modes of an entry key.
const (
	ModeID     byte = 'i'
	ModeClient byte = 'c'
)

var (
	metaApplied = []byte{prefixMeta, 'a'} // uvarint applied LSN
	metaForget  = []byte{prefixMeta, 'f'} // varint before, uvarint LSN
	metaCount   = []byte{prefixMeta, 'n'} // uvarint number of entries
	metaReplies = []byte{prefixMeta, 'r'} // uvarint number of kept replies
	metaFormat  = []byte{prefixMeta, 'v'} // uvarint format version
)

const formatVersion = 1

// EntryKey appends the entry key of (scope, mode, ident) to dst.
func EntryKey(dst []byte, scope string, mode byte, ident []byte) []byte {
	if dst == nil { // one allocation of the right size, not a growing one
		dst = make([]byte, 0, 2+2*binary.MaxVarintLen64+len(scope)+len(ident))
	}
	dst = append(dst, prefixEntry)
	dst = binary.AppendUvarint(dst, uint64(len(scope)))
	dst = append(dst, scope...)
	dst = append(dst, mode)
	dst = binary.AppendUvarint(dst, uint64(len(ident)))
	return append(dst, ident...)
}

// ErrBadKey is returned for a key that does not parse.
var ErrBadKey = errors.New("index: bad key")

// ParseEntryKey splits an entry key. ident aliases k.
func ParseEntryKey(k []byte) (scope string, mode byte, ident []byte, err error) {
	if len(k) == 0 || k[0] != prefixEntry {
		return "", 0, nil, fmt.Errorf("%w: %x", ErrBadKey, k)
	}
	rest := k[1:]
	n, w := binary.Uvarint(rest)
	if w <= 0 || w != uvarintLen(n) || n > uint64(len(rest)-w) {
		return "", 0, nil, fmt.Errorf("%w: scope length in %x", ErrBadKey, k)
	}
	rest = rest[w:]
	scope, rest = string(rest[:n]), rest[n:]
	if len(rest) == 0 || (rest[0] != ModeID && rest[0] != ModeClient) {
		return "", 0, nil, fmt.Errorf("%w: mode in %x", ErrBadKey, k)
	}
	mode, rest = rest[0], rest[1:]
	n, w = binary.Uvarint(rest)
	if w <= 0 || w != uvarintLen(n) || n != uint64(len(rest)-w) {
		return "", 0, nil, fmt.Errorf("%w: ident length in %x", ErrBadKey, k)
	}
	return scope, mode, rest[w:], nil
}

// uvarintLen is the length of n's canonical uvarint encoding: a key with an
// overlong length prefix would be a second encoding of the same identity.
func uvarintLen(n uint64) int {
	var b [binary.MaxVarintLen64]byte
	return len(binary.AppendUvarint(b[:0], n))
}

func timeKey(dst []byte, t int64, entryKey []byte) []byte {
	dst = append(dst, prefixTime)
	dst = binary.BigEndian.AppendUint64(dst, uint64(t)^(1<<63))
	return append(dst, entryKey...)
}

func parseTimeKey(k []byte) (t int64, entryKey []byte, ok bool) {
	if len(k) < 9 || k[0] != prefixTime {
		return 0, nil, false
	}
	return int64(binary.BigEndian.Uint64(k[1:9]) ^ (1 << 63)), k[9:], true
}

func inDoubtKey(dst []byte, entryKey []byte) []byte {
	dst = append(dst, prefixInDoubt)
	return append(dst, entryKey...)
}

func expiryKey(dst []byte, t int64, entryKey []byte) []byte {
	dst = append(dst, prefixExpiry)
	dst = binary.BigEndian.AppendUint64(dst, uint64(t)^(1<<63))
	return append(dst, entryKey...)
}

func parseExpiryKey(k []byte) (t int64, entryKey []byte, ok bool) {
	if len(k) < 9 || k[0] != prefixExpiry {
		return 0, nil, false
	}
	return int64(binary.BigEndian.Uint64(k[1:9]) ^ (1 << 63)), k[9:], true
}
