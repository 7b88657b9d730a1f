package wal

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// LSN is a log sequence number. LSNs are dense: every record gets the
// previous record's LSN plus one. 0 is never a record's LSN.
type LSN uint64

// SyncMode selects when WaitDurable returns and when the log is fsynced.
type SyncMode int

const (
	// SyncAlways: WaitDurable returns after fsync (the default). Every flush
	// of the group-commit buffer is followed by an fsync (an fdatasync: see
	// "Durability" in the package documentation).
	SyncAlways SyncMode = iota
	// SyncInterval: WaitDurable returns after write(2); the log is fsynced
	// every Options.SyncInterval while there is unsynced data.
	SyncInterval
	// SyncNever: WaitDurable returns after write(2); the log is fsynced only
	// on rotation, Close and explicit Sync().
	SyncNever
)

func (m SyncMode) String() string {
	switch m {
	case SyncAlways:
		return "always"
	case SyncInterval:
		return "interval"
	case SyncNever:
		return "never"
	}
	return fmt.Sprintf("SyncMode(%d)", int(m))
}

// Options configures Open.
type Options struct {
	FS vfs.FS // required
	// Dir is the WAL directory; it is created (MkdirAll + parent directory
	// fsync) if missing.
	Dir string
	// SegmentSize: the active segment is rotated, between flushes, once
	// its valid data exceeds it; with Preallocate, segment files are
	// zero-filled to this size up front. A segment may exceed it by up to
	// one flush batch (frames are never split; the file is extended).
	// Default 64 MiB.
	SegmentSize int64
	// Preallocate zero-fills each segment to SegmentSize before use, so
	// that group-commit syncs overwrite allocated blocks and fdatasync has
	// no file size to persist (about 2x cheaper on ext4, see
	// BenchmarkSyncCost). Without it segments grow as frames are written.
	// Worth it on disks; on an in-memory filesystem it only costs memory.
	Preallocate bool
	// MaxRecordSize is the largest payload accepted by Append and read by
	// scans; a larger length on disk is corruption. Default 64 MiB, at most
	// 1 GiB.
	MaxRecordSize int
	SyncMode      SyncMode
	// SyncInterval is the fsync period in SyncInterval mode. Default 100ms.
	SyncInterval time.Duration
	// MaxUnsyncedBytes, if positive, makes the flusher fsync (in
	// SyncInterval and SyncNever modes) once that many bytes were written
	// since the last fsync: OnSynced's values are retained until their
	// fsync, so this bounds the memory they hold.
	MaxUnsyncedBytes int64
	// FirstLSN is the LSN of the first record when the directory holds no
	// segment. Default 1.
	FirstLSN LSN
	// CheckApplied makes Open read and check every frame of every segment,
	// as Scan does. By default Open reads only what can hold records after
	// its after argument: segments whose records are all at or below it
	// have only their header checked, the segment holding after+1 is
	// entered at a position hint near it, and after a clean Close the last
	// segment is entered at its end (see "Reopen" in the package
	// documentation). Checking the already-applied prefix is Scan's job
	// (idem verify).
	CheckApplied bool
	// Logger receives warnings (torn tails cut) and errors (I/O failures).
	// nil discards.
	Logger *slog.Logger
	// OnSynced, if non-nil, is called by the flush that fsynced (on the
	// flusher goroutine, or under SyncNever possibly on a WaitDurable
	// caller's: see writeOwn; one flush at a time), in LSN order, after
	// every fsync, with the records that the fsync made
	// durable (never before they are fsynced, in every mode, and never for
	// records whose write or fsync failed). The slice and its elements are
	// only valid during the call; it must not block for long since it delays
	// the next flush, and must not call WaitDurable, Sync or Close (they
	// wait for the flush running it). Values are retained until their
	// fsync, which in SyncNever mode may be a whole segment later.
	OnSynced func(recs []Synced)
	// Ephemeral makes a log that writes nothing: Open creates no directory
	// or file and replays nothing, Append assigns the LSN and keeps only
	// the value for OnSynced (the payload is checked against
	// MaxRecordSize, never encoded or copied), and a flush hands the
	// records appended so far to OnSynced, in LSN order, as if they were
	// fsynced at once (SyncedLSN and WrittenLSN then cover them). There
	// are no segments, no fsyncs and no Syncs in Stats; SyncMode,
	// SyncInterval, MaxUnsyncedBytes, SegmentSize and Preallocate have no
	// use. WaitDurable returns once a flush took the record (a waiter may
	// run that flush itself, as under SyncNever: see writeOwn), which
	// hands it to OnSynced right after waking the waiters; as with a
	// written log, a caller that waits for its next record waits for that
	// handover to end. For state that is
	// rebuilt elsewhere after a restart (see "Ephemeral" in the package
	// documentation).
	Ephemeral bool

	hooks *testHooks // nil outside tests
}

// testHooks let tests stop the WAL's goroutines at chosen points.
type testHooks struct {
	// beforeFill is called by every append between reserving its frame
	// and encoding it.
	beforeFill func(LSN)
	// idle is called by the flusher when it found no work and is about to
	// block until woken.
	idle func()
}

// Synced is a record made durable, as reported to Options.OnSynced.
type Synced struct {
	LSN   LSN
	Type  byte
	Value any // the value passed to Append
}

// Stats is a snapshot of counters.
type Stats struct {
	Segments int
	Bytes    int64 // total valid bytes in all segments (sum of their logical ends)
	// AllocatedBytes is the total size of the segment files: Bytes plus
	// their preallocated zero space. The spare file prepared for the next
	// segment (at most SegmentSize bytes) is not included.
	AllocatedBytes int64
	LastLSN        LSN // last assigned
	WrittenLSN     LSN // last handed to write(2)
	SyncedLSN      LSN // last covered by an fsync
	TornTailsCut   int // torn tails cut by Open
	Syncs          uint64
	SyncTime       time.Duration // total time in the group commit's fdatasyncs
	Writes         uint64
	// SegmentsRecycled counts the old segments RemoveSegmentsThrough kept
	// for reuse instead of removing them, and SparesRecycled the segments
	// started from such a file instead of a zero-filled one (see
	// "Recycling" in the package documentation).
	SegmentsRecycled uint64
	SparesRecycled   uint64
}

var (
	// ErrClosed is returned by operations on a closed WAL.
	ErrClosed = errors.New("wal: closed")
	// ErrFailed is wrapped, together with the original I/O error, by the
	// sticky error returned after a failed write, fsync or rotation.
	ErrFailed = errors.New("wal: failed")
)

