package fuzz

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/internal/alloctest"
	"github.com/idemdb/idem/internal/testclock"
	"github.com/idemdb/idem/snapshot"
	"github.com/idemdb/idem/wal"
)

// The decoder targets: every function that turns bytes read from disk into
// values. Each must return an error or a value, never panic, and never
// allocate more than a fixed bound (the format's largest legitimate
// object) plus a small multiple of its input.

// allocCheck fails t if f allocates more than fixed plus 32 bytes per
// byte of input plus 1 MiB of slack. f may run several times
// (alloctest.Check: a breach is confirmed by running f again, so that the
// fuzzing engine's and other goroutines' allocations cannot fail it): it
// must start from the same state each time.
func allocCheck(t *testing.T, what string, input int, fixed uint64, f func()) {
	t.Helper()
	alloctest.Check(t, what, allocLimit(input, fixed), f)
}

func allocLimit(input int, fixed uint64) uint64 { return fixed + uint64(32*input) + 1<<20 }

// sample is real on-disk data written by the engine: the seeds of the
// decoder targets.
type sample struct {
	firstSeg, lastSeg []byte // WAL segments (trimmed after their valid data)
	firstSegFirstLSN  uint64
	lastSegFirstLSN   uint64
	frames            [][]byte // every frame of both segments
	snapshot          []byte   // Engine.Snapshot stream
	keys, values      [][]byte // index entries from the snapshot
}

var (
	sampleOnce sync.Once
	sampleData sample
	sampleErr  error
)

const sampleSegSize = 1 << 10

func getSample(tb testing.TB) sample {
	sampleOnce.Do(func() { sampleData, sampleErr = makeSample() })
	if sampleErr != nil {
		tb.Fatal(sampleErr)
	}
	return sampleData
}

