package idemhttp

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"
)

// Key spaces.
//
// Every key is stored under the store scope ScopeFor(Options.ScopePrefix,
// actor) with the key's bytes as the id. The store keeps scope and id
// apart (both are length-prefixed in its index), so only the scope string
// has to be unambiguous. It is
//
//	"idemhttp/1/" <decimal length of prefix> ":" <prefix> "/" <space>
//
// where <space> is "-" for the shared space (no Options.Actor), "p:" followed
// by the actor for actors of up to MaxVerbatimActor bytes, and "h:" followed
// by the hex SHA-256 of the actor for longer ones (the
// engine bounds scopes, 1 KiB by default). The prefix is length-prefixed,
// so no prefix can run into the part after it; the part after it starts
// with a tag ("-", "p:", "h:") and a verbatim actor runs to the end of the
// string, so two different (prefix, actor) pairs never give the same scope
// (hashed actors: unless SHA-256 collides), the shared space never meets an
// actor's, and a middleware mounted with another ScopePrefix never meets
// this one's keys. (The "p:" tag is part of the stored format: it stays.)
const scopeMagic = "idemhttp/1/"

// MaxVerbatimActor is the longest actor kept as it is in the scope; longer
// ones are replaced by their SHA-256.
const MaxVerbatimActor = 256

// ScopeFor returns the store scope in which a middleware with
// Options.ScopePrefix == prefix keeps the keys of actor ("" for the shared
// space of a middleware without Options.Actor). Use it with Store.Lookup or
// Store.Ack to inspect or free a key from outside a request.
func ScopeFor(prefix, actor string) string {
	b := scopePrefixOf(prefix)
	switch {
	case actor == "":
		b.WriteByte('-')
	case len(actor) <= MaxVerbatimActor:
		b.WriteString("p:")
		b.WriteString(actor)
	default:
		sum := sha256.Sum256([]byte(actor))
		b.WriteString("h:")
		b.WriteString(hex.EncodeToString(sum[:]))
	}
	return b.String()
}

// scopePrefixOf starts the scopes of a middleware with
// Options.ScopePrefix == prefix: every one of them, and nothing else,
// starts with what it returns.
func scopePrefixOf(prefix string) *strings.Builder {
	var b strings.Builder
	b.Grow(len(scopeMagic) + 8 + len(prefix) + 3 + 2*sha256.Size)
	b.WriteString(scopeMagic)
	b.WriteString(strconv.Itoa(len(prefix)))
	b.WriteByte(':')
	b.WriteString(prefix)
	b.WriteByte('/')
	return &b
}

// KeyInfo describes a store entry written by the middleware (see
// ParseKey).
type KeyInfo struct {
	// Prefix is the middleware's Options.ScopePrefix.
	Prefix string
	// Actor is the actor the key belongs to; empty for the shared space.
	// When ActorHashed is set it is the hex SHA-256 of an actor longer
	// than MaxVerbatimActor bytes.
	Actor       string
	ActorHashed bool
	// Key is the Idempotency-Key.
	Key string
}

// ParseKey tells whether a store (scope, id) pair, as listed by
// Store.InDoubt, belongs to an idemhttp middleware, and which key and
// actor it is. ok is false for entries written by anything else.
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
		info.Actor = rest[2:]
	case strings.HasPrefix(rest, "h:") && len(rest) == 2+2*sha256.Size:
		info.Actor, info.ActorHashed = rest[2:], true
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
