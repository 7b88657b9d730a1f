package idemgrpc

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// EncodeScope builds the engine scope (idem.Request.Scope) of a call: the
// prefix (Options.ScopePrefix), the actor and the service's scope fields, each
// preceded by its length as a uvarint. The encoding is prefix-free, so two
// distinct tuples never share a scope: ("a", "bc") and ("ab", "c") differ, and
// so do ("ns") and ("ns", "").
func EncodeScope(prefix, actor string, fields ...string) string {
	n := len(prefix) + len(actor) + 2*binary.MaxVarintLen32
	for _, f := range fields {
		n += len(f) + binary.MaxVarintLen32
	}
	b := make([]byte, 0, n)
	b = appendField(b, prefix)
	b = appendField(b, actor)
	for _, f := range fields {
		b = appendField(b, f)
	}
	return string(b)
}

func appendField(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// DecodeScope splits a scope built by EncodeScope (for example the Scope of
// an idem.InDoubtClaim) back into its prefix, actor and fields.
func DecodeScope(scope string) (prefix, actor string, fields []string, err error) {
	var parts []string
	b := []byte(scope)
	for len(b) > 0 {
		n, w := binary.Uvarint(b)
		if w <= 0 || n > uint64(len(b)-w) || w != uvarintLen(n) {
			return "", "", nil, fmt.Errorf("idemgrpc: scope %q: bad length prefix at byte %d", scope, len(scope)-len(b))
		}
		parts = append(parts, string(b[w:w+int(n)]))
		b = b[w+int(n):]
	}
	if len(parts) < 2 {
		return "", "", nil, errors.New("idemgrpc: scope has no prefix and actor: not built by EncodeScope")
	}
	return parts[0], parts[1], parts[2:], nil
}

func uvarintLen(n uint64) int {
	var buf [binary.MaxVarintLen64]byte
	return binary.PutUvarint(buf[:], n)
}