func makeSample() (sample, error) {
	var s sample
	ctx := context.Background()
	fs := vfs.NewMem()
	clk := testclock.New()
	e, err := idem.Open("db", &idem.Options{FS: fs, Clock: clk.Now, SegmentSize: sampleSegSize, KeepSnapshots: -1})
	if err != nil {
		return s, err
	}
	defer e.Close()
	for i := 0; i < 12; i++ {
		clk.Advance(time.Second)
		reply := []byte(fmt.Sprint("reply-", i))
		if i%4 == 3 {
			reply = bytes.Repeat(reply, 200) // compressed in the WAL
		}
		req := idem.Request{Scope: "s", ID: []byte(fmt.Sprint("id-", i)), Fingerprint: []byte{byte(i)}}
		if i%3 == 2 {
			req = idem.Request{Scope: "s", Client: "c", Seq: uint64(i/3 + 1)}
		}
		if i == 5 {
			req.Acked = [][]byte{[]byte("id-0"), []byte("id-1")}
		}
		res, err := e.Begin(ctx, req)
		if err != nil {
			return s, err
		}
		if i%5 == 4 {
			continue // left in flight
		}
		if i%7 == 6 {
			err = res.Claim.Abort(ctx)
		} else {
			err = res.Claim.Commit(ctx, reply)
		}
		if err != nil {
			return s, err
		}
	}
	// A commit that advances two clients (a commit-advance record).
	res, err := e.Begin(ctx, idem.Request{Scope: "s", ID: []byte("id-adv")})
	if err != nil {
		return s, err
	}
	if err := res.Claim.CommitAdvance(ctx, []byte("reply-adv"), idem.Advance{Scope: "f", Client: "p0", Seq: 41}, idem.Advance{Scope: "f", Client: "p1", Seq: 7}); err != nil {
		return s, err
	}
	if err := e.Advance(ctx, idem.Advance{Scope: "f", Client: "p1", Seq: 9}); err != nil {
		return s, err
	}
	if err := e.Ack(ctx, "s", []byte("id-3")); err != nil {
		return s, err
	}
	// A batch record: a claim, claims and commits at once (one with a
	// compressed reply, one with advances), the commit of a claim made
	// before, an ack and an advance.
	held, err := e.Begin(ctx, idem.Request{Scope: "s", ID: []byte("id-held")})
	if err != nil {
		return s, err
	}
	b := e.NewBatch()
	b.Begin(idem.Request{Scope: "s", ID: []byte("id-b0"), Fingerprint: []byte("fp")})
	b.Put(idem.Request{Scope: "s", ID: []byte("id-b1"), TTL: time.Hour}, bytes.Repeat([]byte("batched "), 200))
	b.Put(idem.Request{Scope: "s", Client: "c", Seq: 5, KeepReplies: 3}, []byte("reply-c5"), idem.Advance{Scope: "f", Client: "p2", Seq: 3})
	b.Commit(held.Claim, []byte("reply-held"))
	b.Ack("s", []byte("id-b1"))
	b.Advance(idem.Advance{Scope: "f", Client: "p0", Seq: 50})
	out, err := b.Run(ctx)
	if err != nil {
		return s, err
	}
	for i, r := range out {
		if r.Err != nil {
			return s, fmt.Errorf("sample batch item %d: %w", i, r.Err)
		}
	}
	if err := e.Forget(ctx, clk.Now().Add(-8*time.Second)); err != nil {
		return s, err
	}
	for deadline := time.Now().Add(30 * time.Second); e.Stats().AppliedLSN < e.Stats().LastLSN; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			return s, fmt.Errorf("the index applied LSN %d of %d in 30 s", e.Stats().AppliedLSN, e.Stats().LastLSN)
		}
	}
	var buf bytes.Buffer
	if _, err := e.Snapshot(ctx, &buf); err != nil {
		return s, err
	}
	s.snapshot = buf.Bytes()
	r, err := snapshot.NewReader(bytes.NewReader(s.snapshot))
	if err != nil {
		return s, err
	}
	for {
		k, v, err := r.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return s, err
		}
		s.keys = append(s.keys, bytes.Clone(k))
		s.values = append(s.values, bytes.Clone(v))
	}
	if err := e.Close(); err != nil {
		return s, err
	}
	names, err := fs.List("db/wal")
	if err != nil {
		return s, err
	}
	var segs []string
	for _, n := range names {
		if strings.HasSuffix(n, ".wal") {
			segs = append(segs, n)
		}
	}
	sort.Strings(segs)
	if len(segs) < 2 {
		return s, fmt.Errorf("sample WAL has %d segments, want 2 or more", len(segs))
	}
	read := func(name string) ([]byte, error) {
		f, err := fs.Open("db/wal/" + name)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		return io.ReadAll(f)
	}
	first, err := read(segs[len(segs)-2])
	if err != nil {
		return s, err
	}
	last, err := read(segs[len(segs)-1])
	if err != nil {
		return s, err
	}
	fmt.Sscanf(segs[len(segs)-2], "%d.wal", &s.firstSegFirstLSN)
	fmt.Sscanf(segs[len(segs)-1], "%d.wal", &s.lastSegFirstLSN)
	trim := func(seg []byte) []byte {
		off := 32
		for off < len(seg) {
			_, _, _, n, err := wal.DecodeFrame(seg[off:], 0)
			if err != nil {
				break
			}
			s.frames = append(s.frames, bytes.Clone(seg[off:off+n]))
			off += n
		}
		return bytes.Clone(seg[:off])
	}
	s.firstSeg, s.lastSeg = trim(first), trim(last)
	batches := 0
	for _, fr := range s.frames {
		if fr[16] == wal.OpBatch {
			batches++
		}
	}
	if batches == 0 {
		return s, fmt.Errorf("the sample's last two segments hold no batch record")
	}
	return s, nil
}

