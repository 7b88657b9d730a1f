package idemraft

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
)

var t0 = time.Date(2031, 5, 1, 12, 0, 0, 0, time.UTC) // log time, far from the local clock

// testEngineOptions keep the engines of the tests small.
func testEngineOptions() idem.Options {
	return idem.Options{CacheSize: 1 << 20, IndexCacheSize: 2 << 20, IndexIngestBytes: 1 << 20, IndexFilterBytes: 1 << 16}
}

func wrapT(t *testing.T, app raft.FSM, dir string) *FSM {
	t.Helper()
	f, err := Wrap(app, &Options{Dir: dir, Engine: testEngineOptions()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// feeder hands entries to an FSM as raft's FSM goroutine does.
type feeder struct {
	t   *testing.T
	f   *FSM
	idx uint64
	at  time.Time
}

func (fd *feeder) apply(data []byte) any {
	fd.idx++
	fd.at = fd.at.Add(time.Millisecond)
	return fd.f.Apply(&raft.Log{Index: fd.idx, Term: 1, Type: raft.LogCommand, Data: data, AppendedAt: fd.at})
}

func (fd *feeder) cmd(req idem.Request, op counterOp) *Response {
	fd.t.Helper()
	c, err := Command(req, encodeOp(op))
	if err != nil {
		fd.t.Fatal(err)
	}
	r, ok := fd.apply(c).(*Response)
	if !ok {
		fd.t.Fatalf("Apply returned %T, want *Response", r)
	}
	return r
}

func val(t *testing.T, r *Response) int64 {
	t.Helper()
	if r.Err != nil || len(r.Reply) != 8 {
		t.Fatalf("response %+v: want an 8-byte value", r)
	}
	return int64(binary.BigEndian.Uint64(r.Reply))
}

func TestApplyExactlyOnce(t *testing.T) {
	app := newCounterFSM()
	fd := &feeder{t: t, f: wrapT(t, app, t.TempDir()), at: t0}
	fp := []byte("fingerprint-1")
	r := fd.cmd(idem.Request{ID: []byte("a"), Fingerprint: fp}, counterOp{ID: "a", Key: "k", Delta: 5})
	if val(t, r) != 5 || r.Duplicate {
		t.Fatalf("first: %+v", r)
	}
	// The same request appended twice (a retry that reached the log before
	// the first was applied) runs once.
	r = fd.cmd(idem.Request{ID: []byte("a"), Fingerprint: fp}, counterOp{ID: "a", Key: "k", Delta: 5})
	if val(t, r) != 5 || !r.Duplicate {
		t.Fatalf("retry: %+v", r)
	}
	// Same id, other payload: conflict, nothing runs.
	r = fd.cmd(idem.Request{ID: []byte("a"), Fingerprint: []byte("other")}, counterOp{ID: "a2", Key: "k", Delta: 7})
	if !errors.Is(r.Err, idem.ErrConflict) {
		t.Fatalf("conflict: %+v", r)
	}
	// A new id that acks a: a is removed in the same apply, so a later a runs again.
	r = fd.cmd(idem.Request{ID: []byte("b"), Acked: [][]byte{[]byte("a")}}, counterOp{ID: "b", Key: "k", Delta: 1})
	if val(t, r) != 6 {
		t.Fatalf("b: %+v", r)
	}
	if _, ok := fd.f.Lookup(idem.Request{ID: []byte("a")}); ok {
		t.Fatal("acked id a still answered from the local set")
	}
	r = fd.cmd(idem.Request{ID: []byte("a"), Fingerprint: fp}, counterOp{ID: "a-again", Key: "k", Delta: 5})
	if val(t, r) != 11 || r.Duplicate {
		t.Fatalf("a after its ack: %+v", r)
	}
	st := app.state()
	want := map[string]int{"a": 1, "b": 1, "a-again": 1}
	if !reflect.DeepEqual(st.Applied, want) {
		t.Fatalf("applied %v, want %v", st.Applied, want)
	}
	s := fd.f.Stats()
	if s.Applied != 3 || s.Duplicates != 1 || s.Refused != 1 || s.LastIndex != fd.idx {
		t.Fatalf("stats %+v", s)
	}
}

func TestApplySequenceMode(t *testing.T) {
	app := newCounterFSM()
	fd := &feeder{t: t, f: wrapT(t, app, t.TempDir()), at: t0}
	req := func(seq uint64) idem.Request { return idem.Request{Scope: "s", Client: "c1", Seq: seq} }
	if v := val(t, fd.cmd(req(1), counterOp{ID: "1", Key: "k", Delta: 1})); v != 1 {
		t.Fatal(v)
	}
	if r := fd.cmd(req(1), counterOp{ID: "1", Key: "k", Delta: 1}); !r.Duplicate || val(t, r) != 1 {
		t.Fatalf("replay of seq 1: %+v", r)
	}
	var gap *idem.SequenceGapError
	if r := fd.cmd(req(3), counterOp{ID: "3", Key: "k", Delta: 1}); !errors.As(r.Err, &gap) || gap.Last != 1 || gap.Seq != 3 {
		t.Fatalf("seq 3: %+v", r)
	}
	if v := val(t, fd.cmd(req(2), counterOp{ID: "2", Key: "k", Delta: 1})); v != 2 {
		t.Fatal(v)
	}
	// Starting seq 2 dropped seq 1's reply: it ran, its reply is gone.
	if r := fd.cmd(req(1), counterOp{ID: "1", Key: "k", Delta: 1}); !errors.Is(r.Err, idem.ErrAlreadyCommitted) {
		t.Fatalf("seq 1 after 2: %+v", r)
	}
	if r, ok := fd.f.Lookup(req(2)); !ok || val(t, r) != 2 {
		t.Fatalf("Lookup seq 2: %+v %v", r, ok)
	}
	if got := app.state().Applied; !reflect.DeepEqual(got, map[string]int{"1": 1, "2": 1}) {
		t.Fatalf("applied %v", got)
	}
}

func TestApplyPassThroughAndAppErrors(t *testing.T) {
	app := newCounterFSM()
	fd := &feeder{t: t, f: wrapT(t, app, t.TempDir()), at: t0}
	// An entry that is not a command reaches the application untouched,
	// with the application's own result.
	raw := encodeOp(counterOp{ID: "raw", Key: "k", Delta: 3})
	if out, ok := fd.apply(raw).([]byte); !ok || binary.BigEndian.Uint64(out) != 3 {
		t.Fatalf("pass-through: %v", out)
	}
	if out := fd.apply([]byte("hello")); out == nil {
		t.Fatal("pass-through of garbage: the application's error should come back")
	}
	// The application's error is the request's stored reply.
	r := fd.cmd(idem.Request{ID: []byte("e")}, counterOp{ID: "e", Key: "k", Fail: true})
	var ae *AppError
	if !errors.As(r.Err, &ae) || r.Duplicate || !strings.Contains(ae.Message, "refused") || errors.Unwrap(ae) == nil {
		t.Fatalf("app error: %+v", r)
	}
	r = fd.cmd(idem.Request{ID: []byte("e")}, counterOp{ID: "e", Key: "k", Fail: true})
	if !errors.As(r.Err, &ae) || !r.Duplicate || !strings.Contains(ae.Message, "refused") {
		t.Fatalf("app error replay: %+v", r)
	}
	st := app.state()
	if st.Applied["e"] != 1 || st.Applied["raw"] != 1 || st.Passed != 1 {
		t.Fatalf("state %+v", st)
	}
	// A damaged command is refused the same way everywhere, and the
	// application never sees it.
	bad := append([]byte(commandMagic), kindCommand, 0x93, 0x01)
	if r, ok := fd.apply(bad).(*Response); !ok || !errors.Is(r.Err, ErrInvalidCommand) {
		t.Fatalf("damaged command: %+v", r)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	good, _ := Command(idem.Request{ID: []byte("x"), Acked: [][]byte{[]byte("y")}}, []byte("op"))
	for i := 0; i < 600; i++ {
		b := append([]byte(nil), good...)
		switch i % 3 {
		case 0:
			b = b[:len(commandMagic)+1+rng.IntN(len(b)-len(commandMagic)-1)]
		default:
			p := len(commandMagic) + rng.IntN(len(b)-len(commandMagic))
			b[p] ^= byte(1 + rng.IntN(255))
		}
		before := app.state()
		out := fd.apply(b) // must not panic; a flip may still decode to a valid command
		if _, err := decodeCommand(b); err != nil {
			if r, ok := out.(*Response); !ok || !errors.Is(r.Err, ErrInvalidCommand) {
				t.Fatalf("damaged command %x: %v", b, out)
			}
			if !reflect.DeepEqual(app.state(), before) {
				t.Fatalf("damaged command %x reached the application", b)
			}
		}
	}
}

// TestTimeIsTheLogs checks that every time decision uses the entries'
// AppendedAt: the forget tombstone compares log times, and the FSM's clock
// never goes back even if a new leader's clock does.
func TestTimeIsTheLogs(t *testing.T) {
	app := newCounterFSM()
	fd := &feeder{t: t, f: wrapT(t, app, t.TempDir()), at: t0}
	fd.cmd(idem.Request{ID: []byte("old")}, counterOp{ID: "old", Key: "k", Delta: 1})
	fd.at = t0.Add(time.Hour)
	fd.cmd(idem.Request{ID: []byte("new")}, counterOp{ID: "new", Key: "k", Delta: 1})
	if got := fd.f.Stats().Time; !got.Equal(fd.at) {
		t.Fatalf("clock %v, want the entry's %v", got, fd.at)
	}
	// Log time is to the millisecond (what lets ApplyBatch commit a batch
	// in one engine record).
	fd.at = fd.at.Add(1500 * time.Microsecond)
	fd.apply([]byte("noise"))
	if got, want := fd.f.Stats().Time, fd.at.Add(-500*time.Microsecond); !got.Equal(want) {
		t.Fatalf("clock %v, want %v (the entry's AppendedAt %v to the millisecond)", got, want, fd.at)
	}
	// A leader whose clock is behind appends an entry: the clock holds.
	high := fd.at.Add(-500 * time.Microsecond)
	fd.at = t0.Add(-time.Hour)
	fd.apply([]byte("noise"))
	if got := fd.f.Stats().Time; !got.Equal(high) {
		t.Fatalf("clock went back to %v", got)
	}
	fd.at = t0.Add(2 * time.Hour)
	if r, ok := fd.apply(ForgetCommand(t0.Add(30 * time.Minute))).(*Response); !ok || r.Err != nil {
		t.Fatalf("forget: %+v", r)
	}
	if r := fd.cmd(idem.Request{ID: []byte("old")}, counterOp{ID: "old2", Key: "k", Delta: 1}); r.Duplicate {
		t.Fatal("old was not forgotten")
	}
	if r := fd.cmd(idem.Request{ID: []byte("new")}, counterOp{ID: "new2", Key: "k", Delta: 1}); !r.Duplicate {
		t.Fatal("new was forgotten")
	}
}

// TestLogTimeIsTruncate pins logTime, which replicas must agree on, to
// its definition, AppendedAt.Truncate(clockResolution).UnixNano(), for
// times around the Unix epoch, before year 1 and past what UnixNano can
// hold (where both wrap the same way), and random ones.
func TestLogTimeIsTruncate(t *testing.T) {
	times := []time.Time{
		t0, t0.Add(999_999), t0.Add(1_000_000), t0.Add(-1), time.Unix(0, 0), time.Unix(0, -1), time.Unix(-1, 999_999_999),
		time.Unix(-1, 1_500_000), time.Date(1, 1, 1, 0, 0, 0, 1, time.UTC), time.Date(0, 12, 31, 23, 59, 59, 999_999_999, time.UTC),
		time.Date(-5000, 3, 1, 0, 0, 0, 123_456_789, time.UTC), time.Date(2263, 1, 1, 0, 0, 0, 987_654_321, time.UTC),
		time.Date(1500, 6, 1, 0, 0, 0, 1_000_001, time.UTC), time.Unix(1<<62, 999_999_999), time.Unix(-1<<62, 1),
		time.Now(), // with a monotonic reading
	}
	rng := rand.New(rand.NewPCG(7, 7))
	for range 10000 {
		times = append(times, time.Unix(rng.Int64N(1<<40)-1<<39, rng.Int64N(1e9)).In(time.FixedZone("z", rng.IntN(50000)-25000)))
	}
	for _, at := range times {
		if got, want := logTime(&raft.Log{AppendedAt: at}), at.Truncate(clockResolution).UnixNano(); got != want {
			t.Fatalf("logTime(%v) = %d, want %d", at, got, want)
		}
	}
	if got := logTime(&raft.Log{}); got != 0 {
		t.Fatalf("logTime of no time = %d, want 0", got)
	}
}

// memSink is a raft.SnapshotSink in memory.
type memSink struct {
	bytes.Buffer
	closed, cancelled bool
}

func (m *memSink) ID() string    { return "mem" }
func (m *memSink) Close() error  { m.closed = true; return nil }
func (m *memSink) Cancel() error { m.cancelled = true; return nil }

func persist(t *testing.T, f *FSM) []byte {
	t.Helper()
	s, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Release()
	var sink memSink
	if err := s.Persist(&sink); err != nil || !sink.closed {
		t.Fatalf("persist: %v (closed %v)", err, sink.closed)
	}
	return sink.Bytes()
}

func TestSnapshotRestore(t *testing.T) {
	app := newCounterFSM()
	fd := &feeder{t: t, f: wrapT(t, app, t.TempDir()), at: t0}
	for i := 0; i < 300; i++ {
		id := []byte{byte(i), byte(i >> 8)}
		fd.cmd(idem.Request{ID: id, Fingerprint: id}, counterOp{ID: string(id), Key: "k", Delta: 1})
	}
	fd.cmd(idem.Request{Client: "c", Seq: 1}, counterOp{ID: "seq1", Key: "k", Delta: 1})
	atSnap := app.state()
	idxAtSnap := fd.idx
	s, err := fd.f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	// Persist runs while later entries are applied.
	var sink memSink
	var wg sync.WaitGroup
	wg.Add(1)
	var perr error
	go func() {
		defer wg.Done()
		perr = s.Persist(&sink)
	}()
	for i := 0; i < 100; i++ {
		id := []byte("later-" + string(rune('a'+i%26)) + string(rune('a'+i/26)))
		fd.cmd(idem.Request{ID: id}, counterOp{ID: string(id), Key: "k", Delta: 1})
	}
	wg.Wait()
	s.Release()
	if perr != nil {
		t.Fatal(perr)
	}

	app2 := newCounterFSM()
	f2 := wrapT(t, app2, t.TempDir())
	if err := f2.Restore(io.NopCloser(bytes.NewReader(sink.Bytes()))); err != nil {
		t.Fatal(err)
	}
	if got := app2.state(); !reflect.DeepEqual(got, atSnap) {
		t.Fatal("restored application state differs from the state at the snapshot")
	}
	if !bytes.Equal(app2.restored, app.persisted) {
		t.Fatal("the application's Restore did not get exactly the bytes its Persist wrote")
	}
	if st := f2.Stats(); st.LastIndex != idxAtSnap || st.Restores != 1 {
		t.Fatalf("restored stats %+v, want index %d", st, idxAtSnap)
	}
	// The dedup set came along: a retry of a request before the snapshot is
	// a duplicate, one after it runs.
	fd2 := &feeder{t: t, f: f2, idx: idxAtSnap, at: fd.at}
	if r := fd2.cmd(idem.Request{ID: []byte{7, 0}, Fingerprint: []byte{7, 0}}, counterOp{ID: "x", Key: "k", Delta: 1}); !r.Duplicate {
		t.Fatalf("retry after restore: %+v", r)
	}
	if r := fd2.cmd(idem.Request{ID: []byte{7, 0}, Fingerprint: []byte{9}}, counterOp{ID: "x", Key: "k", Delta: 1}); !errors.Is(r.Err, idem.ErrConflict) {
		t.Fatalf("fingerprint after restore: %+v", r)
	}
	if r := fd2.cmd(idem.Request{Client: "c", Seq: 1}, counterOp{ID: "x", Key: "k", Delta: 1}); !r.Duplicate {
		t.Fatalf("seq retry after restore: %+v", r)
	}
	if r := fd2.cmd(idem.Request{ID: []byte("later-aa")}, counterOp{ID: "later-aa", Key: "k", Delta: 1}); r.Duplicate {
		t.Fatalf("an id applied after the snapshot: %+v", r)
	}
	if app2.state().Applied["x"] != 0 {
		t.Fatal("a duplicate reached the application")
	}
	// Restoring again (as raft does when a follower falls behind) replaces everything.
	if err := f2.Restore(io.NopCloser(bytes.NewReader(sink.Bytes()))); err != nil {
		t.Fatal(err)
	}
	if got := app2.state(); !reflect.DeepEqual(got, atSnap) {
		t.Fatal("second restore: state differs")
	}
	if n := countGenerations(t, f2.dir); n != 1 {
		t.Fatalf("%d generations left in Dir, want 1", n)
	}
	// A snapshot taken before a Restore is still persisted afterwards (raft
	// may install a leader's snapshot while its own is being written): the
	// old dedup engine stays open until the image is released.
	early, err := f2.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	if err := f2.Restore(io.NopCloser(bytes.NewReader(sink.Bytes()))); err != nil {
		t.Fatal(err)
	}
	if n := countGenerations(t, f2.dir); n != 2 {
		t.Fatalf("%d generations while an image of the old one is open, want 2", n)
	}
	var late memSink
	if err := early.Persist(&late); err != nil {
		t.Fatal(err)
	}
	early.Release()
	if n := countGenerations(t, f2.dir); n != 1 {
		t.Fatalf("%d generations after the release, want 1", n)
	}
	app3 := newCounterFSM()
	if err := wrapT(t, app3, t.TempDir()).Restore(io.NopCloser(bytes.NewReader(late.Bytes()))); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(app3.state(), atSnap) {
		t.Fatal("the snapshot persisted across a Restore holds another state")
	}
}

func countGenerations(t *testing.T, dir string) int {
	names, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range names {
		if strings.HasPrefix(e.Name(), "gen-") {
			n++
		}
		if strings.HasPrefix(e.Name(), "tmp-") {
			t.Fatalf("temporary file %s left behind", e.Name())
		}
	}
	return n
}

// TestCorruptSnapshotRefused damages a snapshot in every way and checks
// that Restore refuses it and leaves both states as they were.
func TestCorruptSnapshotRefused(t *testing.T) {
	app := newCounterFSM()
	fd := &feeder{t: t, f: wrapT(t, app, t.TempDir()), at: t0}
	for i := 0; i < 50; i++ {
		id := []byte{'s', byte(i)}
		fd.cmd(idem.Request{ID: id}, counterOp{ID: string(id), Key: "k", Delta: 1})
	}
	good := persist(t, fd.f)

	app2 := newCounterFSM()
	f2 := wrapT(t, app2, t.TempDir())
	fd2 := &feeder{t: t, f: f2, at: t0}
	fd2.cmd(idem.Request{ID: []byte("mine")}, counterOp{ID: "mine", Key: "m", Delta: 1})
	before := app2.state()

	rng := rand.New(rand.NewPCG(3, 4))
	var cases [][]byte
	for _, n := range []int{0, 5, len(snapMagic) + 1, len(snapMagic) + 9, len(good) / 3, len(good) / 2, len(good) - 30, len(good) - 1} {
		cases = append(cases, good[:n])
	}
	for i := 0; i < 16; i++ {
		b := append([]byte(nil), good...)
		b[rng.IntN(len(b))] ^= byte(1 + rng.IntN(255))
		cases = append(cases, b)
	}
	for i, b := range cases {
		err := f2.Restore(io.NopCloser(bytes.NewReader(b)))
		if err == nil {
			t.Fatalf("case %d: a damaged snapshot (%d of %d bytes) was accepted", i, len(b), len(good))
		}
		if !errors.Is(err, ErrCorruptSnapshot) && !errors.Is(err, idem.ErrCorrupt) {
			t.Fatalf("case %d: %v: want ErrCorruptSnapshot or idem.ErrCorrupt", i, err)
		}
		if app2.restores != 0 {
			t.Fatalf("case %d: the application's Restore was called", i)
		}
	}
	if !reflect.DeepEqual(app2.state(), before) {
		t.Fatal("refused snapshots changed the application")
	}
	if r := fd2.cmd(idem.Request{ID: []byte("mine")}, counterOp{ID: "mine", Key: "m", Delta: 1}); !r.Duplicate {
		t.Fatal("refused snapshots changed the dedup set")
	}
	if f2.Err() != nil {
		t.Fatal(f2.Err())
	}
	if n := countGenerations(t, f2.dir); n != 1 {
		t.Fatalf("%d generations left", n)
	}
	// And the good one still loads.
	if err := f2.Restore(io.NopCloser(bytes.NewReader(good))); err != nil {
		t.Fatal(err)
	}
}

// TestRestartReplaysIntoFreshApp: a node restarted from its stores replays
// the log into a new application FSM; every first occurrence must reach
// it again, whatever the dedup directory still holds.
func TestRestartReplaysIntoFreshApp(t *testing.T) {
	dir := t.TempDir()
	app := newCounterFSM()
	f, err := Wrap(app, &Options{Dir: dir, Engine: testEngineOptions()})
	if err != nil {
		t.Fatal(err)
	}
	var log [][]byte
	for i := 0; i < 20; i++ {
		c, _ := Command(idem.Request{ID: []byte{'r', byte(i)}}, encodeOp(counterOp{ID: string([]byte{'r', byte(i)}), Key: "k", Delta: 1}))
		log = append(log, c, c) // every request appended twice
	}
	fd := &feeder{t: t, f: f, at: t0}
	for _, c := range log {
		fd.apply(c)
	}
	want := app.state()
	// A second FSM on the same Dir while the first is open is refused.
	if _, err := Wrap(newCounterFSM(), &Options{Dir: dir}); !errors.Is(err, idem.ErrLocked) {
		t.Fatalf("second Wrap of an open Dir: %v", err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	app2 := newCounterFSM()
	f2 := wrapT(t, app2, dir)
	fd2 := &feeder{t: t, f: f2, at: t0}
	for _, c := range log {
		fd2.apply(c)
	}
	if got := app2.state(); !reflect.DeepEqual(got, want) {
		t.Fatalf("replayed state %+v, want %+v", got, want)
	}
	if len(want.Applied) != 20 {
		t.Fatalf("applied %d", len(want.Applied))
	}
}

func TestWrapRefusesForeignDir(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "precious.txt"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Wrap(newCounterFSM(), &Options{Dir: dir}); err == nil || !strings.Contains(err.Error(), "not an idemraft directory") {
		t.Fatalf("foreign dir: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "precious.txt")); err != nil {
		t.Fatal("Wrap touched a foreign file")
	}
	if _, err := Wrap(newCounterFSM(), &Options{}); err == nil {
		t.Fatal("no Dir accepted")
	}
	if _, err := Wrap(newCounterFSM(), &Options{Dir: t.TempDir(), Engine: idem.Options{MaxEntries: 5}}); err == nil {
		t.Fatal("MaxEntries accepted")
	}
}

func TestCommandValidation(t *testing.T) {
	for _, req := range []idem.Request{
		{},
		{ID: []byte("a"), Client: "c", Seq: 1},
		{Client: "c"},
		{Seq: 3},
		{ID: []byte("a"), KeepReplies: 2},
		{ID: []byte("a"), KeepRepliesFor: time.Second},
		{Client: "c", Seq: 1, KeepReplies: -1},
		{Client: "c", Seq: 1, KeepReplies: idem.MaxKeepReplies + 1},
		{Client: "c", Seq: 1, KeepRepliesFor: -time.Second},
	} {
		if _, err := Command(req, nil); !errors.Is(err, idem.ErrInvalidRequest) {
			t.Errorf("Command(%+v): %v", req, err)
		}
	}
	c, err := Command(idem.Request{Scope: "s", ID: []byte("a"), Fingerprint: []byte("f"), Acked: [][]byte{[]byte("z")}}, []byte("op"))
	if err != nil || !IsCommand(c) {
		t.Fatal(err)
	}
	d, err := decodeCommand(c)
	if err != nil || d.req.Scope != "s" || string(d.req.ID) != "a" || string(d.op) != "op" || len(d.req.Acked) != 1 {
		t.Fatalf("%+v %v", d, err)
	}
	if IsCommand([]byte("plain")) {
		t.Fatal("plain data taken for a command")
	}
}

// TestTTLUsesLogTime: a request's TTL runs out by the log's time: a retry
// within it is a duplicate, one after it runs again, whatever the local
// clock says (the entries here are years away from it).
func TestTTLUsesLogTime(t *testing.T) {
	app := newCounterFSM()
	fd := &feeder{t: t, f: wrapT(t, app, t.TempDir()), at: t0}
	req := idem.Request{ID: []byte("ttl"), TTL: time.Minute}
	fd.cmd(req, counterOp{ID: "ttl-1", Key: "k", Delta: 1})
	fd.at = t0.Add(30 * time.Second)
	if r := fd.cmd(req, counterOp{ID: "ttl-2", Key: "k", Delta: 1}); !r.Duplicate {
		t.Fatalf("retry within the TTL: %+v", r)
	}
	fd.at = t0.Add(2 * time.Minute)
	if r := fd.cmd(req, counterOp{ID: "ttl-3", Key: "k", Delta: 1}); r.Duplicate || val(t, r) != 2 {
		t.Fatalf("retry after the TTL: %+v", r)
	}
	// Cleanup runs at the log's time too, and changes no answer (whether
	// the entry is physically gone yet or not).
	fd.at = t0.Add(10 * time.Minute)
	fd.apply([]byte("noise")) // the clock moves with the log only
	if _, err := fd.f.cur.e.CleanupExpired(context.Background()); err != nil {
		t.Fatal(err)
	}
	if r := fd.cmd(req, counterOp{ID: "ttl-4", Key: "k", Delta: 1}); r.Duplicate || val(t, r) != 3 {
		t.Fatalf("retry after cleanup: %+v", r)
	}
	if got := app.state().Applied; !reflect.DeepEqual(got, map[string]int{"ttl-1": 1, "ttl-3": 1, "ttl-4": 1}) {
		t.Fatalf("applied %v", got)
	}
	if _, err := Command(idem.Request{ID: []byte("x"), TTL: -time.Second}, nil); !errors.Is(err, idem.ErrInvalidRequest) {
		t.Fatalf("negative TTL: %v", err)
	}
}

// TestReplyWindowThroughCommand: a client's reply window (KeepReplies,
// KeepRepliesFor) travels in its command entry, so a retry of an older
// sequence number inside the window gets that number's own reply, through
// Apply and ApplyBatch alike, and one outside it by count or by log time
// is already committed. Entries without a window keep the first kind, which
// idemraft versions from before the window read; the window's kind cannot
// be read as the first one.
func TestReplyWindowThroughCommand(t *testing.T) {
	for _, batch := range []bool{false, true} {
		app := newCounterFSM()
		fd := &feeder{t: t, f: wrapT(t, app, t.TempDir()), at: t0}
		send := func(seq uint64, keep int, keepFor time.Duration) *Response {
			c, err := Command(idem.Request{Client: "w", Seq: seq, KeepReplies: keep, KeepRepliesFor: keepFor},
				encodeOp(counterOp{ID: fmt.Sprint("w", seq), Key: "k", Delta: 1}))
			if err != nil {
				t.Fatal(err)
			}
			fd.idx++
			fd.at = fd.at.Add(time.Millisecond)
			l := &raft.Log{Index: fd.idx, Term: 1, Type: raft.LogCommand, Data: c, AppendedAt: fd.at}
			if batch {
				return fd.f.ApplyBatch([]*raft.Log{l})[0].(*Response)
			}
			return fd.f.Apply(l).(*Response)
		}
		for seq := uint64(1); seq <= 4; seq++ {
			if v := val(t, send(seq, 3, 0)); v != int64(seq) {
				t.Fatalf("batch %v: seq %d gave %d", batch, seq, v)
			}
		}
		// 2, 3 and 4 are kept: 2 gets its own reply; 1 fell out of the window.
		if r := send(2, 3, 0); !r.Duplicate || val(t, r) != 2 {
			t.Fatalf("batch %v: retry of seq 2 inside the window: %+v", batch, r)
		}
		if r := send(1, 3, 0); !errors.Is(r.Err, idem.ErrAlreadyCommitted) {
			t.Fatalf("batch %v: retry of seq 1 outside the window: %+v", batch, r)
		}
		// By age: 5 is kept 3 ms of log time after its commit (at 6 ms from
		// 2 ms later), then not.
		send(5, 3, 3*time.Millisecond)
		send(6, 3, 3*time.Millisecond)
		if r := send(5, 3, 0); !r.Duplicate || val(t, r) != 5 {
			t.Fatalf("batch %v: retry of seq 5 within its age: %+v", batch, r)
		}
		fd.at = fd.at.Add(10 * time.Millisecond)
		if r := send(5, 3, 0); !errors.Is(r.Err, idem.ErrAlreadyCommitted) {
			t.Fatalf("batch %v: retry of seq 5 after its age: %+v", batch, r)
		}
		if got := app.state().Applied; len(got) != 6 {
			t.Fatalf("batch %v: applied %v", batch, got)
		}
	}
	plain, _ := Command(idem.Request{Client: "w", Seq: 1}, nil)
	window, _ := Command(idem.Request{Client: "w", Seq: 1, KeepReplies: 2}, nil)
	if plain[len(commandMagic)] != kindCommand || window[len(commandMagic)] != kindWindowCommand {
		t.Fatalf("kinds %d and %d, want %d without a window and %d with one", plain[len(commandMagic)], window[len(commandMagic)], kindCommand, kindWindowCommand)
	}
	window[len(commandMagic)] = kindCommand
	if _, err := decodeCommand(window); !errors.Is(err, ErrInvalidCommand) {
		t.Fatalf("a window command read as the first kind: %v, want ErrInvalidCommand", err)
	}
}
