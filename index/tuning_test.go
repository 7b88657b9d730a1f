package index

import (
	"crypto/rand"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/wal"
)

// TestCompressionFollowsReplies: every table the index writes, the ingested
// ones and a compaction's output alike, uses snappyAdaptive (tuning.go):
// replies that compress are stored compressed, and replies that do not are
// stored as they are (the compressor stopped trying on most blocks, which
// only the CPU profile shows).
func TestCompressionFollowsReplies(t *testing.T) {
	const sets, per, replyLen = 4, 2000, 128
	for _, c := range []struct {
		name     string
		compress bool
	}{{"zero-replies", true}, {"random-replies", false}} {
		t.Run(c.name, func(t *testing.T) {
			ix, err := Open(Options{FS: vfs.NewMem(), Dir: "ix", IngestBytes: 1 << 30})
			if err != nil {
				t.Fatal(err)
			}
			defer ix.Close(false)
			ingestSets(t, ix, sets, per, func() []byte {
				reply := make([]byte, replyLen)
				if !c.compress {
					_, _ = rand.Read(reply)
				}
				return reply
			})
			check := func(when string) {
				levels, err := ix.db.SSTables(pebble.WithProperties())
				if err != nil {
					t.Fatal(err)
				}
				size, tables := uint64(0), 0
				for level, ts := range levels {
					for _, tb := range ts {
						tables++
						size += tb.Size
						if got := tb.Properties.CompressionName; got != snappyAdaptive.Name {
							t.Errorf("%s: L%d table %s written with compression %q, want %q", when, level, tb.FileNum, got, snappyAdaptive.Name)
						}
					}
				}
				// Uncompressed, the replies alone would take raw bytes;
				// compressed, a zero reply takes a few, and a row about
				// 60 with its random key and the entry's fields.
				raw := uint64(sets * per * replyLen)
				if c.compress && size > raw*3/4 {
					t.Errorf("%s: %d tables of %d bytes hold %d bytes of zero replies: not compressed", when, tables, size, raw)
				}
				if !c.compress && size < raw {
					t.Errorf("%s: %d tables of %d bytes hold %d bytes of random replies", when, tables, size, raw)
				}
			}
			check("ingested")
			if err := ix.db.Compact(t.Context(), []byte{0}, []byte{0xff}, false); err != nil {
				t.Fatal(err)
			}
			check("compacted")
		})
	}
}

// TestL0CompactionThreshold: the index's Pebble runs with
// l0CompactionThreshold (Pebble records the options it runs with in its
// OPTIONS file; before, it ran with its default of 4).
func TestL0CompactionThreshold(t *testing.T) {
	fs := vfs.NewMem()
	ix, err := Open(Options{FS: fs, Dir: "ix"})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close(false)
	names, err := fs.List("ix")
	if err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("l0_compaction_threshold=%d\n", l0CompactionThreshold)
	found := false
	for _, name := range names {
		if !strings.HasPrefix(name, "OPTIONS-") {
			continue
		}
		found = true
		f, err := fs.Open(filepath.Join("ix", name))
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), want) {
			t.Errorf("%s does not say %q:\n%s", name, strings.TrimSpace(want), b)
		}
	}
	if !found {
		t.Fatalf("no OPTIONS file in %v", names)
	}
}

// ingestSets applies sets sets of per new committed ids to ix, each with
// the reply newReply returns, and flushes after each set (one ingest per
// set). It returns each entry key's reply.
func ingestSets(t *testing.T, ix *Index, sets, per int, newReply func() []byte) map[string][]byte {
	t.Helper()
	want := map[string][]byte{}
	lsn := wal.LSN(0)
	for range sets {
		ts := make([]Transition, 0, per)
		for range per {
			lsn++
			id := make([]byte, 16)
			_, _ = rand.Read(id)
			reply := newReply()
			k := EntryKey(nil, "s", ModeID, id)
			e := &Entry{Committed: true, ReplyKept: true, Reply: reply, CommitTime: int64(lsn), CommitLSN: lsn, LSN: lsn}
			ts = append(ts, Transition{Key: k, Mode: ModeID, Next: e})
			want[string(k)] = reply
		}
		if err := ix.Apply([]*Update{{LSN: lsn, Transitions: ts}}); err != nil {
			t.Fatal(err)
		}
		if err := ix.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	return want
}
