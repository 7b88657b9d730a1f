// Package idem is a durable embedded engine for exactly-once request
// handling: each request carries an id; idem remembers, durably, what
// happened to it.
//
//   - an unknown id is claimed by exactly one caller (Begin returns Fresh),
//     who runs the side effect and commits the reply;
//   - a retry of a committed id gets the same reply back (Done);
//   - a retry while the first still runs is told so (InFlight), or waits (Do, Wait);
//   - the same id with a different fingerprint is ErrConflict;
//   - acks, expiry and an administrator's Forget keep storage bounded.
//
// Every change is a record in a write-ahead log (package wal), fsynced before
// it is acknowledged (an engine opened with Options.Ephemeral, whose state
// its owner rebuilds, logs nothing); the live set of ids is kept in a
// Pebble store (package index) that replays the log on Open. See
// docs/design.md for the formats and the durability contract.
package idem

import (
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/snapshot"
	"github.com/idemdb/idem/wal"
	"golang.org/x/sync/semaphore"
)

const numShards = 256

// The applier gathers durable records for up to applyGather or
// applyBatchMax records before writing them to the index.
const (
	applyGather   = 5 * time.Millisecond
	applyBatchMax = 16384
)

// Engine is an open idem directory. It is safe for concurrent use.
type Engine struct {
	o     Options
	dir   string
	fs    vfs.FS
	locks []io.Closer

	w  *wal.WAL
	ix *index.Index

	// opMu is held shared by every operation while it uses the WAL or the
	// index, and exclusively by Close.
	opMu   sync.RWMutex
	closed atomic.Bool
	failed atomic.Pointer[error] // sticky failure of the applier

	seed   maphash.Seed // hashes keys for their shards and shard tables (keyTag)
	shards [numShards]shard
	// getLockedFn is e.getLocked bound once: index.Transitions keeps its
	// lookup function (a batch holds it), so a method value made per call
	// would be an allocation per record.
	getLockedFn func(key []byte, mode byte) (*index.Entry, error)
	// batchRuns holds *batchRun for reuse by Batch.Run.
	batchRuns sync.Pool
	// batchMarks numbers the batch runs (batchRun.mark, slot.batch).
	batchMarks atomic.Uint32
	// mark is the newest forget mark. It is replaced only while every shard
	// lock is held, so an operation holding one shard lock sees a mark that
	// agrees with the log order of its own record.
	mark atomic.Pointer[index.Mark]

	applyCh   chan applyBatch
	applyDone chan struct{}
	// backlog bounds, in estimated bytes (index.Update.MemSize), the
	// durable records handed to the applier and not yet applied (see
	// onSynced); backlogBytes is what it holds now, for Stats.
	backlog      *semaphore.Weighted
	backlogCap   int64
	backlogBytes atomic.Int64
	stopBg       chan struct{}
	evictC       chan struct{} // wakes the maintenance goroutine when over MaxEntries
	bg           sync.WaitGroup

	compactMu   sync.Mutex // one compaction (or retention/eviction pass) at a time
	lastRemoved uint64     // guarded by compactMu: removals counted by the previous Compact
	// removedSinceEntryCompact (guarded by compactMu) counts removals since
	// the entry range was last compacted by hand.
	removedSinceEntryCompact uint64
	// walAfterCompact is the WAL's size after the previous Compact (the
	// size trigger compares with it).
	walAfterCompact atomic.Int64

	inDoubtMu sync.Mutex
	inDoubt   []inDoubtRef // guarded by inDoubtMu

	imagesMu sync.Mutex
	images   map[*SnapshotImage]struct{} // guarded by imagesMu: open SnapshotImages

	st counters
}

