package wal

import (
	"errors"
	"os"
	"sync"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// An Ephemeral log writes no file, gives dense LSNs from FirstLSN and hands
// every record to OnSynced once, in LSN order, by the time its WaitDurable,
// Sync or Close returns; a slow OnSynced holds back the waiters of the next
// records, not the ones it was handed.
func TestEphemeral(t *testing.T) {
	fs := vfs.NewMem()
	var mu sync.Mutex
	var got []LSN
	o := Options{FS: fs, Dir: "wal", Ephemeral: true, FirstLSN: 100, OnSynced: func(recs []Synced) {
		mu.Lock()
		defer mu.Unlock()
		for _, r := range recs {
			if r.Value.(LSN) != r.LSN {
				t.Errorf("value %v for LSN %d", r.Value, r.LSN)
			}
			got = append(got, r.LSN)
		}
	}}
	w, res, err := Open(o, 0, func(Record) error { t.Fatal("replayed a record"); return nil })
	if err != nil {
		t.Fatal(err)
	}
	if res.LastLSN != 99 {
		t.Fatalf("LastLSN %d, want 99", res.LastLSN)
	}
	const writers, each = 8, 500
	var wg sync.WaitGroup
	for g := 0; g < writers; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < each; i++ {
				lsn, err := w.AppendWith(1, make([]byte, 100), func(l LSN) any { return l })
				if err != nil {
					t.Error(err)
					return
				}
				if i%3 != 0 { // some appenders never wait
					if err := w.WaitDurable(lsn); err != nil {
						t.Error(err)
						return
					}
					if w.SyncedLSN() < lsn {
						t.Errorf("WaitDurable(%d) returned with SyncedLSN %d", lsn, w.SyncedLSN())
					}
				}
			}
		}(g)
	}
	wg.Wait()
	if err := w.Sync(); err != nil {
		t.Fatal(err)
	}
	last := LSN(99 + writers*each)
	if st := w.Stats(); st.LastLSN != last || st.SyncedLSN != last || st.Segments != 0 || st.Bytes != 0 || st.Syncs != 0 || st.Writes != 0 {
		t.Fatalf("stats %+v", st)
	}
	if n, _, err := w.RemoveSegmentsThrough(last); n != 0 || err != nil {
		t.Fatalf("RemoveSegmentsThrough: %d %v", n, err)
	}
	if _, err := w.Append(1, nil, LSN(last+1)); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) != int(last+1-99) {
		t.Fatalf("%d records handed over, want %d", len(got), last+1-99)
	}
	for i, l := range got {
		if l != LSN(100+i) {
			t.Fatalf("record %d handed over with LSN %d", i, l)
		}
	}
	if _, err := fs.Stat("wal"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("the log's directory: %v, want none", err)
	}
	if _, err := w.Append(1, nil, nil); err != ErrClosed {
		t.Fatalf("append after Close: %v", err)
	}
}
