package main

import (
	"bytes"
	"encoding/hex"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/idemdb/idem/idemgrpc"
	"github.com/idemdb/idem/idemhttp"
	"github.com/idemdb/idem/wal"
)

// readable renders an id, scope or client name: as text when every byte is
// printable ASCII, else as 0x followed by hex.
func readable(b []byte) string {
	if !printable(string(b)) {
		return "0x" + hex.EncodeToString(b)
	}
	return string(b)
}

// readableText is readable for key=value text output: quoted when empty or
// when it holds a space, a quote, a backslash or '='.
func readableText(b []byte) string {
	s := readable(b)
	if s == "" || strings.ContainsAny(s, " \"\\=") {
		return strconv.Quote(s)
	}
	return s
}

// parseIDArg turns a command-line id into bytes: 0x... is hex, anything
// else is the text itself.
func parseIDArg(s string) []byte {
	if strings.HasPrefix(s, "0x") && len(s) > 2 {
		if b, err := hex.DecodeString(s[2:]); err == nil {
			return b
		}
	}
	return []byte(s)
}

func fmtTime(ns int64) string {
	if ns == 0 {
		return ""
	}
	return time.Unix(0, ns).UTC().Format(time.RFC3339Nano)
}

// parseTimeArg accepts an RFC 3339 time (2026-05-01T12:00:00Z), a date
// (2026-05-01, midnight UTC), or a duration before now (720h, 90m, 30d).
func parseTimeArg(s string, now time.Time) (time.Time, error) {
	s = strings.TrimSpace(s)
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04:05", "2006-01-02"} {
		if t, err := time.Parse(layout, s); err == nil {
			return t, nil
		}
	}
	d, err := parseDurationArg(s)
	if err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, usagef("bad time %q: want an RFC 3339 time (2026-05-01T12:00:00Z), a date (2026-05-01) or a duration before now (720h, 30d)", s)
}

// parseDurationArg is time.ParseDuration plus a "d" (24h) unit.
func parseDurationArg(s string) (time.Duration, error) {
	if n, ok := strings.CutSuffix(s, "d"); ok {
		v, err := strconv.ParseFloat(n, 64)
		if err != nil {
			return 0, err
		}
		return time.Duration(v * float64(24*time.Hour)), nil
	}
	return time.ParseDuration(s)
}

// filter selects records and entries; its zero value selects everything.
type filter struct {
	fs             *flag.FlagSet // the flags registered on, to see which were set
	scopeS, idS    string        // flag values
	sinceS, untilS string        // flag values
	scopeSet       bool          // --scope was given (possibly empty)
	scopeVal       string
	idSet          bool // --id was given
	idPrefix       []byte
	client         string
	fromLSN, toLSN uint64
	since, until   time.Time
}

// register adds the shared filter flags to fs.
func (f *filter) register(fs *flag.FlagSet) {
	f.fs = fs
	fs.StringVar(&f.scopeS, "scope", "", "only this `scope`: exact, or as printed for an integration's scope (--scope 'idemhttp(actor=alice)'); --scope '' is the empty scope")
	fs.StringVar(&f.idS, "id", "", "only ids starting with `prefix` (text, or 0x... for hex)")
	fs.StringVar(&f.client, "client", "", "only this sequence-mode `client`")
	fs.Uint64Var(&f.fromLSN, "from-lsn", 0, "only LSNs >= `n`")
	fs.Uint64Var(&f.toLSN, "to-lsn", 0, "only LSNs <= `n` (0: no bound)")
	fs.StringVar(&f.sinceS, "since", "", "only times at or after `t` (RFC 3339 time, date, or duration before now such as 24h)")
	fs.StringVar(&f.untilS, "until", "", "only times before `t` (same forms as --since)")
}

// resolve turns the flag strings into values, once flags are parsed.
func (f *filter) resolve(now time.Time) error {
	f.fs.Visit(func(fl *flag.Flag) {
		switch fl.Name {
		case "scope":
			f.scopeSet, f.scopeVal = true, f.scopeS
		case "id":
			f.idSet, f.idPrefix = true, parseIDArg(f.idS)
		}
	})
	var err error
	if f.sinceS != "" {
		if f.since, err = parseTimeArg(f.sinceS, now); err != nil {
			return err
		}
	}
	if f.untilS != "" {
		if f.until, err = parseTimeArg(f.untilS, now); err != nil {
			return err
		}
	}
	if f.toLSN != 0 && f.fromLSN > f.toLSN {
		return usagef("--from-lsn %d is after --to-lsn %d", f.fromLSN, f.toLSN)
	}
	return nil
}

