package wal

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/alloctest"
	"github.com/idemdb/idem/internal/vfstest"
)

const testDir = "/db/wal"

// payloadFor returns the deterministic payload used for record lsn in the
// single-writer tests: 0..299 bytes derived from lsn.
func payloadFor(lsn LSN) []byte {
	n := int(uint64(lsn)*7919) % 300
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(uint64(lsn)*31 + uint64(i)*7 + 1)
	}
	return p
}

func kindFor(lsn LSN) byte { return byte(lsn%250) + 1 }

// selfPayload returns a payload that can be verified without knowing its
// LSN: an 8-byte seed followed by seed-derived bytes (concurrent tests).
func selfPayload(seed uint64) []byte {
	n := int(seed % 211)
	p := make([]byte, 8+n)
	binary.LittleEndian.PutUint64(p, seed)
	for i := 0; i < n; i++ {
		p[8+i] = byte(seed>>3) ^ byte(i*13)
	}
	return p
}

func checkSelfPayload(p []byte) error {
	if len(p) < 8 {
		return fmt.Errorf("payload of %d bytes", len(p))
	}
	seed := binary.LittleEndian.Uint64(p)
	if !bytes.Equal(p, selfPayload(seed)) {
		return fmt.Errorf("payload with seed %d does not match", seed)
	}
	return nil
}

func testOptions(fs vfs.FS) Options {
	return Options{FS: fs, Dir: testDir, SegmentSize: 4096, Preallocate: true}
}

func mustOpen(t testing.TB, o Options, after LSN, fn func(Record) error) (*WAL, ScanResult) {
	t.Helper()
	w, res, err := Open(o, after, fn)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	return w, res
}

type gotRecord struct {
	LSN     LSN
	Type    byte
	Payload []byte
}

func collect(recs *[]gotRecord) func(Record) error {
	return func(r Record) error {
		*recs = append(*recs, gotRecord{r.LSN, r.Type, slices.Clone(r.Payload)})
		return nil
	}
}

// scanAll scans dir and returns every record.
func scanAll(t testing.TB, fs vfs.FS, dir string) ([]gotRecord, ScanResult) {
	t.Helper()
	var recs []gotRecord
	res, err := Scan(fs, dir, 0, 0, collect(&recs))
	if err != nil {
		t.Fatalf("Scan: %v", err)
	}
	return recs, res
}

// appendN appends n records with payloadFor and waits for the last.
func appendN(t testing.TB, w *WAL, n int) { appendWait(t, w, n, n) }

// appendWait appends n records with payloadFor, waiting for durability every
// every records (which bounds flush batches, and so segment sizes).
func appendWait(t testing.TB, w *WAL, n, every int) {
	t.Helper()
	var lsn LSN
	for i := 0; i < n; i++ {
		if i > 0 && i%every == 0 {
			if err := w.WaitDurable(lsn); err != nil {
				t.Fatalf("WaitDurable(%d): %v", lsn, err)
			}
		}
		next := w.LastLSN() + 1
		var err error
		lsn, err = w.Append(kindFor(next), payloadFor(next), nil)
		if err != nil {
			t.Fatalf("Append: %v", err)
		}
		if lsn != next {
			t.Fatalf("Append returned LSN %d, want %d", lsn, next)
		}
	}
	if err := w.WaitDurable(lsn); err != nil {
		t.Fatalf("WaitDurable(%d): %v", lsn, err)
	}
}

// checkRecs verifies that recs are exactly LSNs from..to with payloadFor.
func checkRecs(t testing.TB, recs []gotRecord, from, to LSN) {
	t.Helper()
	if want := int(to - from + 1); len(recs) != want {
		t.Fatalf("got %d records, want %d (LSN %d..%d)", len(recs), want, from, to)
	}
	for i, r := range recs {
		lsn := from + LSN(i)
		if r.LSN != lsn || r.Type != kindFor(lsn) || !bytes.Equal(r.Payload, payloadFor(lsn)) {
			t.Fatalf("record %d: got LSN %d type %d len %d, want LSN %d type %d len %d",
				i, r.LSN, r.Type, len(r.Payload), lsn, kindFor(lsn), len(payloadFor(lsn)))
		}
	}
}

