package wal

import (
	"cmp"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/idemdb/idem/internal/vfstest"
)

// durableLog records acknowledged appends of the concurrent crash tests.
type durableLog struct {
	mu    sync.Mutex
	seeds map[LSN]uint64 // LSN -> payload seed, for records WaitDurable acknowledged
}

func (a *durableLog) add(lsn LSN, seed uint64) {
	a.mu.Lock()
	a.seeds[lsn] = seed
	a.mu.Unlock()
}

func (a *durableLog) snapshot() map[LSN]uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	m := make(map[LSN]uint64, len(a.seeds))
	for k, v := range a.seeds {
		m[k] = v
	}
	return m
}

// crashWhileAppending runs concurrent appenders and crash-clones fs while
// they run. It returns the clone, the records acknowledged (by WaitDurable,
// in SyncAlways mode) and the SyncedLSN observed before the clone.
func crashWhileAppending(t *testing.T, fs *vfs.MemFS, o Options, cfg vfs.CrashCloneCfg, minSynced LSN) (*vfs.MemFS, map[LSN]uint64, LSN) {
	t.Helper()
	w, _ := mustOpen(t, o, 0, nil)
	acks := &durableLog{seeds: make(map[LSN]uint64)}
	var stop atomic.Bool
	var wg sync.WaitGroup
	const goroutines = 16
	for g := 0; g < goroutines; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; !stop.Load(); i++ {
				seed := uint64(g)<<32 | uint64(i)
				lsn, err := w.Append(1, selfPayload(seed), nil)
				if err != nil {
					return
				}
				if o.SyncMode == SyncNever && i%25 == 0 {
					err = w.Sync()
				} else {
					err = w.WaitDurable(lsn)
				}
				if err != nil {
					return
				}
				acks.add(lsn, seed)
			}
		}()
	}
	deadline := time.Now().Add(10 * time.Second)
	for w.SyncedLSN() < minSynced && time.Now().Before(deadline) {
		time.Sleep(100 * time.Microsecond)
	}
	acked := acks.snapshot()
	synced := w.SyncedLSN()
	crashed := fs.CrashClone(cfg)
	stop.Store(true)
	wg.Wait()
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return crashed, acked, synced
}

