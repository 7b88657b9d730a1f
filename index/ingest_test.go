package index

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/wal"
)

// TestIngestTablePerKeyGroup: an ingest writes the entries (with the meta
// rows) and each secondary index in tables of their own, so that the time
// index's tables of fresh replies go to the last level instead of L0 and
// no compaction of the entries carries them; and what was ingested reads
// back complete: every entry, one time row per kept reply, one expiry row
// per reply with a TTL, one in-doubt row per claim in flight.
func TestIngestTablePerKeyGroup(t *testing.T) {
	ix, err := Open(Options{FS: vfs.NewMem(), Dir: "ix", IngestBytes: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close(false)
	rng := rand.New(rand.NewPCG(1, 2))
	want := map[string]*Entry{}
	lsn := wal.LSN(0)
	for set := range 4 {
		var ts []Transition
		for i := range 500 {
			lsn++
			id := make([]byte, 16)
			for j := range id {
				id[j] = byte(rng.Uint32())
			}
			k := EntryKey(nil, "s", ModeID, id)
			now := int64(set*1_000_000 + i)
			e := &Entry{Committed: true, ReplyKept: true, Reply: []byte("r"), CommitTime: now, CommitLSN: lsn, LSN: lsn}
			switch i % 10 {
			case 1:
				e.ExpiresAt = now + 5_000_000
			case 2:
				e = &Entry{InFlight: true, ClaimLSN: lsn, ClaimTime: now, LeaseUntil: now + 10, LSN: lsn}
			}
			ts = append(ts, Transition{Key: k, Mode: ModeID, Next: e})
			want[string(k)] = e
		}
		if err := ix.Apply([]*Update{{LSN: lsn, Transitions: ts}}); err != nil {
			t.Fatal(err)
		}
		if err := ix.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	levels, err := ix.db.SSTables()
	if err != nil {
		t.Fatal(err)
	}
	timeTables := 0
	for level, tables := range levels {
		for _, tb := range tables {
			lo, hi := tb.Smallest.UserKey[0], tb.Largest.UserKey[0]
			if hi > prefixEntry && lo != hi {
				t.Errorf("L%d table %s holds keys of groups %#x to %#x: each secondary index must have tables of its own", level, tb.FileNum, lo, hi)
			}
			if lo == prefixTime {
				timeTables++
				if level == 0 {
					t.Errorf("time-index table %s is in L0: its rows follow every row stored, it belongs in the last level", tb.FileNum)
				}
			}
		}
	}
	if timeTables == 0 {
		t.Fatal("no time-index table")
	}
	rows := func(prefix byte) (keys [][]byte) {
		it, err := ix.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefix}, UpperBound: []byte{prefix + 1}})
		if err != nil {
			t.Fatal(err)
		}
		defer it.Close()
		for ok := it.First(); ok; ok = it.Next() {
			keys = append(keys, bytes.Clone(it.Key()))
		}
		return keys
	}
	var wantTimes, wantExpiries, wantDoubts [][]byte
	for k, e := range want {
		if e.HasTimeKey() {
			wantTimes = append(wantTimes, timeKey(nil, e.CommitTime, []byte(k)))
		}
		if e.HasExpiryKey() {
			wantExpiries = append(wantExpiries, expiryKey(nil, e.ExpiresAt, []byte(k)))
		}
		if e.InFlight {
			wantDoubts = append(wantDoubts, inDoubtKey(nil, []byte(k)))
		}
	}
	for _, c := range []struct {
		name   string
		prefix byte
		want   [][]byte
	}{
		{"time", prefixTime, wantTimes},
		{"expiry", prefixExpiry, wantExpiries},
		{"in-doubt", prefixInDoubt, wantDoubts},
	} {
		slices.SortFunc(c.want, bytes.Compare)
		if got := rows(c.prefix); !slices.EqualFunc(got, c.want, bytes.Equal) {
			t.Errorf("%s index: %d rows, want %d (or they differ)", c.name, len(got), len(c.want))
		}
	}
	n := 0
	if err := ix.Entries(nil, func(k []byte, e *Entry) error {
		n++
		if w := want[string(k)]; w == nil || w.LSN != e.LSN {
			return fmt.Errorf("entry %x: got LSN %d, want %+v", k, e.LSN, w)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if n != len(want) {
		t.Fatalf("%d entries, want %d", n, len(want))
	}
}

// TestSortEntryRows: the abbreviated-key sort orders keys as their bytes
// do, also where the abbreviation cannot tell them apart (keys that end
// inside it, zero bytes, one key a prefix of another, keys that share more
// than 8 bytes after the common prefix).
func TestSortEntryRows(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	alphabet := []byte{0, 1, 0xff, 'a'}
	for round := range 200 {
		n := 1 + rng.IntN(60)
		if round%2 == 1 {
			n += 64 + rng.IntN(300) // the radix sort's sizes
		}
		prefix := strings.Repeat("p", rng.IntN(4))
		rows := make([]entryRow, n)
		for i := range rows {
			k := []byte(prefix)
			for range rng.IntN(14) {
				k = append(k, alphabet[rng.IntN(len(alphabet))])
			}
			if i > 0 && rng.IntN(5) == 0 { // a prefix or an extension of an earlier key
				k = append([]byte(rows[rng.IntN(i)].p.key), k[len(prefix):]...)
			}
			rows[i].p = &pendEntry{key: string(k)}
		}
		sortEntryRows(rows)
		for i := 1; i < len(rows); i++ {
			if a, b := rows[i-1].p.key, rows[i].p.key; strings.Compare(a, b) > 0 {
				t.Fatalf("round %d: %x sorted before %x", round, a, b)
			}
		}
	}
}

// TestSortTimeRows: time rows made in key order come out by time, then key
// (their byte order in the time index), negative times included.
func TestSortTimeRows(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for round := range 100 {
		trs := make([]timeRow, rng.IntN(400))
		for i := range trs {
			trs[i] = timeRow{t: rng.Int64N(2000) - 1000, i: int32(i)}
			if round%3 == 0 {
				trs[i].t <<= 50 // differences in the high bytes only
			}
		}
		sortTimeRows(trs)
		for j := 1; j < len(trs); j++ {
			a, b := trs[j-1], trs[j]
			if a.t > b.t || a.t == b.t && a.i > b.i {
				t.Fatalf("round %d: (%d, %d) sorted before (%d, %d)", round, a.t, a.i, b.t, b.i)
			}
		}
	}
}

// TestIngestNewTimeRowsToLastLevel: when a set deletes time rows of earlier
// sets (acked ids) and adds new ones, the new rows (after the last delete)
// get a table of their own, which lands in the last level; the deletes'
// table lands above the rows it deletes. The time index reads back exactly.
func TestIngestNewTimeRowsToLastLevel(t *testing.T) {
	ix, err := Open(Options{FS: vfs.NewMem(), Dir: "ix", IngestBytes: 1 << 30})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close(false)
	live := map[string]*Entry{}
	lsn := wal.LSN(0)
	set := func(first, n int, acks []string) {
		var ts []Transition
		for _, k := range acks {
			lsn++
			ts = append(ts, Transition{Key: []byte(k), Mode: ModeID, Prev: live[k]})
			delete(live, k)
		}
		for i := first; i < first+n; i++ {
			lsn++
			k := EntryKey(nil, "s", ModeID, []byte(fmt.Sprintf("id-%05d", (i*7919)%100000)))
			e := &Entry{Committed: true, ReplyKept: true, Reply: []byte("r"), CommitTime: int64(1000 + i), CommitLSN: lsn, LSN: lsn}
			ts = append(ts, Transition{Key: k, Mode: ModeID, Next: e})
			live[string(k)] = e
		}
		if err := ix.Apply([]*Update{{LSN: lsn, Transitions: ts}}); err != nil {
			t.Fatal(err)
		}
		if err := ix.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	set(0, 300, nil)
	var acks []string
	for k := range live {
		if len(acks) < 50 {
			acks = append(acks, k)
		}
	}
	set(300, 300, acks)
	levels, err := ix.db.SSTables()
	if err != nil {
		t.Fatal(err)
	}
	newFirst := timeKey(nil, 1300, nil)
	found := false
	for level, tables := range levels {
		for _, tb := range tables {
			if tb.Smallest.UserKey[0] != prefixTime || bytes.Compare(tb.Smallest.UserKey, newFirst) < 0 {
				continue
			}
			found = true
			if level != len(levels)-1 {
				t.Errorf("the table of the second set's new time rows is in L%d, want the last level", level)
			}
		}
	}
	if !found {
		t.Error("no table holds only the second set's new time rows")
	}
	var want [][]byte
	for k, e := range live {
		want = append(want, timeKey(nil, e.CommitTime, []byte(k)))
	}
	slices.SortFunc(want, bytes.Compare)
	it, err := ix.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixTime}, UpperBound: []byte{prefixTime + 1}})
	if err != nil {
		t.Fatal(err)
	}
	defer it.Close()
	var got [][]byte
	for ok := it.First(); ok; ok = it.Next() {
		got = append(got, bytes.Clone(it.Key()))
	}
	if !slices.EqualFunc(got, want, bytes.Equal) {
		t.Fatalf("time index: %d rows, want %d (or they differ)", len(got), len(want))
	}
}
