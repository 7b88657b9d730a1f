package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/testclock"
)

// The Idempotency-Key timing table with a per-request TTL of one hour on an
// engine opened with default options: T+60m replays, T+61m runs again.
func TestRequestTTLTimingTable(t *testing.T) {
	clk := testclock.New()
	fs := vfs.NewMem()
	opts := &Options{Clock: clk.Now}
	e := openMem(t, fs, opts)
	r := Request{Scope: "items", ID: id("new-key-123"), Fingerprint: id("fp"), TTL: time.Hour}
	res := mustBegin(t, e, r, Fresh)
	if want := testclock.Epoch.Add(time.Hour); !res.ExpiresAt.Equal(want) {
		t.Fatalf("fresh ExpiresAt %v, want %v", res.ExpiresAt, want)
	}
	clk.Advance(30 * time.Second) // the handler takes a while: created_at is the claim
	if err := res.Claim.Commit(bg, id("201 first")); err != nil {
		t.Fatal(err)
	}
	for _, step := range []time.Duration{time.Minute, 9 * time.Minute, 50*time.Minute - 30*time.Second} {
		clk.Advance(step)
		d := mustBegin(t, e, r, Done)
		if string(d.Reply) != "201 first" || !d.ExpiresAt.Equal(testclock.Epoch.Add(time.Hour)) {
			t.Fatalf("at %v: %q expires %v", clk.Now().Sub(testclock.Epoch), d.Reply, d.ExpiresAt)
		}
	}
	// Exactly T+60m: expires_at < now is false, still cached.
	if got := clk.Now().Sub(testclock.Epoch); got != time.Hour {
		t.Fatalf("clock at %v", got)
	}
	mustBegin(t, e, r, Done)
	if l, _ := e.Lookup(context.Background(), Request{Scope: "items", ID: id("new-key-123")}); l.Status != Done {
		t.Fatalf("lookup at T+60m: %v", l.Status)
	}
	clk.Advance(time.Minute) // T+61m
	if l, _ := e.Lookup(context.Background(), Request{Scope: "items", ID: id("new-key-123")}); l.Status != Absent {
		t.Fatalf("lookup at T+61m: %v", l.Status)
	}
	res = mustBegin(t, e, r, Fresh)
	if err := res.Claim.Commit(bg, id("201 second")); err != nil {
		t.Fatal(err)
	}
	if st := e.Stats(); st.Expired != 1 {
		t.Fatalf("Stats.Expired %d", st.Expired)
	}
	e.Close()
	e = openMem(t, fs, opts)
	defer e.Close()
	if d := mustBegin(t, e, r, Done); string(d.Reply) != "201 second" {
		t.Fatalf("after reopen: %q", d.Reply)
	}
}

// Two TTLs share one engine; the cleanup removes exactly the expired
// entries, by a record that replay applies too, and counts them.
func TestTTLCleanupSharedEngine(t *testing.T) {
	clk := testclock.New()
	fs := vfs.NewMem()
	opts := &Options{Clock: clk.Now}
	e := openMem(t, fs, opts)
	const n = 2500 // more than one expire record
	for i := range n {
		commitID(t, e, Request{Scope: "http", ID: id(fmt.Sprintf("short-%d", i)), TTL: time.Minute}, "s")
		if i%10 == 0 {
			commitID(t, e, Request{Scope: "sink", ID: id(fmt.Sprintf("long-%d", i)), TTL: time.Hour}, "l")
		}
	}
	commitID(t, e, Request{Scope: "none", ID: id("forever")}, "f")
	commitID(t, e, Request{Scope: "seq", Client: "c", Seq: 1, TTL: time.Minute}, "c1")
	waitApplied(t, e)
	if got, err := e.CleanupExpired(bg); err != nil || got != 0 {
		t.Fatalf("cleanup before expiry: %d %v", got, err)
	}
	clk.Advance(time.Minute + time.Nanosecond)
	got, err := e.CleanupExpired(bg)
	if err != nil {
		t.Fatal(err)
	}
	if got != n+1 {
		t.Fatalf("cleanup removed %d, want %d", got, n+1)
	}
	st := e.Stats()
	if st.Cleanups != uint64(n+1) || st.Acked != 0 {
		t.Fatalf("stats: cleanups %d acked %d", st.Cleanups, st.Acked)
	}
	waitApplied(t, e)
	if st := e.Stats(); st.LiveEntries != int64(n/10+2) {
		t.Fatalf("live entries %d, want %d", st.LiveEntries, n/10+2)
	}
	if got, _ := e.CleanupExpired(bg); got != 0 {
		t.Fatalf("second cleanup removed %d", got)
	}
	check := func(e *Engine) {
		t.Helper()
		if l, _ := e.Lookup(context.Background(), Request{Scope: "http", ID: id("short-7")}); l.Status != Absent {
			t.Fatalf("short: %v", l.Status)
		}
		if l, _ := e.Lookup(context.Background(), Request{Scope: "sink", ID: id("long-10")}); l.Status != Done || string(l.Reply) != "l" {
			t.Fatalf("long: %v", l.Status)
		}
		if l, _ := e.Lookup(context.Background(), Request{Scope: "none", ID: id("forever")}); l.Status != Done {
			t.Fatalf("forever: %v", l.Status)
		}
		// The client keeps its number; its reply is gone.
		if last, err := e.ClientState(context.Background(), "seq", "c"); err != nil || last != 1 {
			t.Fatalf("client state %d %v", last, err)
		}
		if _, err := e.Begin(bg, Request{Scope: "seq", Client: "c", Seq: 1}); !errors.Is(err, ErrAlreadyCommitted) {
			t.Fatalf("seq 1 after expiry: %v", err)
		}
	}
	check(e)
	e.Close()
	// Replay from the WAL alone must remove the same entries.
	if err := fs.RemoveAll("db/index"); err != nil {
		t.Fatal(err)
	}
	e = openMem(t, fs, opts)
	defer e.Close()
	check(e)
	waitApplied(t, e)
	if st := e.Stats(); st.LiveEntries != int64(n/10+2) {
		t.Fatalf("after replay: live entries %d, want %d", st.LiveEntries, n/10+2)
	}
	// The long TTL runs out later, and the periodic path (Compact) cleans it.
	clk.Advance(time.Hour)
	if _, err := e.Compact(bg); err != nil {
		t.Fatal(err)
	}
	waitApplied(t, e)
	if st := e.Stats(); st.LiveEntries != 2 {
		t.Fatalf("after the long TTL: live entries %d, want 2", st.LiveEntries)
	}
}

