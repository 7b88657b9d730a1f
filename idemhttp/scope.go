package idemhttp

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"
)

// Key spaces.
//
// Every key is stored under the engine scope ScopeFor(Options.Scope,
// principal) with the key's bytes as the id. The engine keeps scope and id
// apart (both are length-prefixed in its index), so only the scope string
// has to be unambiguous. It is
//
//	"idemhttp/1/" <decimal length of prefix> ":" <prefix> "/" <space>
//
// where <space> is "-" for the shared space (no Principal), "p:" followed by
// the principal for principals of up to MaxVerbatimPrincipal bytes, and
// "h:" followed by the hex SHA-256 of the principal for longer ones (the
// engine bounds scopes, 1 KiB by default). The prefix is length-prefixed,
// so no prefix can run into the part after it; the part after it starts
// with a tag ("-", "p:", "h:") and a verbatim principal runs to the end of
// the string, so two different (prefix, principal) pairs never give the
// same scope (hashed principals: unless SHA-256 collides), the shared space
// never meets a principal's, and a middleware mounted with another Scope
// option never meets this one's keys.
const scopeMagic = "idemhttp/1/"

// MaxVerbatimPrincipal is the longest principal kept as it is in the scope;
// longer ones are replaced by their SHA-256.
const MaxVerbatimPrincipal = 256

// ScopeFor returns the engine scope in which a middleware with
// Options.Scope == prefix keeps the keys of principal ("" for the shared
// space of a middleware without Principal). Use it with Engine.Lookup or
// Engine.Ack to inspect or free a key from outside a request.
func ScopeFor(prefix, principal string) string {
	var b strings.Builder
	b.Grow(len(scopeMagic) + 8 + len(prefix) + 3 + min(len(principal), 2*sha256.Size))
	b.WriteString(scopeMagic)
	b.WriteString(strconv.Itoa(len(prefix)))
	b.WriteByte(':')
	b.WriteString(prefix)
	b.WriteByte('/')
	switch {
	case principal == "":
		b.WriteByte('-')
	case len(principal) <= MaxVerbatimPrincipal:
		b.WriteString("p:")
		b.WriteString(principal)
	default:
		sum := sha256.Sum256([]byte(principal))
		b.WriteString("h:")
		b.WriteString(hex.EncodeToString(sum[:]))
	}
	return b.String()
}

// KeyInfo describes an engine entry written by the middleware (see
// ParseKey).
type KeyInfo struct {
	// Prefix is the middleware's Options.Scope.
	Prefix string
	// Principal is the principal the key belongs to; empty for the shared
	// space. When PrincipalHashed is set it is the hex SHA-256 of a
	// principal longer than MaxVerbatimPrincipal bytes.
	Principal       string
	PrincipalHashed bool
	// Key is the Idempotency-Key.
	Key string
}

// ParseKey tells whether an engine (scope, id) pair, as listed by
// Engine.InDoubt, belongs to an idemhttp middleware, and which key and
// principal it is. ok is false for entries written by anything else.
func ParseKey(scope string, id []byte) (info KeyInfo, ok bool) {
	rest, ok := strings.CutPrefix(scope, scopeMagic)
	if !ok {
		return KeyInfo{}, false
	}
	lenStr, rest, ok := strings.Cut(rest, ":")
	if !ok {
		return KeyInfo{}, false
	}
	n, err := strconv.Atoi(lenStr)
	if err != nil || n < 0 || n > len(rest) || strconv.Itoa(n) != lenStr {
		return KeyInfo{}, false
	}
	info.Prefix, rest = rest[:n], rest[n:]
	rest, ok = strings.CutPrefix(rest, "/")
	if !ok {
		return KeyInfo{}, false
	}
	switch {
	case rest == "-":
	case strings.HasPrefix(rest, "p:") && len(rest) > 2:
		info.Principal = rest[2:]
	case strings.HasPrefix(rest, "h:") && len(rest) == 2+2*sha256.Size:
		info.Principal, info.PrincipalHashed = rest[2:], true
	default:
		return KeyInfo{}, false
	}
	if !ValidKey(string(id)) {
		return KeyInfo{}, false
	}
	info.Key = string(id)
	return info, true
}

// ValidKey reports whether k is a valid Idempotency-Key: 1 to 255
// characters, each a letter (A-Z, a-z), a digit, '-' or '_'.
func ValidKey(k string) bool {
	if len(k) == 0 || len(k) > MaxKeyLen {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// MaxKeyLen is the longest valid Idempotency-Key.
const MaxKeyLen = 255
