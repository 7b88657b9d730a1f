package index

import (
	"bytes"
	"errors"
	"fmt"
	"hash/maphash"
	"slices"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/alloctest"
	"github.com/idemdb/idem/wal"
)

// The reply window of sequence mode (per-client sequences): a client's
// entry keeps the latest reply, and the replies of older numbers inside
// the window the claims ask for live under their own sequence keys.

func TestSeqKeyLayout(t *testing.T) {
	client := []byte("client-1")
	var prev []byte
	for _, seq := range []uint64{1, 2, 255, 256, 1 << 40} {
		k := SeqKey(nil, "scope", client, seq)
		scope, mode, ident, err := ParseEntryKey(k)
		if err != nil || scope != "scope" || mode != ModeSeq {
			t.Fatalf("ParseEntryKey(SeqKey(%d)) = %q %q %v", seq, scope, mode, err)
		}
		c, s, ok := ParseSeqIdent(ident)
		if !ok || !bytes.Equal(c, client) || s != seq {
			t.Fatalf("ParseSeqIdent = %q %d %v, want %q %d", c, s, ok, client, seq)
		}
		if prev != nil && bytes.Compare(prev, k) >= 0 {
			t.Fatalf("sequence keys do not sort by number: %x >= %x", prev, k)
		}
		prev = k
	}
	// A sequence key must name a client and a number >= 1.
	for _, ident := range [][]byte{[]byte("12345678"), append([]byte("c"), make([]byte, 8)...)} {
		k := EntryKey(nil, "scope", ModeSeq, ident)
		if _, _, _, err := ParseEntryKey(k); !errors.Is(err, ErrBadKey) {
			t.Fatalf("ParseEntryKey(%x) = %v, want ErrBadKey", k, err)
		}
	}
	// A client's sequence keys share its entry key's shard.
	seed := maphash.MakeSeed()
	ck := EntryKey(nil, "scope", ModeClient, client)
	if ShardHash(seed, ck) != maphash.Bytes(seed, ck) {
		t.Fatal("ShardHash of a client key differs from its hash")
	}
	for _, seq := range []uint64{1, 7, 1 << 33} {
		if got, want := ShardHash(seed, SeqKey(nil, "scope", client, seq)), maphash.Bytes(seed, ck); got != want {
			t.Fatalf("ShardHash(seq key %d) = %x, want the client key's %x", seq, got, want)
		}
	}
	idk := EntryKey(nil, "scope", ModeID, []byte("an-id"))
	if ShardHash(seed, idk) != maphash.Bytes(seed, idk) {
		t.Fatal("ShardHash of an id key differs from its hash")
	}
	// KeyHashes is ShardHash and the key's own hash: one value but for a
	// sequence key.
	for _, k := range [][]byte{ck, idk, prev} {
		if s, own := KeyHashes(seed, k); s != ShardHash(seed, k) || own != maphash.Bytes(seed, k) {
			t.Fatalf("KeyHashes(%x) = %x %x, want ShardHash %x and the key's hash %x", k, s, own, ShardHash(seed, k), maphash.Bytes(seed, k))
		}
	}
	alloctest.CheckAllocs(t, "ShardHash of an id key", 0, 100, func() { ShardHash(seed, idk) })
	alloctest.CheckAllocs(t, "KeyHashes of a sequence key", 0, 100, func() { KeyHashes(seed, prev) })
	alloctest.CheckAllocs(t, "ShardHash of a sequence key", 0, 100, func() { ShardHash(seed, prev) })
}

func TestEntryWindowFieldsRoundTrip(t *testing.T) {
	for _, e := range []*Entry{
		{Committed: true, Seq: 4, ReplyKept: true, Reply: []byte("r"), InFlight: true, ClaimSeq: 5, ClaimLSN: 9, ClaimKeep: 10000, ClaimKeepFor: 300e9, KeptFrom: 2, LSN: 9},
		{Committed: true, Seq: 4, KeptFrom: 3, LSN: 9},
		{Committed: true, Seq: 4, ReplyKept: true, Reply: []byte{}, ExpiresAt: 77, LSN: 9},
	} {
		d, err := DecodeEntry(EncodeEntry(nil, e))
		if err != nil {
			t.Fatal(err)
		}
		if fmt.Sprint(*d) != fmt.Sprint(*e) {
			t.Fatalf("round trip:\n got %+v\nwant %+v", *d, *e)
		}
	}
	// Entries without a window keep their form (12 fields, 14 with a TTL).
	if b := EncodeEntry(nil, &Entry{Committed: true, Seq: 1}); b[0] != 0x90|entryFields {
		t.Fatalf("entry without TTL or window: header %#x", b[0])
	}
	if b := EncodeEntry(nil, &Entry{Committed: true, ExpiresAt: 5}); b[0] != 0x90|entryFieldsTTL {
		t.Fatalf("entry with a TTL: header %#x", b[0])
	}
}