// checkRecovered opens the crashed file system and checks that the log is
// a dense prefix holding everything synced (and, in SyncAlways mode,
// everything acknowledged) with the acknowledged payloads.
func checkRecovered(t *testing.T, o Options, acked map[LSN]uint64, synced LSN) ScanResult {
	t.Helper()
	var recs []gotRecord
	w, res := mustOpen(t, o, 0, collect(&recs))
	for i, r := range recs {
		if r.LSN != LSN(i+1) {
			t.Fatalf("record %d has LSN %d", i, r.LSN)
		}
		if err := checkSelfPayload(r.Payload); err != nil {
			t.Fatalf("LSN %d: %v", r.LSN, err)
		}
		if seed, ok := acked[r.LSN]; ok && seed != binary.LittleEndian.Uint64(r.Payload) {
			t.Fatalf("LSN %d holds seed %d, acknowledged with seed %d", r.LSN, binary.LittleEndian.Uint64(r.Payload), seed)
		}
	}
	last := LSN(len(recs))
	if res.LastLSN != last || w.LastLSN() != last {
		t.Fatalf("LastLSN: result %d, WAL %d, records %d", res.LastLSN, w.LastLSN(), last)
	}
	if last < synced {
		t.Fatalf("recovered up to LSN %d, but LSN %d was synced before the crash", last, synced)
	}
	if o.SyncMode == SyncAlways {
		for lsn := range acked {
			if lsn > last {
				t.Fatalf("LSN %d was acknowledged but is lost (recovered up to %d)", lsn, last)
			}
		}
	}
	// The repaired log accepts appends and reopens cleanly.
	lsn, err := w.Append(1, selfPayload(1<<40), nil)
	if err != nil || lsn != last+1 {
		t.Fatalf("Append after recovery: %d %v", lsn, err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	recs = recs[:0]
	w, res2 := mustOpen(t, o, 0, collect(&recs))
	if res2.TornTail != nil || LSN(len(recs)) != last+1 {
		t.Fatalf("second reopen: %d records, torn tail %+v", len(recs), res2.TornTail)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return res
}

func TestCrashKeepsAcknowledged(t *testing.T) {
	// Only synced data survives: nothing acknowledged may be lost.
	for _, mode := range []SyncMode{SyncAlways, SyncNever} {
		t.Run(mode.String(), func(t *testing.T) {
			fs := vfs.NewCrashableMem()
			o := testOptions(fs)
			o.SegmentSize = 16 << 10
			o.SyncMode = mode
			crashed, acked, synced := crashWhileAppending(t, fs, o, vfs.CrashCloneCfg{}, 1500)
			o.FS = crashed
			checkRecovered(t, o, acked, synced)
		})
	}
}

func TestCrashUnsyncedBlocks(t *testing.T) {
	// Half of the unsynced 4 KiB blocks survive, as holes and islands of
	// valid frames: Open must always succeed (torn tails cut, never
	// ErrCorrupt) and keep everything acknowledged.
	torn := 0
	for seed := uint64(1); seed <= 12; seed++ {
		mode := SyncAlways
		if seed%2 == 0 {
			mode = SyncNever
		}
		fs := vfs.NewCrashableMem()
		o := testOptions(fs)
		o.SegmentSize = 16 << 10
		o.SyncMode = mode
		cfg := vfs.CrashCloneCfg{UnsyncedDataPercent: 50, RNG: rand.New(rand.NewPCG(seed, seed))}
		crashed, acked, synced := crashWhileAppending(t, fs, o, cfg, 800)
		o.FS = crashed
		if res := checkRecovered(t, o, acked, synced); res.TornTail != nil {
			torn++
		}
	}
	t.Logf("%d of 12 crashes left a torn tail", torn)
}

// TestCrashUnsyncedDeterministic writes a long unsynced tail from a single
// writer (SyncNever), so that every crash clone has holes and kept blocks.
func TestCrashUnsyncedDeterministic(t *testing.T) {
	torn := 0
	for seed := uint64(1); seed <= 40; seed++ {
		fs := vfs.NewCrashableMem()
		o := testOptions(fs)
		o.SegmentSize = 64 << 10
		o.SyncMode = SyncNever
		w, _ := mustOpen(t, o, 0, nil)
		rng := rand.New(rand.NewPCG(seed, 99))
		synced := LSN(0)
		n := 100 + rng.IntN(400)
		for i := 1; i <= n; i++ {
			lsn, err := w.Append(kindFor(LSN(i)), payloadFor(LSN(i)), nil)
			if err != nil {
				t.Fatal(err)
			}
			if rng.IntN(60) == 0 {
				if err := w.Sync(); err != nil {
					t.Fatal(err)
				}
				synced = lsn
			} else if rng.IntN(3) == 0 {
				if err := w.WaitDurable(lsn); err != nil { // written, not synced
					t.Fatal(err)
				}
			}
		}
		if err := w.WaitDurable(LSN(n)); err != nil {
			t.Fatal(err)
		}
		crashed := fs.CrashClone(vfs.CrashCloneCfg{UnsyncedDataPercent: 50, RNG: rng})
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		o.FS = crashed
		var recs []gotRecord
		w, res, err := Open(o, 0, collect(&recs))
		if err != nil {
			t.Fatalf("seed %d: Open after crash: %v", seed, err)
		}
		if len(recs) < int(synced) {
			t.Fatalf("seed %d: %d records, %d were synced", seed, len(recs), synced)
		}
		checkRecs(t, recs, 1, LSN(len(recs)))
		if res.TornTail != nil {
			torn++
			if res.TornTail.SavedAs == "" {
				t.Fatalf("seed %d: torn tail not saved: %+v", seed, res.TornTail)
			}
			saved := vfstest.ReadFile(t, crashed, crashed.PathJoin(testDir, res.TornTail.SavedAs))
			if int64(len(saved)) != res.TornTail.Bytes {
				t.Fatalf("seed %d: saved %d bytes, cut %d", seed, len(saved), res.TornTail.Bytes)
			}
			if w.Stats().TornTailsCut != 1 {
				t.Fatalf("seed %d: TornTailsCut %d", seed, w.Stats().TornTailsCut)
			}
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		// The repair itself was durable: crash again (synced state only).
		again := crashed.CrashClone(vfs.CrashCloneCfg{})
		recs2, res2 := scanAll(t, again, testDir)
		if len(recs2) != len(recs) || res2.TornTail != nil {
			t.Fatalf("seed %d: after repair+crash: %d records (want %d), torn %+v", seed, len(recs2), len(recs), res2.TornTail)
		}
	}
	if torn == 0 {
		t.Fatal("no crash produced a torn tail; the test is not exercising anything")
	}
	t.Logf("%d of 40 crashes left a torn tail", torn)
}

func TestErrorInjection(t *testing.T) {
	// Frames are always written with WriteAt (at the logical end of a
	// preallocated segment) and made durable with SyncData; a segment is
	// started by renaming the spare file and fsyncing its header.
	cases := []struct {
		name     string
		kind     errorfs.OpKind
		suffix   string // of the path the failure applies to; default segmentSuffix
		reopened bool   // fail on a segment reopened by Open
		rotate   bool   // the failure happens while rotating
	}{
		{name: "writeAt", kind: errorfs.OpFileWriteAt},
		{name: "writeAt-reopened", kind: errorfs.OpFileWriteAt, reopened: true},
		{name: "syncData", kind: errorfs.OpFileSyncData},
		{name: "syncData-reopened", kind: errorfs.OpFileSyncData, reopened: true},
		{name: "rename", kind: errorfs.OpRename, suffix: preallocSuffix, rotate: true},
		{name: "header-sync", kind: errorfs.OpFileSync, rotate: true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			mem := vfs.NewCrashableMem()
			var armed atomic.Bool
			suffix := cmp.Or(tc.suffix, segmentSuffix)
			fs := errorfs.Wrap(mem, errorfs.InjectorFunc(func(op errorfs.Op) error {
				if armed.Load() && op.Kind == tc.kind && strings.HasSuffix(op.Path, suffix) {
					return errorfs.ErrInjected
				}
				return nil
			}))
			o := testOptions(fs)
			o.SegmentSize = 1 << 20
			var reportedMu sync.Mutex
			var reported []LSN
			o.OnSynced = func(recs []Synced) {
				reportedMu.Lock()
				defer reportedMu.Unlock()
				for _, r := range recs {
					reported = append(reported, r.LSN)
				}
			}
			w, _ := mustOpen(t, o, 0, nil)
			appendN(t, w, 20)
			if tc.reopened {
				if err := w.Close(); err != nil {
					t.Fatal(err)
				}
				w, _ = mustOpen(t, o, 0, nil)
				appendN(t, w, 5)
			}
			good := w.LastLSN()

			armed.Store(true)
			var failErr error
			if tc.rotate {
				// A record that overflows the segment: it is synced, then the
				// rotation fails, and everything after it fails.
				lsn, err := w.Append(1, make([]byte, 1<<20), nil)
				if err != nil {
					t.Fatal(err)
				}
				if err := w.WaitDurable(lsn); err != nil {
					t.Fatalf("the record before the failed rotation: %v", err)
				}
				good = lsn
				if lsn, err = w.Append(1, []byte("after"), nil); err == nil {
					err = w.WaitDurable(lsn)
				}
				failErr = err
			} else {
				lsn, err := w.Append(1, []byte("doomed"), nil)
				if err != nil {
					t.Fatal(err)
				}
				failErr = w.WaitDurable(lsn)
				if w.SyncedLSN() >= lsn {
					t.Fatalf("SyncedLSN %d covers the failed record %d", w.SyncedLSN(), lsn)
				}
			}
			if !errors.Is(failErr, ErrFailed) || !errors.Is(failErr, errorfs.ErrInjected) {
				t.Fatalf("after injected %s failure: %v", tc.name, failErr)
			}
			armed.Store(false)
			// Sticky: the file system works again, the WAL does not.
			if _, err := w.Append(1, []byte("later"), nil); !errors.Is(err, ErrFailed) {
				t.Fatalf("Append after failure: %v", err)
			}
			if err := w.Sync(); !errors.Is(err, ErrFailed) {
				t.Fatalf("Sync after failure: %v", err)
			}
			if err := w.WaitDurable(good + 1); !errors.Is(err, ErrFailed) {
				t.Fatalf("WaitDurable after failure: %v", err)
			}
			if err := w.WaitDurable(good); err != nil {
				t.Fatalf("WaitDurable of a durable record after failure: %v", err)
			}
			if err := w.Close(); !errors.Is(err, ErrFailed) {
				t.Fatalf("Close after failure: %v", err)
			}
			reportedMu.Lock()
			if n := len(reported); n == 0 || reported[n-1] != good {
				t.Fatalf("OnSynced reported up to %v, want exactly up to %d", reported[max(0, n-1):], good)
			}
			reportedMu.Unlock()

			// Everything acknowledged survives a crash; the log reopens.
			var recs []gotRecord
			o.FS = mem.CrashClone(vfs.CrashCloneCfg{})
			w, _ = mustOpen(t, o, 0, collect(&recs))
			defer w.Close()
			if LSN(len(recs)) < good {
				t.Fatalf("recovered %d records, %d were acknowledged", len(recs), good)
			}
		})
	}
}

func TestSegmentsAfterCrashDuringRotation(t *testing.T) {
	// A crash right after a rotation created the next segment: with only
	// synced data kept, the new (empty) segment is there and valid.
	fs := vfs.NewCrashableMem()
	o := testOptions(fs)
	w, _ := mustOpen(t, o, 0, nil)
	lsn, _ := w.Append(1, make([]byte, 5000), nil)
	if err := w.WaitDurable(lsn); err != nil {
		t.Fatal(err)
	}
	if err := w.Sync(); err != nil { // the rotation follows the flush; let it finish
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(w.Segments()) < 2 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	crashed := fs.CrashClone(vfs.CrashCloneCfg{})
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	names := segmentNames(t, crashed, testDir)
	if !slices.Equal(names, []string{segmentName(1), segmentName(2)}) {
		t.Fatalf("%v", names)
	}
	_, res := scanAll(t, crashed, testDir)
	if len(res.Segments) != 2 || res.Segments[1].LastLSN != 1 || res.LastLSN != 1 {
		t.Fatalf("%+v", res)
	}
}
