// Package index holds idem's live dedup set in a Pebble store.
//
// It is one of idem's building blocks (with packages wal, snapshot and
// compaction), published as Pebble publishes its record and sstable
// packages: the engine, package idem, composes them, and tools use them
// directly (the idem command opens a private copy of a directory's index
// with it). Applications use package idem.
//
// The store runs with Pebble's own WAL disabled: idem's WAL (package wal) is
// the source of truth, and every batch this package commits also stores the
// LSN of the last record it applied. After a crash Pebble comes back with
// some prefix of the applied batches (whatever its memtable flushes made
// durable), and the engine replays the WAL records after that LSN. Records
// are applied only once they are fsynced in the WAL, so the index never holds
// state that the WAL could lose.
//
// The key layout is described in keys.go and docs/design.md.
package index

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/bloom"
	"github.com/cockroachdb/pebble/v2/sstable"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/wal"
)

// Options configure an Index.
type Options struct {
	FS           vfs.FS
	Dir          string
	CacheSize    int64  // Pebble block cache for blocks, on top of the memtables it also holds; default 16 MiB
	MemTableSize uint64 // default 8 MiB (only forget marks and Load write batches; see pending.go)
	// IngestBytes is the size at which the pending set of applied updates
	// is written as an sstable and ingested (see pending.go); default 16 MiB.
	// Up to two sets (one filling, one being ingested) are held in memory.
	IngestBytes int64
	// FilterBytes is the memory of the key filter that answers most
	// lookups of new ids without asking Pebble (see filter.go); default
	// 16 MiB (about 13 million keys), negative turns it off.
	FilterBytes int64
	ReadOnly    bool
	Logger      *slog.Logger
}

// Index is the Pebble-backed dedup set. Apply must be called from one
// goroutine at a time (the engine's applier, or replay before it starts);
// reads are safe concurrently with it.
type Index struct {
	db    *pebble.DB
	cache interface{ Unref() }

	applied atomic.Uint64        // LSN of the last applied record
	mark    atomic.Pointer[Mark] // newest forget mark
	count   atomic.Int64         // entries stored
	replies atomic.Int64         // entries keeping a reply (rows of the time index)
	// forgotten and evicted count replies removed by forget marks since
	// Open (evicted: marks written for Options.MaxEntries).
	forgotten, evicted atomic.Uint64
	// compactedMark is the forget mark's Before when CompactRemoved last
	// compacted the time index below it.
	compactedMark atomic.Int64
	// bg is the first error Pebble reported from its background work (a
	// failed flush, compaction or MANIFEST write: a full or failing disk).
	// It is sticky: every later Apply, Get and Flush fails with it, so the
	// engine stops (ErrFailed) instead of the process.
	bg      atomic.Pointer[error]
	bgOnce  sync.Once
	bgFired chan struct{} // closed when bg is set
	// inPebble counts the calls into Pebble that a wait may have stopped
	// waiting for (guard, ingests, the filter scan): Close after a failure
	// must not close Pebble under them.
	inPebble atomic.Int64

	applyMu sync.Mutex // serializes Apply, ingests and the fields below

	// The pending sets (pending.go). pmu guards the mut and frozen
	// pointers and the contents of mut; a frozen set is read-only.
	pmu         sync.RWMutex
	mut, frozen *pendingSet
	job         *ingestJob // the ingest in progress; nil if none
	ingestErr   error      // sticky ingest failure
	memDirty    bool       // a batch was committed since the last memtable flush
	ingestSeq   int
	// ingestTimes and ingestExpiries are the time and expiry rows of the
	// last set written (writeSSTs sizes the next set's lists by them;
	// one ingest runs at a time).
	ingestTimes, ingestExpiries int
	ingestBytes                 int64
	writerOpts                  sstable.WriterOptions // the ingested entries' tables (L0's options)
	// indexWriterOpts are writerOpts without a bloom filter, for the
	// ingested tables of the time, in-doubt and expiry indexes (pending.go).
	indexWriterOpts sstable.WriterOptions
	fs              vfs.FS
	dir             string
	logger          *slog.Logger

	// The key filter (filter.go).
	filter       atomic.Pointer[keyFilter] // consulted by Get; nil: ask Pebble
	building     *keyFilter                // guarded by applyMu: being built, receives every add
	buildingMem  atomic.Bool               // a filter is being built (for Memory)
	filterBytes  int64
	filterSeed   maphash.Seed
	filterStop   chan struct{}
	filterClosed bool // guarded by applyMu
	// filterSaturated: no filter, because the entries outgrew it
	// (filterSaturation); guarded by applyMu.
	filterSaturated bool
	filterWG        sync.WaitGroup
	// filterHashes is addPending's buffer for the key hashes of a chunk
	// (guarded by applyMu).
	filterHashes []uint64
	// pendHashes is addPending's buffer for the pending-set hashes
	// (pendSeed) of a chunk's keys (guarded by applyMu).
	pendHashes   []uint64
	filterBuilds atomic.Int64

	// pin keeps the deletion of obsolete tables off the lookups (pin.go);
	// nil for a read-only index.
	pin *readPin
}