// shard is one stripe of the in-memory table in front of the index.
type shard struct {
	mu sync.Mutex
	// The shard's slots, found by key (guarded by mu; see table.go,
	// "the shard's table"): slab holds them at their positions (nil: a
	// free position, listed in free), tab is an open-addressing index of
	// (hash tag, position) that holds no pointers, n the number of slots.
	// evictAt is where evictLocked's next sweep of slab starts.
	slab    []*slot
	free    []int32
	tab     []uint64
	n       int
	evictAt int
	bytes   int64 // guarded by mu: accounted size of the slots
	// gen counts the slots evicted from the table (guarded by mu): a read of the
	// index made without the lock may be installed only if no slot of
	// the shard was evicted meanwhile (see lockSlot).
	gen uint64
	// installs counts the slots put into the table (guarded by mu): lockSlot
	// skips its second probe when none was installed while it read
	// the index without the lock.
	installs uint64
	// evictMark and markEvicted (guarded by mu): a batch run that installs
	// a slot sets evictMark to its mark (batchRun.mark), and evicting a
	// slot that carries evictMark sets markEvicted: a slot of a key the
	// run's record may have changed left the table (batchRun.get).
	evictMark   uint32
	markEvicted bool
	// unlock is mu.Unlock bound once, so that lockKeys of one key does not
	// allocate a method value per call.
	unlock func()
	e      *Engine // immutable
	idx    int     // immutable: its index in Engine.shards
	// hintKey and hint (guarded by mu) are the key and slot that getHint
	// (getHinted bound once) answers without a lookup, while a caller
	// holding mu computes a record's transitions (transitionsHinted).
	hintKey []byte
	hint    *slot
	getHint func(key []byte, mode byte) (*index.Entry, error)
}

// slot caches one key's entry. It is pinned (never evicted) while the entry
// is in flight, not yet applied to the index, or waited on.
//
// Its fields fit the 64-byte size class (slotBytes, which the memory
// accounting counts; TestSlotSize pins both): the shard is a byte, not a
// pointer.
type slot struct {
	key     string        // its key (immutable; the caller's bytes when it kept them)
	e       *index.Entry  // as stored (forget marks may still apply); nil = absent
	dirty   wal.LSN       // last change not yet applied to the index; 0 = clean
	waiters chan struct{} // closed when the current claim finishes; nil if nobody waits
	size    int64         // what slotSize counts for it
	// tag is the top 32 bits of key's table hash and pos the slot's
	// position in its shard's slab: together its entry in the shard's
	// tab (immutable).
	tag uint32
	pos int32
	// inFlight is e != nil && e.InFlight, kept here so that eviction
	// decides from the slot alone (one cache line, not two).
	inFlight bool
	evicted  bool  // dropped from its shard's table by eviction (for holders of a slot pointer)
	shard    uint8 // its shard's index in Engine.shards (immutable)
	// batch is the mark (batchRun.mark) of the batch run whose overlay
	// last read the key (0: none), guarded by the shard's lock: a run
	// that finds its mark missing from a key's slot knows that its record
	// has not changed the key (batchRun.getItem). It fills the slot's
	// padding: a slot stays 64 bytes.
	batch uint32
}

// A slot's shard index is a byte.
const _ = uint8(numShards - 1)

type counters struct {
	hits, misses, conflicts, collisions, gaps, alreadyCommitted, leaseLost, takeovers, expired, acked atomic.Uint64
	// ttlRemoved counts entries removed by expire records (per-request TTL).
	ttlRemoved atomic.Uint64
}

var (
	openDirsMu sync.Mutex
	openDirs   = map[string]bool{} // guarded by openDirsMu: directories open in this process
)

// Open opens (creating if needed) the idem directory dir. On open an empty
// index in front of a WAL whose head compaction removed is loaded from the
// newest valid on-disk snapshot, the WAL is read from the index's applied
// LSN on (older segments only have their headers checked; after a clean
// Close the log is entered at its end), a torn tail is cut (and logged), and
// the records the index has not applied are replayed (docs/design.md,
// "Recovery (Open)"; the idem command runs the same recovery read-only).
// `idem verify` checks every frame.
//
// With Options.Ephemeral there is no log to recover: see Ephemeral for what
// Open does with the directory.
func Open(dir string, opts *Options) (*Engine, error) {
	return open(dir, opts, false)
}

