package wal

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
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

// TestSyncNeverWaitersFlushWhileClosing runs writeOwn against the
// flusher and Close: 8 goroutines append and wait under SyncNever, with
// small segments and MaxUnsyncedBytes (so waiters rotate and fsync, and
// call OnSynced), while Close runs. Every wait that returned nil must
// have its record in the log afterwards, OnSynced must see each LSN once,
// in order and never two calls at once, and no append may hang.
func TestSyncNeverWaitersFlushWhileClosing(t *testing.T) {
	fs := vfs.NewMem()
	o := testOptions(fs)
	o.SyncMode = SyncNever
	o.MaxUnsyncedBytes = 2048
	var (
		mu      sync.Mutex
		inCall  bool
		nextLSN LSN = 1
		badCall string
	)
	o.OnSynced = func(recs []Synced) {
		mu.Lock()
		overlap := inCall
		inCall = true
		mu.Unlock()
		for _, r := range recs {
			if r.LSN != nextLSN && badCall == "" {
				badCall = fmt.Sprintf("OnSynced got LSN %d, want %d", r.LSN, nextLSN)
			}
			nextLSN = r.LSN + 1
		}
		mu.Lock()
		if overlap && badCall == "" {
			badCall = "two OnSynced calls ran at once"
		}
		inCall = false
		mu.Unlock()
	}
	w, _ := mustOpen(t, o, 0, nil)
	var (
		wg      sync.WaitGroup
		started sync.WaitGroup
		ackMu   sync.Mutex
		acked   = map[uint64]bool{}
	)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		started.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				if i == 50 {
					started.Done()
				}
				seed := uint64(g)<<32 | uint64(i)
				lsn, err := w.Append(1, selfPayload(seed), nil)
				if err == nil {
					err = w.WaitDurable(lsn)
				}
				if err != nil {
					if !errors.Is(err, ErrClosed) {
						t.Errorf("goroutine %d: %v", g, err)
					}
					if i < 50 {
						started.Done()
					}
					return
				}
				ackMu.Lock()
				acked[seed] = true
				ackMu.Unlock()
			}
		}()
	}
	started.Wait() // every goroutine has written 50 records: flushes run
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Minute): // a hang guard, not a measurement
		t.Fatal("an append or wait hung after Close")
	}
	if badCall != "" {
		t.Fatal(badCall)
	}
	recs, _ := scanAll(t, fs, testDir)
	if want := LSN(len(recs)) + 1; nextLSN != want {
		t.Fatalf("OnSynced reported up to LSN %d, the log holds %d records", nextLSN-1, len(recs))
	}
	found := map[uint64]bool{}
	for i, r := range recs {
		if r.LSN != LSN(i+1) {
			t.Fatalf("record %d has LSN %d", i, r.LSN)
		}
		if err := checkSelfPayload(r.Payload); err != nil {
			t.Fatalf("LSN %d: %v", r.LSN, err)
		}
		found[binary.LittleEndian.Uint64(r.Payload)] = true
	}
	for seed := range acked {
		if !found[seed] {
			t.Fatalf("record with seed %#x was acknowledged durable and is not in the log", seed)
		}
	}
	if len(acked) < 400 {
		t.Fatalf("only %d records acknowledged", len(acked))
	}
}
