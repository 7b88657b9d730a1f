package idemgrpc_test

import (
	"slices"
	"testing"

	"github.com/idemdb/idem/idemgrpc"
)

// TestScopeEncodingInjective: every distinct (prefix, actor, fields) tuple
// over a small alphabet has its own encoding, and decodes back.
func TestScopeEncodingInjective(t *testing.T) {
	atoms := []string{"", "a", "b", "ab", "\x01", "\x00a", string(make([]byte, 200))}
	seen := map[string][]string{}
	var rec func(tuple []string)
	rec = func(tuple []string) {
		if len(tuple) >= 2 {
			enc := idemgrpc.EncodeScope(tuple[0], tuple[1], tuple[2:]...)
			if prev, ok := seen[enc]; ok {
				t.Fatalf("%q and %q share the scope %q", prev, tuple, enc)
			}
			seen[enc] = slices.Clone(tuple)
			p, a, f, err := idemgrpc.DecodeScope(enc)
			if err != nil || p != tuple[0] || a != tuple[1] || !slices.Equal(f, tuple[2:]) && !(len(f) == 0 && len(tuple) == 2) {
				t.Fatalf("decode %q: %q %q %q %v", tuple, p, a, f, err)
			}
		}
		if len(tuple) == 5 {
			return
		}
		for _, x := range atoms {
			rec(append(tuple, x))
		}
	}
	rec(nil)
	if len(seen) < 1000 {
		t.Fatalf("only %d tuples checked", len(seen))
	}
}

// FuzzDecodeScope: no input panics; whatever decodes re-encodes to itself.
func FuzzDecodeScope(f *testing.F) {
	f.Add(idemgrpc.EncodeScope("grpc", "user:alice", "ns", "vault"))
	f.Add("\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")
	f.Add("\x05ab")
	f.Fuzz(func(t *testing.T, s string) {
		p, a, fields, err := idemgrpc.DecodeScope(s)
		if err != nil {
			return
		}
		if idemgrpc.EncodeScope(p, a, fields...) != s {
			t.Fatalf("%q does not re-encode to itself", s)
		}
	})
}