// open is Open; restored says that Restore just loaded the index (an
// Ephemeral engine keeps it).
func open(dir string, opts *Options, restored bool) (*Engine, error) {
	o := opts.withDefaults()
	if o.Sync < SyncAlways || o.Sync > SyncNever {
		return nil, fmt.Errorf("%w: Options.Sync: unknown mode %d (want SyncAlways, SyncInterval or SyncNever)", ErrInvalidRequest, int(o.Sync))
	}
	if err := checkEphemeral(opts); err != nil {
		return nil, err
	}
	e := &Engine{o: o, dir: dir, fs: o.FS, seed: maphash.MakeSeed()}
	e.getLockedFn = e.getLocked
	for i := range e.shards {
		e.shards[i].unlock = e.shards[i].mu.Unlock
		e.shards[i].e = e
		e.shards[i].idx = i
		e.shards[i].getHint = e.shards[i].getHinted
	}
	if err := e.lockDir(); err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			e.unlockDir()
		}
	}()
	if err := e.prepareDir(restored); err != nil {
		return nil, err
	}
	ix, err := index.Open(index.Options{FS: o.FS, Dir: filepath.Join(dir, "index"), CacheSize: o.IndexCacheSize, MemTableSize: o.memTableSize(), IngestBytes: o.IndexIngestBytes, FilterBytes: o.IndexFilterBytes, Logger: o.Logger})
	if errors.Is(err, syscall.EAGAIN) {
		// Pebble's own lock on the index directory is held although ours
		// was free: by a Pebble this process left behind after a fatal
		// background failure (see docs/design.md, durability contract).
		return nil, fmt.Errorf("%w: the index directory %s is still held by a Pebble instance that stopped after a background failure in this process; reopen in a new process: %w",
			ErrLocked, filepath.Join(dir, "index"), err)
	}
	if err != nil {
		return nil, wrapCorrupt(err)
	}
	e.ix = ix
	// One element per group-commit fsync. The buffer lets the WAL go on
	// while the applier waits for an ingest (a forget record persists the
	// pending sets first: ~0.1-0.2 s for a full 16 MiB set); at ~5,000
	// fsyncs/s it covers about 0.8 s. What the elements hold is bounded
	// in bytes by the backlog (IndexIngestBytes/2, 1/32 of the budget):
	// with only the element count as a bound, an applier held back by
	// ingests into a backlogged LSM let the records of 4,096 fsyncs wait,
	// 227 MiB of Go heap with a 32 MiB budget.
	e.applyCh = make(chan applyBatch, 4096)
	e.backlogCap = max(o.IndexIngestBytes/2, 1<<20)
	e.backlog = semaphore.NewWeighted(e.backlogCap)
	w, err := e.recover(ix)
	if err != nil {
		ix.Close(false)
		return nil, err
	}
	e.w = w
	fail := func(err error) (*Engine, error) {
		w.Close()
		ix.Close(false)
		return nil, err
	}
	ix.StartFilter() // after replay, which then adds nothing to it (see index/filter.go)
	m := ix.Mark()
	e.mark.Store(&m)
	if err := ix.InDoubt(func(key []byte, en *index.Entry) error {
		e.inDoubt = append(e.inDoubt, inDoubtRef{key: key, claimLSN: en.ClaimLSN})
		return nil
	}); err != nil {
		return fail(wrapCorrupt(err))
	}
	e.applyDone = make(chan struct{})
	e.stopBg = make(chan struct{})
	e.evictC = make(chan struct{}, 1)
	go e.applier()
	e.bg.Add(1)
	go e.maintenance()
	ok = true
	return e, nil
}

