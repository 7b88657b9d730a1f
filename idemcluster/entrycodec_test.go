package idemcluster

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/internal/alloctest"
	"github.com/idemdb/idem/internal/cputime"
	"github.com/vmihailenco/msgpack/v5"
)

// randomCommand is a command with a random selection of fields set, some
// to empty values (which omitempty leaves out), and for a batch, random
// sub-commands (some nil).
func randomCommand(rng *rand.Rand, depth int) *command {
	bs := func() []byte {
		if rng.IntN(4) == 0 {
			return nil
		}
		b := make([]byte, rng.IntN(40))
		for i := range b {
			b[i] = byte(rng.UintN(256))
		}
		return b
	}
	str := func() string { return string(bs()) }
	num := func() uint64 {
		switch rng.IntN(4) {
		case 0:
			return 0
		case 1:
			return uint64(rng.IntN(200))
		default:
			return rng.Uint64()
		}
	}
	slices := func() [][]byte {
		if rng.IntN(2) == 0 {
			return nil
		}
		out := make([][]byte, rng.IntN(4))
		for i := range out {
			out[i] = bs()
		}
		return out
	}
	c := &command{Op: byte(rng.IntN(9)), Owner: str(), Token: bs(), Seq: num(), Reply: bs(), IDs: slices(),
		Before: int64(num()), Node: str(), Addr: str(), Key: claimKey{Scope: str(), ID: bs(), Client: str()}}
	if rng.IntN(2) == 0 {
		c.Req = &wireRequest{Scope: str(), ID: bs(), Client: str(), Seq: num(), Fingerprint: bs(), Acked: slices(),
			TTL: int64(num()), KeepReplies: int(int32(num())), KeepFor: -int64(num() >> 1)}
	}
	for range rng.IntN(3) {
		c.Adv = append(c.Adv, idem.Advance{Scope: str(), Client: str(), Seq: num()})
	}
	if depth == 0 && rng.IntN(3) == 0 {
		for range rng.IntN(5) {
			if rng.IntN(5) == 0 {
				c.Cmds = append(c.Cmds, nil)
				continue
			}
			c.Cmds = append(c.Cmds, randomCommand(rng, depth+1))
		}
	}
	return c
}

// TestEntryCodecMatchesReflection: the codec (msgpack's low-level API,
// field by field) writes the bytes msgpack's reflection writes for a
// command (the log's format since the first release), and reads them back
// as reflection does, so that nodes of either kind read each other's
// entries.
func TestEntryCodecMatchesReflection(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	for i := range 3000 {
		c := randomCommand(rng, 0)
		want, err := msgpack.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		got, err := encodeCommand(c)
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("command %d %+v:\nencodeCommand %x\nreflection    %x", i, c, got, want)
		}
		var viaReflection command
		if err := msgpack.Unmarshal(want, &viaReflection); err != nil {
			t.Fatal(err)
		}
		decoded, err := decodeCommand(want)
		if err != nil {
			t.Fatalf("command %d: decodeCommand: %v", i, err)
		}
		if !reflect.DeepEqual(normalized(decoded), normalized(&viaReflection)) {
			t.Fatalf("command %d:\ndecodeCommand %+v\nreflection    %+v", i, decoded, &viaReflection)
		}
	}
}

// normalized makes empty byte slices nil (the two decoders differ only
// there: an empty binary is nil to one, empty to the other; the FSM tells
// them apart nowhere).
func normalized(c *command) *command {
	if c == nil {
		return nil
	}
	n := *c
	nb := func(b []byte) []byte {
		if len(b) == 0 {
			return nil
		}
		return b
	}
	nbs := func(bs [][]byte) [][]byte {
		if bs == nil {
			return nil
		}
		out := make([][]byte, len(bs))
		for i, b := range bs {
			out[i] = nb(b)
		}
		return out
	}
	n.Token, n.Reply, n.Key.ID, n.IDs = nb(n.Token), nb(n.Reply), nb(n.Key.ID), nbs(n.IDs)
	if n.Req != nil {
		r := *n.Req
		r.ID, r.Fingerprint, r.Acked = nb(r.ID), nb(r.Fingerprint), nbs(r.Acked)
		n.Req = &r
	}
	n.Cmds = nil
	for _, sub := range c.Cmds {
		n.Cmds = append(n.Cmds, normalized(sub))
	}
	return &n
}

// TestEntryCodecRefusesCorruptEntries: a cut entry, a wrong type and an
// array longer than the entry are errors, never a panic or an allocation
// the entry's length does not justify; unknown fields are skipped, as
// reflection skips them.
func TestEntryCodecRefusesCorruptEntries(t *testing.T) {
	c := &command{Op: cmdBatch, Cmds: []*command{
		{Op: cmdBegin, Req: &wireRequest{Scope: "s", ID: []byte("id"), Acked: [][]byte{[]byte("a")}}, Owner: "o", Token: []byte("t")},
		{Op: cmdCommit, Key: claimKey{Scope: "s", ID: []byte("id")}, Token: []byte("t"), Reply: []byte("r"), Adv: []idem.Advance{{Scope: "s", Client: "c", Seq: 3}}},
	}}
	data, err := encodeCommand(c)
	if err != nil {
		t.Fatal(err)
	}
	for n := range len(data) {
		if _, err := decodeCommand(data[:n]); err == nil {
			t.Errorf("decodeCommand of the first %d of %d bytes: no error", n, len(data))
		}
	}
	huge := func(field string) []byte {
		var buf bytes.Buffer
		enc := msgpack.NewEncoder(&buf)
		_ = enc.EncodeMapLen(1)
		_ = enc.EncodeString(field)
		_ = enc.EncodeArrayLen(1 << 30)
		return buf.Bytes()
	}
	for _, tc := range []struct {
		name string
		data []byte
	}{
		{"cmds of 2^30", huge("cmds")},
		{"ids of 2^30", huge("ids")},
		{"adv of 2^30", huge("adv")},
		{"an array, not a map", []byte{0x91, 0x01}},
		{"op a string", func() []byte { b, _ := msgpack.Marshal(map[string]any{"op": "x"}); return b }()},
	} {
		if got, err := decodeCommand(tc.data); err == nil {
			t.Errorf("%s: decoded %+v, want an error", tc.name, got)
		}
	}
	extra, err := msgpack.Marshal(map[string]any{"op": cmdAbort, "later": map[string]any{"x": []int{1, 2}}, "tok": []byte("t")})
	if err != nil {
		t.Fatal(err)
	}
	got, err := decodeCommand(extra)
	if err != nil || got.Op != cmdAbort || string(got.Token) != "t" {
		t.Errorf("an entry with an unknown field: %+v %v, want op %d token t", got, err, cmdAbort)
	}
}

