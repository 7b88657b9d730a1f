package idemraft

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"reflect"
	"strconv"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
)

// genLog makes a random log of n entries for the property test: requests
// by id over a few ids (repeats, other fingerprints, acks, TTLs of a few
// milliseconds of log time), by sequence over a few clients (the next
// number, repeats, older numbers, gaps, reply windows), forgets, entries
// that are not commands, damaged commands and configuration changes.
// Consecutive entries often share their AppendedAt, as a leader's batch of
// appends does, or their millisecond; a new leader's clock may be behind.
func genLog(rng *rand.Rand, n int) []*raft.Log {
	at := t0
	last := map[string]uint64{}
	ids := []string{"a", "b", "c", "d", "e", "f"}
	fps := []string{"", "f1", "f2"}
	logs := make([]*raft.Log, 0, n)
	for i := 0; i < n; i++ {
		switch x := rng.IntN(10); {
		case x < 5:
			at = at.Add(time.Duration(rng.IntN(2500)) * time.Microsecond)
		case x == 5:
			at = at.Add(-time.Millisecond)
		}
		l := &raft.Log{Index: uint64(i + 1), Term: 1, Type: raft.LogCommand, AppendedAt: at}
		op := counterOp{ID: "op-" + strconv.Itoa(i), Key: "k" + strconv.Itoa(rng.IntN(3)), Delta: int64(1 + rng.IntN(5)), Fail: rng.IntN(10) == 0}
		var req idem.Request
		switch x := rng.IntN(100); {
		case x < 45:
			req = idem.Request{Scope: []string{"", "s"}[rng.IntN(2)], ID: []byte(ids[rng.IntN(len(ids))]), Fingerprint: []byte(fps[rng.IntN(len(fps))])}
			if rng.IntN(6) == 0 {
				if a := ids[rng.IntN(len(ids))]; a != string(req.ID) {
					req.Acked = [][]byte{[]byte(a)}
				}
			}
			if rng.IntN(5) == 0 {
				req.TTL = time.Duration(1+rng.IntN(4)) * time.Millisecond
			}
		case x < 75:
			c := []string{"c1", "c2"}[rng.IntN(2)]
			seq := last[c] + 1
			switch y := rng.IntN(10); {
			case y < 2 && last[c] > 0:
				seq = last[c]
			case y < 4 && last[c] > 1:
				seq = last[c] - uint64(1+rng.IntN(int(min(last[c]-1, 3))))
			case y == 4:
				seq = last[c] + 2
			}
			last[c] = max(last[c], seq)
			req = idem.Request{Scope: "q", Client: c, Seq: seq, Fingerprint: []byte(fps[rng.IntN(len(fps))])}
			if rng.IntN(3) == 0 {
				req.KeepReplies = rng.IntN(4)
			}
			if rng.IntN(4) == 0 {
				req.KeepRepliesFor = time.Duration(rng.IntN(5)) * time.Millisecond
			}
		case x < 80:
			l.Data = ForgetCommand(at.Add(-time.Duration(rng.IntN(6)) * time.Millisecond))
		case x < 88:
			l.Data = encodeOp(op) // not a command: the application's own entry
		case x < 92:
			l.Data = []byte("noise")
		case x < 95:
			l.Data = append([]byte(commandMagic), 9, 0x90) // an unknown kind
		default:
			l.Type = raft.LogConfiguration
			l.Data = raft.EncodeConfiguration(raft.Configuration{Servers: []raft.Server{{ID: "n1", Address: "a1"}}})
		}
		if l.Data == nil {
			c, err := Command(req, encodeOp(op))
			if err != nil {
				panic(err)
			}
			l.Data = c
		}
		logs = append(logs, l)
	}
	return logs
}