// seqLog drives a client through records, each encoded and decoded as the
// WAL stores it, applying the transitions to an in-memory set (get) and
// keeping the records to replay into a real index.
type seqLog struct {
	t      *testing.T
	set    map[string]*Entry
	ops    []*wal.Op
	lsn    wal.LSN
	claims map[uint64]wal.LSN
}

func newSeqLog(t *testing.T) *seqLog {
	return &seqLog{t: t, set: map[string]*Entry{}, claims: map[uint64]wal.LSN{}}
}

func (l *seqLog) get(k []byte, mode byte) (*Entry, error) { return l.set[string(k)], nil }

func (l *seqLog) apply(op *wal.Op) []Transition {
	l.t.Helper()
	p, err := wal.EncodeOp(nil, op)
	if err != nil {
		l.t.Fatal(err)
	}
	dec, err := wal.DecodeOp(op.Type, p)
	if err != nil {
		l.t.Fatal(err)
	}
	l.lsn++
	ts, err := Transitions(dec, l.lsn, l.get)
	if err != nil {
		l.t.Fatalf("LSN %d %s: %v", l.lsn, wal.OpName(op.Type), err)
	}
	for _, tr := range ts {
		if tr.Next == nil {
			delete(l.set, string(tr.Key))
		} else {
			l.set[string(tr.Key)] = tr.Next
		}
	}
	l.ops = append(l.ops, dec)
	return ts
}

const seqClient = "c1"

func (l *seqLog) claim(seq, keep uint64, keepFor, now int64) {
	l.apply(&wal.Op{Type: wal.OpClaim, Scope: "s", Client: seqClient, Seq: seq, Time: now, LeaseUntil: now + 1e9, KeepReplies: keep, KeepFor: keepFor})
	l.claims[seq] = l.lsn
}

func (l *seqLog) commit(seq uint64, now int64) {
	l.apply(&wal.Op{Type: wal.OpCommit, Scope: "s", Client: seqClient, Seq: seq, ClaimLSN: l.claims[seq], Time: now, Reply: []byte(fmt.Sprint("reply-", seq))})
}

func (l *seqLog) abort(seq uint64, now int64) {
	l.apply(&wal.Op{Type: wal.OpAbort, Scope: "s", Client: seqClient, Seq: seq, ClaimLSN: l.claims[seq], Time: now})
}

// kept returns the sequence numbers with a kept reply: the sequence keys,
// and the client entry's latest.
func (l *seqLog) kept() []uint64 {
	var out []uint64
	for k, e := range l.set {
		_, mode, ident, err := ParseEntryKey([]byte(k))
		if err != nil {
			l.t.Fatal(err)
		}
		switch mode {
		case ModeSeq:
			_, s, _ := ParseSeqIdent(ident)
			if !e.ReplyKept || e.Seq != s || string(e.Reply) != fmt.Sprint("reply-", s) {
				l.t.Fatalf("sequence key %d holds %+v", s, *e)
			}
			out = append(out, s)
		case ModeClient:
			if e.ReplyKept {
				out = append(out, e.Seq)
			}
		}
	}
	slices.Sort(out)
	return out
}

func (l *seqLog) client() *Entry {
	return l.set[string(EntryKey(nil, "s", ModeClient, []byte(seqClient)))]
}

func seqs(lo, hi uint64) []uint64 {
	var out []uint64
	for s := lo; s <= hi; s++ {
		out = append(out, s)
	}
	return out
}