// settle waits until the rotation that may follow the last flush is done
// (a rotation is pending exactly when the active segment is over size).
func settle(t testing.TB, w *WAL) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		segs := w.Segments()
		if segs[len(segs)-1].Size <= w.opts.SegmentSize {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("rotation never happened: %+v", segs[len(segs)-1])
		}
		time.Sleep(100 * time.Microsecond)
	}
}

func listDir(t testing.TB, fs vfs.FS, dir string) []string {
	t.Helper()
	names, err := fs.List(dir)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(names)
	return names
}

// segmentNames lists the segment files of dir, in order (not the spare
// next.prealloc, nor *.torn files).
func segmentNames(t testing.TB, fs vfs.FS, dir string) []string {
	t.Helper()
	var segs []string
	for _, n := range listDir(t, fs, dir) {
		if _, ok := ParseSegmentName(n); ok {
			segs = append(segs, n)
		}
	}
	return segs
}

func TestAppendReopenReplay(t *testing.T) {
	for _, mode := range []SyncMode{SyncAlways, SyncInterval, SyncNever} {
		t.Run(mode.String(), func(t *testing.T) {
			fs := vfs.NewMem()
			o := testOptions(fs)
			o.SyncMode = mode
			o.SyncInterval = time.Millisecond
			w, res := mustOpen(t, o, 0, nil)
			if res.LastLSN != 0 || len(res.Segments) != 1 || res.Segments[0].Name != segmentName(1) {
				t.Fatalf("fresh Open: %+v", res)
			}
			const n = 3000
			appendWait(t, w, n, 10)
			st := w.Stats()
			if st.LastLSN != n || st.WrittenLSN != n || st.Segments < 10 {
				t.Fatalf("stats %+v", st)
			}
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
			segs := w.Segments() // after Close: a rotation may follow the last flush
			if w.SyncedLSN() != n {
				t.Fatalf("SyncedLSN after Close = %d", w.SyncedLSN())
			}

			recs, sres := scanAll(t, fs, testDir)
			checkRecs(t, recs, 1, n)
			if sres.TornTail != nil || sres.LastLSN != n || !slices.Equal(sres.Segments, segs) {
				t.Fatalf("Scan: %d segments, last LSN %d, torn %+v; WAL: %d segments",
					len(sres.Segments), sres.LastLSN, sres.TornTail, len(segs))
			}
			for i, s := range sres.Segments {
				if s.Name != segmentName(s.FirstLSN) || (i > 0 && s.FirstLSN != sres.Segments[i-1].LastLSN+1) {
					t.Fatalf("segment %d: %+v", i, s)
				}
				if i < len(sres.Segments)-1 && s.Size <= o.SegmentSize {
					t.Fatalf("segment %d rotated before reaching SegmentSize: %+v", i, s)
				}
			}

			// Reopen: replay everything, continue appending, reopen again.
			var replay []gotRecord
			w, res = mustOpen(t, o, 0, collect(&replay))
			checkRecs(t, replay, 1, n)
			if res.LastLSN != n || w.LastLSN() != n || w.SyncedLSN() != n {
				t.Fatalf("reopen: res.LastLSN %d LastLSN %d SyncedLSN %d", res.LastLSN, w.LastLSN(), w.SyncedLSN())
			}
			appendN(t, w, 500)
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
			recs, _ = scanAll(t, fs, testDir)
			checkRecs(t, recs, 1, n+500)
		})
	}
}