// ErrCorrupt wraps errors about index contents that cannot be parsed.
var ErrCorrupt = errors.New("index: corrupt")

// Open opens (creating if needed) the index in o.Dir.
func Open(o Options) (*Index, error) {
	if o.CacheSize == 0 {
		o.CacheSize = 16 << 20
	}
	if o.MemTableSize == 0 {
		o.MemTableSize = 8 << 20
	}
	if o.IngestBytes <= 0 {
		o.IngestBytes = 16 << 20
	}
	if o.FilterBytes == 0 {
		o.FilterBytes = 16 << 20
	}
	if o.ReadOnly {
		o.FilterBytes = -1
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	// Pebble charges its memtables to the block cache (db.go reserves
	// each memtable's size from it until the memtable is flushed), so a
	// cache no larger than the memtables holds no blocks at all: every
	// filter and index block is read and checksummed again on each lookup.
	// Size the cache for the blocks plus the memtables that can be alive at
	// once (the mutable one, one being flushed, and one queued).
	pfs := o.FS
	if _, ok := vfs.Root(o.FS).(*vfs.MemFS); ok {
		pfs = copyNotLinkFS{o.FS}
	}
	cache := pebble.NewCache(o.CacheSize + 3*int64(o.MemTableSize))
	ix := &Index{mut: newPendingSet(0), ingestBytes: o.IngestBytes,
		fs: o.FS, dir: o.Dir, logger: o.Logger, bgFired: make(chan struct{}),
		filterBytes: o.FilterBytes, filterSeed: maphash.MakeSeed(), filterStop: make(chan struct{})}
	plog := &pebbleLogger{l: o.Logger, ix: ix}
	rp := newReadPin(ix)
	popts := &pebble.Options{
		FS:           dirSyncFS{FS: ioBufFS{pfs}, log: plog},
		Cache:        cache,
		DisableWAL:   true,
		MemTableSize: o.MemTableSize,
		ReadOnly:     o.ReadOnly,
		Logger:       plog,
		EventListener: &pebble.EventListener{
			BackgroundError: func(err error) { ix.fail(fmt.Errorf("pebble background work: %w", err)) },
			// Pebble's default handler calls Fatalf on the reader's own
			// goroutine; the read returns the corruption error anyway
			// (ErrCorrupt for the engine's caller, a PROBLEM line for
			// idem verify), so log it and let the read fail.
			DataCorruption: func(info pebble.DataCorruptionInfo) {
				o.Logger.Error("index: Pebble found corrupt data", "info", info.String())
			},
			// Versions change: the read pin takes a reference (pin.go).
			CompactionBegin: func(pebble.CompactionInfo) { rp.signal() },
			CompactionEnd:   func(pebble.CompactionInfo) { rp.signal() },
			FlushEnd:        func(pebble.FlushInfo) { rp.signal() },
		},
	}
	// Most lookups of a fresh id miss: bloom filters let a miss skip the
	// sstables' blocks, on every level but the last. The last level holds
	// nearly all the keys, so its filters are nearly all the filter bytes
	// (about 125 MB at 100 million ids, against a 64 MiB block cache), one
	// block of 1-2 MB per table: a lookup whose table's filter was not
	// cached read and checksummed that whole block (into C memory), and
	// at 90 million ids glibc's heap held 250 MiB of RSS for 98 MB in
	// use (malloc_stats). Without them a
	// lookup that reaches the last level reads an index block and a data
	// block (4 KiB each), which a key present there needs anyway (Pebble's
	// own Get skips last-level filters for that reason). Fresh ids rarely
	// get there while the key filter holds the keys (filter.go).
	for i := range popts.Levels {
		if i < len(popts.Levels)-1 {
			popts.Levels[i].FilterPolicy = bloom.FilterPolicy(10)
		}
	}
	popts.EnsureDefaults() // MakeWriterOptions below needs the defaults filled in
	tunePebble(popts)
	sched := newGatedScheduler()
	popts.Experimental.CompactionScheduler = sched
	db, err := ix.openPebble(o.Dir, popts, plog, cache)
	if err != nil { // openPebble released the cache, or left it to the abandoned pebble.Open
		sched.Unregister() // idempotent: Pebble's own Close may call it too
		return nil, fmt.Errorf("index: open %s: %w", o.Dir, err)
	}
	sched.opened()
	plog.opened.Store(true)
	plog.opener.Store(-1)
	if err := ix.failure(); err != nil { // reported while opening
		closed := make(chan struct{})
		go func() { db.Close(); cache.Unref(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(closeAfterFailure): // parked by Fatalf: leave it
		}
		return nil, fmt.Errorf("index: open %s: %w", o.Dir, err)
	}
	ix.db, ix.cache = db, cache
	ix.writerOpts = popts.MakeWriterOptions(0, db.TableFormat())
	ix.indexWriterOpts = ix.writerOpts
	ix.indexWriterOpts.FilterPolicy = nil
	if !o.ReadOnly {
		if err := ix.removeIngestLeftovers(); err != nil {
			db.Close()
			cache.Unref()
			return nil, err
		}
	}
	if err := ix.loadMeta(o.ReadOnly); err != nil {
		db.Close()
		cache.Unref()
		return nil, err
	}
	if !o.ReadOnly {
		ix.pin = rp
		rp.start()
		rp.signal() // the first pin: the version as opened
	}
	return ix, nil
}

// openPebble opens the store. pebble.Open runs on a goroutine of its own,
// the opener (pebbleLogger.opener), and:
//
//   - a Fatalf on the opener (a MANIFEST write that failed while Open
//     writes its new MANIFEST) panics in pebbleLogger.Fatalf, and
//     openRecover turns the panic into Open's error;
//   - a Fatalf on another of Pebble's goroutines while Open runs (a flush
//     or a compaction that Open started and whose MANIFEST write failed)
//     records the index's failure and parks that goroutine, which may hold
//     DB.mu or be what pebble.Open waits for: pebble.Open then never
//     returns. openPebble waits for the failure as well as for Open: once
//     the failure is recorded it gives Open closeAfterFailure to return and
//     then abandons it, returning the failure (ErrBackground, which the
//     engine reports as ErrFailed).
//
// An abandoned pebble.Open goroutine stays blocked, as the parked goroutine
// does (both leak, with Pebble's lock on the directory: the index can then
// be reopened only by a new process, which recovers from the WAL what the
// index lacks). Nothing it uses is freed under it: the cache is then its to
// release, and the options, the logger and the Index it reports to stay
// reachable from it. Should pebble.Open return after all, that goroutine
// closes the store and releases the cache itself.
//
// On error the cache is released (here, or by the abandoned goroutine).
func (ix *Index) openPebble(dir string, o *pebble.Options, plog *pebbleLogger, cache *pebble.Cache) (*pebble.DB, error) {
	type result struct {
		db  *pebble.DB
		err error
	}
	var mu sync.Mutex // guards abandoned and the send on res
	abandoned := false
	res := make(chan result, 1)
	go func() {
		plog.opener.Store(goroutineID())
		db, err := openRecover(dir, o)
		mu.Lock()
		gaveUp := abandoned
		if !gaveUp {
			res <- result{db, err}
		}
		mu.Unlock()
		if gaveUp {
			plog.opener.Store(-1) // a Fatalf while closing parks, it does not panic here
			if db != nil {
				_ = db.Close()
			}
			cache.Unref()
		}
	}()
	done := func(r result) (*pebble.DB, error) {
		if r.err != nil {
			cache.Unref()
		}
		return r.db, r.err
	}
	select {
	case r := <-res:
		return done(r)
	case <-ix.bgFired:
	}
	select {
	case r := <-res:
		return done(r) // Open still returned: the caller closes it
	case <-time.After(closeAfterFailure):
	}
	mu.Lock()
	select {
	case r := <-res:
		mu.Unlock()
		return done(r)
	default:
	}
	abandoned = true
	mu.Unlock()
	ix.logger.Error("index: Pebble failed while opening and its Open did not return; leaving it", "waited", closeAfterFailure)
	return nil, fmt.Errorf("pebble did not finish opening: %w", ix.failure())
}

// openRecover is pebble.Open, turning a panic (pebble's Fatalf on the
// opener goroutine goes through pebbleLogger.Fatalf, which panics there)
// into an error, so that Open fails instead of crashing the application.
func openRecover(dir string, o *pebble.Options) (db *pebble.DB, err error) {
	defer func() {
		if r := recover(); r != nil {
			db, err = nil, fmt.Errorf("index: pebble failed while opening: %v", r)
		}
	}()
	return pebble.Open(dir, o)
}

func (ix *Index) loadMeta(readOnly bool) error {
	v, err := ix.getMeta(metaFormat)
	if err != nil {
		return err
	}
	if v == nil {
		if readOnly {
			ix.mark.Store(&Mark{})
			return nil
		}
		b := binary.AppendUvarint(nil, formatVersion)
		if err := ix.db.Set(metaFormat, b, pebble.NoSync); err != nil {
			return fmt.Errorf("index: write format: %w", err)
		}
		ix.memDirty = true
	} else if ver, n := binary.Uvarint(v); n <= 0 || ver != formatVersion {
		return fmt.Errorf("%w: unsupported index format %x", ErrCorrupt, v)
	}
	if v, err = ix.getMeta(metaApplied); err != nil {
		return err
	} else if v != nil {
		a, n := binary.Uvarint(v)
		if n <= 0 {
			return fmt.Errorf("%w: applied LSN %x", ErrCorrupt, v)
		}
		ix.applied.Store(a)
	}
	m := &Mark{}
	if v, err = ix.getMeta(metaForget); err != nil {
		return err
	} else if v != nil {
		b, n := binary.Varint(v)
		l, n2 := uint64(0), 0
		if n > 0 {
			l, n2 = binary.Uvarint(v[n:])
		}
		if n <= 0 || n2 <= 0 {
			return fmt.Errorf("%w: forget mark %x", ErrCorrupt, v)
		}
		m = &Mark{Before: b, LSN: wal.LSN(l)}
	}
	ix.mark.Store(m)
	if v, err = ix.getMeta(metaCount); err != nil {
		return err
	} else if v != nil {
		c, n := binary.Uvarint(v)
		if n <= 0 {
			return fmt.Errorf("%w: count %x", ErrCorrupt, v)
		}
		ix.count.Store(int64(c))
	}
	if v, err = ix.getMeta(metaReplies); err != nil {
		return err
	} else if v != nil {
		c, n := binary.Uvarint(v)
		if n <= 0 {
			return fmt.Errorf("%w: replies %x", ErrCorrupt, v)
		}
		ix.replies.Store(int64(c))
	}
	return nil
}

func (ix *Index) getMeta(k []byte) ([]byte, error) {
	v, c, err := ix.db.Get(k)
	if errors.Is(err, pebble.ErrNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("index: read meta %q: %w", k[1:], err)
	}
	defer c.Close()
	return bytes.Clone(v), nil
}

// Applied returns the LSN of the last applied record.
func (ix *Index) Applied() wal.LSN { return wal.LSN(ix.applied.Load()) }

// Mark returns the newest forget mark.
func (ix *Index) Mark() Mark { return *ix.mark.Load() }

// Forgotten returns how many replies and abandoned claims forget marks
// removed since Open (evictions included).
func (ix *Index) Forgotten() uint64 { return ix.forgotten.Load() }

// Evicted returns how many replies capacity marks removed since Open.
func (ix *Index) Evicted() uint64 { return ix.evicted.Load() }

// Replies returns the number of entries that keep a reply.
func (ix *Index) Replies() int64 { return ix.replies.Load() }

// Count returns the number of entries stored.
func (ix *Index) Count() int64 { return ix.count.Load() }

// Get returns the entry stored under key, or nil. An entry still pending
// (not yet in Pebble) is shared: callers must not modify what Get returns.
func (ix *Index) Get(key []byte) (*Entry, error) {
	if err := ix.failure(); err != nil {
		return nil, err
	}
	// The key filter holds every key present in a pending set as well as
	// every key in Pebble (filter.go), so a key it does not hold is absent:
	// asking it first spares a lookup of a new id the probes of the two
	// sets' maps (large, so each probe was a cache miss or two).
	if ix.filterAbsent(key) {
		return nil, nil
	}
	if e, ok := ix.lookupPending(key); ok {
		return e, nil
	}
	// Pebble's Get, not an iterator's SeekPrefixGE: it walks the
	// memtables and levels newest first and stops at the first that holds
	// the key, opening one level's table at a time, where an iterator
	// builds a merging iterator over every level and seeks each (the last
	// level has no bloom filters, see Open). A key present in the index
	// costs 7-40% less CPU in BenchmarkLookupWhileWriting (present-ns).
	v, c, err := ix.db.Get(key)
	if errors.Is(err, pebble.ErrNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("index: get: %w", err)
	}
	defer c.Close()
	e, err := DecodeEntry(v)
	if err != nil {
		return nil, fmt.Errorf("%w: key %x: %v", ErrCorrupt, key, err)
	}
	return e, nil
}

// Update is what one WAL record changes.
type Update struct {
	LSN         wal.LSN
	Transitions []Transition
	Forget      *Mark // set for forget records
	Reason      byte  // forget records: wal.Forget*
}

// Apply writes updates, which must be in LSN order and follow Applied(),
// and records the last LSN. Runs of key updates are coalesced per key and
// written in one Pebble batch; forget marks are applied physically through
// the time index.
func (ix *Index) Apply(ups []*Update) error { return ix.apply(ups, ix.ingestBytes) }

// apply is Apply with the size at which the mutable pending set is frozen
// and ingested.
func (ix *Index) apply(ups []*Update, ingestAt int64) error {
	ix.applyMu.Lock()
	defer ix.applyMu.Unlock()
	if ix.ingestErr != nil {
		return ix.ingestErr
	}
	if err := ix.failure(); err != nil {
		return err
	}
	for len(ups) > 0 {
		if ups[0].Forget != nil {
			// A forget walks Pebble's time index: everything before it
			// must be there.
			if err := ix.persistLocked(); err != nil {
				return err
			}
			if err := ix.applyForget(ups[0].LSN, *ups[0].Forget, ups[0].Reason); err != nil {
				return err
			}
			ups = ups[1:]
			continue
		}
		n := 1
		for n < len(ups) && ups[n].Forget == nil {
			n++
		}
		if err := ix.addPending(ups[:n], ingestAt); err != nil {
			return err
		}
		ups = ups[n:]
	}
	return nil
}

func (ix *Index) putMeta(b *pebble.Batch, applied wal.LSN, count, replies int64, m *Mark) error {
	var buf [2 * binary.MaxVarintLen64]byte
	if err := b.Set(metaApplied, binary.AppendUvarint(buf[:0], uint64(applied)), nil); err != nil {
		return err
	}
	// Counts never go negative with a consistent log; do not wrap around.
	if err := b.Set(metaCount, binary.AppendUvarint(buf[:0], uint64(max(count, 0))), nil); err != nil {
		return err
	}
	if err := b.Set(metaReplies, binary.AppendUvarint(buf[:0], uint64(max(replies, 0))), nil); err != nil {
		return err
	}
	if m != nil {
		v := binary.AppendVarint(buf[:0], m.Before)
		v = binary.AppendUvarint(v, uint64(m.LSN))
		if err := b.Set(metaForget, v, nil); err != nil {
			return err
		}
	}
	return nil
}

// forgetChunk bounds the work of one batch when a forget removes many
// entries.
const forgetChunk = 4096

// applyForget applies the mark m written at lsn. At this point every stored
// entry was written by a record before lsn, so every time index row below
// m.Before is forgotten: walk those rows in chunks, drop each entry's reply
// (deleting id entries), and range-delete the rows. Then drop abandoned
// claims (lease ended before m.Before) found through the in-doubt index.
// A crash between chunks is harmless: replay applies the mark again and
// finds less to do.
func (ix *Index) applyForget(lsn wal.LSN, m Mark, reason byte) error {
	if cur := ix.Mark(); m.Before < cur.Before {
		m.Before = cur.Before // marks only grow; the engine already ensures this
	}
	lower := []byte{prefixTime}
	upper := timeKey(nil, m.Before, nil)
	for {
		done, next, err := ix.forgetChunk(lower, upper, lsn, m, reason)
		if err != nil {
			return err
		}
		if done {
			break
		}
		lower = next
	}
	return ix.forgetClaims(lsn, m)
}

// forgetChunk handles up to forgetChunk time index rows from lower.
func (ix *Index) forgetChunk(lower, upper []byte, lsn wal.LSN, m Mark, reason byte) (done bool, next []byte, err error) {
	it, err := ix.db.NewIter(&pebble.IterOptions{LowerBound: lower, UpperBound: upper})
	if err != nil {
		return false, nil, fmt.Errorf("index: forget: %w", err)
	}
	b := ix.db.NewBatch()
	defer b.Close()
	delta, n, removed := int64(0), 0, int64(0)
	var last []byte
	for ok := it.First(); ok && n < forgetChunk; ok = it.Next() {
		n++
		last = append(last[:0], it.Key()...)
		t, ek, valid := parseTimeKey(it.Key())
		if !valid {
			continue
		}
		_, mode, _, perr := ParseEntryKey(ek)
		if perr != nil {
			continue // stale row; the range delete removes it
		}
		e, gerr := ix.Get(ek)
		if gerr != nil {
			it.Close()
			return false, nil, gerr
		}
		if e == nil || !e.HasTimeKey() || e.CommitTime != t {
			continue
		}
		removed++
		if e.HasExpiryKey() {
			if err = b.Delete(expiryKey(nil, e.ExpiresAt, ek), nil); err != nil {
				it.Close()
				return false, nil, err
			}
		}
		if nx := DropReply(e, mode); nx == nil {
			err = b.Delete(ek, nil)
			delta--
		} else {
			nx.LSN = lsn
			err = b.Set(ek, EncodeEntry(nil, nx), nil)
		}
		if err != nil {
			it.Close()
			return false, nil, err
		}
	}
	more := it.Valid()
	if err := it.Close(); err != nil {
		return false, nil, fmt.Errorf("index: forget: %w", err)
	}
	end := upper
	if more {
		end = append(append([]byte(nil), last...), 0) // just past last
	}
	if err := b.DeleteRange(lower, end, nil); err != nil {
		return false, nil, err
	}
	count, replies := ix.count.Load()+delta, ix.replies.Load()-removed
	if err := ix.putMeta(b, ix.Applied(), count, replies, nil); err != nil {
		return false, nil, err
	}
	if err := b.Commit(pebble.NoSync); err != nil {
		return false, nil, fmt.Errorf("index: forget at LSN %d: %w", lsn, err)
	}
	ix.memDirty = true
	ix.count.Store(count)
	ix.replies.Store(replies)
	ix.forgotten.Add(uint64(removed))
	if reason == wal.ForgetCapacity {
		ix.evicted.Add(uint64(removed))
	}
	return !more, end, nil
}

// forgetClaims drops the claims m abandons and records the mark and lsn as
// applied. In-flight claims are few (bounded by concurrency plus what
// crashes left in doubt), so walking the in-doubt index is cheap.
func (ix *Index) forgetClaims(lsn wal.LSN, m Mark) error {
	b := ix.db.NewBatch()
	defer b.Close()
	delta, removed := int64(0), uint64(0)
	err := ix.inDoubt(func(key []byte, e *Entry) error {
		if !m.ClaimForgotten(e) {
			return nil
		}
		_, mode, _, err := ParseEntryKey(key)
		if err != nil {
			return nil
		}
		removed++
		if err := b.Delete(inDoubtKey(nil, key), nil); err != nil {
			return err
		}
		if nx := dropClaim(e, mode); nx == nil {
			delta--
			return b.Delete(key, nil)
		} else {
			nx.LSN = lsn
			return b.Set(key, EncodeEntry(nil, nx), nil)
		}
	})
	if err != nil {
		return err
	}
	count := ix.count.Load() + delta
	if err := ix.putMeta(b, lsn, count, ix.replies.Load(), &m); err != nil {
		return err
	}
	if err := b.Commit(pebble.NoSync); err != nil {
		return fmt.Errorf("index: forget at LSN %d: %w", lsn, err)
	}
	ix.memDirty = true
	ix.count.Store(count)
	ix.forgotten.Add(removed)
	ix.mark.Store(&m)
	ix.applied.Store(uint64(lsn))
	return nil
}

// InDoubt calls fn for every in-flight entry.
// The pending sets are read too (Open calls this right after replay, which
// leaves them full; persisting them first would make Open wait for an
// ingest).
func (ix *Index) InDoubt(fn func(key []byte, e *Entry) error) error {
	// applyMu: no Apply meanwhile, so the mutable set does not change and
	// no set is frozen or started; an ingest in progress may finish, which
	// changes nothing for keys the captured sets cover.
	ix.applyMu.Lock()
	defer ix.applyMu.Unlock()
	ix.pmu.RLock()
	mut, frozen := ix.mut, ix.frozen
	ix.pmu.RUnlock()
	covered := func(k string) bool {
		return mut.get(k) != nil || (frozen != nil && frozen.get(k) != nil)
	}
	// The sets hold the newest state of the keys they cover.
	for _, slab := range mut.slabs {
		for i := range slab {
			if p := &slab[i]; p.next != nil && p.next.InFlight {
				if err := fn([]byte(p.key), p.next); err != nil {
					return err
				}
			}
		}
	}
	if frozen != nil {
		for _, slab := range frozen.slabs {
			for i := range slab {
				if p := &slab[i]; mut.get(p.key) == nil && p.next != nil && p.next.InFlight {
					if err := fn([]byte(p.key), p.next); err != nil {
						return err
					}
				}
			}
		}
	}
	// Pebble's rows, for the other keys.
	return ix.inDoubt(func(key []byte, e *Entry) error {
		if covered(string(key)) {
			return nil
		}
		return fn(key, e)
	})
}

// inDoubt is InDoubt over what Pebble holds (within Apply, after
// persistLocked).
func (ix *Index) inDoubt(fn func(key []byte, e *Entry) error) error {
	it, err := ix.db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefixInDoubt}, UpperBound: []byte{prefixInDoubt + 1}})
	if err != nil {
		return err
	}
	defer it.Close()
	for ok := it.First(); ok; ok = it.Next() {
		ek := it.Key()[1:]
		e, err := ix.Get(ek)
		if err != nil {
			return err
		}
		if e == nil || !e.InFlight {
			continue
		}
		if err := fn(bytes.Clone(ek), e); err != nil {
			return err
		}
	}
	return it.Error()
}