// equalOps compares decoded operations, nil and empty byte strings alike.
func equalOps(a, b *wal.Op) bool {
	var norm func(o *wal.Op) wal.Op
	norm = func(o *wal.Op) wal.Op {
		c := *o
		c.ID, c.Fingerprint, c.Reply = bytes.Clone(c.ID), bytes.Clone(c.Fingerprint), bytes.Clone(c.Reply)
		if len(c.ID) == 0 {
			c.ID = nil
		}
		if len(c.Fingerprint) == 0 {
			c.Fingerprint = nil
		}
		if len(c.Reply) == 0 {
			c.Reply = nil
		}
		c.Acked = nil
		for _, a := range o.Acked {
			c.Acked = append(c.Acked, append([]byte{}, a...))
		}
		c.Ops = nil
		for i := range o.Ops {
			c.Ops = append(c.Ops, norm(&o.Ops[i]))
		}
		return c
	}
	return reflect.DeepEqual(norm(a), norm(b))
}

// FuzzWALDecode: wal.DecodeFrame and wal.DecodeOp on arbitrary bytes. A
// frame that decodes has a sane size; an operation that decodes encodes
// and decodes back to itself.
func FuzzWALDecode(f *testing.F) {
	s := getSample(f)
	for _, fr := range s.frames {
		f.Add(fr)
		f.Add(append([]byte{fr[16]}, fr[17:]...)) // type byte + payload
	}
	f.Add([]byte{})
	f.Add(make([]byte, 24))
	f.Fuzz(func(t *testing.T, data []byte) {
		allocCheck(t, "DecodeFrame+DecodeOp", len(data), 64<<20, func() {
			for _, max := range []int{0, 64} {
				lsn, typ, payload, n, err := wal.DecodeFrame(data, max)
				if err != nil {
					if !errors.Is(err, wal.ErrCorrupt) {
						t.Fatalf("DecodeFrame error %v is not wal.ErrCorrupt", err)
					}
					continue
				}
				if n < 24 || n%8 != 0 || n > len(data) || lsn == 0 || typ == 0 || len(payload) > n-17 {
					t.Fatalf("DecodeFrame: lsn %d type %d payload %d bytes, size %d of %d", lsn, typ, len(payload), n, len(data))
				}
				if max > 0 && len(payload) > max {
					t.Fatalf("DecodeFrame accepted a %d-byte payload over the %d limit", len(payload), max)
				}
				decodeOp(t, typ, payload)
			}
			if len(data) > 0 {
				decodeOp(t, data[0]%10, data[1:]) // kinds 0..9 (9: batch)
			}
		})
	})
}

func decodeOp(t *testing.T, typ byte, payload []byte) {
	if decoderAllocBug && lyingMsgpackLength(payload) {
		return // TestBugDecodersAllocateUnbounded
	}
	op, err := wal.DecodeOp(typ, payload)
	if err != nil {
		if !errors.Is(err, wal.ErrBadRecord) {
			t.Fatalf("DecodeOp error %v is not wal.ErrBadRecord", err)
		}
		return
	}
	if op.Type != typ {
		t.Fatalf("DecodeOp: type %d, asked %d", op.Type, typ)
	}
	enc, err := wal.EncodeOp(nil, op)
	if err != nil {
		t.Fatalf("EncodeOp of a decoded op %+v: %v", op, err)
	}
	op2, err := wal.DecodeOp(typ, enc)
	if err != nil {
		t.Fatalf("DecodeOp of a re-encoded op %+v: %v", op, err)
	}
	if !equalOps(op, op2) {
		t.Fatalf("op does not survive a round trip:\n%+v\n%+v", op, op2)
	}
}

