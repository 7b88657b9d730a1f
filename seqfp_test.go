package idem

import (
	"errors"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestSequenceFingerprints: in sequence mode the fingerprint is checked as
// in id mode, for the committed number whose reply is kept and for the
// number in flight. A retry of client c's seq N with another fingerprint
// is ErrConflict; with the same one it is Done (committed) or InFlight; a
// retry without a fingerprint is unchecked and matches; a request with a
// fingerprint never matches an entry stored without one. A conflict
// changes nothing: the claim still commits, the number still moves on. The
// same answers hold after a reopen (the fingerprints are in the log).
func TestSequenceFingerprints(t *testing.T) {
	fs := vfs.NewMem()
	e := openMem(t, fs, nil)
	defer func() { e.Close() }()
	seq := func(client string, n uint64, fp string) Request {
		r := Request{Scope: "s", Client: client, Seq: n}
		if fp != "" {
			r.Fingerprint = []byte(fp)
		}
		return r
	}
	// conflict checks that Begin and Lookup (which answers what Begin
	// would) both refuse r.
	conflict := func(r Request, what string) {
		t.Helper()
		res, err := e.Begin(bg, r)
		if !errors.Is(err, ErrConflict) {
			t.Fatalf("%s: client %s seq %d fingerprint %q: got %v %v, want ErrConflict", what, r.Client, r.Seq, r.Fingerprint, res.Status, err)
		}
		if res, err := e.Lookup(bg, r); !errors.Is(err, ErrConflict) {
			t.Fatalf("%s: Lookup of client %s seq %d fingerprint %q: got %v %v, want ErrConflict", what, r.Client, r.Seq, r.Fingerprint, res.Status, err)
		}
	}
	// says checks what Lookup answers, then Begin.
	says := func(r Request, want Status) Result {
		t.Helper()
		if res, err := e.Lookup(bg, r); err != nil || res.Status != want {
			t.Fatalf("Lookup of client %s seq %d fingerprint %q: %v %v, want %v", r.Client, r.Seq, r.Fingerprint, res.Status, err, want)
		}
		return mustBegin(t, e, r, want)
	}
	conflicts := uint64(0)

	// In flight, claimed with fingerprint A.
	claim := mustBegin(t, e, seq("c", 1, "A"), Fresh)
	conflict(seq("c", 1, "B"), "in flight, other fingerprint")
	conflicts++
	says(seq("c", 1, "A"), InFlight)
	says(seq("c", 1, ""), InFlight) // unchecked
	if err := claim.Claim.Commit(bg, id("r1")); err != nil {
		t.Fatalf("commit after a conflict: %v", err)
	}

	// Committed with fingerprint A, reply kept.
	check := func() {
		t.Helper()
		conflict(seq("c", 1, "B"), "committed, other fingerprint")
		if d := says(seq("c", 1, "A"), Done); string(d.Reply) != "r1" || d.Seq != 1 {
			t.Fatalf("same fingerprint: %+v", d)
		}
		if d := says(seq("c", 1, ""), Done); string(d.Reply) != "r1" {
			t.Fatalf("unchecked retry: %+v", d)
		}
	}
	check()
	conflicts++

	// Stored without a fingerprint: a checked request never matches it,
	// in flight or committed; unchecked ones do.
	claim = mustBegin(t, e, seq("u", 1, ""), Fresh)
	conflict(seq("u", 1, "A"), "in flight without a fingerprint, asked with one")
	conflicts++
	says(seq("u", 1, ""), InFlight)
	if err := claim.Claim.Commit(bg, id("u1")); err != nil {
		t.Fatal(err)
	}
	conflict(seq("u", 1, "A"), "committed without a fingerprint, asked with one")
	conflicts++
	if d := says(seq("u", 1, ""), Done); string(d.Reply) != "u1" {
		t.Fatalf("unchecked retry: %+v", d)
	}

	// An empty fingerprint is no fingerprint.
	claim = mustBegin(t, e, Request{Scope: "s", Client: "e", Seq: 1, Fingerprint: []byte{}}, Fresh)
	says(seq("e", 1, ""), InFlight)
	conflict(seq("e", 1, "A"), "claimed with an empty fingerprint, asked with one")
	conflicts++
	if err := claim.Claim.Abort(bg); err != nil {
		t.Fatal(err)
	}

	if st := e.Stats(); st.Conflicts != conflicts {
		t.Fatalf("Stats.Conflicts %d, want %d", st.Conflicts, conflicts)
	}
	if n, err := e.ClientState(bg, "s", "c"); err != nil || n != 1 {
		t.Fatalf("client c at %d (%v), want 1: a conflict must not move it", n, err)
	}

	// The next number is checked against its own claim, not the last one.
	claim = mustBegin(t, e, seq("c", 2, "B"), Fresh)
	conflict(seq("c", 2, "A"), "next number in flight, the last number's fingerprint")
	says(seq("c", 2, "B"), InFlight)

	// After a reopen the claim of c/2 is in doubt, c/1's reply was dropped
	// by that claim (starting N+1 promises N is never retried), and u/1 is
	// still kept with no fingerprint.
	e.Close()
	e = openMem(t, fs, nil)
	conflict(seq("c", 2, "A"), "in doubt after reopen, other fingerprint")
	says(seq("c", 2, "B"), InFlight)
	says(seq("c", 2, ""), InFlight)
	conflict(seq("u", 1, "A"), "committed without a fingerprint, after reopen")
	if d := says(seq("u", 1, ""), Done); string(d.Reply) != "u1" {
		t.Fatalf("after reopen: %+v", d)
	}
	if _, err := e.Begin(bg, seq("c", 1, "A")); !errors.Is(err, ErrAlreadyCommitted) {
		t.Fatalf("c/1 after c/2 was claimed: %v, want ErrAlreadyCommitted", err)
	}
}

// TestSequenceFingerprintsSurviveReopen: a committed number's fingerprint
// is in its commit's entry, so a reopen (replay from the log) keeps the
// check: the same client and number with another fingerprint is still
// ErrConflict, the same one Done.
func TestSequenceFingerprintsSurviveReopen(t *testing.T) {
	fs := vfs.NewMem()
	e := openMem(t, fs, nil)
	commitID(t, e, Request{Client: "c", Seq: 1, Fingerprint: id("A")}, "r1")
	e.Close()
	e = openMem(t, fs, nil)
	defer e.Close()
	if _, err := e.Begin(bg, Request{Client: "c", Seq: 1, Fingerprint: id("B")}); !errors.Is(err, ErrConflict) {
		t.Fatalf("after reopen, other fingerprint: %v, want ErrConflict", err)
	}
	if d := mustBegin(t, e, Request{Client: "c", Seq: 1, Fingerprint: id("A")}, Done); string(d.Reply) != "r1" {
		t.Fatalf("after reopen: %+v", d)
	}
}

// TestSequenceFingerprintsInReplyWindow: an older number whose reply the
// client's reply window keeps (Request.KeepReplies) is checked like the
// last one: another fingerprint is ErrConflict (Begin and Lookup), the
// same one or none is Done with that number's own reply, and a checked
// retry of a number stored without a fingerprint is ErrConflict.
func TestSequenceFingerprintsInReplyWindow(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	defer e.Close()
	req := func(n uint64, fp string) Request {
		r := Request{Scope: "s", Client: "w", Seq: n, KeepReplies: 3}
		if fp != "" {
			r.Fingerprint = []byte(fp)
		}
		return r
	}
	commitID(t, e, req(1, "A"), "r1")
	commitID(t, e, req(2, ""), "r2")
	commitID(t, e, req(3, "C"), "r3")
	for _, tc := range []struct {
		n      uint64
		fp     string
		reply  string // "" = ErrConflict
		reason string
	}{
		{1, "B", "", "older number, other fingerprint"},
		{1, "A", "r1", "older number, same fingerprint"},
		{1, "", "r1", "older number, unchecked"},
		{2, "A", "", "older number stored without a fingerprint, asked with one"},
		{2, "", "r2", "older number stored without a fingerprint, unchecked"},
		{3, "A", "", "last number, other fingerprint"},
	} {
		for _, call := range []string{"Lookup", "Begin"} {
			var res Result
			var err error
			if call == "Lookup" {
				res, err = e.Lookup(bg, req(tc.n, tc.fp))
			} else {
				res, err = e.Begin(bg, req(tc.n, tc.fp))
			}
			switch {
			case tc.reply == "" && !errors.Is(err, ErrConflict):
				t.Fatalf("%s: %s of seq %d fingerprint %q: %v %v, want ErrConflict", tc.reason, call, tc.n, tc.fp, res.Status, err)
			case tc.reply != "" && (err != nil || res.Status != Done || string(res.Reply) != tc.reply || res.Seq != tc.n):
				t.Fatalf("%s: %s of seq %d fingerprint %q: %v %q seq %d %v, want done %q", tc.reason, call, tc.n, tc.fp, res.Status, res.Reply, res.Seq, err, tc.reply)
			}
		}
	}
}