// WAL is an append-only, segmented, group-committed write-ahead log.
//
// Appenders reserve their frames' places (and LSNs) in a shared buffer under
// mu and encode the frames there after releasing it; a single flusher
// goroutine swaps that buffer out, writes it with one WriteAt, fdatasyncs per
// SyncMode, publishes progress through atomics and wakes waiters by closing
// a channel (under SyncNever a waiter may run that flush itself: see
// writeOwn). All file I/O on segments happens in flush, one at a time
// (flushMu), except for Open, Close (after the flusher exited) and
// RemoveSegmentsThrough; the spare file for the next segment is prepared by a
// background goroutine that the flusher starts and waits for.
type WAL struct {
	opts   Options // normalised
	logger *slog.Logger

	workC chan struct{} // capacity 1: wakes the flusher
	doneC chan struct{} // closed when the flusher exits

	// Progress, published by the flusher; read without locks.
	written atomic.Uint64 // last LSN successfully handed to write(2)
	synced  atomic.Uint64 // last LSN covered by a successful fsync; <= written
	failed  atomic.Bool   // mirrors mu.err != nil
	syncs   atomic.Uint64
	// syncNanos is the time spent in the group commit's fdatasyncs.
	syncNanos atomic.Uint64
	writes    atomic.Uint64
	// fillWaits counts the flushes that found a frame of the buffer they
	// took still being copied by its appender (see fills).
	fillWaits atomic.Uint64

	tornTailsCut int // set by Open, immutable afterwards

	mu struct {
		sync.Mutex
		// buf holds encoded frames appended since the flusher last took the
		// buffer; its first frame has LSN written+1 once the flusher caught up.
		// An appender reserves its frame's bytes (and LSN) under mu and
		// encodes the frame after releasing it, so the bytes of a frame
		// are only complete once fills says so.
		buf []byte
		// fills counts the frames of buf reserved and not yet encoded. The
		// flusher waits for it after taking buf, before writing it; growing
		// buf waits for it too (the frames move).
		fills *fills
		// recs holds (LSN, type, value) of the frames in buf, for OnSynced;
		// empty when OnSynced is nil.
		recs []Synced
		// lastOff is the offset in buf of the last frame appended (valid
		// when buf is not empty).
		lastOff int
		// nextLSN is the LSN the next Append assigns.
		nextLSN LSN
		// syncTarget: a Sync() caller waits for synced >= syncTarget, so the
		// flusher must fsync while synced < syncTarget.
		syncTarget LSN
		// signaled is set when a wake-up token was sent to workC and the
		// flusher has not taken the buffer since; it spares appenders a
		// channel operation per Append.
		signaled bool
		// Waiters block on one of two channels, so that a flush wakes only
		// the goroutines it can satisfy (waking everybody would also wake
		// the next group-commit cohort, whose records are still in the
		// buffer, and have each of them re-check and re-block):
		//   - curC: records taken by the flush in progress (inFlush and
		//     lsn <= taken); closed when that flush ends.
		//   - nextC: everybody else; at the next buffer swap nextC becomes
		//     curC, since the swap takes every record appended so far.
		// Both are closed on failure and Close. curWaiters and nextWaiters
		// count the goroutines registered on each; the flusher uses the
		// number it woke to batch their next appends (gather).
		curC, nextC             chan struct{}
		curWaiters, nextWaiters int
		inFlush                 bool
		taken                   LSN // last LSN taken by the flush in progress
		// err is the sticky failure (wraps ErrFailed); nil while healthy.
		err error
		// closing is set by Close: Append and Sync refuse from then on.
		closing bool
		// closed is set once the flusher exited and the file is closed.
		closed bool
	}

	// flushMu is held by whoever runs flush: the flusher goroutine, or
	// under SyncNever a waiter that writes the buffer holding its record
	// itself (see wait). Taken before mu, never while holding it.
	flushMu sync.Mutex

	// fl is owned by the holder of flushMu (and by Open before the flusher
	// starts and Close after it exits). timer is the flusher's alone
	// (SyncInterval mode, where no waiter flushes).
	fl struct {
		active     *segFile
		spareBuf   []byte   // the buffer written last time, recycled for appenders
		spareRecs  []Synced // likewise for recs
		spareFills *fills   // likewise for fills (zero: every frame encoded)
		unsynced   []Synced // written but not yet fsynced, for OnSynced
		lastSync   time.Time
		sinceSync  int64       // bytes written since the last fsync
		timer      *time.Timer // SyncInterval mode
		woken      int         // waiters woken by the last notify
		frames     int         // records written by the last flush that wrote
		// prepC receives the result of the background preparation of the
		// spare file (preparePrealloc); nil when none was started since the
		// last rotation (or Open).
		prepC chan error
		// prepRecycledOnly: the preparation in prepC was started by a
		// rotation and only takes a recycled file; it reports
		// errNoRecycled if none was kept, and the flusher then starts a
		// full preparation once the segment is half full.
		prepRecycledOnly bool
		// Position hints (see "Reopen" in doc.go): positions is the ring
		// written to positions.hint, cand a frame boundary written since
		// the last entry, waiting for an fsync to cover it.
		positions []position
		cand      position
		sinceLast int64 // bytes written since the last entry
	}

	// pos hands the position hints to the goroutine that writes
	// positions.hint, so that the flusher never waits for that file.
	pos struct {
		mu      sync.Mutex
		pending []position // the newest ring not yet written (nil: none); guarded by mu
		writing bool       // a writer goroutine runs; guarded by mu
		wg      sync.WaitGroup
	}

	segMu sync.Mutex
	// segs lists the segments, oldest first; the last one is the active
	// segment (its LastLSN and Size are updated after every write). Guarded
	// by segMu.
	segs []SegmentInfo

	// removeMu serialises RemoveSegmentsThrough calls, so that only one
	// caller drops segments from the front of segs.
	removeMu sync.Mutex

	// recycleMu guards the recycled files (recycledName): RemoveSegmentsThrough
	// moves old segments there, prepareSpare (possibly in the background)
	// takes one as the spare file.
	recycleMu sync.Mutex
	// recycled is set once RemoveSegmentsThrough kept a segment for reuse:
	// from then on a rotation does not zero-fill a spare file right away
	// (see startPrep).
	recycled atomic.Bool
	// segmentsRecycled and sparesRecycled are Stats.SegmentsRecycled and
	// Stats.SparesRecycled.
	segmentsRecycled, sparesRecycled atomic.Uint64
}