func TestOpenAfter(t *testing.T) {
	fs := vfs.NewMem()
	o := testOptions(fs)
	w, _ := mustOpen(t, o, 0, nil)
	appendN(t, w, 1000)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	for _, after := range []LSN{0, 1, 499, 999, 1000, 5000} {
		var recs []gotRecord
		w, res := mustOpen(t, o, after, collect(&recs))
		if after < 1000 {
			checkRecs(t, recs, after+1, 1000)
		} else if len(recs) != 0 {
			t.Fatalf("after=%d: got %d records", after, len(recs))
		}
		if res.LastLSN != 1000 {
			t.Fatalf("after=%d: LastLSN %d", after, res.LastLSN)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		// Scan honours after too.
		recs = recs[:0]
		if _, err := Scan(fs, testDir, after, 0, collect(&recs)); err != nil {
			t.Fatal(err)
		}
		if after < 1000 {
			checkRecs(t, recs, after+1, 1000)
		}
	}
}

func TestFirstLSNAndCallbackError(t *testing.T) {
	fs := vfs.NewMem()
	o := testOptions(fs)
	o.FirstLSN = 1000
	w, res := mustOpen(t, o, 0, nil)
	if res.LastLSN != 999 || res.Segments[0].Name != segmentName(1000) {
		t.Fatalf("%+v", res)
	}
	appendN(t, w, 10)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	recs, _ := scanAll(t, fs, testDir)
	checkRecs(t, recs, 1000, 1009)

	// An fn error aborts Open and is returned as is; nothing is modified.
	boom := errors.New("boom")
	_, _, err := Open(o, 0, func(r Record) error {
		if r.LSN == 1005 {
			return boom
		}
		return nil
	})
	if err != boom {
		t.Fatalf("Open with failing fn: %v", err)
	}
}

func TestAppendValidation(t *testing.T) {
	fs := vfs.NewMem()
	o := testOptions(fs)
	o.MaxRecordSize = 100
	w, _ := mustOpen(t, o, 0, nil)
	defer w.Close()
	if _, err := w.Append(0, nil, nil); err == nil {
		t.Fatal("type 0 accepted")
	}
	if _, err := w.Append(1, make([]byte, 101), nil); err == nil {
		t.Fatal("oversized payload accepted")
	}
	lsn, err := w.Append(1, make([]byte, 100), nil)
	if err != nil || lsn != 1 {
		t.Fatalf("Append: %d %v", lsn, err)
	}
	if _, err := w.Append(2, nil, nil); err != nil { // empty payload is fine
		t.Fatal(err)
	}
	if err := w.WaitDurable(2); err != nil {
		t.Fatal(err)
	}
	if err := w.WaitDurable(3); err == nil {
		t.Fatal("WaitDurable for an unassigned LSN succeeded")
	}
	if _, _, err := Open(Options{Dir: "x"}, 0, nil); err == nil {
		t.Fatal("Open without FS succeeded")
	}
}

func TestCloseSemantics(t *testing.T) {
	fs := vfs.NewMem()
	w, _ := mustOpen(t, testOptions(fs), 0, nil)
	lsn, err := w.Append(1, []byte("x"), nil)
	if err != nil {
		t.Fatal(err)
	}
	// Close flushes without an explicit WaitDurable.
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); !errors.Is(err, ErrClosed) {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := w.Append(1, nil, nil); !errors.Is(err, ErrClosed) {
		t.Fatalf("Append after Close: %v", err)
	}
	if err := w.Sync(); !errors.Is(err, ErrClosed) {
		t.Fatalf("Sync after Close: %v", err)
	}
	if err := w.WaitDurable(lsn); err != nil {
		t.Fatalf("WaitDurable of a durable LSN after Close: %v", err)
	}
	if _, _, err := w.RemoveSegmentsThrough(lsn); !errors.Is(err, ErrClosed) {
		t.Fatalf("RemoveSegmentsThrough after Close: %v", err)
	}
	recs, _ := scanAll(t, fs, testDir)
	if len(recs) != 1 || recs[0].LSN != lsn {
		t.Fatalf("%+v", recs)
	}
}

func TestConcurrentAppenders(t *testing.T) {
	fs := vfs.NewCrashableMem()
	o := testOptions(fs)
	o.SegmentSize = 64 << 10
	var (
		cbMu    sync.Mutex
		cbLSNs  []LSN
		cbCalls int
	)
	o.OnSynced = func(recs []Synced) {
		cbMu.Lock()
		defer cbMu.Unlock()
		cbCalls++
		for _, r := range recs {
			if r.Value.(uint64) != binary.LittleEndian.Uint64(selfPayload(r.Value.(uint64))) {
				panic("bad value")
			}
			cbLSNs = append(cbLSNs, r.LSN)
		}
	}
	w, _ := mustOpen(t, o, 0, nil)
	const goroutines, perG = 64, 60
	var wg sync.WaitGroup
	errC := make(chan error, goroutines)
	for g := 0; g < goroutines; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < perG; i++ {
				seed := uint64(g*perG + i)
				lsn, err := w.Append(1, selfPayload(seed), seed)
				if err == nil {
					err = w.WaitDurable(lsn)
				}
				if err == nil && w.SyncedLSN() < lsn {
					err = fmt.Errorf("WaitDurable(%d) returned with SyncedLSN %d", lsn, w.SyncedLSN())
				}
				if err != nil {
					errC <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errC)
	for err := range errC {
		t.Fatal(err)
	}
	const total = goroutines * perG
	if w.SyncedLSN() != total {
		t.Fatalf("SyncedLSN %d", w.SyncedLSN())
	}
	st := w.Stats()
	t.Logf("stats: %+v (%.1f records per fsync)", st, float64(total)/float64(st.Syncs))
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	// OnSynced saw every record exactly once, in LSN order.
	if len(cbLSNs) != total {
		t.Fatalf("OnSynced reported %d records", len(cbLSNs))
	}
	for i, l := range cbLSNs {
		if l != LSN(i+1) {
			t.Fatalf("OnSynced record %d has LSN %d", i, l)
		}
	}
	// The log is dense and holds every payload once.
	recs, _ := scanAll(t, fs, testDir)
	seen := make(map[uint64]bool)
	for i, r := range recs {
		if r.LSN != LSN(i+1) {
			t.Fatalf("record %d has LSN %d", i, r.LSN)
		}
		if err := checkSelfPayload(r.Payload); err != nil {
			t.Fatal(err)
		}
		seed := binary.LittleEndian.Uint64(r.Payload)
		if seen[seed] {
			t.Fatalf("seed %d twice", seed)
		}
		seen[seed] = true
	}
	if len(seen) != total {
		t.Fatalf("%d distinct payloads", len(seen))
	}
}

// TestOnSyncedOnlyAfterFsync crash-clones the file system (keeping only
// synced data) from inside OnSynced: every reported record must survive.
func TestOnSyncedOnlyAfterFsync(t *testing.T) {
	for _, mode := range []SyncMode{SyncAlways, SyncInterval, SyncNever} {
		t.Run(mode.String(), func(t *testing.T) {
			fs := vfs.NewCrashableMem()
			o := testOptions(fs)
			o.SyncMode = mode
			o.SyncInterval = 2 * time.Millisecond
			var calls atomic.Int32
			var failure atomic.Pointer[string]
			o.OnSynced = func(recs []Synced) {
				if calls.Add(1) > 20 {
					return
				}
				crashed := fs.CrashClone(vfs.CrashCloneCfg{})
				var last LSN
				if _, err := Scan(crashed, testDir, 0, 0, func(r Record) error { last = r.LSN; return nil }); err != nil {
					s := err.Error()
					failure.Store(&s)
				}
				if want := recs[len(recs)-1].LSN; last < want {
					s := fmt.Sprintf("OnSynced reported LSN %d but the synced state ends at %d", want, last)
					failure.Store(&s)
				}
			}
			w, _ := mustOpen(t, o, 0, nil)
			var lsn LSN
			for i := 0; i < 300; i++ {
				var err error
				if lsn, err = w.Append(1, payloadFor(LSN(i)), nil); err != nil {
					t.Fatal(err)
				}
				if i%7 == 0 {
					if err := w.WaitDurable(lsn); err != nil {
						t.Fatal(err)
					}
				}
				if mode == SyncNever && i%50 == 0 {
					if err := w.Sync(); err != nil {
						t.Fatal(err)
					}
					if w.SyncedLSN() < lsn {
						t.Fatalf("Sync returned with SyncedLSN %d < %d", w.SyncedLSN(), lsn)
					}
				}
			}
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
			if calls.Load() == 0 {
				t.Fatal("OnSynced never called")
			}
			if f := failure.Load(); f != nil {
				t.Fatal(*f)
			}
		})
	}
}

func TestSyncNeverAndInterval(t *testing.T) {
	fs := vfs.NewMem()
	o := testOptions(fs)
	o.SyncMode = SyncNever
	w, _ := mustOpen(t, o, 0, nil)
	lsn, _ := w.Append(1, []byte("a"), nil)
	if err := w.WaitDurable(lsn); err != nil {
		t.Fatal(err)
	}
	if st := w.Stats(); st.WrittenLSN != lsn || st.SyncedLSN != 0 {
		t.Fatalf("SyncNever after WaitDurable: %+v", st)
	}
	if err := w.Sync(); err != nil {
		t.Fatal(err)
	}
	if w.SyncedLSN() != lsn {
		t.Fatalf("SyncedLSN %d after Sync", w.SyncedLSN())
	}
	if err := w.Sync(); err != nil { // nothing new: returns at once
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}

	o.SyncMode = SyncInterval
	o.SyncInterval = 5 * time.Millisecond
	w, _ = mustOpen(t, o, 0, nil)
	defer w.Close()
	lsn, _ = w.Append(1, []byte("b"), nil)
	if err := w.WaitDurable(lsn); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for w.SyncedLSN() < lsn {
		if time.Now().After(deadline) {
			t.Fatal("SyncInterval never synced")
		}
		time.Sleep(time.Millisecond)
	}
}

func TestCreatesDirDurably(t *testing.T) {
	fs := vfs.NewCrashableMem()
	o := testOptions(fs)
	o.Dir = "/a/b/c/wal"
	w, _ := mustOpen(t, o, 0, nil)
	lsn, _ := w.Append(1, []byte("x"), nil)
	if err := w.WaitDurable(lsn); err != nil {
		t.Fatal(err)
	}
	crashed := fs.CrashClone(vfs.CrashCloneCfg{})
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	recs, _ := scanAll(t, crashed, o.Dir)
	if len(recs) != 1 {
		t.Fatalf("after crash: %d records", len(recs))
	}
}

func TestRemoveSegmentsThrough(t *testing.T) {
	fs := vfs.NewCrashableMem()
	o := testOptions(fs)
	w, _ := mustOpen(t, o, 0, nil)
	appendWait(t, w, 2000, 5)
	settle(t, w)
	segs := w.Segments()
	if len(segs) < 10 {
		t.Fatalf("%d segments", len(segs))
	}
	// Nothing at or below an LSN inside the first segment.
	if n, b, err := w.RemoveSegmentsThrough(segs[0].LastLSN - 1); n != 0 || b != 0 || err != nil {
		t.Fatalf("%d %d %v", n, b, err)
	}
	mid := segs[4].LastLSN + 3 // inside segs[5]
	n, b, err := w.RemoveSegmentsThrough(mid)
	if err != nil || n != 5 {
		t.Fatalf("removed %d (%d bytes): %v", n, b, err)
	}
	var wantBytes int64 // file sizes
	for _, s := range segs[:5] {
		wantBytes += s.Allocated
		if s.Allocated < s.Size {
			t.Fatalf("%+v", s)
		}
	}
	if b != wantBytes {
		t.Fatalf("removed %d bytes, want %d", b, wantBytes)
	}
	if got := w.Segments(); got[0].Name != segs[5].Name {
		t.Fatalf("first segment now %s", got[0].Name)
	}
	// Never the active segment, even when asked for everything.
	n, _, err = w.RemoveSegmentsThrough(LSN(1 << 62))
	if err != nil || n != len(segs)-6 {
		t.Fatalf("removed %d: %v", n, err)
	}
	active := w.Segments()
	if len(active) != 1 || active[0].Name != segs[len(segs)-1].Name {
		t.Fatalf("segments left: %+v", active)
	}
	// Removed files are gone after a crash.
	crashed := fs.CrashClone(vfs.CrashCloneCfg{})
	if names := segmentNames(t, crashed, testDir); !slices.Equal(names, []string{active[0].Name}) {
		t.Fatalf("after crash: %v", names)
	}
	appendN(t, w, 10)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	var recs []gotRecord
	w, res := mustOpen(t, o, 0, collect(&recs))
	defer w.Close()
	checkRecs(t, recs, active[0].FirstLSN, 2010)
	if res.Segments[0].FirstLSN != active[0].FirstLSN {
		t.Fatalf("%+v", res.Segments)
	}
}

func TestWaitersWakeCheaply(t *testing.T) {
	// Thousands of waiters on one WAL: all are released by a handful of
	// flushes (no per-waiter goroutine, no lost wake-up).
	fs := vfs.NewMem()
	w, _ := mustOpen(t, testOptions(fs), 0, nil)
	defer w.Close()
	const n = 3000
	var wg sync.WaitGroup
	var failures atomic.Int32
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lsn, err := w.Append(1, []byte("w"), nil)
			if err == nil {
				err = w.WaitDurable(lsn)
			}
			if err != nil {
				failures.Add(1)
			}
		}()
	}
	wg.Wait()
	if failures.Load() != 0 || w.SyncedLSN() != n {
		t.Fatalf("%d failures, SyncedLSN %d", failures.Load(), w.SyncedLSN())
	}
	t.Logf("%d waiters, %d fsyncs", n, w.Stats().Syncs)
}