// Entries calls fn for every entry whose key starts with prefix (an entry
// key prefix; nil for all), in key order.
func (ix *Index) Entries(prefix []byte, fn func(key []byte, e *Entry) error) error {
	lower := []byte{prefixEntry}
	upper := []byte{prefixEntry + 1}
	if len(prefix) > 0 {
		lower = prefix
		upper = prefixUpper(prefix)
	}
	if err := ix.persist(); err != nil {
		return err
	}
	it, err := ix.db.NewIter(&pebble.IterOptions{LowerBound: lower, UpperBound: upper})
	if err != nil {
		return err
	}
	defer it.Close()
	for ok := it.First(); ok; ok = it.Next() {
		e, err := DecodeEntry(it.Value())
		if err != nil {
			return fmt.Errorf("%w: key %x: %v", ErrCorrupt, it.Key(), err)
		}
		if err := fn(it.Key(), e); err != nil {
			return err
		}
	}
	return it.Error()
}

func prefixUpper(p []byte) []byte {
	u := bytes.Clone(p)
	for i := len(u) - 1; i >= 0; i-- {
		if u[i] < 0xff {
			u[i]++
			return u[:i+1]
		}
	}
	return nil
}

// Flush makes everything applied so far durable in Pebble's sstables. The
// ingest of the pending sets is waited for without holding applyMu, so that
// the applier goes on meanwhile (compaction calls this with up to a full
// set pending).
func (ix *Index) Flush() error {
	ix.applyMu.Lock()
	if err := ix.freezeLocked(); err != nil {
		ix.applyMu.Unlock()
		return err
	}
	job := ix.job // ingests everything applied so far (nil: nothing pending)
	ix.applyMu.Unlock()
	if job != nil {
		select {
		case <-job.done:
		case <-ix.bgFired: // the ingest may be stuck in a parked Pebble
			return ix.failure()
		}
		if job.err != nil {
			return job.err // sticky: the next Apply reports it too
		}
	}
	ix.applyMu.Lock()
	defer ix.applyMu.Unlock()
	if err := ix.flushMemtables(); err != nil {
		return err
	}
	ix.memDirty = false
	return nil
}