func (o *Options) normalize() error {
	if o.FS == nil {
		return errors.New("wal: Options.FS is required")
	}
	if o.Dir == "" {
		return errors.New("wal: Options.Dir is required")
	}
	o.Dir = o.FS.PathJoin(o.Dir) // clean it ("./x" confuses MemFS)
	if o.SegmentSize <= 0 {
		o.SegmentSize = defaultSegmentSize
	}
	if o.MaxRecordSize <= 0 {
		o.MaxRecordSize = defaultMaxRecordSize
	}
	if o.MaxRecordSize > maxRecordSizeLimit {
		return fmt.Errorf("wal: Options.MaxRecordSize %d exceeds the limit %d", o.MaxRecordSize, maxRecordSizeLimit)
	}
	switch o.SyncMode {
	case SyncAlways, SyncInterval, SyncNever:
	default:
		return fmt.Errorf("wal: invalid Options.SyncMode %d", int(o.SyncMode))
	}
	if o.Ephemeral {
		// A waiter hands the records to OnSynced itself, as a SyncNever
		// waiter writes them (wait); nothing is fsynced or written.
		o.SyncMode, o.Preallocate, o.MaxUnsyncedBytes = SyncNever, false, 0
	}
	if o.SyncInterval <= 0 {
		o.SyncInterval = defaultSyncInterval
	}
	if o.FirstLSN == 0 {
		o.FirstLSN = 1
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// Open scans the WAL directory like Scan (calling fn for every record with
// LSN > after, during the scan: this is how the caller replays), repairs the
// last segment and opens it for appending at the end of its valid data:
//
//   - a torn tail is cut: the cut bytes (up to the last non-zero byte) are
//     first saved to "<segment>.torn" (fsynced, directory fsynced), then
//     overwritten with zeros in place and fsynced (the file keeps its size);
//     a warning is logged and Stats.TornTailsCut counts it;
//   - trailing zero bytes (a clean end: the preallocated space) are kept;
//     appends overwrite them;
//   - a last segment whose header is torn is removed (its non-zero bytes
//     saved first);
//   - with no segment left, the first segment is created, preallocated
//     (named Options.FirstLSN, or the LSN of a removed torn-header segment).
//
// The last segment is fsynced before Open returns, so everything replayed is
// durable. A leftover spare file (next.prealloc) is reused if intact, or
// replaced, by the next preparation (in Open itself when it creates the
// first segment, otherwise later in the background). The returned
// ScanResult describes the log after repair (Segments includes a newly
// created segment; TornTail.SavedAs is set). Nothing is repaired when fn or
// the scan fails.
func Open(o Options, after LSN, fn func(Record) error) (*WAL, ScanResult, error) {
	if err := o.normalize(); err != nil {
		return nil, ScanResult{}, err
	}
	if o.Ephemeral {
		w := &WAL{opts: o, logger: o.Logger}
		w.start(o.FirstLSN - 1)
		return w, ScanResult{LastLSN: o.FirstLSN - 1}, nil
	}
	fs, dir := o.FS, o.Dir
	if err := EnsureDir(fs, dir); err != nil {
		return nil, ScanResult{}, fmt.Errorf("wal: creating %s: %w", dir, err)
	}
	sc := &scanner{fs: fs, dir: dir, after: after, maxRec: o.MaxRecordSize, fn: fn, skipApplied: !o.CheckApplied}
	var hintPresent bool
	sc.hint, hintPresent = readHint(fs, dir)
	if o.CheckApplied {
		sc.hint = nil
	} else {
		sc.positions = readPositions(fs, dir)
	}
	out, err := sc.run()
	if err != nil {
		return nil, out.result(), err
	}
	res := out.result()
	res.SkippedBytes = out.skipped
	w := &WAL{opts: o, logger: o.Logger}
	if hintPresent {
		// Before anything is appended; repair's directory fsync below
		// makes the removal durable, so the hint can never outlive the
		// end it describes.
		if err := removeHint(fs, dir); err != nil {
			return nil, res, fmt.Errorf("wal: removing %s: %w", hintName, err)
		}
	}
	if err := w.repair(&out, &res); err != nil {
		return nil, res, err
	}
	if !o.Preallocate {
		w.removeRecycled()
	}
	res.Segments = slices.Clone(out.segs)
	res.LastLSN = out.lastLSN
	if out.skipped > 0 {
		w.logger.Debug("wal: opened without reading the applied prefix", "after", uint64(after), "bytes_not_read", out.skipped)
	}

	w.segs = out.segs
	w.start(out.lastLSN)
	return w, res, nil
}

// start sets the WAL up to append after last and starts the flusher.
func (w *WAL) start(last LSN) {
	w.written.Store(uint64(last))
	w.synced.Store(uint64(last))
	w.mu.nextLSN = last + 1
	w.mu.syncTarget = last
	w.mu.curC = make(chan struct{})
	w.mu.nextC = make(chan struct{})
	w.mu.fills, w.fl.spareFills = newFills(), newFills()
	w.workC = make(chan struct{}, 1)
	w.doneC = make(chan struct{})
	w.fl.lastSync = time.Now()
	go w.run()
}

// repair applies the repairs described in Open's comment and leaves the
// active segment open in w.fl.active. out.segs and out.lastLSN are updated to
// the repaired state.
func (w *WAL) repair(out *scanOutcome, res *ScanResult) error {
	fs, dir := w.opts.FS, w.opts.Dir
	if (out.tail == tailTorn || out.tail == tailTornHeader) && out.nonZero() {
		saved, err := saveTorn(fs, dir, out.tailSeg, out.cut, out.nzEnd)
		if err != nil {
			return fmt.Errorf("wal: saving torn tail of %s: %w", out.tailSeg, err)
		}
		res.TornTail.SavedAs = saved
		w.tornTailsCut++
		w.logger.Warn("wal: cutting torn tail", "segment", out.tailSeg, "offset", out.cut,
			"bytes", out.nzEnd-out.cut, "saved_as", saved)
	}
	var active *segFile
	var err error
	existing := true // active is a segment the scan found (not created here)
	switch out.tail {
	case tailTornHeader:
		// The header was never fsynced, so neither was anything else in the
		// file: remove it, then continue the previous segment, or recreate
		// it (with the LSN of its name, so LSNs never go backwards).
		if err := fs.Remove(fs.PathJoin(dir, out.tailSeg)); err != nil {
			return fmt.Errorf("wal: removing torn segment %s: %w", out.tailSeg, err)
		}
		if err := SyncDir(fs, dir); err != nil {
			return fmt.Errorf("wal: syncing %s: %w", dir, err)
		}
		w.logger.Info("wal: removed segment with a torn header", "segment", out.tailSeg)
	case tailTorn:
		// Cut by zeroing: the file keeps its preallocated size, and the
		// zeros are a clean end for the next scan. Open's Sync below makes
		// the cut durable.
		last := out.segs[len(out.segs)-1]
		active, err = openSegmentForAppend(fs, dir, last.Name, last.FirstLSN, last.Size, last.Allocated, out.lastVersion == segmentVersionRecycled)
		if err == nil {
			if err = zeroRange(active.f, out.cut, out.nzEnd); err != nil {
				_ = active.f.Close()
				active = nil
			}
		}
	}
	switch {
	case err != nil || active != nil:
	case len(out.segs) > 0:
		last := out.segs[len(out.segs)-1]
		active, err = openSegmentForAppend(fs, dir, last.Name, last.FirstLSN, last.Size, last.Allocated, out.lastVersion == segmentVersionRecycled)
	default:
		existing = false
		first := w.opts.FirstLSN
		if out.tail == tailTornHeader {
			first = out.tailFirst
		}
		err = w.prepareSpare()
		if err == nil {
			active, err = activateSegment(fs, dir, first)
		}
		if err == nil {
			out.segs = append(out.segs, SegmentInfo{Name: active.name, FirstLSN: first,
				LastLSN: first - 1, Size: active.end, Allocated: active.alloc})
			out.lastLSN = first - 1
		}
	}
	if err != nil {
		return fmt.Errorf("wal: opening the active segment: %w", err)
	}
	if last := out.segs[len(out.segs)-1]; last.Name == active.name && last.LastLSN >= last.FirstLSN {
		active.lastOff, active.lastLSN = out.lastOff, last.LastLSN
	} else {
		active.lastLSN = active.first - 1
	}
	if existing && out.lastVersion == segmentVersion1 {
		// A version 1 segment (frames without the synced LSN) is never
		// appended to: frames of one format per segment.
		if active, err = w.upgradeActive(active, out); err != nil {
			return fmt.Errorf("wal: starting a version %d segment after the version 1 segment: %w", segmentVersion, err)
		}
	}
	// The replayed records may only be in the page cache (the previous
	// process may have died before its fsync): make them durable before
	// anyone treats them as such.
	if err := active.f.Sync(); err != nil {
		_ = active.f.Close()
		return fmt.Errorf("wal: syncing %s: %w", active.name, err)
	}
	if err := SyncDir(fs, dir); err != nil {
		_ = active.f.Close()
		return fmt.Errorf("wal: syncing %s: %w", dir, err)
	}
	w.fl.active = active
	return nil
}

// upgradeActive replaces the version 1 last segment as the active segment.
// If it holds no frame its header is rewritten as version 2 in place (a
// crash during the rewrite leaves a torn header over an empty segment,
// which the next Open removes and recreates); otherwise it is fsynced and
// the next segment, starting at its last LSN plus one, is created as at a
// rotation.
func (w *WAL) upgradeActive(active *segFile, out *scanOutcome) (*segFile, error) {
	fs, dir := w.opts.FS, w.opts.Dir
	last := &out.segs[len(out.segs)-1]
	if last.LastLSN < last.FirstLSN {
		if _, err := active.f.WriteAt(encodeSegmentHeader(active.first), 0); err != nil {
			_ = active.f.Close()
			return nil, err
		}
		return active, nil
	}
	if err := active.f.Sync(); err != nil {
		_ = active.f.Close()
		return nil, err
	}
	if err := w.prepareSpare(); err != nil {
		_ = active.f.Close()
		return nil, err
	}
	next := last.LastLSN + 1
	seg, err := activateSegment(fs, dir, next)
	if cerr := active.f.Close(); err == nil && cerr != nil {
		w.logger.Warn("wal: closing a version 1 segment", "segment", active.name, "error", cerr)
	}
	if err != nil {
		return nil, err
	}
	w.logger.Info("wal: started a new segment after a version 1 segment", "segment", seg.name, "previous", active.name)
	out.segs = append(out.segs, SegmentInfo{Name: seg.name, FirstLSN: next, LastLSN: next - 1, Size: seg.end, Allocated: seg.alloc})
	return seg, nil
}

// Append frames payload (copying it) into the group-commit buffer, assigns
// the next LSN and returns it. It does not wait for I/O; use WaitDurable.
// typ must be non-zero and payload at most Options.MaxRecordSize bytes. v is
// handed back through Options.OnSynced. Safe for concurrent use. After a
// failed write or fsync it returns the sticky error (wrapping ErrFailed)
// forever; after Close it returns ErrClosed.
func (w *WAL) Append(typ byte, payload []byte, v any) (LSN, error) {
	return w.append(typ, payload, v, nil)
}

// AppendWith is Append for callers that need the LSN to build the value
// handed to OnSynced: fn is called with the record's LSN under the WAL's
// lock (so before the flusher can see the record) and returns the value.
// fn must be quick and must not call the WAL.
func (w *WAL) AppendWith(typ byte, payload []byte, fn func(LSN) any) (LSN, error) {
	return w.append(typ, payload, nil, fn)
}

func (w *WAL) append(typ byte, payload []byte, v any, fn func(LSN) any) (LSN, error) {
	if typ == 0 {
		return 0, errors.New("wal: record type 0 is reserved")
	}
	if len(payload) > w.opts.MaxRecordSize {
		return 0, fmt.Errorf("wal: payload of %d bytes exceeds MaxRecordSize %d", len(payload), w.opts.MaxRecordSize)
	}
	n := frameSize(len(payload))
	// Only the LSN and the frame's place in buf are decided under mu; the
	// frame (a copy and a checksum of the payload) is encoded after
	// releasing it, which keeps the critical section that every appender
	// of the engine queues on short.
	w.mu.Lock()
	if err := w.mu.err; err != nil {
		w.mu.Unlock()
		return 0, err
	}
	if w.mu.closing {
		w.mu.Unlock()
		return 0, ErrClosed
	}
	lsn := w.mu.nextLSN
	if lsn == math.MaxUint64 {
		w.mu.Unlock()
		return 0, errors.New("wal: LSN space exhausted")
	}
	w.mu.nextLSN++
	if w.opts.Ephemeral {
		return w.appendEphemeralLocked(lsn, typ, v, fn), nil
	}
	off := len(w.mu.buf)
	if cap(w.mu.buf)-off < n {
		// The frames still being encoded into buf must be complete
		// before they are copied. Their appenders do not need mu to
		// finish, and buf settles at its working size (it is recycled),
		// so this wait is rare.
		w.mu.fills.wait(w)
		nb := make([]byte, off, max(2*cap(w.mu.buf), off+n, 64<<10))
		copy(nb, w.mu.buf)
		w.mu.buf = nb
	}
	w.mu.buf = w.mu.buf[:off+n]
	frame := w.mu.buf[off : off+n]
	f := w.mu.fills
	f.add()
	w.mu.lastOff = off
	if fn != nil {
		v = fn(lsn)
	}
	if w.opts.OnSynced != nil {
		w.mu.recs = append(w.mu.recs, Synced{LSN: lsn, Type: typ, Value: v})
	}
	signal := !w.mu.signaled
	w.mu.signaled = true
	w.mu.Unlock()
	// Woken now, the flusher takes this frame's buffer sooner; it waits
	// for the frame below before writing it. Waking after encoding would
	// hold back every record appended meanwhile behind this one (they
	// see signaled and leave the wake-up to this append).
	if signal {
		w.wake()
	}
	if h := w.opts.hooks; h != nil && h.beforeFill != nil {
		h.beforeFill(lsn)
	}
	// Every record up to synced was fsynced before this frame can be
	// written (the flusher writes it only after f.done): recovery uses it
	// to tell lost fsynced frames from a torn tail (see "Torn tail vs
	// corruption" in doc.go).
	putFrame(frame, lsn, LSN(w.synced.Load()), typ, payload)
	f.done()
	return lsn, nil
}

// appendEphemeralLocked is append's end in Ephemeral mode, with w.mu held
// and lsn assigned: no frame, only the value for OnSynced. It releases
// w.mu.
func (w *WAL) appendEphemeralLocked(lsn LSN, typ byte, v any, fn func(LSN) any) LSN {
	if fn != nil {
		v = fn(lsn)
	}
	if w.opts.OnSynced == nil {
		// Nothing to hand over: the record is "written" and "synced" now
		// (under w.mu, so the LSNs published only grow).
		w.written.Store(uint64(lsn))
		w.synced.Store(uint64(lsn))
		w.mu.Unlock()
		return lsn
	}
	w.mu.recs = append(w.mu.recs, Synced{LSN: lsn, Type: typ, Value: v})
	signal := !w.mu.signaled
	w.mu.signaled = true
	w.mu.Unlock()
	if signal {
		w.wake()
	}
	return lsn
}

// fills counts the frames of one group-commit buffer that were reserved
// (under w.mu) and encoded (by their appenders, without it), so that
// nobody reads or moves the buffer before they are complete. There are
// two, swapped with the buffers. An append costs one atomic add here:
// only a waiter (the flusher, or an appender growing the buffer: one at a
// time, see wait) publishes a target for the encoders to compare with.
type fills struct {
	reserved int64        // frames reserved; guarded by w.mu while the buffer takes frames
	filled   atomic.Int64 // frames encoded
	// target, when not zero, is the reserved count a waiter waits for:
	// the encoder that brings filled to it sends a token on c.
	target atomic.Int64
	c      chan struct{} // capacity 1
}

func newFills() *fills { return &fills{c: make(chan struct{}, 1)} }

// add counts a reserved frame; w.mu is held.
func (f *fills) add() { f.reserved++ }

// done marks a reserved frame as encoded. Either the waiter sees the
// new count after publishing its target, or this sees the target after
// adding (sequentially consistent atomics), so a waiter is never left
// blocked.
func (f *fills) done() {
	if f.filled.Add(1) == f.target.Load() {
		select {
		case f.c <- struct{}{}:
		default: // a token is pending already
		}
	}
}

// wait returns once every reserved frame is encoded. It is called by the
// flusher for the buffer it took (no appender reserves in it any more)
// and by an appender growing the buffer (it holds w.mu, so nobody
// reserves meanwhile); never by both on one fills. A token left over from
// an earlier wait only costs one more look at filled.
func (f *fills) wait(w *WAL) {
	n := f.reserved
	if f.filled.Load() == n {
		return
	}
	w.fillWaits.Add(1)
	f.target.Store(n)
	for f.filled.Load() != n {
		<-f.c
	}
	f.target.Store(0)
}

// reset empties f once the buffer it counts was written; the flusher calls
// it before the buffer (and f) are handed to appenders again.
func (f *fills) reset() {
	f.reserved = 0
	f.filled.Store(0)
}

// wake makes sure the flusher runs soon.
func (w *WAL) wake() {
	select {
	case w.workC <- struct{}{}:
	default: // a token is already pending
	}
}

// WaitDurable blocks until lsn is durable per the SyncMode (SyncAlways:
// fsynced; otherwise written to the OS), or the WAL failed or closed. It
// returns nil only if lsn is durable. It takes no context on purpose: a
// durability wait must not be abandoned half way (callers can wrap it).
func (w *WAL) WaitDurable(lsn LSN) error {
	return w.wait(lsn, w.opts.SyncMode == SyncAlways)
}

// Sync writes and fsyncs everything appended so far and waits for it.
func (w *WAL) Sync() error {
	w.mu.Lock()
	if err := w.mu.err; err != nil {
		w.mu.Unlock()
		return err
	}
	if w.mu.closing {
		w.mu.Unlock()
		return ErrClosed
	}
	target := w.mu.nextLSN - 1
	if LSN(w.synced.Load()) >= target {
		w.mu.Unlock()
		return nil
	}
	w.mu.syncTarget = max(w.mu.syncTarget, target)
	signal := !w.mu.signaled
	w.mu.signaled = true
	w.mu.Unlock()
	if signal {
		w.wake()
	}
	return w.wait(target, true)
}

// durable reports whether lsn is durable in the sense required by a waiter.
func (w *WAL) durable(lsn LSN, needSync bool) bool {
	if LSN(w.synced.Load()) >= lsn {
		return true
	}
	// Written-but-unsynced data is only good enough while healthy: after a
	// failed fsync the page cache may have dropped it.
	return !needSync && LSN(w.written.Load()) >= lsn && !w.failed.Load()
}

func (w *WAL) wait(lsn LSN, needSync bool) error {
	for {
		if w.durable(lsn, needSync) {
			return nil
		}
		w.mu.Lock()
		if w.durable(lsn, needSync) {
			w.mu.Unlock()
			return nil
		}
		if err := w.mu.err; err != nil {
			w.mu.Unlock()
			return err
		}
		if w.mu.closed {
			w.mu.Unlock()
			return ErrClosed
		}
		if lsn >= w.mu.nextLSN {
			last := w.mu.nextLSN - 1
			w.mu.Unlock()
			return fmt.Errorf("wal: waiting for LSN %d beyond the last assigned LSN %d", lsn, last)
		}
		if w.opts.SyncMode == SyncNever && !needSync && !(w.mu.inFlush && lsn <= w.mu.taken) {
			w.mu.Unlock()
			if w.writeOwn() {
				continue
			}
			w.mu.Lock()
			if w.durable(lsn, needSync) || w.mu.err != nil || w.mu.closed {
				w.mu.Unlock()
				continue
			}
		}
		var ch chan struct{}
		if w.mu.inFlush && lsn <= w.mu.taken {
			ch = w.mu.curC
			w.mu.curWaiters++
		} else {
			ch = w.mu.nextC
			w.mu.nextWaiters++
		}
		w.mu.Unlock()
		<-ch
	}
}

// writeOwn is the SyncNever waiter's flush: rather than hand its record
// to the flusher goroutine and sleep until it is written (a wake-up of
// another goroutine, and of its thread, per record waited for), the
// waiter writes the buffer itself when no flush is running, exactly as
// the flusher would (the same flush: every record appended so far, the
// waiters of the buffer woken, an fsync when rotation or
// MaxUnsyncedBytes asks for one, OnSynced then called from this
// goroutine). It reports whether it flushed. It leaves the flush to the
// flusher once Close began (the flusher makes the last flush, then Close
// owns the file), and when the last flush wrote more than one record or
// woke more than one waiter: with concurrent appenders the flusher's
// gather lets them append before it takes the buffer (group commit),
// where each waiter writing at once would write a record or two per
// write. A lone writer (raft's FSM goroutine applying a batch) writes its
// own records.
func (w *WAL) writeOwn() bool {
	if !w.flushMu.TryLock() {
		return false
	}
	w.mu.Lock()
	own := !w.mu.closing && w.mu.err == nil && w.fl.woken <= 1 && w.fl.frames <= 1
	w.mu.Unlock()
	if own {
		w.fl.woken = 0 // no gather: this waiter's record is in the buffer already
		w.flush()
	}
	w.flushMu.Unlock()
	// Records appended after this flush took the buffer, or left to the
	// flusher (their wake-up may have found it unable to take flushMu), or
	// Close begun meanwhile: the flusher must run. Checked after the
	// unlock, so that the flusher this wakes can take flushMu.
	if w.hasWork() {
		w.wake()
	}
	return own
}

// SyncedLSN returns the last LSN covered by an fsync.
func (w *WAL) SyncedLSN() LSN { return LSN(w.synced.Load()) }

// LastLSN returns the last assigned LSN.
func (w *WAL) LastLSN() LSN {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.mu.nextLSN - 1
}

// Stats returns a snapshot of counters.
func (w *WAL) Stats() Stats {
	s := Stats{
		LastLSN:      w.LastLSN(),
		WrittenLSN:   LSN(w.written.Load()),
		SyncedLSN:    LSN(w.synced.Load()),
		TornTailsCut: w.tornTailsCut,
		Syncs:        w.syncs.Load(),
		SyncTime:     time.Duration(w.syncNanos.Load()),
		Writes:       w.writes.Load(),

		SegmentsRecycled: w.segmentsRecycled.Load(),
		SparesRecycled:   w.sparesRecycled.Load(),
	}
	w.segMu.Lock()
	s.Segments = len(w.segs)
	for _, seg := range w.segs {
		s.Bytes += seg.Size
		s.AllocatedBytes += seg.Allocated
	}
	w.segMu.Unlock()
	return s
}

// Segments returns the segments, oldest first; the last one is active.
func (w *WAL) Segments() []SegmentInfo {
	w.segMu.Lock()
	defer w.segMu.Unlock()
	return slices.Clone(w.segs)
}

// RemoveSegmentsThrough removes, oldest first, every non-active segment whose
// LastLSN <= lsn, fsyncing the directory after each removal (so a crash can
// only leave a suffix of the log, never a gap). With preallocation, up to two
// full segments are kept for reuse instead (renamed, then recycled as later
// segments: see "Recycling" in the package documentation); they count as
// removed. It returns the number of segments and bytes (file sizes,
// SegmentInfo.Allocated) removed; on error, what was removed before it.
func (w *WAL) RemoveSegmentsThrough(lsn LSN) (int, int64, error) {
	w.removeMu.Lock()
	defer w.removeMu.Unlock()
	w.mu.Lock()
	closing := w.mu.closing
	w.mu.Unlock()
	if closing {
		return 0, 0, ErrClosed
	}
	w.segMu.Lock()
	var victims []SegmentInfo
	for _, s := range w.segs[:max(len(w.segs), 1)-1] {
		if s.LastLSN > lsn {
			break
		}
		victims = append(victims, s)
	}
	w.segMu.Unlock()

	fs, dir := w.opts.FS, w.opts.Dir
	var count int
	var bytes int64
	for _, s := range victims {
		recycled, err := w.recycleSegment(s)
		if !recycled && err == nil {
			err = fs.Remove(fs.PathJoin(dir, s.Name))
		}
		if err != nil && !recycled {
			return count, bytes, fmt.Errorf("wal: removing %s: %w", s.Name, err)
		}
		// Only removeMu holders drop from the front, so segs[0] is s.
		w.segMu.Lock()
		w.segs = slices.Delete(w.segs, 0, 1)
		w.segMu.Unlock()
		count++
		bytes += s.Allocated
		if err != nil {
			return count, bytes, fmt.Errorf("wal: recycling %s: %w", s.Name, err)
		}
		if recycled {
			continue // recycleSegment fsynced the directory
		}
		if err := SyncDir(fs, dir); err != nil {
			return count, bytes, fmt.Errorf("wal: syncing %s: %w", dir, err)
		}
	}
	return count, bytes, nil
}

// recycleSegment keeps the old segment s for reuse as a later segment
// instead of removing it (see "Recycling" in doc.go), if segments are
// preallocated, s is a full one (at least SegmentSize bytes, at most twice
// that) and fewer than maxRecycled recycled files are kept (one while the
// disk has less than two segments' worth of free space, as for
// preallocation: the space of the others is given back). It reports
// whether s was moved away (an error then concerns the recycled file, not
// the log).
func (w *WAL) recycleSegment(s SegmentInfo) (bool, error) {
	fs, dir, size := w.opts.FS, w.opts.Dir, w.preallocSize()
	if size == 0 || s.Allocated < size || s.Allocated > 2*size {
		return false, nil
	}
	slots := maxRecycled
	if du, err := fs.GetDiskUsage(dir); err == nil && du.AvailBytes < 2*uint64(size) {
		slots = 1
	}
	w.recycleMu.Lock()
	defer w.recycleMu.Unlock()
	ok, err := recycleSegment(fs, dir, s.Name, s.LastLSN+1, slots)
	if ok {
		w.recycled.Store(true)
		w.segmentsRecycled.Add(1)
	}
	return ok, err
}

// Close flushes and fsyncs everything appended, stops the flusher and closes
// the active segment. It returns the sticky failure if the WAL failed. A
// second call returns ErrClosed.
func (w *WAL) Close() error {
	w.mu.Lock()
	if w.mu.closing {
		w.mu.Unlock()
		return ErrClosed
	}
	w.mu.closing = true
	w.mu.Unlock()
	w.wake()
	<-w.doneC
	w.pos.wg.Wait()
	if w.fl.prepC != nil {
		if err := w.awaitPrep(); err != nil && !errors.Is(err, errNoRecycled) {
			// Only the spare file is affected; the next Open replaces it.
			w.logger.Warn("wal: preparing the next segment", "error", err)
		}
	}

	var cerr error
	if a := w.fl.active; a != nil {
		cerr = a.f.Close()
		w.fl.active = nil
		w.mu.Lock()
		healthy := w.mu.err == nil
		w.mu.Unlock()
		if healthy && cerr == nil && LSN(w.synced.Load()) == a.lastLSN {
			// Everything is fsynced and nothing more will be written:
			// the next Open can start at the end (see "Reopen" in doc.go).
			h := &closeHint{segment: a.name, first: a.first, lastOff: a.lastOff, lastLSN: a.lastLSN, end: a.end}
			if err := writeHint(w.opts.FS, w.opts.Dir, h); err != nil {
				w.logger.Warn("wal: writing the close hint (the next Open reads the last segment in full)", "error", err)
			}
		}
	}
	if w.fl.timer != nil {
		w.fl.timer.Stop()
	}
	w.mu.Lock()
	w.mu.closed = true
	err := w.mu.err
	w.notifyAllLocked()
	w.mu.Unlock()
	if err != nil {
		return err
	}
	if cerr != nil {
		return fmt.Errorf("wal: closing %s: %w", w.opts.Dir, cerr)
	}
	return nil
}

// endFlushLocked ends the flush in progress: it wakes the waiters whose
// records the flush took (they re-check durability: a flush that did not
// fsync leaves needSync waiters to block again, on nextC) and remembers how
// many it woke for gather. w.mu must be held; calling it twice is harmless.
// A channel is only replaced once closed, so a flush that nobody waits for
// allocates nothing.
func (w *WAL) endFlushLocked() {
	if c := w.detachFlushLocked(); c != nil {
		close(c)
	}
}

// detachFlushLocked is endFlushLocked without the wake-up: it returns the
// channel of the waiters to wake (nil if none), which the caller closes
// once it released w.mu. Closing readies every waiter, one by one (up to
// one per caller: hundreds), and appenders and new waiters need w.mu
// meanwhile. No waiter can register on the returned channel any more.
func (w *WAL) detachFlushLocked() chan struct{} {
	w.mu.inFlush = false
	w.fl.woken = w.mu.curWaiters
	if w.mu.curWaiters == 0 {
		return nil
	}
	c := w.mu.curC
	w.mu.curC = make(chan struct{})
	w.mu.curWaiters = 0
	return c
}

// notifyAllLocked wakes every waiter (failure, Close). w.mu must be held.
func (w *WAL) notifyAllLocked() {
	w.endFlushLocked()
	if w.mu.nextWaiters > 0 {
		close(w.mu.nextC)
		w.mu.nextC = make(chan struct{})
		w.mu.nextWaiters = 0
	}
}

// fail records the sticky error and wakes everyone. Called by the flusher.
func (w *WAL) fail(op string, err error) {
	name := ""
	if w.fl.active != nil {
		name = w.fl.active.name
	}
	w.logger.Error("wal: I/O failure; the log refuses further appends", "op", op, "segment", name, "error", err)
	w.mu.Lock()
	if w.mu.err == nil {
		w.mu.err = fmt.Errorf("%w: %s %s: %w", ErrFailed, op, name, err)
		w.failed.Store(true)
	}
	w.notifyAllLocked()
	w.mu.Unlock()
	// Records that were written but not fsynced are never reported.
	clear(w.fl.unsynced)
	w.fl.unsynced = w.fl.unsynced[:0]
}

// run is the flusher goroutine.
func (w *WAL) run() {
	defer close(w.doneC)
	for {
		// A waiter holding flushMu is writing the buffer (writeOwn): it
		// takes every record appended before its flush and wakes this
		// goroutine if it leaves work behind, so the flusher waits for a
		// wake-up rather than for the lock.
		if w.flushMu.TryLock() {
			exit := w.flush()
			w.flushMu.Unlock()
			if exit {
				return
			}
			if w.hasWork() {
				continue
			}
		}
		if h := w.opts.hooks; h != nil && h.idle != nil {
			h.idle()
		}
		var timerC <-chan time.Time
		if w.fl.timer != nil {
			timerC = w.fl.timer.C
		}
		select {
		case <-w.workC:
		case <-timerC:
		}
	}
}

// hasWork reports whether a flush should start right away.
func (w *WAL) hasWork() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.mu.err == nil && (len(w.mu.buf) > 0 || len(w.mu.recs) > 0 || w.mu.closing ||
		w.mu.syncTarget > LSN(w.synced.Load()))
}

// pendingFrames returns how many records were appended and not yet taken.
func (w *WAL) pendingFrames() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return int(w.mu.nextLSN - 1 - LSN(w.written.Load()))
}

