package wal

import (
	"bytes"
	"runtime"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestFrameEncodedOutsideTheLock pins the split of append into a
// reservation under w.mu and the frame's encoding after it: while an
// appender is between the two, nothing may read or move its frame. Record
// 1's appender is held there (beforeFill); then record 2 is appended and
// waited for, which makes the flusher take the buffer ("flush"), or is
// big enough to make the buffer grow ("grow"). The flusher, or the
// growing appender (the flusher is held then), must wait for record 1's frame: the test lets record
// 1 go only once one of them waits for it (fillWaits) or has gone past it
// (record 2 written, or appended). Then every record must read back
// intact. The flusher is idle when the test starts, so a lost wake-up
// leaves record 2 waiting for ever.
func TestFrameEncodedOutsideTheLock(t *testing.T) {
	for _, tc := range []struct {
		name string
		big  bool // record 2 is too big for the buffer record 1 made: it grows
	}{
		{name: "flush"},
		{name: "grow", big: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := vfs.NewMem()
			o := testOptions(fs)
			reserved, release := make(chan struct{}), make(chan struct{})
			idle, flusherGo := make(chan struct{}, 1), make(chan struct{})
			o.hooks = &testHooks{
				beforeFill: func(lsn LSN) {
					if lsn == 1 {
						close(reserved)
						<-release
					}
				},
				idle: func() {
					select {
					case idle <- struct{}{}:
					default:
					}
					if tc.big {
						<-flusherGo // no flush takes record 1 before record 2 grows the buffer
					}
				},
			}
			w, _ := mustOpen(t, o, 0, nil)
			// The flusher is idle: only the appends' wake-up can start the
			// flush below (a lost one leaves record 2 waiting for ever).
			<-idle
			errA := make(chan error, 1)
			go func() {
				_, err := w.Append(1, selfPayload(1), nil)
				errA <- err
			}()
			<-reserved

			p2 := selfPayload(2)
			if tc.big {
				p2 = append(p2, make([]byte, 128<<10)...) // more than the first buffer (64 KiB)
			}
			lsn2 := make(chan LSN, 1)
			errB := make(chan error, 1)
			go func() {
				lsn, err := w.Append(2, p2, nil)
				lsn2 <- lsn
				if err == nil {
					err = w.WaitDurable(lsn)
				}
				errB <- err
			}()
			// Record 2 is past record 1 once it was written or, when it
			// grows the buffer, appended; the correct code gets there only
			// by waiting for record 1's frame.
			past := func() bool { return w.written.Load() >= 2 || (tc.big && len(lsn2) > 0) }
			deadline := time.Now().Add(time.Minute) // a hang guard, not a measurement
			for w.fillWaits.Load() == 0 && !past() {
				if time.Now().After(deadline) {
					t.Fatal("neither the flusher nor record 2's append waited for record 1's frame, nor went past it")
				}
				runtime.Gosched()
			}
			close(release)
			close(flusherGo)
			if err := <-errA; err != nil {
				t.Fatalf("Append 1: %v", err)
			}
			select {
			case err := <-errB:
				if err != nil {
					t.Fatalf("Append 2: %v", err)
				}
			case <-time.After(time.Minute): // a hang guard, not a measurement
				t.Fatal("record 2 never became durable: a lost wake-up (of the flusher, or of a wait for record 1's frame)")
			}
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
			recs, _ := scanAll(t, fs, testDir)
			if len(recs) != 2 {
				t.Fatalf("read back %d records, want 2: %+v", len(recs), recs)
			}
			for i, want := range [][]byte{selfPayload(1), p2} {
				if r := recs[i]; r.LSN != LSN(i+1) || !bytes.Equal(r.Payload, want) {
					t.Fatalf("record %d read back as LSN %d with %d bytes, want %d bytes", i+1, r.LSN, len(r.Payload), len(want))
				}
			}
		})
	}
}
