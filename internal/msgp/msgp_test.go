package msgp

import (
	"bytes"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// Every helper writes exactly what msgpack/v5's Encoder writes, at every
// boundary of every form and for random values.
func TestSameBytesAsTheLibrary(t *testing.T) {
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	check := func(what string, got []byte, encode func() error) {
		t.Helper()
		buf.Reset()
		if err := encode(); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, buf.Bytes()) {
			t.Fatalf("%s: got %x, the library writes %x", what, got, buf.Bytes())
		}
	}
	var uints []uint64
	for _, edge := range []uint64{0, 1, math.MaxInt8, math.MaxUint8, math.MaxUint16, math.MaxUint32, math.MaxInt64, math.MaxUint64} {
		uints = append(uints, edge-1, edge, edge+1)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 2000; i++ {
		uints = append(uints, rng.Uint64()>>rng.IntN(64))
	}
	for _, u := range uints {
		check("uint", AppendUint(nil, u), func() error { return enc.EncodeUint(u) })
		n := int64(u)
		check("int", AppendInt(nil, n), func() error { return enc.EncodeInt(n) })
		check("-int", AppendInt(nil, -n), func() error { return enc.EncodeInt(-n) })
	}
	for _, n := range []int64{-32, -33, math.MinInt8, math.MinInt8 - 1, math.MinInt16, math.MinInt16 - 1, math.MinInt32, math.MinInt32 - 1, math.MinInt64} {
		check("int edge", AppendInt(nil, n), func() error { return enc.EncodeInt(n) })
	}
	for _, l := range []int{0, 1, 15, 16, 31, 32, 255, 256, math.MaxUint16, math.MaxUint16 + 1} {
		check("array", AppendArrayLen(nil, l), func() error { return enc.EncodeArrayLen(l) })
		v := bytes.Repeat([]byte{'x'}, l)
		check("bytes", AppendBytes(nil, v), func() error { return enc.EncodeBytes(v) })
		s := strings.Repeat("y", l)
		check("string", AppendString(nil, s), func() error { return enc.EncodeString(s) })
	}
	check("nil bytes", AppendBytes(nil, nil), func() error { return enc.EncodeBytes(nil) })
	check("appends", AppendUint([]byte("prefix"), 300)[6:], func() error { return enc.EncodeUint(300) })
}