func TestSeqWindowTransitions(t *testing.T) {
	l := newSeqLog(t)
	// Latest only (no window): today's rule, no sequence keys ever.
	l.claim(1, 0, 0, 10)
	l.commit(1, 11)
	l.claim(2, 0, 0, 12)
	if got := l.kept(); len(got) != 0 {
		t.Fatalf("a claim without a window keeps %v", got)
	}
	l.commit(2, 13)
	if got := l.kept(); !slices.Equal(got, []uint64{2}) {
		t.Fatalf("kept %v, want [2]", got)
	}
	// A window of 3: the claim keeps the latest, each commit moves it.
	for s := uint64(3); s <= 10; s++ {
		l.claim(s, 3, 0, int64(10*s))
		if got := l.kept(); got[len(got)-1] != s-1 {
			t.Fatalf("claim %d with a window dropped the reply of %d: kept %v", s, s-1, got)
		}
		l.commit(s, int64(10*s+1))
	}
	if got := l.kept(); !slices.Equal(got, []uint64{8, 9, 10}) {
		t.Fatalf("window 3 after 10: kept %v, want [8 9 10]", got)
	}
	if c := l.client(); c.KeptFrom != 8 || c.Seq != 10 {
		t.Fatalf("client %+v, want Seq 10 KeptFrom 8", *c)
	}
	// A moved reply keeps its commit time and LSN, and the fingerprint.
	se := l.set[string(SeqKey(nil, "s", []byte(seqClient), 9))]
	if se.CommitTime != 91 || se.Committed != true || se.InFlight {
		t.Fatalf("moved reply %+v", *se)
	}
	// An abort leaves the window as it was.
	l.claim(11, 3, 0, 200)
	l.abort(11, 201)
	if got := l.kept(); !slices.Equal(got, []uint64{8, 9, 10}) {
		t.Fatalf("after an abort: kept %v", got)
	}
	// A larger window keeps more.
	for s := uint64(11); s <= 14; s++ {
		l.claim(s, 5, 0, int64(10*s))
		l.commit(s, int64(10*s+1))
	}
	if got := l.kept(); !slices.Equal(got, seqs(10, 14)) {
		t.Fatalf("window 5 after 14: kept %v", got)
	}
	// Shrinking to the latest only drops every sequence key in one commit.
	l.claim(15, 1, 0, 300)
	l.commit(15, 301)
	if got := l.kept(); !slices.Equal(got, []uint64{15}) {
		t.Fatalf("window 1 after 15: kept %v", got)
	}
	if c := l.client(); c.KeptFrom != 0 {
		t.Fatalf("client KeptFrom %d after its keys went", c.KeptFrom)
	}
	// The age bound: a reply older than keepFor when the next commit
	// comes is not moved; younger ones expire at commit time + keepFor.
	l.claim(16, 10, 100, 1000) // 15 committed at 301: 301+100 < 1000
	l.commit(16, 1001)
	if got := l.kept(); !slices.Equal(got, []uint64{16}) {
		t.Fatalf("aged-out reply moved: kept %v", got)
	}
	l.claim(17, 10, 100, 1010)
	l.commit(17, 1011)
	se = l.set[string(SeqKey(nil, "s", []byte(seqClient), 16))]
	if se == nil || se.ExpiresAt != 1001+100 || !se.HasExpiryKey() {
		t.Fatalf("sequence reply 16 with the age bound: %+v", se)
	}
	// An expire record removes an aged-out sequence reply.
	l.apply(&wal.Op{Type: wal.OpExpire, Keys: [][]byte{SeqKey(nil, "s", []byte(seqClient), 16)}, Time: 2000})
	if got := l.kept(); !slices.Equal(got, []uint64{17}) {
		t.Fatalf("after expire: kept %v", got)
	}
	// An advance ends the window: the older replies and the latest go, the
	// number stays.
	l.claim(18, 10, 0, 2010)
	l.commit(18, 2011)
	l.claim(19, 10, 0, 2020)
	l.commit(19, 2021)
	if got := l.kept(); !slices.Equal(got, []uint64{17, 18, 19}) {
		t.Fatalf("kept %v", got)
	}
	ts := l.apply(&wal.Op{Type: wal.OpAdvance, Advances: []wal.Advance{{Scope: "s", Client: seqClient, Seq: 1 << 40}}, Time: 2030})
	if got := l.kept(); len(got) != 0 || len(ts) != 3 {
		t.Fatalf("after an advance: kept %v, %d transitions", got, len(ts))
	}
	if c := l.client(); c.Seq != 1<<40 || c.KeptFrom != 0 {
		t.Fatalf("client after advance %+v", *c)
	}
	// A commit far past old keys looks up a bounded range, not the gap.
	l.claim(1<<40+1, 3, 0, 3000)
	if ts := l.apply(&wal.Op{Type: wal.OpCommit, Scope: "s", Client: seqClient, Seq: 1<<40 + 1, ClaimLSN: l.claims[1<<40+1], Time: 3001, Reply: []byte("x")}); len(ts) != 1 {
		t.Fatalf("commit after the advance: %d transitions", len(ts))
	}
}

