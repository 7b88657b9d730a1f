package index

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
)

// Key layout of the Pebble store (frozen; see docs/design.md):
//
//	meta      0x00 name                                  -> value (see meta*)
//	entry     0x01 uvarint(len scope) scope mode uvarint(len ident) ident -> EncodeEntry
//	time      0x02 be64(commitTime^signbit) entryKey     -> empty
//	in-doubt  0x03 entryKey                              -> empty
//	expiry    0x04 be64(expiresAt^signbit) entryKey      -> empty
//
// mode is 'i' for an id (ident = the request id), 'c' for a sequence-mode
// client (ident = the client name), and 's' for the kept reply of one older
// sequence number of a client (ident = client name, then be64(seq); see
// SeqKey). Scope and ident are length-prefixed so that no two
// (scope, mode, ident) triples share an encoding; a client's 's' keys share
// one prefix and sort by sequence number. The time index
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
	// ModeSeq keys hold the reply of an older sequence number of a client
	// (the client's entry holds the latest): kept while it is inside the
	// reply window the client's requests ask for (Request.KeepReplies).
	// Their entries are committed replies only, never claims.
	ModeSeq byte = 's'
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
	if len(rest) == 0 || (rest[0] != ModeID && rest[0] != ModeClient && rest[0] != ModeSeq) {
		return "", 0, nil, fmt.Errorf("%w: mode in %x", ErrBadKey, k)
	}
	mode, rest = rest[0], rest[1:]
	n, w = binary.Uvarint(rest)
	if w <= 0 || w != uvarintLen(n) || n != uint64(len(rest)-w) {
		return "", 0, nil, fmt.Errorf("%w: ident length in %x", ErrBadKey, k)
	}
	ident = rest[w:]
	if mode == ModeSeq {
		if _, seq, ok := ParseSeqIdent(ident); !ok || seq == 0 {
			return "", 0, nil, fmt.Errorf("%w: sequence key ident %x (want a client name and a sequence number >= 1)", ErrBadKey, ident)
		}
	}
	return scope, mode, ident, nil
}

// SeqKey appends the entry key (mode ModeSeq) of the kept reply of the
// client's sequence number seq to dst: ident is the client name followed by
// seq in big-endian, so a client's sequence keys share a prefix and sort by
// number.
func SeqKey(dst []byte, scope string, client []byte, seq uint64) []byte {
	if dst == nil {
		dst = make([]byte, 0, 2+2*binary.MaxVarintLen64+len(scope)+len(client)+8)
	}
	dst = append(dst, prefixEntry)
	dst = binary.AppendUvarint(dst, uint64(len(scope)))
	dst = append(dst, scope...)
	dst = append(dst, ModeSeq)
	dst = binary.AppendUvarint(dst, uint64(len(client)+8))
	dst = append(dst, client...)
	return binary.BigEndian.AppendUint64(dst, seq)
}

// ParseSeqIdent splits the ident of a ModeSeq key into the client name
// (aliasing ident) and the sequence number.
func ParseSeqIdent(ident []byte) (client []byte, seq uint64, ok bool) {
	if len(ident) < 9 {
		return nil, 0, false
	}
	n := len(ident) - 8
	return ident[:n], binary.BigEndian.Uint64(ident[n:]), true
}

// ShardHash hashes an entry key for the engine's lock shards: the key
// itself, except that a ModeSeq key hashes as its client's entry key
// (mode ModeClient), so that a client's entry and its kept older replies
// always share one shard and one lock. A commit that moves and drops
// sequence replies then needs only the client's lock. It does not
// allocate; for a key that is not a ModeSeq key it costs one uvarint read
// on top of maphash.Bytes.
func ShardHash(seed maphash.Seed, key []byte) uint64 {
	if prefix, client, ok := seqKeyClient(key); ok {
		return clientHash(seed, prefix, client)
	}
	return maphash.Bytes(seed, key)
}

// KeyHashes returns ShardHash(seed, key) and key's own hash
// (maphash.Bytes(seed, key)), which the engine's shard tables use. They
// are one value, computed once, for every key but a ModeSeq key, whose
// own hash tells it apart from its client's other sequence keys.
func KeyHashes(seed maphash.Seed, key []byte) (shard, own uint64) {
	own = maphash.Bytes(seed, key)
	if prefix, client, ok := seqKeyClient(key); ok {
		return clientHash(seed, prefix, client), own
	}
	return own, own
}

// seqKeyClient splits a well-formed ModeSeq key into its prefix up to
// the mode byte (the scope) and its client's name; ok is false for any
// other key.
func seqKeyClient(key []byte) (prefix, client []byte, ok bool) {
	if len(key) < 2 || key[0] != prefixEntry {
		return nil, nil, false
	}
	n, w := binary.Uvarint(key[1:])
	at := 1 + w + int(n) // the mode byte
	if w <= 0 || n >= uint64(len(key)) || at >= len(key) || key[at] != ModeSeq {
		return nil, nil, false
	}
	m, w2 := binary.Uvarint(key[at+1:])
	ident := key[at+1+max(w2, 0):]
	if w2 <= 0 || m != uint64(len(ident)) || len(ident) < 9 {
		return nil, nil, false
	}
	return key[:at], ident[:len(ident)-8], true
}

// clientHash is the hash of the ModeClient entry key of client in the
// scope whose key prefix (up to the mode byte) is prefix.
func clientHash(seed maphash.Seed, prefix, client []byte) uint64 {
	var h maphash.Hash
	h.SetSeed(seed)
	h.Write(prefix)
	h.WriteByte(ModeClient)
	var b [binary.MaxVarintLen64]byte
	h.Write(binary.AppendUvarint(b[:0], uint64(len(client))))
	h.Write(client)
	return h.Sum64()
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