// wrapSmall is wrapT with small WAL segments: the property test opens
// dozens of engines, and each preallocates its segment.
func wrapSmall(t *testing.T, app raft.FSM) *FSM {
	t.Helper()
	eo := testEngineOptions()
	eo.SegmentSize = 1 << 20
	f, err := Wrap(app, &Options{Dir: t.TempDir(), Engine: eo})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// applyOneByOne applies logs as raft does to an FSM without ApplyBatch:
// Apply for commands, StoreConfiguration for configuration changes.
func applyOneByOne(f *FSM, logs []*raft.Log) []any {
	out := make([]any, len(logs))
	for i, l := range logs {
		if l.Type == raft.LogCommand {
			out[i] = f.Apply(l)
		} else {
			f.StoreConfiguration(l.Index, raft.DecodeConfiguration(l.Data))
		}
	}
	return out
}

// resultString describes one entry's result for comparison: a Response's
// fields, an application error's text, a reply's bytes.
func resultString(v any) string {
	switch r := v.(type) {
	case *Response:
		err := ""
		if r.Err != nil {
			err = r.Err.Error()
		}
		return fmt.Sprintf("reply %x dup %v err %q", r.Reply, r.Duplicate, err)
	case error:
		return "error " + r.Error()
	}
	return fmt.Sprintf("%T %v", v, v)
}

// TestApplyBatchMatchesApply is the property: for random logs with
// duplicates, conflicts, sequence gaps, reply windows, repeats inside one
// batch, TTLs and forgets in log time, and entries that are not commands
// in between, ApplyBatch (cut into random batches, to an application with
// and without its own ApplyBatch) gives every entry exactly the result
// Apply gives it one by one, and after every batch the FSMs agree on their
// counters, last index and clock; at the end the applications' states are
// equal. Halfway, the batched FSM is snapshotted and restored into a new
// FSM, which applies the rest.
func TestApplyBatchMatchesApply(t *testing.T) {
	seeds := 10
	if testing.Short() {
		seeds = 3
	}
	for seed := 0; seed < seeds; seed++ {
		rng := rand.New(rand.NewPCG(uint64(seed), 24))
		logs := genLog(rng, 600)
		for _, batching := range []bool{false, true} {
			refApp := newCounterFSM()
			ref := wrapSmall(t, refApp)
			newApp := func() (*counterFSM, raft.FSM) {
				app := newCounterFSM()
				if batching {
					return app, &batchingCounter{counterFSM: app}
				}
				return app, app
			}
			_, wrapped := newApp()
			f := wrapSmall(t, wrapped)
			var base Stats // counters of the FSMs before f
			pos := 0
			applyUntil := func(end int) {
				for pos < end {
					n := min(end-pos, 1+rng.IntN(40))
					batch := logs[pos : pos+n]
					got := f.ApplyBatch(batch)
					want := applyOneByOne(ref, batch)
					checkResults(t, seed, batching, batch, got, want)
					s := f.Stats()
					s.Applied += base.Applied
					s.Duplicates += base.Duplicates
					s.Refused += base.Refused
					checkStats(t, seed, fmt.Sprintf("after entry %d", pos+n-1), s, ref.Stats())
					pos += n
				}
			}
			applyUntil(len(logs) / 2)
			snap := persist(t, f)
			base = f.Stats()
			app2, wrapped := newApp()
			f = wrapSmall(t, wrapped)
			if err := f.Restore(io.NopCloser(bytes.NewReader(snap))); err != nil {
				t.Fatal(err)
			}
			applyUntil(len(logs))
			if g, w := app2.state(), refApp.state(); !reflect.DeepEqual(g, w) {
				t.Fatalf("seed %d, app batching %v: application state\n%+v\nwant %+v", seed, batching, g, w)
			}
		}
	}
}

func checkResults(t *testing.T, seed int, batching bool, logs []*raft.Log, got, want []any) {
	t.Helper()
	for i := range logs {
		if g, w := resultString(got[i]), resultString(want[i]); g != w {
			t.Fatalf("seed %d, app batching %v: entry %d (%s): ApplyBatch gave %s, Apply %s",
				seed, batching, i, describe(logs[i]), g, w)
		}
	}
}

// describe names a log entry in a failure message.
func describe(l *raft.Log) string {
	at := l.AppendedAt.Sub(t0)
	if l.Type != raft.LogCommand || !IsCommand(l.Data) {
		return fmt.Sprintf("index %d at %v, %v %.20q", l.Index, at, l.Type, l.Data)
	}
	d, err := decodeCommand(l.Data)
	switch {
	case err != nil:
		return fmt.Sprintf("index %d at %v, damaged command", l.Index, at)
	case d.kind == kindForget:
		return fmt.Sprintf("index %d at %v, forget before %v", l.Index, at, d.before.Sub(t0))
	}
	r := d.req
	return fmt.Sprintf("index %d at %v, scope %q id %q client %q seq %d fp %q acked %q ttl %v keep %d/%v",
		l.Index, at, r.Scope, r.ID, r.Client, r.Seq, r.Fingerprint, r.Acked, r.TTL, r.KeepReplies, r.KeepRepliesFor)
}

func checkStats(t *testing.T, seed int, when string, got, want Stats) {
	t.Helper()
	if got.Applied != want.Applied || got.Duplicates != want.Duplicates || got.Refused != want.Refused ||
		got.LastIndex != want.LastIndex || !got.Time.Equal(want.Time) {
		t.Fatalf("seed %d, %s: stats applied %d dups %d refused %d last %d time %v, want %d %d %d %d %v", seed, when,
			got.Applied, got.Duplicates, got.Refused, got.LastIndex, got.Time,
			want.Applied, want.Duplicates, want.Refused, want.LastIndex, want.Time)
	}
}

// TestApplyBatchAppGetsNewCommands: an application with its own ApplyBatch
// gets, in one call per run, exactly the operations of the new requests
// and the entries that are not commands (configuration changes included),
// in log order, with each entry's index and time; duplicates, refused and
// damaged commands never reach it. A second append of a request in the
// same batch ends the run before it and is answered as a duplicate.
func TestApplyBatchAppGetsNewCommands(t *testing.T) {
	app := &batchingCounter{counterFSM: newCounterFSM(), record: true}
	f := wrapT(t, app, t.TempDir())
	at := t0
	idx := uint64(0)
	entry := func(typ raft.LogType, data []byte) *raft.Log {
		idx++
		return &raft.Log{Index: idx, Term: 1, Type: typ, Data: data, AppendedAt: at}
	}
	cmd := func(req idem.Request, id string) *raft.Log {
		c, err := Command(req, encodeOp(counterOp{ID: id, Key: "k", Delta: 1}))
		if err != nil {
			t.Fatal(err)
		}
		return entry(raft.LogCommand, c)
	}
	// Known before the batch: x (fingerprint fx) and client c at 1.
	f.ApplyBatch([]*raft.Log{cmd(idem.Request{ID: []byte("x"), Fingerprint: []byte("fx")}, "x"), cmd(idem.Request{Client: "c", Seq: 1}, "c1")})
	app.calls = nil

	at = at.Add(time.Second)
	conf := raft.EncodeConfiguration(raft.Configuration{Servers: []raft.Server{{ID: "n1", Address: "a1"}}})
	batch := []*raft.Log{
		cmd(idem.Request{ID: []byte("a")}, "a"),                                  // 0 new
		entry(raft.LogCommand, encodeOp(counterOp{ID: "raw", Key: "k"})),         // 1 not a command
		cmd(idem.Request{ID: []byte("x"), Fingerprint: []byte("fx")}, "x-again"), // 2 duplicate
		cmd(idem.Request{ID: []byte("x"), Fingerprint: []byte("fy")}, "x-other"), // 3 conflict
		cmd(idem.Request{Client: "c", Seq: 3}, "c3"),                             // 4 gap
		entry(raft.LogConfiguration, conf),                                       // 5 configuration
		entry(raft.LogCommand, append([]byte(commandMagic), kindCommand, 0x91)),  // 6 damaged
		cmd(idem.Request{Client: "c", Seq: 2}, "c2"),                             // 7 new
		cmd(idem.Request{ID: []byte("b"), Acked: [][]byte{[]byte("x")}}, "b"),    // 8 new, acks x
		cmd(idem.Request{ID: []byte("a")}, "a-again"),                            // 9 a second append of a: a new run
		cmd(idem.Request{ID: []byte("d")}, "d"),                                  // 10 new
	}
	out := f.ApplyBatch(batch)
	wantCalls := [][]int{{0, 1, 5, 7, 8}, {10}}
	if len(app.calls) != len(wantCalls) {
		t.Fatalf("%d ApplyBatch calls, want %d: %v", len(app.calls), len(wantCalls), app.calls)
	}
	for c, want := range wantCalls {
		got := app.calls[c]
		if len(got) != len(want) {
			t.Fatalf("call %d: %d entries, want %d (%v)", c, len(got), len(want), got)
		}
		for n, i := range want {
			l := batch[i]
			data := l.Data
			if d, err := decodeCommand(l.Data); err == nil {
				data = d.op // a new request's operation, not the command
			}
			if g := got[n]; g.Index != l.Index || g.Type != l.Type || !bytes.Equal(g.Data, data) || !g.AppendedAt.Equal(l.AppendedAt) {
				t.Fatalf("call %d entry %d: index %d type %v data %q, want entry %d: index %d type %v data %q", c, n, g.Index, g.Type, g.Data, i, l.Index, l.Type, data)
			}
		}
	}
	if r := out[9].(*Response); !r.Duplicate || r.Err != nil {
		t.Fatalf("second append of a in the batch: %+v, want a duplicate", r)
	}
	if st := app.state(); st.Applied["a-again"] != 0 || st.Applied["a"] != 1 || st.Applied["x-again"] != 0 {
		t.Fatalf("applied %v", st.Applied)
	}
	if app.configs != 1 {
		t.Fatalf("%d configuration changes reached the application, want 1", app.configs)
	}
}

// TestApplyBatchStopsOnEngineFailure: once the dedup engine fails in a
// batch (here: closed under the FSM), that command and every entry after
// it get the failure, entries of the run not yet applied included, and
// nothing more reaches the application: its state stays a prefix of the
// log.
func TestApplyBatchStopsOnEngineFailure(t *testing.T) {
	app := newCounterFSM()
	f := wrapT(t, app, t.TempDir())
	raw := func(i uint64, id string) *raft.Log {
		return &raft.Log{Index: i, Type: raft.LogCommand, Data: encodeOp(counterOp{ID: id, Key: "k", Delta: 1}), AppendedAt: t0}
	}
	c, _ := Command(idem.Request{ID: []byte("b")}, encodeOp(counterOp{ID: "b", Key: "k", Delta: 1}))
	f.ApplyBatch([]*raft.Log{raw(1, "r1")})
	before := app.state()
	f.cur.e.Close() // every engine call now fails
	out := f.ApplyBatch([]*raft.Log{raw(2, "r2"), {Index: 3, Type: raft.LogCommand, Data: c, AppendedAt: t0}, raw(4, "r4")})
	if f.Err() == nil || !errors.Is(f.Err(), idem.ErrClosed) {
		t.Fatalf("Err %v, want the engine's failure", f.Err())
	}
	if err, ok := out[0].(error); !ok || !errors.Is(err, idem.ErrClosed) {
		t.Fatalf("entry before the failing command: %v", out[0])
	}
	if r, ok := out[1].(*Response); !ok || !errors.Is(r.Err, idem.ErrClosed) {
		t.Fatalf("failing command: %v", out[1])
	}
	if err, ok := out[2].(error); !ok || !errors.Is(err, idem.ErrClosed) {
		t.Fatalf("entry after the failing command: %v", out[2])
	}
	if got := app.state(); !reflect.DeepEqual(got, before) {
		t.Fatalf("the application got entries after the failure: %+v, was %+v", got, before)
	}
}

// TestDedupSetKeepsNoLogBytes: the decoder reads a command in place (the
// id, acked ids and operation are slices of the entry's data), so nothing
// the dedup set keeps may point into an entry: after ApplyBatch and Apply
// return, scribbling over every entry's data changes no answer. Raft's
// log stores own their entries' bytes, but an application may reuse the
// buffer it gave raft.Apply once the entry is applied.
func TestDedupSetKeepsNoLogBytes(t *testing.T) {
	f := wrapSmall(t, newCounterFSM())
	var logs []*raft.Log
	var reqs []idem.Request
	for i := range 40 {
		req := idem.Request{Scope: "s", ID: []byte("id-" + strconv.Itoa(i)), Fingerprint: []byte("fp-" + strconv.Itoa(i))}
		if i%4 == 3 {
			req = idem.Request{Scope: "q", Client: "c", Seq: uint64(1 + i/4), Fingerprint: []byte("fp-" + strconv.Itoa(i)), KeepReplies: 10}
		}
		c, err := Command(req, encodeOp(counterOp{ID: "op-" + strconv.Itoa(i), Key: "k", Delta: 1}))
		if err != nil {
			t.Fatal(err)
		}
		reqs = append(reqs, req)
		logs = append(logs, &raft.Log{Index: uint64(i + 1), Term: 1, Type: raft.LogCommand, Data: c, AppendedAt: t0})
	}
	want := make([]*Response, len(logs))
	for i, r := range f.ApplyBatch(logs[:30]) {
		want[i] = r.(*Response)
	}
	for i := 30; i < len(logs); i++ {
		want[i] = f.Apply(logs[i]).(*Response)
	}
	for _, l := range logs {
		for j := len(commandMagic) + 1; j < len(l.Data); j++ {
			l.Data[j] = 'X'
		}
	}
	for i, req := range reqs {
		got, ok := f.Lookup(req)
		if !ok || want[i].Err != nil || !bytes.Equal(got.Reply, want[i].Reply) {
			t.Fatalf("request %d (%+v) after its entry's bytes changed: %+v %v, want the reply %+v", i, req, got, ok, want[i])
		}
	}
}

// TestApplyBatchPrefetchesRequests: ApplyBatch decodes the batch's
// commands first and hands the engine's Prefetch every request, by log
// position (the zero Request for an entry that is not a request: another
// entry, a forget, a damaged command), once per batch and before any of
// them is applied. On a build without the prefetch the hook never runs.
func TestApplyBatchPrefetchesRequests(t *testing.T) {
	f := wrapT(t, newCounterFSM(), t.TempDir())
	idx := uint64(0)
	entry := func(typ raft.LogType, data []byte) *raft.Log {
		idx++
		return &raft.Log{Index: idx, Term: 1, Type: typ, Data: data, AppendedAt: t0}
	}
	cmd := func(req idem.Request) *raft.Log {
		c, err := Command(req, encodeOp(counterOp{ID: "op" + strconv.Itoa(int(idx)), Key: "k", Delta: 1}))
		if err != nil {
			t.Fatal(err)
		}
		return entry(raft.LogCommand, c)
	}
	conf := raft.EncodeConfiguration(raft.Configuration{Servers: []raft.Server{{ID: "n1", Address: "a1"}}})
	want := []idem.Request{
		{ID: []byte("a")},
		{},
		{Scope: "s", Client: "c", Seq: 1, Fingerprint: []byte("f")},
		{},
		{},
		{},
		{ID: []byte("b"), Acked: [][]byte{[]byte("a")}},
	}
	batch := []*raft.Log{
		cmd(want[0]),
		entry(raft.LogCommand, encodeOp(counterOp{ID: "raw", Key: "k"})), // not a command
		cmd(want[2]),
		entry(raft.LogConfiguration, conf),
		entry(raft.LogCommand, append([]byte(commandMagic), kindCommand, 0x91)), // damaged
		entry(raft.LogCommand, ForgetCommand(t0.Add(-time.Hour))),
		cmd(want[6]),
	}
	var calls int
	testHookPrefetch = func(reqs []idem.Request) {
		calls++
		if n := f.Stats().Applied; n != 0 {
			t.Errorf("prefetch after %d requests were applied, want before any", n)
		}
		if !reflect.DeepEqual(reqs, want) {
			t.Errorf("prefetched %+v\nwant %+v", reqs, want)
		}
	}
	t.Cleanup(func() { testHookPrefetch = nil })
	for _, r := range f.ApplyBatch(batch) {
		if resp, ok := r.(*Response); ok && resp.Err != nil && !errors.Is(resp.Err, ErrInvalidCommand) {
			t.Fatal(resp.Err)
		}
	}
	if calls != 1 {
		t.Fatalf("%d prefetches for one batch, want 1", calls)
	}
	if st := f.Stats(); st.Applied != 3 {
		t.Fatalf("applied %d, want 3", st.Applied)
	}
}

// TestApplyBatchLooksUpSegments: ApplyBatch looks its requests up a
// segment at a time (lookAhead): the requests of one log time up to the
// first entry that is not a request, one with a later log time, or one
// whose key a request of the run or of the segment reads or writes (a
// repeated id, an acked id), at most maxSegment; and once more after a
// run's write (a repeated id after its fresh request is looked up again,
// and answered as a duplicate). On a build that looks requests up one by
// one, every segment is one request long.
func TestApplyBatchLooksUpSegments(t *testing.T) {
	f := wrapT(t, newCounterFSM(), t.TempDir())
	idx := uint64(0)
	cmd := func(at time.Duration, req idem.Request) *raft.Log {
		idx++
		c, err := Command(req, encodeOp(counterOp{ID: "op" + strconv.Itoa(int(idx)), Key: "k", Delta: 1}))
		if err != nil {
			t.Fatal(err)
		}
		return &raft.Log{Index: idx, Term: 1, Type: raft.LogCommand, Data: c, AppendedAt: t0.Add(at)}
	}
	id := func(s string) idem.Request { return idem.Request{ID: []byte(s)} }
	var batch []*raft.Log
	for i := range 3 {
		batch = append(batch, cmd(0, id(fmt.Sprint("a", i)))) // 0-2
	}
	batch = append(batch, cmd(0, id("a1")))                                                      // 3: a repeat: the run writes a0-a2 first
	batch = append(batch, cmd(0, id("b0")))                                                      // 4
	batch = append(batch, cmd(0, idem.Request{ID: []byte("b1"), Acked: [][]byte{[]byte("b2")}})) // 5
	batch = append(batch, cmd(0, id("b2")))                                                      // 6: acked by 5
	batch = append(batch, cmd(time.Millisecond, id("c0")))                                       // 7: a later log time
	batch = append(batch, &raft.Log{Index: 100, Term: 1, Type: raft.LogCommand, Data: encodeOp(counterOp{ID: "raw", Key: "k"})})
	for i := range maxSegment + 2 {
		batch = append(batch, cmd(time.Millisecond, id(fmt.Sprint("d", i)))) // 9-
	}
	var got [][2]int
	testHookLookAhead = func(from, to int) { got = append(got, [2]int{from, to}) }
	t.Cleanup(func() { testHookLookAhead = nil })
	out := f.ApplyBatch(batch)
	want := [][2]int{{0, 3}, {3, 6}, {6, 7}, {7, 8}, {9, 9 + maxSegment}, {9 + maxSegment, 11 + maxSegment}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("segments %v, want %v", got, want)
	}
	if r := out[3].(*Response); r.Err != nil || !r.Duplicate {
		t.Fatalf("the repeated request: %+v, want a duplicate", r)
	}
	if st := f.Stats(); st.Applied != 9+maxSegment || st.Duplicates != 1 {
		t.Fatalf("applied %d, duplicates %d; want %d, 1", st.Applied, st.Duplicates, 9+maxSegment)
	}
}
