package wal

import (
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestSyncNeverWaiterWritesItsRecord pins writeOwn: under SyncNever a
// WaitDurable caller writes the buffer holding its record itself when no
// flush runs, rather than wait for the flusher goroutine. The flusher is
// held in its idle hook for the whole wait, so only the waiter can write
// the records; once let go, the flusher writes what was appended after
// (a record nobody waits for), and Close reads everything back.
func TestSyncNeverWaiterWritesItsRecord(t *testing.T) {
	fs := vfs.NewMem()
	o := testOptions(fs)
	o.SyncMode = SyncNever
	idle, flusherGo := make(chan struct{}, 1), make(chan struct{})
	held := true
	o.hooks = &testHooks{idle: func() {
		if !held {
			return
		}
		held = false // only the first idle is held (the flusher goroutine's own variable)
		idle <- struct{}{}
		<-flusherGo
	}}
	w, _ := mustOpen(t, o, 0, nil)
	<-idle // the flusher is held: it can write nothing until flusherGo
	done := make(chan error, 1)
	go func() {
		for i := 1; i <= 3; i++ {
			lsn, err := w.Append(kindFor(LSN(i)), payloadFor(LSN(i)), nil)
			if err == nil {
				err = w.WaitDurable(lsn)
			}
			if err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(time.Minute): // a hang guard, not a measurement
		close(flusherGo)
		t.Fatal("WaitDurable under SyncNever waited for the held flusher instead of writing its record")
	}
	if got := w.written.Load(); got != 3 {
		t.Fatalf("written LSN %d after three waits, want 3", got)
	}
	if _, err := w.Append(kindFor(4), payloadFor(4), nil); err != nil { // nobody waits: the flusher's
		t.Fatal(err)
	}
	close(flusherGo)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	recs, _ := scanAll(t, fs, testDir)
	checkRecs(t, recs, 1, 4)
}