// decodeAllocLimit bounds what decoding data may allocate: a multiple of
// data (a command struct per element of a batch) plus 64 KiB, whatever
// lengths data claims.
func decodeAllocLimit(data []byte) uint64 { return uint64(400*len(data)) + 64<<10 }

// TestEntryCodecBoundsAllocation: a command whose strings, binaries or
// arrays claim gigabytes in a few bytes is refused without allocating
// them (the library's DecodeBytes and DecodeString size their buffer by
// the claimed length).
func TestEntryCodecBoundsAllocation(t *testing.T) {
	huge := []byte{0xc6, 0xf0, 0, 0, 0}      // bin32 of 3.75 GiB
	hugeStr := []byte{0xdb, 0xf0, 0, 0, 0}   // str32 of 3.75 GiB
	hugeArray := []byte{0xdd, 0xf0, 0, 0, 0} // array32 of 4 billion elements
	field := func(name string, value []byte) []byte {
		b := append([]byte{0x81, 0xa0 | byte(len(name))}, name...)
		return append(b, value...)
	}
	for _, data := range [][]byte{
		field("tok", huge), field("owner", hugeStr), field("reply", huge), field("cmds", hugeArray),
		field("req", field("i", huge)), field("key", field("s", hugeStr)), field("ids", append([]byte{0x91}, huge...)),
		field("unknown", huge), field("unknown", []byte{0xc9, 0xf0, 0, 0, 0, 1}), // an unknown field's binary, extension
		field("unknown", append([]byte{0x92, 0x81, 0xa1, 'x'}, huge...)), // ... and a binary inside its array of maps
	} {
		alloctest.Check(t, fmt.Sprintf("decodeCommand(%x)", data), decodeAllocLimit(data), func() {
			if c, err := decodeCommand(data); err == nil {
				t.Errorf("decodeCommand(%x) = %+v, want an error", data, c)
			}
		})
	}
}

// FuzzDecodeCommand: any bytes decode to a command or an error, never a
// panic or an allocation the input's length does not justify; what
// decodes encodes again to bytes that decode to the same command.
func FuzzDecodeCommand(f *testing.F) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 16 {
		data, err := encodeCommand(randomCommand(rng, 0))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		alloctest.Check(t, "decodeCommand", decodeAllocLimit(data), func() { decodeCommand(data) })
		c, err := decodeCommand(data)
		if err != nil {
			return
		}
		again, err := encodeCommand(c)
		if err != nil {
			t.Fatalf("a decoded command does not encode: %v", err)
		}
		c2, err := decodeCommand(again)
		if err != nil {
			t.Fatalf("a re-encoded command does not decode: %v", err)
		}
		if !reflect.DeepEqual(normalized(c), normalized(c2)) {
			t.Fatalf("decode, encode, decode changed the command:\n%+v\n%+v", c, c2)
		}
	})
}

// benchBatch is a batch of 32 Begins as a Client sends them.
func benchBatch() *command {
	c := &command{Op: cmdBatch}
	for i := range 32 {
		c.Cmds = append(c.Cmds, &command{Op: cmdBegin, Owner: "bench", Token: bytes.Repeat([]byte{byte(i)}, 16),
			Req: &wireRequest{Scope: "orders", ID: fmt.Appendf(nil, "request-%08d", i), Fingerprint: bytes.Repeat([]byte{7}, 32),
				TTL: int64(24 * time.Hour), KeepReplies: 16, KeepFor: int64(time.Hour)}})
	}
	return c
}

// BenchmarkEntryCodec measures the CPU of encoding and of decoding a batch
// of 32 Begins (cpu-µs/batch; the process's CPU, so run it alone).
//
//	go test -run '^$' -bench 'EntryCodec' ./idemcluster/
func BenchmarkEntryCodec(b *testing.B) {
	c := benchBatch()
	data, err := encodeCommand(c)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("encode", func(b *testing.B) {
		b.ReportAllocs()
		cpu := cputime.Process()
		for b.Loop() {
			if _, err := encodeCommand(c); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(cputime.Process()-cpu)/float64(time.Microsecond)/float64(b.N), "cpu-µs/batch")
	})
	b.Run("decode", func(b *testing.B) {
		b.ReportAllocs()
		cpu := cputime.Process()
		for b.Loop() {
			if _, err := decodeCommand(data); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(cputime.Process()-cpu)/float64(time.Microsecond)/float64(b.N), "cpu-µs/batch")
	})
}