// A retry does not extend the TTL, an entry re-claimed after expiry gets a
// new one, and the cleanup never removes an entry that was re-committed.
func TestTTLNotExtendedAndReclaimSurvivesCleanup(t *testing.T) {
	clk := testclock.New()
	e := openMem(t, vfs.NewMem(), &Options{Clock: clk.Now})
	defer e.Close()
	r := Request{ID: id("k"), TTL: 10 * time.Minute}
	commitID(t, e, r, "v1")
	clk.Advance(9 * time.Minute)
	if d := mustBegin(t, e, r, Done); !d.ExpiresAt.Equal(testclock.Epoch.Add(10 * time.Minute)) {
		t.Fatalf("retry moved expiry to %v", d.ExpiresAt)
	}
	clk.Advance(2 * time.Minute)
	commitID(t, e, r, "v2") // expired: runs as new, expires at T+21m
	waitApplied(t, e)
	if got, _ := e.CleanupExpired(bg); got != 0 {
		t.Fatalf("cleanup removed the re-committed entry (%d)", got)
	}
	if d := mustBegin(t, e, r, Done); string(d.Reply) != "v2" {
		t.Fatalf("%q", d.Reply)
	}
	if _, err := e.Begin(bg, Request{ID: id("x"), TTL: -time.Second}); !errors.Is(err, ErrInvalidRequest) {
		t.Fatalf("negative TTL: %v", err)
	}
}

// Snapshots keep the TTL of every entry; a restored engine expires them at
// the same moment.
func TestTTLSurvivesSnapshotRestore(t *testing.T) {
	clk := testclock.New()
	e := openMem(t, vfs.NewMem(), &Options{Clock: clk.Now})
	commitID(t, e, Request{ID: id("a"), TTL: time.Minute}, "a")
	commitID(t, e, Request{ID: id("b")}, "b")
	img, err := e.SnapshotImage(bg)
	if err != nil {
		t.Fatal(err)
	}
	commitID(t, e, Request{ID: id("after")}, "x") // not in the image
	var buf bytes.Buffer
	info, err := img.WriteTo(bg, &buf)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := img.WriteTo(bg, &buf); err == nil {
		t.Fatal("second WriteTo succeeded")
	}
	if info.Entries != 2 || info.LSN != img.LSN() {
		t.Fatalf("info %+v lsn %d", info, img.LSN())
	}
	img.Close()
	// An image left open is released by Close.
	if _, err := e.SnapshotImage(bg); err != nil {
		t.Fatal(err)
	}
	if err := e.Close(); err != nil {
		t.Fatalf("close with an open image: %v", err)
	}
	r, err := Restore("restored", &buf, &Options{FS: vfs.NewMem(), Clock: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if l, _ := r.Lookup(context.Background(), Request{Scope: "", ID: id("after")}); l.Status != Absent {
		t.Fatalf("after: %v", l.Status)
	}
	if l, _ := r.Lookup(context.Background(), Request{Scope: "", ID: id("a")}); l.Status != Done || !l.ExpiresAt.Equal(testclock.Epoch.Add(time.Minute)) {
		t.Fatalf("a: %v %v", l.Status, l.ExpiresAt)
	}
	clk.Advance(2 * time.Minute)
	if got, err := r.CleanupExpired(bg); err != nil || got != 1 {
		t.Fatalf("cleanup after restore: %d %v", got, err)
	}
	if l, _ := r.Lookup(context.Background(), Request{Scope: "", ID: id("b")}); l.Status != Done {
		t.Fatalf("b: %v", l.Status)
	}
	if !r.Now().Equal(clk.Now()) {
		t.Fatal("Now is not the engine clock")
	}
}