// flushMemtables flushes Pebble's memtables and waits for it, or for a
// background failure: Pebble retries a failed flush (on a full disk) for
// as long as the disk stays full, and db.Flush would wait as long.
func (ix *Index) flushMemtables() error {
	if err := ix.failure(); err != nil {
		return err
	}
	var done <-chan struct{}
	if err := ix.guard(func() (err error) {
		done, err = ix.db.AsyncFlush()
		return err
	}); err != nil {
		return err
	}
	select {
	case <-done:
		return ix.failure()
	case <-ix.bgFired:
		return ix.failure()
	}
}

// DB exposes the Pebble store to the packages that snapshot and compact it.
func (ix *Index) DB() *pebble.DB { return ix.db }

// DiskUsage returns the bytes Pebble uses on disk.
func (ix *Index) DiskUsage() uint64 {
	if ix.failure() != nil {
		return 0 // Pebble may hold its locks for good (see guard)
	}
	return ix.db.Metrics().DiskSpaceUsage()
}

// Close flushes (if flush is set: everything applied is then in the
// sstables) and closes the store. Without flush, pending updates are
// dropped; replay redoes them.
//
// Every wait is bounded by a background failure, also one that happens
// while Close runs: Pebble's Close waits for its flushes and compactions,
// and one of them may be parked by Fatalf meanwhile (found by the index
// fault sweep).
func (ix *Index) Close(flush bool) error {
	if ix.pin != nil {
		ix.pin.shutdown() // its pins must be closed before Pebble is
	}
	if ix.failure() == nil {
		// The filter's scan may block inside a Pebble parked meanwhile:
		// then it is counted among the calls still in Pebble below.
		stopped := make(chan struct{})
		go func() { ix.stopFilter(); close(stopped) }()
		select {
		case <-stopped:
		case <-ix.bgFired:
		}
	} else {
		go ix.stopFilter()
	}
	var err error
	if flush && ix.failure() == nil {
		err = ix.Flush()
	} else {
		ix.applyMu.Lock()
		_ = ix.waitIngestLocked() // never close Pebble under an ingest
		ix.applyMu.Unlock()
	}
	if ix.failure() == nil {
		closed := make(chan error, 1)
		go func() {
			err := ix.db.Close()
			ix.cache.Unref()
			closed <- err
		}()
		select {
		case cerr := <-closed:
			if err == nil {
				err = cerr
			}
			if err == nil {
				err = ix.failure() // reported while closing
			}
			return err
		case <-ix.bgFired:
			// A flush or compaction Close waits for failed (Fatalf parked
			// it): give Close the same bound as below, then leave it.
			select {
			case <-closed:
			case <-time.After(closeAfterFailure):
				ix.logger.Error("index: Pebble did not close after its background failure; leaving it", "waited", closeAfterFailure)
			}
			return ix.failure()
		}
	}
	// After a background failure Pebble may be retrying a flush or a
	// compaction that cannot succeed (a full disk), or be parked by Fatalf,
	// and its Close waits for it: give it closeAfterFailure, then leave it.
	// Its files, and its lock on the directory, stay held until the process
	// exits: the index can then be reopened only by a new process (which
	// recovers from the WAL what the index lacks).
	//
	// Pebble must not be closed under a call still running in it (an
	// ingest, a compaction or a scan the guards stopped waiting for):
	// closing frees memory that call still reads. Wait for them within the
	// same bound, and leave Pebble open if they do not return.
	deadline := time.Now().Add(closeAfterFailure)
	for ix.inPebble.Load() > 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if n := ix.inPebble.Load(); n > 0 {
		ix.logger.Error("index: calls still inside Pebble after its background failure; leaving it open", "calls", n, "waited", closeAfterFailure)
	} else {
		closed := make(chan struct{})
		go func() {
			_ = ix.db.Close()
			ix.cache.Unref() // only once Pebble closed, even after the wait below gave up
			close(closed)
		}()
		select {
		case <-closed:
		case <-time.After(time.Until(deadline) + 100*time.Millisecond):
			ix.logger.Error("index: Pebble did not close after its background failure; leaving it", "waited", closeAfterFailure)
		}
	}
	if err == nil {
		err = ix.failure()
	}
	return err
}