// gather gives the waiters woken by the last flush a chance to append their
// next records before the next flush starts, so that they share one fsync
// instead of being split across two. It yields the processor while the
// number of pending records keeps growing and is below the number of woken
// waiters; it stops at the first yield that brings nothing new, so a lone
// appender pays one Gosched at most.
//
// At 512 callers on 2 processors the cohort takes longer to come back than
// an fsync lasts, so the disk idles while it appends and the processors
// idle during the fsync. Splitting the cohort so that one part's fsync runs
// while the other appends was measured twice with the engine
// (bench/peers, idem at 512 callers, interleaved with this version): not
// gathering at all, and skipping gather while the woken waiters' measured
// re-append time exceeded the last fdatasync's. Both lost (85-183k fresh
// requests/s here against 68-117k, CPU per request 8.4-11 µs against
// 12-14 µs): the extra fdatasyncs cost kernel CPU, and each flush's work
// in the engine (waking, applying its records) is spread over fewer
// records. BenchmarkGroupCommitWork, whose callers have no such per-flush
// cost, shows the opposite. Bounding gather by the last fdatasync's
// duration (branch gather512-budget) was a coin toss at 512 callers on a
// loaded machine and lost every round at 64, whose cohort, on processors
// shared with other work, takes longer than an fsync to come back.
func (w *WAL) gather() {
	woken := w.fl.woken
	w.fl.woken = 0
	if woken <= 1 {
		return
	}
	prev := -1
	for i := 0; i < 64; i++ {
		n := w.pendingFrames()
		if n >= woken || n == prev {
			return
		}
		prev = n
		runtime.Gosched()
	}
}

