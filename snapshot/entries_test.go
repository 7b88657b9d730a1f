package snapshot

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"slices"

	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
)

// testEntry is one (key, value) pair of a snapshot.
type testEntry struct{ key, value []byte }

// realisticEntries returns n committed id-mode entries as the engine stores
// them, sorted by key: 16-byte random request ids in one scope, 128-byte
// JSON-like replies (an order id, an amount, a status, a timestamp), a
// 16-byte fingerprint, commit times and LSNs that grow like a live log.
// randomReplies replaces the JSON replies by 128 random bytes (the
// incompressible worst case).
func realisticEntries(seed uint64, n int, randomReplies bool) []testEntry {
	rng := rand.New(rand.NewPCG(seed, seed^0x5eed))
	out := make([]testEntry, 0, n)
	t := int64(1_760_000_000_000_000_000)
	seen := make(map[[16]byte]bool, n)
	for len(out) < n {
		var id [16]byte
		for i := range id {
			id[i] = byte(rng.Uint32())
		}
		if seen[id] {
			continue
		}
		seen[id] = true
		t += int64(rng.IntN(2_000_000))
		lsn := wal.LSN(2*len(out) + 2)
		e := &index.Entry{
			Committed:   true,
			CommitTime:  t,
			CommitLSN:   lsn,
			ReplyKept:   true,
			Reply:       testReply(rng, randomReplies),
			Fingerprint: make([]byte, 16),
			LSN:         lsn,
		}
		for i := range e.Fingerprint {
			e.Fingerprint[i] = byte(rng.Uint32())
		}
		out = append(out, testEntry{
			key:   index.EntryKey(nil, "payments", index.ModeID, id[:]),
			value: index.EncodeEntry(nil, e),
		})
	}
	slices.SortFunc(out, func(a, b testEntry) int { return bytes.Compare(a.key, b.key) })
	return out
}

func testReply(rng *rand.Rand, random bool) []byte {
	b := make([]byte, 128)
	if random {
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		return b
	}
	var oid [16]byte
	for i := range oid {
		oid[i] = byte(rng.Uint32())
	}
	statuses := []string{"captured", "authorized", "declined", "refunded"}
	s := fmt.Sprintf(`{"order":"%s","status":"%s","amount":%d,"currency":"EUR","at":%d}`,
		hex.EncodeToString(oid[:]), statuses[rng.IntN(len(statuses))], rng.IntN(1_000_000), 1_760_000_000+rng.IntN(1_000_000))
	copy(b, s)
	for i := len(s); i < len(b); i++ {
		b[i] = ' '
	}
	return b
}