// closeAfterFailure bounds Close after a background failure.
const closeAfterFailure = 2 * time.Second

// copyNotLinkFS makes Pebble copy the sstables it ingests instead of
// hard-linking them. It is used on vfs.MemFS only: MemFS.Link on a crashable
// MemFS takes cloneMu.RLock twice (pebble v2.1.7, vfs/mem_fs.go), which
// deadlocks when a CrashClone queues for the write lock in between (found
// by fuzz.TestCrashAtEverySyncPoint). A copy in memory is cheap.
type copyNotLinkFS struct{ vfs.FS }

var errNoLink = errors.New("index: hard links disabled on MemFS (see copyNotLinkFS)")

func (copyNotLinkFS) Link(oldname, newname string) error { return errNoLink }

// Unwrap returns the wrapped FS.
func (f copyNotLinkFS) Unwrap() vfs.FS { return f.FS }

// Memory is the memory the index accounts for, in bytes.
type Memory struct {
	Pending    int64 // pending sets of applied updates (estimated)
	Filter     int64 // key filters (two while one is built)
	BlockCache int64 // Pebble's block cache in use
	MemTables  int64 // Pebble's memtables
}

// Total is the sum of the parts.
func (m Memory) Total() int64 { return m.Pending + m.Filter + m.BlockCache + m.MemTables }

// Memory reports what the index holds in memory now.
func (ix *Index) Memory() Memory {
	var m Memory
	ix.pmu.RLock()
	if ix.mut != nil {
		m.Pending += ix.mut.bytes
	}
	if ix.frozen != nil {
		m.Pending += ix.frozen.bytes
	}
	ix.pmu.RUnlock()
	if ix.filter.Load() != nil {
		m.Filter += ix.filterBytes
	}
	if ix.buildingMem.Load() {
		m.Filter += ix.filterBytes
	}
	if ix.failure() != nil {
		return m // Pebble may hold its locks for good (see guard)
	}
	pm := ix.db.Metrics()
	m.BlockCache = pm.BlockCache.Size
	m.MemTables = int64(pm.MemTable.Size)
	return m
}

// MemSize estimates the memory an update holds until it is applied: per
// transition its key, the bookkeeping around it and its new entry (the
// same estimate the pending sets use).
func (u *Update) MemSize() int64 {
	n := int64(64)
	for _, t := range u.Transitions {
		n += int64(len(t.Key)) + pendingOverhead + entryMem(t.Next)
	}
	return n
}