// flush runs one flush cycle: take the buffer, write it, fdatasync if the mode
// or a caller requires, publish progress, wake waiters, report to OnSynced
// and rotate if the segment is full. It returns true when the flusher must
// exit (Close was called and everything has been flushed, or the WAL failed
// and is closing).
func (w *WAL) flush() (exit bool) {
	w.gather()
	if w.opts.Ephemeral {
		return w.flushEphemeral()
	}

	w.mu.Lock()
	buf, recs, lastOff, fills := w.mu.buf, w.mu.recs, w.mu.lastOff, w.mu.fills
	w.mu.buf, w.mu.recs, w.mu.fills = w.fl.spareBuf[:0], w.fl.spareRecs[:0], w.fl.spareFills
	last := w.mu.nextLSN - 1
	syncWanted := w.mu.syncTarget > LSN(w.synced.Load())
	closing := w.mu.closing
	failed := w.mu.err != nil
	w.mu.signaled = false
	// Every waiter on nextC waits for an LSN below nextLSN: this flush
	// takes all of them. curC is idle (the last flush ended), so the two
	// channels swap.
	w.mu.inFlush, w.mu.taken = true, last
	w.mu.curC, w.mu.nextC = w.mu.nextC, w.mu.curC
	w.mu.curWaiters, w.mu.nextWaiters = w.mu.nextWaiters, 0
	w.mu.Unlock()
	// The appenders of the last frames taken may still be encoding them;
	// until they are done, buf is neither written nor recycled.
	fills.wait(w)
	fills.reset()
	w.fl.spareFills = fills
	// Whatever path this flush leaves by, its waiters are woken (most
	// paths do it earlier, right after the write or fsync).
	defer func() {
		w.mu.Lock()
		if w.mu.inFlush {
			w.endFlushLocked()
		}
		w.mu.Unlock()
	}()

	w.recycle(buf, recs)
	defer clear(recs) // drop references to the values once reported or discarded
	if failed {
		return closing
	}
	wrote := false
	if len(buf) > 0 {
		start := w.fl.active.end
		if err := w.fl.active.write(buf); err != nil {
			w.fail("write", err)
			return closing
		}
		if w.fl.cand.lsn == 0 && w.fl.sinceLast >= w.positionInterval() {
			w.fl.cand = position{first: w.fl.active.first, off: start, lsn: LSN(w.written.Load()) + 1}
		}
		w.fl.sinceLast += int64(len(buf))
		w.fl.sinceSync += int64(len(buf))
		w.fl.active.lastOff, w.fl.active.lastLSN = start+int64(lastOff), last
		w.writes.Add(1)
		w.fl.frames = int(last - LSN(w.written.Load()))
		w.written.Store(uint64(last))
		wrote = true
		if w.opts.OnSynced != nil {
			w.fl.unsynced = append(w.fl.unsynced, recs...)
		}
		w.segMu.Lock()
		s := &w.segs[len(w.segs)-1]
		s.LastLSN, s.Size, s.Allocated = last, w.fl.active.end, w.fl.active.alloc
		w.segMu.Unlock()
		if w.fl.active.end >= w.opts.SegmentSize/2 {
			w.prepHalfFull()
		}
	}

	unsynced := w.synced.Load() < w.written.Load()
	// Only a flush that wrote rotates: a segment reopened past a smaller
	// SegmentSize takes the next batch first, so the layout does not depend
	// on whether Open's first (empty) flush ran before it.
	rotate := wrote && w.fl.active.end > w.opts.SegmentSize && !closing
	doSync := unsynced && (w.opts.SyncMode == SyncAlways || syncWanted || closing || rotate ||
		(w.opts.SyncMode == SyncInterval && time.Since(w.fl.lastSync) >= w.opts.SyncInterval) ||
		(w.opts.MaxUnsyncedBytes > 0 && w.fl.sinceSync >= w.opts.MaxUnsyncedBytes))
	if doSync {
		// fdatasync: the frames normally overwrite preallocated, already
		// fsynced zeros, so no metadata needs to be committed; when a batch
		// extended the file, fdatasync commits the new size too (it is
		// needed to read the data back).
		t0 := time.Now()
		if err := w.fl.active.f.SyncData(); err != nil {
			w.fail("sync", err)
			return closing
		}
		w.syncNanos.Add(uint64(time.Since(t0)))
		w.syncs.Add(1)
		w.synced.Store(w.written.Load())
		w.fl.lastSync = time.Now()
		w.fl.sinceSync = 0
		if w.fl.cand.lsn != 0 {
			w.recordPosition()
		}
	}
	if wrote || doSync {
		w.mu.Lock()
		woken := w.detachFlushLocked()
		w.mu.Unlock()
		if woken != nil {
			close(woken)
		}
	}
	if doSync && len(w.fl.unsynced) > 0 {
		w.opts.OnSynced(w.fl.unsynced)
		clear(w.fl.unsynced)
		w.fl.unsynced = w.fl.unsynced[:0]
	}
	if rotate {
		if err := w.rotate(); err != nil {
			w.fail("rotate", err)
			return closing
		}
	}
	if closing {
		// closing was read together with the buffer swap, and Append refuses
		// once closing is set: everything appended has been written and
		// fsynced above.
		return true
	}
	if w.opts.SyncMode == SyncInterval && w.synced.Load() < w.written.Load() {
		d := w.opts.SyncInterval - time.Since(w.fl.lastSync)
		if w.fl.timer == nil {
			w.fl.timer = time.NewTimer(d)
		} else {
			w.fl.timer.Reset(d)
		}
	}
	return false
}