// FuzzWALScan: wal.Scan of a directory whose last segment is the fuzzer's
// bytes (after a valid first segment when the first byte is odd). Scan
// must only read, report a torn tail or a *CorruptError or succeed, and
// deliver dense LSNs; then wal.Open repairs the directory, after which a
// scan finds the same records and no torn tail.
func FuzzWALScan(f *testing.F) {
	s := getSample(f)
	f.Add(append([]byte{1}, s.lastSeg...))
	f.Add(append([]byte{0}, s.firstSeg...))
	f.Add(append(append([]byte{0}, s.firstSeg...), 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3))
	f.Add(append([]byte{1}, s.lastSeg[:len(s.lastSeg)-5]...))
	flipped := append([]byte{0}, s.firstSeg...)
	flipped[len(flipped)/2] ^= 0x20
	f.Add(flipped)
	f.Add([]byte{0})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 || len(data) > 1<<16 {
			return
		}
		fs := vfs.NewMem()
		if err := fs.MkdirAll("wal", 0o755); err != nil {
			t.Fatal(err)
		}
		write := func(name string, b []byte) {
			f, err := fs.Create("wal/"+name, vfs.WriteCategoryUnspecified)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.Write(b); err != nil {
				t.Fatal(err)
			}
			f.Close()
		}
		lastName := fmt.Sprintf("%020d.wal", s.firstSegFirstLSN)
		if data[0]&1 == 1 {
			write(lastName, s.firstSeg)
			lastName = fmt.Sprintf("%020d.wal", s.lastSegFirstLSN)
		}
		write(lastName, data[1:])
		before := dirBytes(t, fs)
		var lsns []wal.LSN
		var payloads [][]byte
		var res wal.ScanResult
		var err error
		allocCheck(t, "Scan", len(data), 2<<20, func() {
			lsns, payloads = nil, nil
			res, err = wal.Scan(fs, "wal", 0, 1<<20, func(r wal.Record) error {
				lsns = append(lsns, r.LSN)
				payloads = append(payloads, bytes.Clone(r.Payload))
				if _, err := wal.DecodeOp(r.Type, r.Payload); err != nil && !errors.Is(err, wal.ErrBadRecord) {
					t.Fatalf("DecodeOp error %v is not wal.ErrBadRecord", err)
				}
				return nil
			})
		})
		if after := dirBytes(t, fs); !reflect.DeepEqual(before, after) {
			t.Fatalf("Scan modified the directory")
		}
		for i := 1; i < len(lsns); i++ {
			if lsns[i] != lsns[i-1]+1 {
				t.Fatalf("Scan delivered LSN %d after %d", lsns[i], lsns[i-1])
			}
		}
		if err != nil {
			if !errors.Is(err, wal.ErrCorrupt) {
				t.Fatalf("Scan error %v is not wal.ErrCorrupt", err)
			}
			return
		}
		if len(lsns) > 0 && res.LastLSN != lsns[len(lsns)-1] {
			t.Fatalf("ScanResult.LastLSN %d, last record %d", res.LastLSN, lsns[len(lsns)-1])
		}
		// Open cuts what Scan called torn; the repaired log holds the same
		// records and ends cleanly.
		w, _, err := wal.Open(wal.Options{FS: fs, Dir: "wal", SegmentSize: sampleSegSize, MaxRecordSize: 1 << 20}, 0, func(wal.Record) error { return nil })
		if err != nil {
			t.Fatalf("Open after a clean Scan: %v", err)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		var again [][]byte
		res2, err := wal.Scan(fs, "wal", 0, 1<<20, func(r wal.Record) error {
			again = append(again, bytes.Clone(r.Payload))
			return nil
		})
		if err != nil || res2.TornTail != nil {
			t.Fatalf("scan after Open's repair: torn tail %+v, error %v", res2.TornTail, err)
		}
		if !slices.EqualFunc(payloads, again, bytes.Equal) {
			t.Fatalf("repair changed the records: %d before, %d after", len(payloads), len(again))
		}
	})
}

func dirBytes(t *testing.T, fs vfs.FS) map[string][]byte {
	names, err := fs.List("wal")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]byte{}
	for _, n := range names {
		f, err := fs.Open("wal/" + n)
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		out[n] = b
	}
	return out
}