func TestAppendDoesNotAllocate(t *testing.T) {
	if testing.Short() {
		t.Skip()
	}
	fs := vfs.NewMem()
	o := testOptions(fs)
	o.SegmentSize = 16 << 20 // no rotation during the test (segments are preallocated in memory)
	o.SyncMode = SyncNever
	o.OnSynced = func([]Synced) {}
	w, _ := mustOpen(t, o, 0, nil)
	defer w.Close()
	payload := make([]byte, 200)
	v := &struct{}{}
	for i := 0; i < 10000; i++ { // reach the steady-state buffer sizes
		if _, err := w.Append(1, payload, v); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Sync(); err != nil {
		t.Fatal(err)
	}
	alloctest.CheckAllocs(t, "Append", 0, 5000, func() {
		if _, err := w.Append(1, payload, v); err != nil {
			t.Fatal(err)
		}
	})
}

// TestRealFS runs reopen and torn-tail repair on the OS file system: segments
// are preallocated, frames overwrite the zeros, and a torn tail is cut by
// zeroing it in place.
func TestRealFS(t *testing.T) {
	fs := vfs.Default
	o := Options{FS: fs, Dir: fs.PathJoin(t.TempDir(), "sub", "wal"), SegmentSize: 8192, Preallocate: true}
	w, _ := mustOpen(t, o, 0, nil)
	appendWait(t, w, 300, 3)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	w, _ = mustOpen(t, o, 0, nil) // reopened active segment: WriteAt
	appendWait(t, w, 50, 3)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	segs := w.Segments()
	last := segs[len(segs)-1]
	path := fs.PathJoin(o.Dir, last.Name)
	f, err := fs.OpenReadWrite(path, vfs.WriteCategoryUnspecified)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("garbage!"), last.Size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if last.Allocated < o.SegmentSize {
		t.Fatalf("last segment not preallocated: %+v", last)
	}

	var recs []gotRecord
	w, res := mustOpen(t, o, 0, collect(&recs))
	checkRecs(t, recs, 1, 350)
	if res.TornTail == nil || res.TornTail.Offset != last.Size || res.TornTail.Bytes != 8 {
		t.Fatalf("TornTail %+v", res.TornTail)
	}
	if b := vfstest.ReadFile(t, fs, path); int64(len(b)) != last.Allocated || !allZero(b[last.Size:]) {
		t.Fatalf("segment not cut by zeroing in place: %d bytes (was %d), zeros after %d: %v",
			len(b), last.Allocated, last.Size, allZero(b[last.Size:]))
	}
	appendWait(t, w, 20, 3)
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	all, res2 := scanAll(t, fs, o.Dir)
	checkRecs(t, all, 1, 370)
	if res2.TornTail != nil {
		t.Fatalf("%+v", res2.TornTail)
	}
	if !slices.Contains(listDir(t, fs, o.Dir), last.Name+tornSuffix) {
		t.Fatal("no .torn file")
	}
}