// flushEphemeral is flush in Ephemeral mode: it takes the records
// appended so far, publishes them as written and synced, wakes their
// waiters and hands them to OnSynced. It writes nothing.
func (w *WAL) flushEphemeral() (exit bool) {
	w.mu.Lock()
	recs := w.mu.recs
	w.mu.recs = w.fl.spareRecs[:0]
	last := w.mu.nextLSN - 1
	closing := w.mu.closing
	w.mu.signaled = false
	w.mu.inFlush, w.mu.taken = true, last
	w.mu.curC, w.mu.nextC = w.mu.nextC, w.mu.curC
	w.mu.curWaiters, w.mu.nextWaiters = w.mu.nextWaiters, 0
	w.mu.Unlock()
	// As flush does: progress is published and the waiters woken before
	// OnSynced, which may block (the engine's applier backlog); a caller
	// that waits for its next record then waits for this flush to end,
	// which bounds what the appenders that wait leave queued.
	w.written.Store(uint64(last))
	w.synced.Store(uint64(last))
	w.fl.frames = len(recs)
	w.mu.Lock()
	woken := w.detachFlushLocked()
	w.mu.Unlock()
	if woken != nil {
		close(woken)
	}
	if len(recs) > 0 {
		w.opts.OnSynced(recs)
		clear(recs)
	}
	w.fl.spareRecs = recs[:0]
	return closing
}