// FuzzIndexEntry: index.DecodeEntry and index.ParseEntryKey on arbitrary
// bytes. A decoded entry re-encodes to a fixed point; a parsed key
// re-encodes to the same bytes.
func FuzzIndexEntry(f *testing.F) {
	s := getSample(f)
	for i := range s.values {
		f.Add(s.values[i])
		f.Add(s.keys[i])
	}
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		allocCheck(t, "DecodeEntry", len(data), 2<<20, func() {
			var en *index.Entry
			var err error
			if decoderAllocBug && lyingMsgpackLength(data) {
				err = index.ErrBadEntry // TestBugDecodersAllocateUnbounded: not decoded
			} else {
				en, err = index.DecodeEntry(data)
			}
			if err != nil {
				if !errors.Is(err, index.ErrBadEntry) {
					t.Fatalf("DecodeEntry error %v is not index.ErrBadEntry", err)
				}
			} else {
				enc := index.EncodeEntry(nil, en)
				en2, err := index.DecodeEntry(enc)
				if err != nil {
					t.Fatalf("DecodeEntry of a re-encoded entry %+v: %v", en, err)
				}
				if !reflect.DeepEqual(en, en2) {
					t.Fatalf("entry does not survive a round trip:\n%+v\n%+v", en, en2)
				}
				if enc2 := index.EncodeEntry(nil, en2); !bytes.Equal(enc, enc2) {
					t.Fatalf("entry encoding is not a fixed point")
				}
			}
			scope, mode, ident, err := index.ParseEntryKey(data)
			if err != nil {
				if !errors.Is(err, index.ErrBadKey) {
					t.Fatalf("ParseEntryKey error %v is not index.ErrBadKey", err)
				}
				return
			}
			k := index.EntryKey(nil, scope, mode, ident)
			if entryKeyCanonicalBug { // TestBugEntryKeyNotCanonical: the identity must survive, at least
				s2, m2, i2, err := index.ParseEntryKey(k)
				if err != nil || s2 != scope || m2 != mode || !bytes.Equal(i2, ident) {
					t.Fatalf("key %x parses to (%q, %c, %q), whose key %x parses to (%q, %c, %q), %v", data, scope, mode, ident, k, s2, m2, i2, err)
				}
			} else if !bytes.Equal(k, data) {
				t.Fatalf("key %x parses to (%q, %c, %q), which encodes to %x", data, scope, mode, ident, k)
			}
		})
	})
}

