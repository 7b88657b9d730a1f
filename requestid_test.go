package idem

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

var idempotencyKeyRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,255}$`)

func TestRequestIDTextForm(t *testing.T) {
	before := time.Now().Truncate(time.Microsecond)
	id := NewRequestID()
	after := time.Now()
	if id.IsZero() {
		t.Fatal("new id is zero")
	}
	if tm := id.Time(); tm.Before(before) || tm.After(after) {
		t.Fatalf("Time() = %v, want within [%v, %v]", tm, before, after)
	}
	s := id.String()
	if len(s) != RequestIDTextLen || !idempotencyKeyRE.MatchString(s) {
		t.Fatalf("String() = %q: not a 26-character Idempotency-Key", s)
	}
	back, err := ParseRequestID(s)
	if err != nil || back != id {
		t.Fatalf("ParseRequestID(%q) = %v, %v; want %v", s, back, err, id)
	}
	if b := id.Bytes(); !bytes.Equal(b, id[:]) {
		t.Fatalf("Bytes() = %x, want %x", b, id[:])
	} else {
		b[0] ^= 0xff
		if id[0] == b[0] {
			t.Fatal("Bytes() shares memory with the id")
		}
	}
	// JSON goes through MarshalText / UnmarshalText.
	js, err := json.Marshal(map[string]RequestID{"id": id})
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"id":"` + s + `"}`; string(js) != want {
		t.Fatalf("json %s, want %s", js, want)
	}
	var m map[string]RequestID
	if err := json.Unmarshal(js, &m); err != nil || m["id"] != id {
		t.Fatalf("json round trip: %v %v", m, err)
	}
}

func TestRequestIDRandomAndDistinct(t *testing.T) {
	seen := make(map[RequestID]bool)
	for range 10000 {
		id := NewRequestID()
		if seen[id] {
			t.Fatalf("duplicate id %v", id)
		}
		seen[id] = true
	}
}

// The text form sorts as the ids do, and the ids sort by time.
func TestRequestIDSortsByTime(t *testing.T) {
	base := time.Date(2026, 11, 23, 19, 0, 0, 0, time.UTC)
	var ids []RequestID
	for i := range 2000 {
		var id RequestID
		// Times spread over microseconds to centuries; random tails.
		us := base.UnixMicro() + int64(i)*int64(i)*int64(i)*7919
		binary.BigEndian.PutUint64(id[:8], uint64(us))
		binary.BigEndian.PutUint64(id[8:], uint64(i)*0x9e3779b97f4a7c15)
		ids = append(ids, id)
		if got := id.Time(); !got.Equal(time.UnixMicro(us)) {
			t.Fatalf("Time() = %v, want %v", got, time.UnixMicro(us))
		}
	}
	// Also the extremes of every byte.
	ids = append(ids, RequestID{}, RequestID{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	byBytes := slices.Clone(ids)
	slices.SortFunc(byBytes, func(a, b RequestID) int { return bytes.Compare(a[:], b[:]) })
	byText := slices.Clone(ids)
	slices.SortFunc(byText, func(a, b RequestID) int { return strings.Compare(a.String(), b.String()) })
	if !slices.Equal(byBytes, byText) {
		t.Fatal("text order differs from byte order")
	}
	// Every id but the all-ones one (a negative time) has its top bit clear: byte order is time order.
	for i := 1; i < len(byBytes)-1; i++ {
		if byBytes[i].Time().Before(byBytes[i-1].Time()) {
			t.Fatalf("byte order is not time order at %d", i)
		}
	}
	if got := (RequestID{}).String(); got != strings.Repeat("0", 26) {
		t.Fatalf("zero id text %q", got)
	}
}

func TestParseRequestIDRejects(t *testing.T) {
	good := NewRequestID().String()
	cases := map[string]string{
		"empty":           "",
		"short":           good[:25],
		"long":            good + "0",
		"lower case":      "a" + good[1:],
		"out of alphabet": good[:10] + "W" + good[11:],
		"symbol":          good[:10] + "-" + good[11:],
		"non canonical":   good[:25] + "1", // the last character's low bits set
		"very long":       strings.Repeat("A", 5000),
	}
	for name, s := range cases {
		if id, err := ParseRequestID(s); err == nil {
			t.Errorf("%s: ParseRequestID(%q) = %v, want an error", name, s, id)
		} else if !strings.Contains(err.Error(), "request id") {
			t.Errorf("%s: error %q does not say what was wrong", name, err)
		}
	}
	var id RequestID
	before := id
	if err := id.UnmarshalText([]byte("nope")); err == nil || id != before {
		t.Fatalf("UnmarshalText of garbage: %v, id changed to %v", err, id)
	}
}

func FuzzParseRequestID(f *testing.F) {
	f.Add(NewRequestID().String())
	f.Add("")
	f.Add("0000000000000000000000000V")
	f.Fuzz(func(t *testing.T, s string) {
		id, err := ParseRequestID(s)
		if err != nil {
			return
		}
		if id.String() != s {
			t.Fatalf("accepted %q but it prints as %q", s, id.String())
		}
	})
}
