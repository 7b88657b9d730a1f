package idemraft

import (
	"bytes"
	"context"
	"io"
	"io/fs"
	"math/rand/v2"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
	"github.com/vmihailenco/msgpack/v5"
)

// TestWrapRefusesEngineOptions: the engine options idemraft sets itself,
// and those that would let replicas disagree, are refused when set, with
// an error naming the field (they used to be overridden silently).
func TestWrapRefusesEngineOptions(t *testing.T) {
	for field, o := range map[string]idem.Options{
		"Clock":         {Clock: time.Now},
		"Sync":          {Sync: idem.SyncNever},
		"SyncInterval":  {SyncInterval: time.Second},
		"RelaxedClaims": {RelaxedClaims: true},
		"KeepSnapshots": {KeepSnapshots: 2},
		"MaxEntries":    {MaxEntries: 5},
		"FS":            {FS: vfs.NewMem()},
	} {
		f, err := Wrap(newCounterFSM(), &Options{Dir: t.TempDir(), Engine: o})
		if err == nil {
			f.Close()
			t.Errorf("Options.Engine.%s set: accepted", field)
			continue
		}
		if !strings.Contains(err.Error(), "Options.Engine."+field+" ") {
			t.Errorf("Options.Engine.%s set: the error does not name it: %v", field, err)
		}
	}
	if _, err := Wrap(newCounterFSM(), nil); err == nil || !strings.Contains(err.Error(), "Options.Dir") {
		t.Errorf("nil options: %v", err)
	}
	// The defaults are fine, and so are the options idemraft leaves to the caller.
	f, err := Wrap(newCounterFSM(), &Options{Dir: t.TempDir(), Engine: idem.Options{Sync: idem.SyncAlways, NoPreallocate: true, Retention: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
}

// TestConfigurationErrors: the constructors return their configuration
// errors, naming what is wrong, instead of failing later.
func TestConfigurationErrors(t *testing.T) {
	c := newCluster(t, 1, clusterOpts{wrap: true})
	nd := c.nodes[0]
	r, f, _, _ := nd.current()
	good, err := LocalNode(nd.id, r, f)
	if err != nil {
		t.Fatal(err)
	}
	twin, _ := LocalNode(nd.id, r, f)
	for name, tc := range map[string]struct {
		err  func() error
		want string
	}{
		"LocalNode without id":   {func() error { _, err := LocalNode("", r, f); return err }, "empty server id"},
		"LocalNode without raft": {func() error { _, err := LocalNode("n", nil, f); return err }, "nil *raft.Raft"},
		"LocalNode without FSM":  {func() error { _, err := LocalNode("n", r, nil); return err }, "nil *FSM"},
		"Handler without FSM":    {func() error { _, err := Handler(nd.id, r, nil); return err }, "nil *FSM"},
		"HTTPNode without id":    {func() error { _, err := HTTPNode("", "http://127.0.0.1:1/", nil); return err }, "empty server id"},
		"HTTPNode without scheme": {func() error {
			_, err := HTTPNode("n", "127.0.0.1:8080/apply", nil)
			return err
		}, `url "127.0.0.1:8080/apply"`},
		"NewClient without nodes": {func() error { _, err := NewClient(nil, nil); return err }, "no nodes"},
		"NewClient with a nil node": {func() error {
			_, err := NewClient([]Node{good, nil}, nil)
			return err
		}, "node 1 is nil"},
		"NewClient with one id twice": {func() error {
			_, err := NewClient([]Node{good, twin}, nil)
			return err
		}, `same id "n1"`},
		"NewClient negative Attempt": {func() error {
			_, err := NewClient([]Node{good}, &ClientOptions{Attempt: -time.Second})
			return err
		}, "ClientOptions.Attempt = -1s"},
		"NewClient backoffs crossed": {func() error {
			_, err := NewClient([]Node{good}, &ClientOptions{MinBackoff: time.Second, MaxBackoff: time.Millisecond})
			return err
		}, "ClientOptions.MinBackoff = 1s exceeds MaxBackoff = 1ms"},
		"Submit without FSM": {func() error { _, err := Submit(context.Background(), r, nil, nil); return err }, "nil"},
	} {
		err := tc.err()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error with %q", name, err, tc.want)
		}
	}
	// Defaults: nil options.
	cl, err := NewClient([]Node{good}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if cl.attempt != 5*time.Second || cl.minBackoff != 5*time.Millisecond || cl.maxBack != 500*time.Millisecond {
		t.Fatalf("defaults: attempt %v, backoff %v..%v", cl.attempt, cl.minBackoff, cl.maxBack)
	}
}

// envelopeV0 is the envelope as idemraft wrote it before idem's API v1,
// with a copy of the request's fingerprint at its end.
type envelopeV0 struct {
	_msgpack    struct{} `msgpack:",as_array"`
	Kind        int
	Reply       []byte
	Msg         string
	Fingerprint []byte
}

// TestOldEnvelopesInSnapshots: a dedup set written before API v1 (every
// reply with its fingerprint copy) still restores from a raft snapshot:
// its replies are answered, and the fingerprint is checked by the engine
// (the copy is ignored).
func TestOldEnvelopesInSnapshots(t *testing.T) {
	fd := &feeder{t: t, f: wrapT(t, newCounterFSM(), t.TempDir()), at: t0}
	fd.apply([]byte("noise")) // a log time for the engine's clock
	ctx := context.Background()
	for _, old := range []struct {
		req idem.Request
		env envelopeV0
	}{
		{idem.Request{Scope: "s", ID: []byte("old-1"), Fingerprint: []byte("fp")}, envelopeV0{Kind: replyBytes, Reply: []byte("reply-1"), Fingerprint: []byte("fp")}},
		{idem.Request{Scope: "s", ID: []byte("old-2")}, envelopeV0{Kind: replyAppError, Msg: "refused"}},
	} {
		b, err := msgpack.Marshal(&old.env)
		if err != nil {
			t.Fatal(err)
		}
		if b[0] != 0x94 {
			t.Fatalf("the old form is a 4-element array, got %x", b[0])
		}
		res, err := fd.f.cur.e.Begin(ctx, old.req)
		if err != nil || res.Status != idem.Fresh {
			t.Fatal(res, err)
		}
		if err := res.Claim.Commit(ctx, b); err != nil {
			t.Fatal(err)
		}
	}
	snap := persist(t, fd.f)
	app2 := newCounterFSM()
	f2 := wrapT(t, app2, t.TempDir())
	if err := f2.Restore(io.NopCloser(bytes.NewReader(snap))); err != nil {
		t.Fatal(err)
	}
	fd2 := &feeder{t: t, f: f2, idx: fd.idx, at: fd.at}
	if r := fd2.cmd(idem.Request{Scope: "s", ID: []byte("old-1"), Fingerprint: []byte("fp")}, counterOp{ID: "x", Key: "k", Delta: 1}); !r.Duplicate || string(r.Reply) != "reply-1" {
		t.Fatalf("old reply through the log: %+v", r)
	}
	if r, ok := f2.Lookup(idem.Request{Scope: "s", ID: []byte("old-1"), Fingerprint: []byte("fp")}); !ok || string(r.Reply) != "reply-1" {
		t.Fatalf("old reply from the local set: %+v %v", r, ok)
	}
	if _, ok := f2.Lookup(idem.Request{Scope: "s", ID: []byte("old-1"), Fingerprint: []byte("other")}); ok {
		t.Fatal("another fingerprint answered from the local set")
	}
	if r, ok := f2.Lookup(idem.Request{Scope: "s", ID: []byte("old-2")}); !ok || r.Err == nil || r.Err.Error() != "refused" {
		t.Fatalf("old application error: %+v %v", r, ok)
	}
	if n := app2.state().Applied["x"]; n != 0 {
		t.Fatal("a duplicate of an old request ran")
	}
	// The new form has 3 elements; damaged envelopes are refused, never a panic.
	b, _ := msgpack.Marshal(&envelope{Kind: replyBytes, Reply: []byte("r")})
	if b[0] != 0x93 {
		t.Fatalf("the new form: %x", b[0])
	}
	for _, bad := range [][]byte{nil, {0x92, 0, 0xc4, 0}, append(append([]byte(nil), b...), 0), b[:len(b)-1]} {
		if _, err := decodeEnvelope(bad); err == nil {
			t.Errorf("envelope %x accepted", bad)
		}
	}
}

// TestEnvelopeEncoding: encodeEnvelope writes the bytes msgpack.Marshal
// writes for the envelope struct, at every length boundary of msgpack's
// bin and str formats, and they decode back.
func TestEnvelopeEncoding(t *testing.T) {
	for _, kind := range []int{replyBytes, replyNil, replyAppError, replyTooLarge, replyUnsupported} {
		for _, n := range []int{-1, 0, 1, 31, 32, 255, 256, 65535, 65536, 70000} {
			env := envelope{Kind: kind}
			if n >= 0 {
				env.Reply = bytes.Repeat([]byte{'r'}, n)
				env.Msg = strings.Repeat("m", n)
			}
			got := encodeEnvelope(env)
			want, _ := msgpack.Marshal(&env)
			if !bytes.Equal(got, want) {
				t.Fatalf("kind %d, %d bytes: %x..., msgpack writes %x...", kind, n, got[:min(len(got), 8)], want[:min(len(want), 8)])
			}
			back, err := decodeEnvelope(got)
			if err != nil || back.Kind != kind || !bytes.Equal(back.Reply, env.Reply) || back.Msg != env.Msg {
				t.Fatalf("kind %d, %d bytes: decoded %v %v", kind, n, back.Kind, err)
			}
		}
	}
}

// TestCommandEncoding: Command writes the bytes msgpack.Marshal writes for
// the command structs (wireCommand, wireWindowCommand) after the prefix
// and kind byte, for requests with and without each field (nil and empty
// slices, every integer size, lengths at msgpack's str and bin format
// boundaries), and they decode back to the request.
func TestCommandEncoding(t *testing.T) {
	rng := rand.New(rand.NewPCG(24, 1))
	pick := func(vals ...int) int { return vals[rng.IntN(len(vals))] }
	blob := func() []byte {
		switch n := pick(-1, 0, 1, 31, 32, 255, 256, 65535, 65536); n {
		case -1:
			return nil
		default:
			return bytes.Repeat([]byte{'b'}, n)
		}
	}
	nums := []uint64{0, 1, 127, 128, 255, 256, 65535, 65536, 1<<32 - 1, 1 << 32, 1<<63 - 1}
	for i := range 400 {
		req := idem.Request{Scope: strings.Repeat("s", pick(0, 1, 31, 32, 255)), Fingerprint: blob(), TTL: time.Duration(nums[rng.IntN(len(nums))])}
		if rng.IntN(2) == 0 {
			req.ID = append([]byte("id-"), blob()...)
		} else {
			req.Client, req.Seq = strings.Repeat("c", pick(1, 32, 256)), max(1, nums[rng.IntN(len(nums))])
			if rng.IntN(2) == 0 {
				req.KeepReplies, req.KeepRepliesFor = pick(0, 1, 200, idem.MaxKeepReplies), time.Duration(nums[rng.IntN(len(nums))])
			}
		}
		switch rng.IntN(3) {
		case 1:
			req.Acked = [][]byte{}
		case 2:
			for range pick(1, 2, 16) {
				req.Acked = append(req.Acked, append([]byte("a-"), blob()...))
			}
		}
		op := blob()
		got, err := Command(req, op)
		if err != nil {
			t.Fatalf("case %d: %v", i, err)
		}
		var body any = &wireCommand{Scope: req.Scope, ID: req.ID, Client: req.Client, Seq: req.Seq,
			Fingerprint: req.Fingerprint, Acked: req.Acked, TTL: int64(req.TTL), Op: op}
		kind := kindCommand
		if req.KeepReplies != 0 || req.KeepRepliesFor != 0 {
			kind = kindWindowCommand
			body = &wireWindowCommand{Scope: req.Scope, ID: req.ID, Client: req.Client, Seq: req.Seq,
				Fingerprint: req.Fingerprint, Acked: req.Acked, TTL: int64(req.TTL), Op: op,
				KeepReplies: int64(req.KeepReplies), KeepRepliesFor: int64(req.KeepRepliesFor)}
		}
		enc, err := msgpack.Marshal(body)
		if err != nil {
			t.Fatal(err)
		}
		want := append(append([]byte(commandMagic), kind), enc...)
		if !bytes.Equal(got, want) {
			t.Fatalf("case %d (%+v): Command wrote\n%x\nmsgpack writes\n%x", i, req, got[:min(len(got), 96)], want[:min(len(want), 96)])
		}
		checkCanonical(t, got, true)
		for range 8 { // damaged copies: the fast path reads them as the general one, or leaves them to it
			bad := bytes.Clone(got)
			switch rng.IntN(3) {
			case 0:
				bad = bad[:rng.IntN(len(bad))]
			case 1:
				bad[rng.IntN(len(bad))] = byte(rng.IntN(256))
			default:
				bad = append(bad, byte(rng.IntN(256)))
			}
			checkCanonical(t, bad, false)
		}
		d, err := decodeCommand(got)
		if err != nil || d.kind != kind || !bytes.Equal(d.op, op) || d.req.Scope != req.Scope || !bytes.Equal(d.req.ID, req.ID) ||
			d.req.Client != req.Client || d.req.Seq != req.Seq || d.req.TTL != req.TTL || len(d.req.Acked) != len(req.Acked) ||
			d.req.KeepReplies != req.KeepReplies || d.req.KeepRepliesFor != req.KeepRepliesFor {
			t.Fatalf("case %d: decoded %+v %v, want %+v", i, d.req, err, req)
		}
	}
}

// checkCanonical checks that decodeCanonical reads the command b exactly
// as decodeGeneral does whenever it reads it, and (want) that it does.
func checkCanonical(t *testing.T, b []byte, want bool) {
	t.Helper()
	if len(b) <= len(commandMagic) {
		return
	}
	kind, body := b[len(commandMagic)], b[len(commandMagic)+1:]
	if kind != kindCommand && kind != kindWindowCommand {
		return
	}
	req, op, ok := decodeCanonical(body, kind == kindWindowCommand)
	if want && !ok {
		t.Fatalf("the fast path refused Command's output %x", b)
	}
	if !ok {
		return
	}
	greq, gop, err := decodeGeneral(body, kind == kindWindowCommand)
	if err != nil || !reflect.DeepEqual(req, greq) || !bytes.Equal(op, gop) {
		t.Fatalf("%x: the fast path read %+v %q, the general one %+v %q %v", b, req, op, greq, gop, err)
	}
}

// TestDecodeCanonical: the general path still reads what the fast path
// leaves to it: numbers in compact encodings, a body in an array16.
func TestDecodeCanonical(t *testing.T) {
	req := idem.Request{Scope: "s", Client: "c", Seq: 3, TTL: time.Second, KeepReplies: 4, KeepRepliesFor: time.Minute, Acked: [][]byte{[]byte("a")}}
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	if err := enc.Encode(&wireWindowCommand{Scope: req.Scope, Client: req.Client, Seq: req.Seq, Acked: req.Acked, TTL: int64(req.TTL), Op: []byte("op"),
		KeepReplies: int64(req.KeepReplies), KeepRepliesFor: int64(req.KeepRepliesFor)}); err != nil {
		t.Fatal(err)
	}
	compact := append([]byte(commandMagic+string(kindWindowCommand)), buf.Bytes()...)
	canon, err := Command(req, []byte("op"))
	if err != nil {
		t.Fatal(err)
	}
	body := canon[len(commandMagic)+1:]
	array16 := append([]byte(commandMagic+string(kindWindowCommand)+"\xdc\x00\x0a"), body[1:]...)
	for name, b := range map[string][]byte{"compact ints": compact, "array16": array16} {
		if _, _, ok := decodeCanonical(b[len(commandMagic)+1:], true); ok {
			t.Fatalf("%s: the fast path took it", name)
		}
		d, err := decodeCommand(b)
		if err != nil || !reflect.DeepEqual(d.req, idem.Request{Scope: "s", Client: "c", Seq: 3, Fingerprint: nil, TTL: time.Second, KeepReplies: 4, KeepRepliesFor: time.Minute, Acked: [][]byte{[]byte("a")}}) || string(d.op) != "op" {
			t.Fatalf("%s: %+v %q %v", name, d.req, d.op, err)
		}
	}
}

// TestEngineWALNotPreallocated: the dedup engine's WAL segments are not
// zero-filled to their size (idem.Options.NoPreallocate): that only speeds
// up fsyncs, which idemraft's engine does not wait for, and cost every node
// a segment's worth of disk writes at each Wrap and Restore.
func TestEngineWALNotPreallocated(t *testing.T) {
	dir := t.TempDir()
	f, err := Wrap(newCounterFSM(), &Options{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const segment = 64 << 20 // idem.Options.SegmentSize's default
	var files int
	err = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		files++
		if fi.Size() >= segment {
			t.Errorf("%s: %d bytes, preallocated", path, fi.Size())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files == 0 {
		t.Fatalf("no file under %s", dir)
	}
}