func (f *filter) lsnOK(l wal.LSN) bool {
	return uint64(l) >= f.fromLSN && (f.toLSN == 0 || uint64(l) <= f.toLSN)
}

func (f *filter) timeOK(ns int64) bool {
	if !f.since.IsZero() && ns < f.since.UnixNano() {
		return false
	}
	if !f.until.IsZero() && ns >= f.until.UnixNano() {
		return false
	}
	return true
}

// keyOK checks scope, id and client filters against one identity. ids is
// every id the item names (a record's id and its acked ids).
func (f *filter) keyOK(scope string, hasScope bool, ids [][]byte, client string) bool {
	if f.scopeSet && (!hasScope || scope != f.scopeVal && (f.scopeVal == "" || scopeWords(scope) != f.scopeVal)) {
		return false
	}
	if f.idSet {
		ok := false
		for _, id := range ids {
			if bytes.HasPrefix(id, f.idPrefix) {
				ok = true
				break
			}
		}
		if !ok {
			return false
		}
	}
	if f.client != "" && client != f.client {
		return false
	}
	return true
}

// describe renders the active filters for notes ("" when none).
func (f *filter) describe() string {
	var parts []string
	if f.scopeSet {
		parts = append(parts, fmt.Sprintf("scope=%q", f.scopeVal))
	}
	if f.idSet {
		parts = append(parts, "id^="+readableText(f.idPrefix))
	}
	if f.client != "" {
		parts = append(parts, "client="+f.client)
	}
	return strings.Join(parts, " ")
}

// scopeWords renders a scope written by one of idem's integrations in that
// integration's own terms, as a single token ("" for any other scope):
//
//	idemhttp(actor=alice)               idemhttp.ScopeFor("", "alice")
//	idemhttp(prefix=api,shared)         the shared key space of a middleware with ScopePrefix "api"
//	idemhttp(actor-sha256=3f1c...)      an actor too long to keep verbatim
//	idemgrpc(actor=bob,fields=[t1])     idemgrpc.EncodeScope("", "bob", "t1")
//
// idemhttp's scopes are recognised by idemhttp.ParseKey, idemgrpc's by
// idemgrpc.DecodeScope; the latter are binary (length-prefixed fields), so
// a scope that is printable text is never taken for one.
func scopeWords(scope string) string {
	var parts []string
	add := func(k, v string) {
		if k == "" {
			parts = append(parts, v)
			return
		}
		parts = append(parts, k+"="+readableText([]byte(v)))
	}
	var kind string
	if info, ok := idemhttp.ParseKey(scope, []byte("k")); ok { // any valid key: only the scope is parsed
		kind = "idemhttp"
		if info.Prefix != "" {
			add("prefix", info.Prefix)
		}
		switch {
		case info.Actor == "":
			add("", "shared")
		case info.ActorHashed:
			add("actor-sha256", info.Actor)
		default:
			add("actor", info.Actor)
		}
	} else if !printable(scope) {
		prefix, actor, fields, err := idemgrpc.DecodeScope(scope)
		if err != nil {
			return ""
		}
		kind = "idemgrpc"
		if prefix != "" {
			add("prefix", prefix)
		}
		add("actor", actor)
		if len(fields) > 0 {
			q := make([]string, len(fields))
			for i, f := range fields {
				q[i] = readableText([]byte(f))
			}
			parts = append(parts, "fields=["+strings.Join(q, ",")+"]")
		}
	} else {
		return ""
	}
	return kind + "(" + strings.Join(parts, ",") + ")"
}

// showScope renders a scope for text output: in its integration's words
// when an integration wrote it (scopeWords), else as readableText.
func showScope(scope string) string {
	if w := scopeWords(scope); w != "" {
		return w
	}
	return readableText([]byte(scope))
}

// printable says whether every byte of s is printable ASCII.
func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}