// positionInterval is how many bytes are written between position hints.
func (w *WAL) positionInterval() int64 { return max(w.opts.SegmentSize/16, 512) }

// recordPosition adds the candidate position, now fsynced, to the position
// hints and rewrites positions.hint. A failure only costs a longer Open
// after a crash: it is logged, and the log goes on.
func (w *WAL) recordPosition() {
	p := w.fl.cand
	w.fl.cand, w.fl.sinceLast = position{}, 0
	if len(w.fl.positions) == maxPositions {
		w.fl.positions = slices.Delete(w.fl.positions, 0, 1)
	}
	w.fl.positions = append(w.fl.positions, p)
	w.pos.mu.Lock()
	defer w.pos.mu.Unlock()
	w.pos.pending = slices.Clone(w.fl.positions)
	if w.pos.writing {
		return // the running writer writes this ring after its current one
	}
	w.pos.writing = true
	w.pos.wg.Add(1)
	go w.writePositionsLoop()
}

// writePositionsLoop writes the newest pending ring of position hints
// until none is left, so that the last hints recorded are on disk soon
// after the fsync that covers them, not only when a later one comes.
func (w *WAL) writePositionsLoop() {
	defer w.pos.wg.Done()
	for {
		w.pos.mu.Lock()
		ps := w.pos.pending
		w.pos.pending = nil
		if ps == nil {
			w.pos.writing = false
			w.pos.mu.Unlock()
			return
		}
		w.pos.mu.Unlock()
		if err := writePositions(w.opts.FS, w.opts.Dir, ps); err != nil {
			w.logger.Warn("wal: writing position hints (Open after a crash reads more of the segment)", "error", err)
		}
	}
}