// FuzzSnapshotDecode: snapshot.NewReader / Next and snapshot.Verify on
// arbitrary bytes, and idem.Restore of whatever reads through: a stream the
// reader accepts restores into an engine or is refused with ErrCorrupt; a
// stream it refuses is refused by Restore too, with ErrCorrupt.
func FuzzSnapshotDecode(f *testing.F) {
	s := getSample(f)
	f.Add(s.snapshot)
	f.Add(s.snapshot[:len(s.snapshot)-3])
	f.Add(s.snapshot[:len(s.snapshot)/2])
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		var n uint64
		readOK, lying := false, false
		allocCheck(t, "snapshot reader", len(data), 64<<20, func() {
			n, readOK, lying = 0, false, false
			r, err := snapshot.NewReader(bytes.NewReader(data))
			if err != nil {
				if !errors.Is(err, snapshot.ErrCorrupt) {
					t.Fatalf("NewReader: %v is not snapshot.ErrCorrupt", err)
				}
				return
			}
			var prev []byte
			for {
				k, v, err := r.Next()
				if err == io.EOF {
					if r.Trailer().Count != n {
						t.Fatalf("trailer count %d, read %d", r.Trailer().Count, n)
					}
					readOK = true
					return
				}
				if err != nil {
					if !errors.Is(err, snapshot.ErrCorrupt) {
						t.Fatalf("Next: %v is not snapshot.ErrCorrupt", err)
					}
					return
				}
				if n > 0 && bytes.Compare(k, prev) <= 0 {
					t.Fatalf("key %x after %x", k, prev)
				}
				prev = append(prev[:0], k...)
				n++
				_, _, _, _ = index.ParseEntryKey(k)
				if decoderAllocBug && lyingMsgpackLength(v) {
					lying = true // TestBugDecodersAllocateUnbounded
				} else {
					_, _ = index.DecodeEntry(v)
				}
			}
		})
		fs := vfs.NewMem()
		if err := fs.MkdirAll("snap", 0o755); err != nil {
			t.Fatal(err)
		}
		path := "snap/" + snapshot.FileName(1)
		fw, err := fs.Create(path, vfs.WriteCategoryUnspecified)
		if err != nil {
			t.Fatal(err)
		}
		fw.Write(data)
		fw.Close()
		if _, _, err := snapshot.Verify(fs, path); (err == nil) != readOK || (err != nil && !errors.Is(err, snapshot.ErrCorrupt)) {
			t.Fatalf("Verify says %v, the reader read it through: %v", err, readOK)
		}
		if !readOK {
			if _, err := idem.Restore("r", bytes.NewReader(data), &idem.Options{FS: fs, SegmentSize: 4 << 10}); !errors.Is(err, idem.ErrCorrupt) {
				t.Fatalf("Restore of a stream the reader refuses: %v, want ErrCorrupt", err)
			}
			return
		}
		if lying {
			return
		}
		e, err := idem.Restore("r", bytes.NewReader(data), &idem.Options{FS: fs, SegmentSize: 4 << 10})
		if err != nil {
			if !errors.Is(err, idem.ErrCorrupt) {
				t.Fatalf("Restore of a well-formed stream: %v is not ErrCorrupt", err)
			}
			return
		}
		defer e.Close()
		if st := e.Stats(); st.LiveEntries != int64(n) {
			t.Fatalf("restored %d entries, the stream holds %d", st.LiveEntries, n)
		}
	})
}

var (
	baselineOnce sync.Once
	baseline     uint64
)

// restoreBaseline is what restoring an empty snapshot allocates (Pebble's
// memtables and caches, the WAL's preallocated segment, all in the Go heap
// on a MemFS): the fixed part of FuzzRestore's allocation bound.
func restoreBaseline(t *testing.T) uint64 {
	baselineOnce.Do(func() {
		var buf bytes.Buffer
		w, err := snapshot.NewWriter(&buf, snapshot.Header{LSN: 1})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Close(); err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 3; i++ {
			var e *idem.Engine
			var err error
			n := alloctest.Measure(func() {
				e, err = idem.Restore("r", bytes.NewReader(buf.Bytes()), &idem.Options{FS: vfs.NewMem(), SegmentSize: 4 << 10})
			})
			if err != nil {
				t.Fatal(err)
			}
			e.Close()
			baseline = max(baseline, n)
		}
	})
	return baseline
}

// entriesFrom splits data into (key, value) pairs: a length byte and the
// bytes, twice per pair. Keys are sorted and deduplicated, as a snapshot
// stores them.
func entriesFrom(data []byte) (keys, values [][]byte) {
	m := map[string][]byte{}
	for len(data) > 0 {
		var kv [2][]byte
		for i := range kv {
			if len(data) == 0 {
				break
			}
			n := min(int(data[0]), len(data)-1)
			kv[i], data = data[1:1+n], data[1+n:]
		}
		m[string(kv[0])] = kv[1]
	}
	for _, k := range slices.Sorted(maps.Keys(m)) {
		keys, values = append(keys, []byte(k)), append(values, m[k])
	}
	return keys, values
}

func encodeEntries(keys, values [][]byte) []byte {
	var b []byte
	for i := range keys {
		b = append(b, byte(len(keys[i])))
		b = append(b, keys[i]...)
		b = append(b, byte(len(values[i])))
		b = append(b, values[i]...)
	}
	return b
}