// TestSeqWindowIndexReplaySnapshotForget replays a windowed workload into
// a real index (Pebble), compares it with the in-memory set, carries it
// through an image into a new index (what a snapshot does), and checks that
// a forget mark removes the sequence replies while the client keeps its
// number.
func TestSeqWindowIndexReplaySnapshotForget(t *testing.T) {
	l := newSeqLog(t)
	for s := uint64(1); s <= 30; s++ {
		l.claim(s, 4, 0, int64(100*s))
		l.commit(s, int64(100*s+1))
	}
	l.claim(31, 4, 0, 3100) // in flight: the latest reply stays kept
	if got := l.kept(); !slices.Equal(got, seqs(27, 30)) {
		t.Fatalf("kept %v", got)
	}
	fs := vfs.NewMem()
	ix, err := Open(Options{FS: fs, Dir: "ix", IngestBytes: 1 << 10})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { ix.Close(false) }()
	r := ix.NewReplayer()
	for i, op := range l.ops {
		if err := r.ApplyOp(wal.LSN(i+1), op); err != nil {
			t.Fatal(err)
		}
	}
	if err := r.Flush(); err != nil {
		t.Fatal(err)
	}
	sameEntries(t, "replayed index", ix, l.set)
	if got, want := ix.Replies(), int64(4); got != want {
		t.Fatalf("Replies() = %d, want %d (3 sequence keys + the latest)", got, want)
	}

	img, err := ix.Image()
	if err != nil {
		t.Fatal(err)
	}
	var kv [][2][]byte
	if err := img.Entries(func(k, v []byte) error {
		kv = append(kv, [2][]byte{bytes.Clone(k), bytes.Clone(v)})
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	img.Close()
	ix2, err := Open(Options{FS: fs, Dir: "ix2"})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { ix2.Close(false) }()
	i := 0
	if err := ix2.Load(img.LSN, img.Mark, func() ([]byte, []byte, bool, error) {
		if i == len(kv) {
			return nil, nil, false, nil
		}
		i++
		return kv[i-1][0], kv[i-1][1], true, nil
	}); err != nil {
		t.Fatal(err)
	}
	sameEntries(t, "loaded image", ix2, l.set)

	// A forget mark before 3000 takes the replies of 27..29 (committed at
	// 2701..2901) and keeps 30's (3001) and the client's number.
	if err := ix2.Apply([]*Update{{LSN: img.LSN + 1, Forget: &Mark{Before: 3000, LSN: img.LSN + 1}}}); err != nil {
		t.Fatal(err)
	}
	for s := uint64(27); s <= 29; s++ {
		if e, err := ix2.Get(SeqKey(nil, "s", []byte(seqClient), s)); err != nil || e != nil {
			t.Fatalf("sequence reply %d after the forget: %+v %v", s, e, err)
		}
	}
	c, err := ix2.Get(EntryKey(nil, "s", ModeClient, []byte(seqClient)))
	if err != nil || c == nil || c.Seq != 30 || !c.ReplyKept || !c.InFlight {
		t.Fatalf("client after the forget: %+v %v", c, err)
	}
}

func sameEntries(t *testing.T, what string, ix *Index, want map[string]*Entry) {
	t.Helper()
	n := 0
	if err := ix.Entries(nil, func(k []byte, e *Entry) error {
		n++
		w := want[string(k)]
		if w == nil {
			return fmt.Errorf("%s: unexpected key %x: %+v", what, k, *e)
		}
		if fmt.Sprint(*e) != fmt.Sprint(*w) {
			return fmt.Errorf("%s: key %x\n got %+v\nwant %+v", what, k, *e, *w)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if n != len(want) {
		t.Fatalf("%s: %d entries, want %d", what, n, len(want))
	}
	if got := ix.Count(); got != int64(len(want)) {
		t.Fatalf("%s: Count() = %d, want %d", what, got, len(want))
	}
}