// recycle keeps the buffers just taken for the next swap, unless a huge
// record made them too big to keep around.
func (w *WAL) recycle(buf []byte, recs []Synced) {
	const maxKeep = 4 << 20
	if cap(buf) <= maxKeep {
		w.fl.spareBuf = buf[:0]
	} else {
		w.fl.spareBuf = nil
	}
	if cap(recs) <= maxKeep/16 {
		w.fl.spareRecs = recs[:0]
	} else {
		w.fl.spareRecs = nil
	}
}

// rotate closes the full (and fsynced) active segment and starts the next
// one, named after the next LSN: the spare file prepared in the background is
// renamed, and activateSegment fsyncs its header and the directory before any
// frame goes into it. If the background preparation failed, it is retried
// here once. Then the preparation of the following spare file starts.
func (w *WAL) rotate() error {
	next := LSN(w.written.Load()) + 1
	fs, dir := w.opts.FS, w.opts.Dir
	if w.fl.prepC == nil {
		// Not started: one flush batch took the segment from below half
		// full to full.
		if err := w.prepareSpare(); err != nil {
			return err
		}
	} else if err := w.awaitPrep(); errors.Is(err, errNoRecycled) {
		if err := w.prepareSpare(); err != nil {
			return err
		}
	} else if err != nil {
		w.logger.Warn("wal: preparing the next segment in the background failed; retrying", "error", err)
		if err := w.prepareSpare(); err != nil {
			return err
		}
	}
	seg, err := activateSegment(fs, dir, next)
	if err != nil {
		return err
	}
	if seg.recycled {
		w.sparesRecycled.Add(1)
	}
	old := w.fl.active
	w.fl.active = seg
	if err := old.f.Close(); err != nil {
		// The old segment was fsynced; a close error cannot lose data.
		w.logger.Warn("wal: closing a full segment", "segment", old.name, "error", err)
	}
	w.segMu.Lock()
	w.segs = append(w.segs, SegmentInfo{Name: seg.name, FirstLSN: next, LastLSN: next - 1,
		Size: seg.end, Allocated: seg.alloc})
	w.segMu.Unlock()
	w.startPrep(w.recycled.Load())
	return nil
}

// startPrep starts preparing the spare file for the next segment in the
// background. The flusher calls it right after a rotation (the log is busy:
// the whole next segment's worth of writes is left for the preparation), and
// after Open once the active segment is half full, so that a log that is
// opened and written little (tests, tools, an idle service) does not
// allocate a spare segment at all.
//
// Once segments are being recycled (recycledOnly), the preparation after a
// rotation only takes a recycled old segment: if none is kept, the next
// one is usually about to be released (the index is made durable past it a
// little later), so zero-filling is put off until the segment is half full
// (prepHalfFull), by when truncation that keeps up has released one.
func (w *WAL) startPrep(recycledOnly bool) {
	c := make(chan error, 1)
	w.fl.prepC, w.fl.prepRecycledOnly = c, recycledOnly
	go func() {
		if recycledOnly {
			c <- w.takeRecycledSpare()
			return
		}
		c <- w.prepareSpare()
	}()
}

// errNoRecycled is returned by a recycled-only preparation that found no
// recycled file.
var errNoRecycled = errors.New("wal: no recycled segment to reuse")

// prepHalfFull is called by the flusher once the active segment is half
// full: it starts the preparation of the spare file if none was started
// since Open, or if the one started at the rotation found no recycled file.
func (w *WAL) prepHalfFull() {
	if w.fl.prepC == nil {
		w.startPrep(false)
		return
	}
	if !w.fl.prepRecycledOnly {
		return
	}
	select {
	case err := <-w.fl.prepC:
		if errors.Is(err, errNoRecycled) {
			w.startPrep(false)
			return
		}
		// Done: hand the result to awaitPrep.
		c := make(chan error, 1)
		c <- err
		w.fl.prepC, w.fl.prepRecycledOnly = c, false
	default: // still running: check again at the next flush
	}
}

// takeRecycledSpare is the recycled-only preparation: it makes the kept
// recycled file, if any, the spare file and checks it (prepareSpare), or
// returns errNoRecycled when there is no spare file afterwards.
func (w *WAL) takeRecycledSpare() error {
	fs, dir := w.opts.FS, w.opts.Dir
	w.recycleMu.Lock()
	err := takeRecycled(fs, dir)
	w.recycleMu.Unlock()
	if err != nil {
		return err
	}
	if _, err := fs.Stat(fs.PathJoin(dir, preallocName)); errors.Is(err, os.ErrNotExist) {
		return errNoRecycled
	} else if err != nil {
		return err
	}
	return w.prepareSpare()
}

// prepareSpare prepares the spare file (preparePrealloc). If zero-filling it
// to SegmentSize fails because the disk is full, the partial file is removed
// and an empty spare file is made instead: the next segment then grows as
// frames are written (each fdatasync also commits the new size), so a disk
// smaller than a segment still takes records until it is really full. The
// fallback is logged. Safe to call from the background goroutine.
func (w *WAL) prepareSpare() error {
	fs, dir, size := w.opts.FS, w.opts.Dir, w.preallocSize()
	recycle := size > 0
	if recycle {
		// A recycled old segment, if one is kept, is the spare file: no
		// zero-filling (and no new space taken).
		w.recycleMu.Lock()
		err := takeRecycled(fs, dir)
		w.recycleMu.Unlock()
		if err != nil {
			return err
		}
	}
	if size > 0 {
		// Zero-filling until ENOSPC would fill the disk to the brim for a
		// moment, failing whoever else writes there then (the index):
		// preallocate only while at least two segments' worth is free.
		if du, err := fs.GetDiskUsage(dir); err == nil && du.AvailBytes < 2*uint64(size) {
			w.logger.Warn("wal: little free space; the next segment is not preallocated and grows as it is written",
				"dir", dir, "free", du.AvailBytes, "segment_size", size)
			return preparePrealloc(fs, dir, 0, recycle)
		}
	}
	err := preparePrealloc(fs, dir, size, recycle)
	if err == nil || size == 0 || !isNoSpace(err) {
		return err
	}
	w.logger.Warn("wal: no space to preallocate the next segment; it grows as it is written instead",
		"file", fs.PathJoin(dir, preallocName), "size", size, "error", err)
	if err2 := preparePrealloc(fs, dir, 0, recycle); err2 != nil {
		return fmt.Errorf("%w (then, without preallocation: %w)", err, err2)
	}
	return nil
}

// preallocSize is the size spare segment files are zero-filled to.
func (w *WAL) preallocSize() int64 {
	if w.opts.Preallocate {
		return w.opts.SegmentSize
	}
	return 0
}

// awaitPrep waits for the background preparation started by startPrep
// (w.fl.prepC != nil) and returns its result.
func (w *WAL) awaitPrep() error {
	c := w.fl.prepC
	w.fl.prepC = nil
	return <-c
}