// FuzzRestore: idem.Restore of well-formed snapshot streams (valid
// checksums) whose entries are the fuzzer's: keys and values that may not
// parse, entries that break the state machine's invariants. Restore must
// refuse what does not parse with ErrCorrupt; whatever it accepts, the
// engine must answer Lookup (ids and sequences), ClientState, InDoubt, Begin and
// Compact about every key without panicking, with an answer or an error.
func FuzzRestore(f *testing.F) {
	s := getSample(f)
	var small [][2][]byte
	for i := range s.keys {
		if len(s.keys[i]) < 256 && len(s.values[i]) < 256 {
			small = append(small, [2][]byte{s.keys[i], s.values[i]})
		}
	}
	var ks, vs [][]byte
	for _, kv := range small {
		ks, vs = append(ks, kv[0]), append(vs, kv[1])
	}
	f.Add(uint8(0), encodeEntries(ks, vs))
	for i := range ks {
		f.Add(uint8(i), encodeEntries(ks[i:i+1], vs[i:i+1]))
	}
	f.Add(uint8(3), []byte{})
	f.Fuzz(func(t *testing.T, lsn uint8, data []byte) {
		keys, values := entriesFrom(data)
		if len(keys) > 64 {
			return
		}
		for _, v := range values {
			if decoderAllocBug && lyingMsgpackLength(v) {
				return // TestBugDecodersAllocateUnbounded
			}
		}
		var buf bytes.Buffer
		w, err := snapshot.NewWriter(&buf, snapshot.Header{LSN: uint64(lsn), ForgetBefore: int64(lsn) << 50, ForgetLSN: uint64(lsn) / 2})
		if err != nil {
			t.Fatal(err)
		}
		for i := range keys {
			if err := w.Add(keys[i], values[i]); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := w.Close(); err != nil {
			t.Fatal(err)
		}
		clk := testclock.New()
		var e *idem.Engine
		alloctest.CheckUndo(t, "Restore", allocLimit(buf.Len(), 2*restoreBaseline(t)), func() (undo func()) {
			e, err = idem.Restore("r", bytes.NewReader(buf.Bytes()), &idem.Options{FS: vfs.NewMem(), Clock: clk.Now, Retention: time.Hour, SegmentSize: 4 << 10})
			if err != nil {
				return nil
			}
			return func() { e.Close() }
		})
		if err != nil {
			if !errors.Is(err, idem.ErrCorrupt) {
				t.Fatalf("Restore: %v is not ErrCorrupt", err)
			}
			return
		}
		defer e.Close()
		ctx := context.Background()
		for _, k := range keys {
			scope, mode, ident, err := index.ParseEntryKey(k)
			if err != nil || len(ident) == 0 || len(ident) > 1024 || len(scope) > 1024 {
				continue
			}
			if mode == 'i' {
				_, _ = e.Lookup(context.Background(), idem.Request{Scope: scope, ID: ident})
				if res, err := e.Begin(ctx, idem.Request{Scope: scope, ID: ident}); err == nil && res.Status == idem.Fresh {
					_ = res.Claim.Commit(ctx, []byte("r"))
				}
			} else {
				n, _ := e.ClientState(context.Background(), scope, string(ident))
				_, _ = e.Lookup(context.Background(), idem.Request{Scope: scope, Client: string(ident), Seq: n + 1})
				if res, err := e.Begin(ctx, idem.Request{Scope: scope, Client: string(ident), Seq: n + 1}); err == nil && res.Status == idem.Fresh {
					_ = res.Claim.Abort(ctx)
				}
			}
		}
		if ds, err := e.InDoubt(context.Background(), ""); err == nil {
			for _, d := range ds {
				_ = d.Claim.Abort(ctx)
			}
		}
		clk.Advance(2 * time.Hour)
		_, _ = e.Compact(ctx)
		_ = e.Stats()
	})
}