func wrapCorrupt(err error) error {
	if errors.Is(err, ErrCorrupt) || errors.Is(err, ErrFailed) {
		return err
	}
	if isRecoveryCorrupt(err) {
		return fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	if errors.Is(err, index.ErrBackground) {
		return fmt.Errorf("%w: %w", ErrFailed, err)
	}
	if errors.Is(err, snapshot.ErrCorrupt) || errors.Is(err, wal.ErrCorrupt) || errors.Is(err, index.ErrCorrupt) || errors.Is(err, wal.ErrBadRecord) || errors.Is(err, index.ErrBadEntry) || errors.Is(err, index.ErrNoClaim) {
		return fmt.Errorf("%w: %w", ErrCorrupt, err)
	}
	return err
}

func (e *Engine) lockDir() error {
	abs, err := filepath.Abs(e.dir)
	if err != nil {
		abs = e.dir
	}
	// Directories on different in-memory filesystems are different even
	// with the same name; only the OS filesystem is shared process-wide.
	regKey := ""
	if e.fs == vfs.Default {
		regKey = abs
		openDirsMu.Lock()
		if openDirs[abs] {
			openDirsMu.Unlock()
			return fmt.Errorf("%w: %s is already open in this process", ErrLocked, e.dir)
		}
		openDirs[abs] = true
		openDirsMu.Unlock()
	}
	if err := wal.EnsureDir(e.fs, e.dir); err != nil {
		e.releaseReg(regKey)
		return fmt.Errorf("idem: create %s: %w", e.dir, err)
	}
	l, err := e.fs.Lock(filepath.Join(e.dir, "LOCK"))
	if err != nil {
		e.releaseReg(regKey)
		return fmt.Errorf("%w: %s: %v", ErrLocked, e.dir, err)
	}
	e.locks = append(e.locks, l, regCloser(regKey))
	return nil
}

type regCloser string

func (r regCloser) Close() error {
	if r != "" {
		openDirsMu.Lock()
		delete(openDirs, string(r))
		openDirsMu.Unlock()
	}
	return nil
}

func (e *Engine) releaseReg(k string) { _ = regCloser(k).Close() }

func (e *Engine) unlockDir() {
	for _, l := range e.locks {
		_ = l.Close()
	}
	e.locks = nil
}

// Close flushes the WAL and the index and releases the directory. Claims
// still open stay in doubt (see InDoubt). Close is safe to call twice.
func (e *Engine) Close() error {
	e.opMu.Lock()
	if e.closed.Swap(true) {
		e.opMu.Unlock()
		return nil
	}
	e.opMu.Unlock()
	close(e.stopBg)
	e.bg.Wait()
	err := e.w.Close() // fsyncs and delivers the last OnSynced batch
	close(e.applyCh)
	<-e.applyDone
	if f := e.failed.Load(); f != nil && err == nil {
		err = *f
	}
	// An Ephemeral engine's index is removed below: nothing to flush.
	flush := e.failed.Load() == nil && !e.o.Ephemeral
	e.releaseImages()
	if cerr := e.ix.Close(flush); err == nil {
		err = cerr
	}
	if e.o.Ephemeral {
		if rerr := e.removeEphemeral(); err == nil {
			err = rerr
		}
	}
	e.unlockDir()
	return err
}

// enter starts an operation: it fails once the engine is closed or failed.
func (e *Engine) enter() error {
	e.opMu.RLock()
	if e.closed.Load() {
		e.opMu.RUnlock()
		return ErrClosed
	}
	if f := e.failed.Load(); f != nil {
		e.opMu.RUnlock()
		return *f
	}
	return nil
}

func (e *Engine) leave() { e.opMu.RUnlock() }

// Dir returns the engine's directory.
func (e *Engine) Dir() string { return e.dir }

// Now returns the engine's clock (Options.Clock, default time.Now). Code
// built on the engine uses it for every time decision, so that a test with
// a fake clock sees one time everywhere.
func (e *Engine) Now() time.Time { return e.o.Clock() }

// printable renders an id for error messages: text when printable, else hex.
func printable(b []byte) string {
	for _, c := range b {
		if c < 0x20 || c > 0x7e {
			return fmt.Sprintf("0x%x", b)
		}
	}
	return fmt.Sprintf("%q", b)
}
