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
// it is acknowledged; the live set of ids is kept in a Pebble store (package
// index) that replays the log on Open. See docs/design.md for the formats and
// the durability contract.
package idem

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
	"golang.org/x/sync/semaphore"
)

// Status of a Result.
type Status int

const (
	// Absent: the id is unknown (Lookup only).
	Absent Status = iota
	// Fresh: the caller owns the id now and must Commit or Abort its Claim.
	Fresh
	// Done: the id was committed; Result.Reply is its reply. Nothing runs.
	Done
	// InFlight: another caller owns the id until Result.LeaseUntil.
	InFlight
)

func (s Status) String() string {
	switch s {
	case Absent:
		return "absent"
	case Fresh:
		return "fresh"
	case Done:
		return "done"
	case InFlight:
		return "in-flight"
	}
	return fmt.Sprintf("status(%d)", int(s))
}

// Request identifies one request. Give either ID, or Client and Seq
// (sequence mode: per-client sequences), never both.
type Request struct {
	// Scope separates independent id spaces (tenants, endpoints). May be empty.
	Scope string
	// ID is the request id (for example a UUID, or time + random nonce).
	ID []byte
	// Acked lists ids (in Scope) whose replies the client has received and
	// will never retry; they are removed from the set (acked ids).
	Acked [][]byte
	// Fingerprint of the payload (for example its SHA-256). A retry with a
	// different fingerprint is ErrConflict. Empty means unchecked.
	Fingerprint []byte
	// Client and Seq select sequence mode: Seq must be the client's last
	// committed sequence number + 1 to run.
	Client string
	Seq    uint64
	// TTL, when positive, makes the entry expire at claim time + TTL
	// (expires_at = created_at + TTL; a retry does not extend it). A Begin
	// at a time when that moment has passed (expiresAt < now) treats the
	// committed reply as gone: the id runs again as new, and a
	// sequence-mode client keeps its number (ErrAlreadyCommitted for
	// seq <= last). Expired entries are removed by a logged expire record
	// every Options.CleanupInterval (CleanupExpired does it now), counted
	// in Stats.Cleanups. Zero: no per-request expiry (Options.Retention
	// still applies). Requests with different TTLs share one engine.
	TTL time.Duration
}

// Result is the outcome of Begin, Wait and Lookup.
type Result struct {
	Status Status
	// Reply is the stored reply when Status is Done.
	Reply []byte
	// Claim is set when Status is Fresh: commit or abort it.
	Claim *Claim
	// LeaseUntil is when the owner's claim expires (InFlight, Fresh).
	LeaseUntil time.Time
	// CommittedAt is when the reply was committed (Done).
	CommittedAt time.Time
	// Seq is the sequence number the result is about (sequence mode).
	Seq uint64
	// ExpiresAt is when the entry's TTL runs out (Done, Fresh); zero if it
	// has none.
	ExpiresAt time.Time
}

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

	seed   maphash.Seed
	shards [numShards]shard
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
	mu    sync.Mutex
	m     map[string]*slot // guarded by mu
	bytes int64            // guarded by mu: accounted size of the slots
	// gen counts the slots evicted from m (guarded by mu): a read of the
	// index made without the lock may be installed only if no slot of
	// the shard was evicted meanwhile (see lockSlot).
	gen uint64
	// unlock is mu.Unlock bound once, so that lockKeys of one key does not
	// allocate a method value per call.
	unlock func()
}

// slot caches one key's entry. It is pinned (never evicted) while the entry
// is in flight, not yet applied to the index, or waited on.
type slot struct {
	e       *index.Entry  // as stored (forget marks may still apply); nil = absent
	dirty   wal.LSN       // last change not yet applied to the index; 0 = clean
	waiters chan struct{} // closed when the current claim finishes; nil if nobody waits
	size    int64
}

type counters struct {
	hits, misses, conflicts, collisions, gaps, alreadyCommitted, leaseLost, takeovers, expired, acked atomic.Uint64
	// ttlRemoved counts entries removed by expire records (per-request TTL).
	ttlRemoved atomic.Uint64
}

var (
	openDirsMu sync.Mutex
	openDirs   = map[string]bool{} // guarded by openDirsMu: directories open in this process
)

// Open opens (creating if needed) the idem directory dir. On open the WAL
// is read from the index's applied LSN on (older segments only have their
// headers checked; after a clean Close the log is entered at its end), a
// torn tail is cut (and logged), and the records the index has not applied
// are replayed. `idem verify` checks every frame.
func Open(dir string, opts *Options) (*Engine, error) {
	o := opts.withDefaults()
	e := &Engine{o: o, dir: dir, fs: o.FS, seed: maphash.MakeSeed()}
	for i := range e.shards {
		e.shards[i].m = make(map[string]*slot)
		e.shards[i].unlock = e.shards[i].mu.Unlock
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
	// An empty index in front of a WAL that no longer starts at LSN 1 (its
	// head was truncated by compaction) must start from a snapshot.
	if ix.Applied() == 0 && ix.Count() == 0 {
		first, err := walFirstLSN(o.FS, filepath.Join(dir, "wal"))
		if err != nil {
			ix.Close(false)
			return nil, err
		}
		if first > 1 {
			if err := e.loadDiskSnapshot(ix, first); err != nil {
				ix.Close(false)
				return nil, wrapCorrupt(err)
			}
		}
	}
	rep := ix.NewReplayer()
	applied := ix.Applied()
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
	w, scan, err := wal.Open(wal.Options{
		FS:           o.FS,
		Dir:          filepath.Join(dir, "wal"),
		SegmentSize:  o.SegmentSize,
		Preallocate:  o.FS == vfs.Default && !o.NoPreallocate,
		SyncMode:     o.Sync,
		SyncInterval: o.SyncInterval,
		// Records are retained (and their slots pinned) until their fsync:
		// in SyncNever mode that was up to a whole segment, 300-700 MiB of
		// Go heap with 64 MiB segments. An fsync per 1/128 of the budget
		// of log (2 MiB by default) bounds that at a few tens of MiB.
		MaxUnsyncedBytes: max(o.MemoryBudget/128, 1<<20),
		FirstLSN:         applied + 1,
		Logger:           o.Logger,
		OnSynced:         e.onSynced,
	}, applied, func(r wal.Record) error {
		if err := rep.Apply(r.LSN, r.Type, r.Payload); err != nil {
			return fmt.Errorf("%w: segment %s offset %d: %w", ErrCorrupt, r.Segment, r.Offset, err)
		}
		return nil
	})
	if err != nil {
		rep.Discard()
		ix.Close(false)
		return nil, wrapCorrupt(err)
	}
	e.w = w
	fail := func(err error) (*Engine, error) {
		w.Close()
		ix.Close(false)
		return nil, err
	}
	if err := rep.Flush(); err != nil {
		return fail(wrapCorrupt(err))
	}
	ix.StartFilter() // after replay, which then adds nothing to it (see index/filter.go)
	if scan.LastLSN < applied {
		return fail(fmt.Errorf("%w: the index has applied LSN %d but the WAL ends at LSN %d (WAL segments lost?)", ErrCorrupt, applied, scan.LastLSN))
	}
	if scan.TornTail != nil {
		o.Logger.Warn("idem: cut torn WAL tail", "segment", scan.TornTail.Segment, "offset", scan.TornTail.Offset, "bytes", scan.TornTail.Bytes, "saved_as", scan.TornTail.SavedAs)
	}
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
	if errors.Is(err, index.ErrBackground) {
		return fmt.Errorf("%w: %w", ErrFailed, err)
	}
	if errors.Is(err, wal.ErrCorrupt) || errors.Is(err, index.ErrCorrupt) || errors.Is(err, wal.ErrBadRecord) || errors.Is(err, index.ErrBadEntry) || errors.Is(err, index.ErrNoClaim) {
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
	flush := e.failed.Load() == nil
	e.releaseImages()
	if cerr := e.ix.Close(flush); err == nil {
		err = cerr
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

// applyBatch is what one fsync made durable, for the applier: the updates
// and the backlog bytes they hold (released once applied).
type applyBatch struct {
	ups   []*index.Update
	bytes int64
}

// onSynced runs on the WAL's sync goroutine: hand the records it made
// durable to the applier, in order. While the applier is behind by the
// backlog's bound, it waits: the sync goroutine held back holds back the
// callers waiting for durability, which bounds the memory of records not
// yet applied (their updates, and the entries they pin in the table).
// The applier takes shard locks to unpin what it applied, so nothing may
// wait for durability (or for the applier) while holding a shard lock:
// that would stop the three of them (TestClientStateWhileApplierBehind).
func (e *Engine) onSynced(recs []wal.Synced) {
	ups := make([]*index.Update, 0, len(recs))
	var n int64
	for _, r := range recs {
		if u, ok := r.Value.(*index.Update); ok && u != nil {
			ups = append(ups, u)
			n += u.MemSize()
		}
	}
	if len(ups) == 0 {
		return
	}
	n = min(n, e.backlogCap) // a batch larger than the bound goes alone
	// The applier releases what it applied whatever happens (it keeps
	// draining after a failure, and Close closes the channel only after
	// the WAL delivered its last batch), so this wait ends.
	_ = e.backlog.Acquire(context.Background(), n)
	e.backlogBytes.Add(n)
	e.applyCh <- applyBatch{ups: ups, bytes: n}
}

// applier writes durable records into the index, in LSN order, and then
// unpins the slots they changed.
func (e *Engine) applier() {
	defer close(e.applyDone)
	var batch []*index.Update
	for first := range e.applyCh {
		batch = append(batch[:0], first.ups...)
		held := first.bytes
		// Gather for a little while: a claim and its commit usually arrive
		// within a few fsyncs of each other, and applying them in one batch
		// writes the entry once instead of twice (and never writes its
		// in-doubt row). The slots stay pinned in memory meanwhile.
		deadline := time.NewTimer(applyGather)
	drain:
		for len(batch) < applyBatchMax {
			select {
			case more, ok := <-e.applyCh:
				if !ok {
					break drain
				}
				batch = append(batch, more.ups...)
				held += more.bytes
			case <-deadline.C:
				break drain
			}
		}
		deadline.Stop()
		e.applyBatch(batch)
		e.backlogBytes.Add(-held)
		e.backlog.Release(held)
	}
}

// applyBatch applies durable records to the index and unpins the slots
// they changed. After a failure it does nothing: the applier keeps
// draining so that the WAL never blocks.
func (e *Engine) applyBatch(batch []*index.Update) {
	if e.failed.Load() != nil {
		return
	}
	if err := e.ix.Apply(batch); err != nil {
		err = fmt.Errorf("%w: applying to the index: %w", ErrFailed, err)
		e.failed.Store(&err)
		e.o.Logger.Error("idem: index apply failed; the engine stops accepting writes", "err", err)
		return
	}
	for _, u := range batch {
		for _, t := range u.Transitions {
			sh := e.shardOf(t.Key)
			sh.mu.Lock()
			if sl := sh.m[string(t.Key)]; sl != nil && sl.dirty == u.LSN {
				sl.dirty = 0
			}
			sh.mu.Unlock()
		}
	}
	if e.o.MaxEntries > 0 && e.ix.Replies() > e.o.MaxEntries {
		select {
		case e.evictC <- struct{}{}:
		default:
		}
	}
}

// payloadPool holds record encoding buffers (see appendOp).
var payloadPool = sync.Pool{New: func() any { b := make([]byte, 0, 512); return &b }}

// ---- keys and the in-memory table ----

// reqKey is a validated request identity.
type reqKey struct {
	scope  string
	mode   byte
	ident  []byte // id, or client name
	seq    uint64
	key    []byte // index entry key
	acked  [][]byte
	ackKey [][]byte
}

func (e *Engine) validate(r *Request) (reqKey, error) {
	max := e.o.MaxIDLen
	if len(r.Scope) > max {
		return reqKey{}, invalid("scope of %d bytes exceeds %d", len(r.Scope), max)
	}
	if len(r.Fingerprint) > max {
		return reqKey{}, invalid("fingerprint of %d bytes exceeds %d", len(r.Fingerprint), max)
	}
	if r.TTL < 0 {
		return reqKey{}, invalid("negative TTL %v", r.TTL)
	}
	k := reqKey{scope: r.Scope}
	switch {
	case len(r.ID) > 0 && (r.Client != "" || r.Seq != 0):
		return reqKey{}, invalid("both an id and a client/seq were given; use one identity")
	case len(r.ID) > 0:
		if len(r.ID) > max {
			return reqKey{}, invalid("id of %d bytes exceeds %d", len(r.ID), max)
		}
		k.mode, k.ident = index.ModeID, r.ID
	case r.Client != "":
		if r.Seq == 0 {
			return reqKey{}, invalid("client %q without a sequence number (sequences start at 1)", r.Client)
		}
		if len(r.Client) > max {
			return reqKey{}, invalid("client name of %d bytes exceeds %d", len(r.Client), max)
		}
		k.mode, k.ident, k.seq = index.ModeClient, []byte(r.Client), r.Seq
	case r.Seq != 0:
		return reqKey{}, invalid("sequence number %d without a client", r.Seq)
	default:
		return reqKey{}, invalid("empty id")
	}
	k.key = index.EntryKey(nil, k.scope, k.mode, k.ident)
	if len(r.Acked) > 4096 {
		return reqKey{}, invalid("%d acked ids exceed 4096", len(r.Acked))
	}
	for _, a := range r.Acked {
		if len(a) == 0 || len(a) > max {
			return reqKey{}, invalid("acked id of %d bytes (want 1..%d)", len(a), max)
		}
		if k.mode == index.ModeID && string(a) == string(r.ID) {
			return reqKey{}, invalid("a request cannot ack its own id")
		}
		k.acked = append(k.acked, a)
		k.ackKey = append(k.ackKey, index.EntryKey(nil, k.scope, index.ModeID, a))
	}
	return k, nil
}

func (e *Engine) shardIdx(key []byte) int { return int(maphash.Bytes(e.seed, key) % numShards) }

func (e *Engine) shardOf(key []byte) *shard { return &e.shards[e.shardIdx(key)] }

// lockKeys locks the shards of keys in index order (so that multi-key
// operations never deadlock) and returns the unlock function.
func (e *Engine) lockKeys(keys ...[]byte) func() {
	if len(keys) == 1 {
		sh := e.shardOf(keys[0])
		sh.mu.Lock()
		return sh.unlock
	}
	idx := make([]int, 0, len(keys))
	for _, k := range keys {
		idx = append(idx, e.shardIdx(k))
	}
	slices.Sort(idx)
	idx = slices.Compact(idx)
	for _, i := range idx {
		e.shards[i].mu.Lock()
	}
	return func() {
		for j := len(idx) - 1; j >= 0; j-- {
			e.shards[idx[j]].mu.Unlock()
		}
	}
}

func (e *Engine) lockAll() func() {
	for i := range e.shards {
		e.shards[i].mu.Lock()
	}
	return func() {
		for i := len(e.shards) - 1; i >= 0; i-- {
			e.shards[i].mu.Unlock()
		}
	}
}

// slotLocked returns key's slot, loading it from the index if needed. The
// shard's lock must be held.
func (e *Engine) slotLocked(key []byte) (*slot, error) {
	sh := e.shardOf(key)
	if sl := sh.m[string(key)]; sl != nil {
		return sl, nil
	}
	en, err := e.ix.Get(key)
	if err != nil {
		return nil, wrapCorrupt(err)
	}
	return e.installLocked(sh, key, en), nil
}

// installLocked puts a slot holding en, as read from the index, into sh
// (whose lock is held) and evicts past the shard's share, never that slot.
func (e *Engine) installLocked(sh *shard, key []byte, en *index.Entry) *slot {
	sl := &slot{e: en, size: slotSize(key, en)}
	k := string(key)
	sh.m[k] = sl
	sh.bytes += sl.size
	e.evictLocked(sh, k)
	return sl
}

// lockSlot locks key's shard and returns key's slot and the unlock
// function. A slot that is not in memory is read from the index without
// holding the shard's lock, so that a lookup that has to read the disk (a
// duplicate of an id committed long ago, while Pebble compacts) does not
// stall every other key of its shard behind it.
//
// The read is installed only if the key still has no slot and no slot of
// the shard was evicted meanwhile. That makes it current: every change to
// a key goes through its slot, which stays in memory (pinned) until the
// index has applied it; so if no slot was evicted, no change to the key
// can have been made and applied during the read. Forget marks change the
// index without the slots, but readers apply the newest mark to whatever
// they read (Engine.current). Otherwise the key is read again under the
// lock.
func (e *Engine) lockSlot(key []byte) (*slot, func(), error) {
	sh := e.shardOf(key)
	sh.mu.Lock()
	if sl := sh.m[string(key)]; sl != nil {
		return sl, sh.unlock, nil
	}
	gen := sh.gen
	sh.mu.Unlock()
	en, err := e.ix.Get(key)
	if testHookUnlockedRead != nil {
		testHookUnlockedRead(key)
	}
	sh.mu.Lock()
	if sl := sh.m[string(key)]; sl != nil {
		return sl, sh.unlock, nil
	}
	if err != nil || sh.gen != gen {
		sl, err := e.slotLocked(key)
		if err != nil {
			sh.mu.Unlock()
			return nil, nil, err
		}
		return sl, sh.unlock, nil
	}
	return e.installLocked(sh, key, en), sh.unlock, nil
}

// testHookUnlockedRead, set by tests only, runs after lockSlot read key
// from the index without the shard's lock, before it takes the lock again.
var testHookUnlockedRead func(key []byte)

func slotSize(key []byte, en *index.Entry) int64 {
	n := int64(len(key)) + 160
	if en != nil {
		n += int64(len(en.Reply) + len(en.Fingerprint) + len(en.ClaimFP))
	}
	return n
}

// evictLocked drops clean, unpinned slots while the shard is over its share
// of CacheSize, never the slot keep (just loaded: its caller is about to use
// it). Go's map iteration order is random, which makes this a random
// eviction: cheap, and good enough in front of Pebble's own cache.
func (e *Engine) evictLocked(sh *shard, keep string) {
	limit := e.o.CacheSize / numShards
	if sh.bytes <= limit {
		return
	}
	target := limit - limit/8
	// Look at a bounded number of slots: when most are pinned (a burst of
	// claims, or SyncNever before its next fsync) a full scan on every
	// insert would be quadratic. The shard may then stay over its share
	// until slots are unpinned; pinned slots are needed anyway.
	seen := 0
	for k, sl := range sh.m {
		if sh.bytes <= target || seen >= evictScan {
			return
		}
		seen++
		if sl.dirty != 0 || sl.waiters != nil || (sl.e != nil && sl.e.InFlight) || k == keep {
			continue
		}
		delete(sh.m, k)
		sh.gen++
		sh.bytes -= sl.size
	}
}

// evictScan bounds the slots one eviction pass looks at.
const evictScan = 64

// setLocked publishes a new entry for a slot after its record was appended.
// The slot must be key's slot in the map: a dirty entry that is not in the
// map would be invisible to the next caller, who would read the index.
func (e *Engine) setLocked(key []byte, sl *slot, en *index.Entry, lsn wal.LSN) {
	sh := e.shardOf(key)
	if sh.m[string(key)] != sl {
		panic(fmt.Sprintf("idem: slot of key %x is not in its shard", key)) // invariant
	}
	sh.bytes -= sl.size
	sl.e = en
	sl.dirty = lsn
	sl.size = slotSize(key, en)
	sh.bytes += sl.size
}

// current returns the slot's entry as the newest forget mark leaves it.
func (e *Engine) current(sl *slot, mode byte) *index.Entry {
	return index.Normalize(sl.e, mode, *e.mark.Load())
}

// expired says whether retention has expired en's reply (a decision made
// with the clock now; the log learns of it through forget records).
func (e *Engine) expired(en *index.Entry, now time.Time) bool {
	if !en.HasTimeKey() {
		return false
	}
	if en.ExpiresAt != 0 && en.ExpiresAt < now.UnixNano() {
		return true // its TTL ran out: expires_at < now
	}
	return e.o.Retention > 0 && en.CommitTime < now.Add(-e.o.Retention).UnixNano()
}

// getLocked is the Transitions callback for the live path: every key it is
// asked for is locked by the caller.
func (e *Engine) getLocked(key []byte, mode byte) (*index.Entry, error) {
	sl, err := e.slotLocked(key)
	if err != nil {
		return nil, err
	}
	return e.current(sl, mode), nil
}

// appendOp appends op, whose transitions ts were computed with the caller
// holding the locks of every key they touch, stamps the LSN into them and
// publishes them to the slots. It returns the LSN; the caller still holds
// the locks and waits for durability after releasing them.
func (e *Engine) appendOp(op *wal.Op, ts []index.Transition) (wal.LSN, error) {
	// The payload is copied into the WAL's buffer by AppendWith: encode it
	// into a pooled buffer.
	pb := payloadPool.Get().(*[]byte)
	defer func() {
		if cap(*pb) <= 64<<10 {
			payloadPool.Put(pb)
		}
	}()
	payload, err := wal.EncodeOp((*pb)[:0], op)
	*pb = payload
	if err != nil {
		return 0, err
	}
	up := &index.Update{Transitions: ts}
	lsn, err := e.w.AppendWith(op.Type, payload, func(lsn wal.LSN) any {
		up.LSN = lsn
		index.Stamp(ts, op.Type, lsn)
		return up
	})
	if err != nil {
		return 0, e.failure(err)
	}
	for _, t := range ts {
		sl, err := e.slotLocked(t.Key)
		if err != nil { // cannot happen: every key was loaded by getLocked
			return 0, err
		}
		e.setLocked(t.Key, sl, t.Next, lsn)
		if op.Type != wal.OpExpire && t.Next == nil && t.Prev != nil && t.Prev.Committed {
			e.st.acked.Add(1)
		}
	}
	return lsn, nil
}

func (e *Engine) failure(err error) error {
	if errors.Is(err, wal.ErrClosed) {
		return ErrClosed
	}
	if errors.Is(err, ErrFailed) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrFailed, err)
}

func (e *Engine) waitDurable(lsn wal.LSN) error {
	if err := e.w.WaitDurable(lsn); err != nil {
		return e.failure(err)
	}
	return nil
}

// ---- the API ----

// Begin looks the request up and, if it is new, claims it for the caller.
//
//   - Fresh: the caller owns the id; run the side effect, then
//     Result.Claim.Commit(reply) or Abort(). The claim is durable when Begin
//     returns (unless Options.RelaxedClaims).
//   - Done: Result.Reply is the committed reply; nothing must run.
//   - InFlight: someone else owns the id until Result.LeaseUntil.
//
// Errors: ErrConflict (fingerprint mismatch), *SequenceGapError,
// ErrAlreadyCommitted, ErrInvalidRequest, ErrClosed, ErrFailed.
func (e *Engine) Begin(ctx context.Context, req Request) (Result, error) {
	res, _, err := e.begin(ctx, req)
	return res, err
}

func (e *Engine) begin(ctx context.Context, req Request) (Result, reqKey, error) {
	k, err := e.validate(&req)
	if err != nil {
		return Result{}, k, err
	}
	if err := ctx.Err(); err != nil {
		return Result{}, k, err
	}
	if err := e.enter(); err != nil {
		return Result{}, k, err
	}
	defer e.leave()
	fp := req.Fingerprint
	if len(fp) == 0 {
		fp = nil
	}
	now := e.o.Clock()
	var (
		unlock func()
		sl     *slot
	)
	if len(k.ackKey) == 0 {
		sl, unlock, err = e.lockSlot(k.key)
		if err != nil {
			return Result{}, k, err
		}
	} else {
		unlock = e.lockKeys(append([][]byte{k.key}, k.ackKey...)...)
		sl, err = e.slotLocked(k.key)
		if err != nil {
			unlock()
			return Result{}, k, err
		}
	}
	cur := e.current(sl, k.mode)
	takeover := false
	if k.mode == index.ModeID {
		switch {
		case cur != nil && cur.Committed && !e.expired(cur, now):
			if !fpMatch(cur.Fingerprint, fp) {
				unlock()
				e.st.conflicts.Add(1)
				return Result{}, k, fmt.Errorf("%w: scope %q id %s", ErrConflict, k.scope, printable(k.ident))
			}
			res := doneResult(cur)
			unlock()
			e.st.hits.Add(1)
			return res, k, e.waitDurable(cur.CommitLSN)
		case cur != nil && cur.Committed:
			e.st.expired.Add(1) // retention or TTL ran out: runs again as new (T+61m for a one-hour TTL)
		case cur != nil && cur.InFlight:
			if !fpMatch(cur.ClaimFP, fp) {
				unlock()
				e.st.conflicts.Add(1)
				return Result{}, k, fmt.Errorf("%w: scope %q id %s (in flight)", ErrConflict, k.scope, printable(k.ident))
			}
			if now.UnixNano() < cur.LeaseUntil {
				res := Result{Status: InFlight, LeaseUntil: time.Unix(0, cur.LeaseUntil)}
				unlock()
				e.st.collisions.Add(1)
				return res, k, nil
			}
			takeover = true
		}
	} else {
		var last uint64
		if cur != nil && cur.Committed {
			last = cur.Seq
		}
		switch {
		case k.seq <= last:
			if k.seq == last && cur.ReplyKept && !e.expired(cur, now) {
				if !fpMatch(cur.Fingerprint, fp) {
					unlock()
					e.st.conflicts.Add(1)
					return Result{}, k, fmt.Errorf("%w: scope %q client %q seq %d", ErrConflict, k.scope, k.ident, k.seq)
				}
				res := doneResult(cur)
				unlock()
				e.st.hits.Add(1)
				return res, k, e.waitDurable(cur.CommitLSN)
			}
			unlock()
			e.st.alreadyCommitted.Add(1)
			return Result{Seq: k.seq}, k, &AlreadyCommittedError{Scope: k.scope, Client: string(k.ident), Seq: k.seq, Last: last}
		case k.seq == last+1:
			if cur != nil && cur.InFlight {
				if !fpMatch(cur.ClaimFP, fp) {
					unlock()
					e.st.conflicts.Add(1)
					return Result{}, k, fmt.Errorf("%w: scope %q client %q seq %d (in flight)", ErrConflict, k.scope, k.ident, k.seq)
				}
				if now.UnixNano() < cur.LeaseUntil {
					res := Result{Status: InFlight, LeaseUntil: time.Unix(0, cur.LeaseUntil), Seq: k.seq}
					unlock()
					e.st.collisions.Add(1)
					return res, k, nil
				}
				takeover = true
			}
		default:
			unlock()
			e.st.gaps.Add(1)
			return Result{}, k, &SequenceGapError{Scope: k.scope, Client: string(k.ident), Seq: k.seq, Last: last}
		}
	}
	// Claim it.
	lease := now.Add(e.o.Lease)
	op := &wal.Op{
		Type: wal.OpClaim, Scope: k.scope, Fingerprint: fp, Acked: k.acked,
		Time: now.UnixNano(), LeaseUntil: lease.UnixNano(),
	}
	var expiresAt time.Time
	if req.TTL > 0 {
		expiresAt = now.Add(req.TTL)
		op.ExpiresAt = expiresAt.UnixNano()
	}
	if k.mode == index.ModeID {
		op.ID = k.ident
		if cur == nil {
			op.Flags |= wal.ClaimFlagNew
		}
	} else {
		op.Client, op.Seq = string(k.ident), k.seq
	}
	ts, err := index.Transitions(op, 0, e.getLocked)
	if err != nil {
		unlock()
		return Result{}, k, err
	}
	lsn, err := e.appendOp(op, ts)
	unlock()
	if err != nil {
		return Result{}, k, err
	}
	if takeover {
		e.st.takeovers.Add(1)
	}
	e.st.misses.Add(1)
	if !e.o.RelaxedClaims {
		if err := e.waitDurable(lsn); err != nil {
			return Result{}, k, err
		}
	}
	c := &Claim{e: e, k: k, lsn: lsn, fp: fp, leaseUntil: lease}
	return Result{Status: Fresh, Claim: c, LeaseUntil: lease, Seq: k.seq, ExpiresAt: expiresAt}, k, nil
}

func doneResult(en *index.Entry) Result {
	r := Result{Status: Done, Reply: en.Reply, CommittedAt: time.Unix(0, en.CommitTime), Seq: en.Seq}
	if en.ExpiresAt != 0 {
		r.ExpiresAt = time.Unix(0, en.ExpiresAt)
	}
	return r
}

// fpMatch: an unchecked request matches anything; a checked one needs the
// same fingerprint, and never matches an entry stored without one.
func fpMatch(stored, asked []byte) bool {
	if asked == nil {
		return true
	}
	return stored != nil && string(stored) == string(asked)
}

// Claim is the ownership of one id handed out by a Fresh Begin (or by
// InDoubt after a restart). Exactly one of Commit or Abort should be called.
type Claim struct {
	e          *Engine
	k          reqKey
	lsn        wal.LSN
	fp         []byte
	leaseUntil time.Time
	finished   atomic.Bool
}

// LeaseUntil is when the claim's lease runs out.
func (c *Claim) LeaseUntil() time.Time { return c.leaseUntil }

// Commit stores reply as the id's reply, durably (in SyncAlways mode) when it
// returns, and wakes callers waiting for it. If the lease ran out and another
// caller took the id over, it returns ErrLeaseLost and changes nothing.
func (c *Claim) Commit(ctx context.Context, reply []byte) error {
	if len(reply) > c.e.o.MaxReplySize {
		return invalid("reply of %d bytes exceeds %d", len(reply), c.e.o.MaxReplySize)
	}
	if reply == nil {
		reply = []byte{}
	}
	return c.finish(ctx, wal.OpCommit, reply, nil, nil)
}

// Abort releases the id: it is unknown again (a sequence number is not
// consumed). Use it when the side effect failed and did not happen.
func (c *Claim) Abort(ctx context.Context) error {
	return c.finish(ctx, wal.OpAbort, nil, nil, nil)
}

// Advance names a sequence-mode client (Scope, Client) whose last
// committed sequence number a commit raises to at least Seq, in the commit's
// own record (Claim.CommitAdvance). Numbers never go down: an advance to a
// number at or below the client's is a no-op. ClientState returns the
// number, which survives Forget, Ack, retention and TTL cleanup as every
// client's number does.
type Advance struct {
	Scope  string
	Client string
	Seq    uint64
}

// maxAdvances bounds the advances of one commit.
const maxAdvances = 1024

// CommitAdvance is Commit that also advances the sequence-mode clients adv
// in the same WAL record: after a crash either the reply and every advance
// are there, or none is. A stream consumer keeps its commit frontier this
// way (the client is the partition, Seq its offset): the offset is durable
// exactly when the event's effect is.
//
// Each advance needs a client name (1..MaxIDLen bytes), Seq >= 1, and a
// distinct client that is not the claim's own key. A client with a claim in
// flight cannot be advanced: CommitAdvance returns ErrInFlight, writes
// nothing and leaves the claim open (Commit, Abort or CommitAdvance it again).
// A raised client's kept reply is dropped, as a claim of a later number
// drops it.
func (c *Claim) CommitAdvance(ctx context.Context, reply []byte, adv ...Advance) error {
	if len(adv) == 0 {
		return c.Commit(ctx, reply)
	}
	if len(reply) > c.e.o.MaxReplySize {
		return invalid("reply of %d bytes exceeds %d", len(reply), c.e.o.MaxReplySize)
	}
	wadv, keys, err := c.e.checkAdvances(adv, c.k.key)
	if err != nil {
		return err
	}
	if reply == nil {
		reply = []byte{}
	}
	return c.finish(ctx, wal.OpCommitAdvance, reply, wadv, keys)
}

// checkAdvances validates adv and returns them for the WAL with the keys
// to lock: own (the committed key; nil for none) first, then one per
// advance.
func (e *Engine) checkAdvances(adv []Advance, own []byte) ([]wal.Advance, [][]byte, error) {
	if len(adv) > maxAdvances {
		return nil, nil, invalid("%d advances exceed %d", len(adv), maxAdvances)
	}
	keys := make([][]byte, 0, len(adv)+1)
	seen := make(map[string]bool, len(adv)+1)
	if own != nil {
		keys = append(keys, own)
		seen[string(own)] = true
	}
	wadv := make([]wal.Advance, len(adv))
	for i, a := range adv {
		if a.Client == "" || len(a.Client) > e.o.MaxIDLen || len(a.Scope) > e.o.MaxIDLen {
			return nil, nil, invalid("advance %d: client name must be 1..%d bytes and scope at most %d (client %d bytes, scope %d)", i, e.o.MaxIDLen, e.o.MaxIDLen, len(a.Client), len(a.Scope))
		}
		if a.Seq == 0 {
			return nil, nil, invalid("advance %d: client %q to sequence number 0 (numbers start at 1)", i, a.Client)
		}
		k := index.EntryKey(nil, a.Scope, index.ModeClient, []byte(a.Client))
		if seen[string(k)] {
			return nil, nil, invalid("advance %d: client %q in scope %q is named twice or is the committed key", i, a.Client, a.Scope)
		}
		seen[string(k)] = true
		keys = append(keys, k)
		wadv[i] = wal.Advance{Scope: a.Scope, Client: a.Client, Seq: a.Seq}
	}
	return wadv, keys, nil
}

// advancesInFlightLocked returns ErrInFlight if a client of adv (whose keys
// are locked) has a claim in flight.
func (e *Engine) advancesInFlightLocked(adv []wal.Advance, keys [][]byte) error {
	for i, a := range adv {
		sl, err := e.slotLocked(keys[i])
		if err != nil {
			return err
		}
		if en := e.current(sl, index.ModeClient); en != nil && en.InFlight {
			return fmt.Errorf("%w: cannot advance client %q in scope %q to %d: its sequence number %d is claimed", ErrInFlight, a.Client, a.Scope, a.Seq, en.ClaimSeq)
		}
	}
	return nil
}

// Advance raises the sequence-mode clients adv, without a commit, in one
// WAL record, durable when it returns (SyncAlways): a position whose
// effect was committed earlier by another record (a stream consumer that
// replays a redelivered event found at a new offset). Same rules as
// Claim.CommitAdvance: ErrInvalidRequest, or ErrInFlight (nothing written)
// for a client with a claim in flight; an advance to a number at or below
// the client's changes nothing, and when every one is such, no record is
// written.
func (e *Engine) Advance(ctx context.Context, adv ...Advance) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if len(adv) == 0 {
		return nil
	}
	wadv, keys, err := e.checkAdvances(adv, nil)
	if err != nil {
		return err
	}
	if err := e.enter(); err != nil {
		return err
	}
	defer e.leave()
	unlock := e.lockKeys(keys...)
	if err := e.advancesInFlightLocked(wadv, keys); err != nil {
		unlock()
		return err
	}
	op := &wal.Op{Type: wal.OpAdvance, Time: e.o.Clock().UnixNano(), Advances: wadv}
	ts, err := index.Transitions(op, 0, e.getLocked)
	if err != nil {
		unlock()
		return err
	}
	var lsn wal.LSN
	if len(ts) == 0 {
		// Nothing to raise: wait for the records that raised them.
		for _, k := range keys {
			if sl, err := e.slotLocked(k); err == nil && sl.e != nil && sl.e.CommitLSN > lsn {
				lsn = sl.e.CommitLSN
			}
		}
		unlock()
		if lsn == 0 {
			return nil
		}
		return e.waitDurable(lsn)
	}
	lsn, err = e.appendOp(op, ts)
	unlock()
	if err != nil {
		return err
	}
	return e.waitDurable(lsn)
}

func (c *Claim) finish(ctx context.Context, typ byte, reply []byte, adv []wal.Advance, keys [][]byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	e := c.e
	if err := e.enter(); err != nil {
		return err
	}
	defer e.leave()
	if c.finished.Swap(true) {
		return fmt.Errorf("%w: claim on %s was already finished", ErrLeaseLost, printable(c.k.ident))
	}
	k := c.k
	var unlock func()
	if keys == nil { // Commit, Abort: the claim's key alone (no slice to build)
		unlock = e.lockKeys(k.key)
	} else {
		unlock = e.lockKeys(keys...)
	}
	sl, err := e.slotLocked(k.key)
	if err != nil {
		unlock()
		return err
	}
	cur := e.current(sl, k.mode)
	if cur == nil || !cur.InFlight || cur.ClaimLSN != c.lsn {
		unlock()
		e.st.leaseLost.Add(1)
		return fmt.Errorf("%w: scope %q %s", ErrLeaseLost, k.scope, printable(k.ident))
	}
	if len(adv) > 0 {
		if err := e.advancesInFlightLocked(adv, keys[1:]); err != nil {
			unlock()
			c.finished.Store(false)
			return err
		}
	}
	op := &wal.Op{Type: typ, Scope: k.scope, ClaimLSN: c.lsn, Time: e.o.Clock().UnixNano(), Reply: reply, Advances: adv}
	if k.mode == index.ModeID {
		op.ID = k.ident
	} else {
		op.Client, op.Seq = string(k.ident), k.seq
	}
	ts, err := index.Transitions(op, 0, e.getLocked)
	if err != nil {
		unlock()
		return err
	}
	lsn, err := e.appendOp(op, ts)
	var waiters chan struct{}
	if err == nil {
		waiters, sl.waiters = sl.waiters, nil
	}
	unlock()
	if err != nil {
		return err
	}
	err = e.waitDurable(lsn)
	if waiters != nil {
		close(waiters)
	}
	return err
}

// Do runs fn exactly once for the request: a new id runs fn and commits its
// reply (or aborts on its error, so that a retry runs again); a committed id
// returns the stored reply; while another caller runs the id, Do waits for
// it (bounded by ctx). If fn panics the claim is aborted and the panic goes on.
func (e *Engine) Do(ctx context.Context, req Request, fn func(context.Context) ([]byte, error)) ([]byte, error) {
	for {
		res, k, err := e.begin(ctx, req)
		if err != nil {
			return nil, err
		}
		switch res.Status {
		case Done:
			return res.Reply, nil
		case Fresh:
			return e.run(ctx, res.Claim, fn)
		case InFlight:
			if _, err := e.waitKey(ctx, k); err != nil {
				return nil, err
			}
		}
	}
}

func (e *Engine) run(ctx context.Context, c *Claim, fn func(context.Context) ([]byte, error)) (reply []byte, err error) {
	done := false
	defer func() {
		if !done {
			_ = c.Abort(context.WithoutCancel(ctx))
		}
	}()
	reply, err = fn(ctx)
	if err != nil {
		done = true
		if aerr := c.Abort(context.WithoutCancel(ctx)); aerr != nil {
			return nil, errors.Join(err, aerr)
		}
		return nil, err
	}
	done = true
	if err := c.Commit(context.WithoutCancel(ctx), reply); err != nil {
		return nil, err
	}
	return reply, nil
}

// Wait blocks until the id is no longer in flight (or its lease runs out, or
// ctx ends) and returns what Lookup then says.
func (e *Engine) Wait(ctx context.Context, scope string, id []byte) (Result, error) {
	k, err := e.validate(&Request{Scope: scope, ID: id})
	if err != nil {
		return Result{}, err
	}
	return e.waitKey(ctx, k)
}

// WaitSeq is Wait for sequence mode: it blocks while the client's request
// seq is in flight (until its claim is committed or aborted, its lease runs
// out, or ctx ends) and returns what LookupSeq then says.
func (e *Engine) WaitSeq(ctx context.Context, scope, client string, seq uint64) (Result, error) {
	k, err := e.validate(&Request{Scope: scope, Client: client, Seq: seq})
	if err != nil {
		return Result{}, err
	}
	return e.waitKey(ctx, k)
}

func (e *Engine) waitKey(ctx context.Context, k reqKey) (Result, error) {
	for {
		if err := ctx.Err(); err != nil {
			return Result{}, err
		}
		if err := e.enter(); err != nil {
			return Result{}, err
		}
		unlock := e.lockKeys(k.key)
		sl, err := e.slotLocked(k.key)
		if err != nil {
			unlock()
			e.leave()
			return Result{}, err
		}
		cur := e.current(sl, k.mode)
		now := e.o.Clock()
		if cur != nil && cur.InFlight && (k.mode == index.ModeID || cur.ClaimSeq == k.seq) && now.UnixNano() < cur.LeaseUntil {
			if sl.waiters == nil {
				sl.waiters = make(chan struct{})
			}
			ch := sl.waiters
			left := time.Duration(cur.LeaseUntil - now.UnixNano())
			unlock()
			e.leave()
			t := time.NewTimer(left)
			select {
			case <-ch:
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return Result{}, ctx.Err()
			}
			t.Stop()
			continue
		}
		res := e.resultLocked(cur, k, now)
		unlock()
		e.leave()
		if res.Status == Done {
			if err := e.waitDurable(cur.CommitLSN); err != nil {
				return Result{}, err
			}
		}
		return res, nil
	}
}

func (e *Engine) resultLocked(cur *index.Entry, k reqKey, now time.Time) Result {
	if cur == nil {
		return Result{Status: Absent}
	}
	if k.mode == index.ModeClient {
		if cur.InFlight && (k.seq == 0 || k.seq == cur.ClaimSeq) {
			return Result{Status: InFlight, LeaseUntil: time.Unix(0, cur.LeaseUntil), Seq: cur.ClaimSeq}
		}
		if cur.Committed && cur.ReplyKept && !e.expired(cur, now) && (k.seq == 0 || k.seq == cur.Seq) {
			return doneResult(cur)
		}
		return Result{Status: Absent, Seq: k.seq}
	}
	if cur.InFlight {
		return Result{Status: InFlight, LeaseUntil: time.Unix(0, cur.LeaseUntil)}
	}
	if cur.Committed && !e.expired(cur, now) {
		return doneResult(cur)
	}
	return Result{Status: Absent}
}

// Lookup reports what the engine knows of an id without claiming it:
// Absent, Done (with the reply) or InFlight. It does not count as a hit or
// a miss.
func (e *Engine) Lookup(scope string, id []byte) (Result, error) {
	k, err := e.validate(&Request{Scope: scope, ID: id})
	if err != nil {
		return Result{}, err
	}
	return e.lookup(k)
}

// LookupSeq is Lookup for sequence mode: what the engine knows of a
// client's request seq.
func (e *Engine) LookupSeq(scope, client string, seq uint64) (Result, error) {
	k, err := e.validate(&Request{Scope: scope, Client: client, Seq: seq})
	if err != nil {
		return Result{}, err
	}
	return e.lookup(k)
}

func (e *Engine) lookup(k reqKey) (Result, error) {
	if err := e.enter(); err != nil {
		return Result{}, err
	}
	defer e.leave()
	sl, unlock, err := e.lockSlot(k.key)
	if err != nil {
		return Result{}, err
	}
	cur := e.current(sl, k.mode)
	res := e.resultLocked(cur, k, e.o.Clock())
	unlock()
	if res.Status == Done {
		if err := e.waitDurable(cur.CommitLSN); err != nil {
			return Result{}, err
		}
	}
	return res, nil
}

// ClientState returns the client's last committed sequence number in scope
// (0 for a client never seen). The client resumes at that number + 1.
func (e *Engine) ClientState(scope, client string) (uint64, error) {
	if client == "" || len(client) > e.o.MaxIDLen || len(scope) > e.o.MaxIDLen {
		return 0, invalid("client name must be 1..%d bytes", e.o.MaxIDLen)
	}
	if err := e.enter(); err != nil {
		return 0, err
	}
	defer e.leave()
	key := index.EntryKey(nil, scope, index.ModeClient, []byte(client))
	unlock := e.lockKeys(key)
	sl, err := e.slotLocked(key)
	if err != nil {
		unlock()
		return 0, err
	}
	if sl.e == nil || !sl.e.Committed {
		unlock()
		return 0, nil
	}
	seq, lsn := sl.e.Seq, sl.e.CommitLSN
	// Wait for the number's record without the key's lock, as every other
	// read does: the applier takes the shard's lock to unpin what it
	// applied, and the WAL's sync goroutine waits for the applier once
	// the records waiting for it reach their bound.
	unlock()
	if err := e.waitDurable(lsn); err != nil {
		return 0, err
	}
	return seq, nil
}

// Ack removes committed ids whose replies the client has received, by a
// logged record, so that replay removes them too. Unknown and
// in-flight ids are ignored. Durable when it returns (SyncAlways).
func (e *Engine) Ack(ctx context.Context, scope string, ids ...[]byte) error {
	if len(ids) == 0 {
		return nil
	}
	if len(scope) > e.o.MaxIDLen {
		return invalid("scope of %d bytes exceeds %d", len(scope), e.o.MaxIDLen)
	}
	keys := make([][]byte, 0, len(ids))
	for _, id := range ids {
		if len(id) == 0 || len(id) > e.o.MaxIDLen {
			return invalid("acked id of %d bytes (want 1..%d)", len(id), e.o.MaxIDLen)
		}
		keys = append(keys, index.EntryKey(nil, scope, index.ModeID, id))
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := e.enter(); err != nil {
		return err
	}
	defer e.leave()
	unlock := e.lockKeys(keys...)
	op := &wal.Op{Type: wal.OpAck, Scope: scope, Acked: ids, Time: e.o.Clock().UnixNano()}
	ts, err := index.Transitions(op, 0, e.getLocked)
	if err != nil || len(ts) == 0 {
		unlock()
		return err // nothing to remove: nothing to log
	}
	lsn, err := e.appendOp(op, ts)
	unlock()
	if err != nil {
		return err
	}
	return e.waitDurable(lsn)
}

// Forget appends the administrator's tombstone "forget every reply
// committed before before". Ids forgotten run again as new;
// sequence-mode clients keep their last sequence number (a retry at or
// below it is ErrAlreadyCommitted). In-flight claims whose lease ended
// before before are dropped too (abandoned claims). A forget never moves
// backwards: a before earlier than a previous one changes nothing. Durable
// when it returns (SyncAlways).
func (e *Engine) Forget(ctx context.Context, before time.Time) error {
	return e.forget(ctx, before.UnixNano(), wal.ForgetAdmin)
}

func (e *Engine) forget(ctx context.Context, before int64, reason byte) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := e.enter(); err != nil {
		return err
	}
	defer e.leave()
	unlock := e.lockAll()
	cur := *e.mark.Load()
	b := max(before, cur.Before)
	op := &wal.Op{Type: wal.OpForget, Before: b, Time: e.o.Clock().UnixNano(), Reason: reason}
	payload, err := wal.EncodeOp(nil, op)
	if err != nil {
		unlock()
		return err
	}
	lsn, err := e.w.AppendWith(wal.OpForget, payload, func(lsn wal.LSN) any {
		return &index.Update{LSN: lsn, Forget: &index.Mark{Before: b, LSN: lsn}, Reason: reason}
	})
	if err != nil {
		unlock()
		return e.failure(err)
	}
	e.mark.Store(&index.Mark{Before: b, LSN: lsn})
	unlock()
	return e.waitDurable(lsn)
}

// InDoubtClaim is a claim found in flight when the engine opened: its
// owner crashed (or closed) between Begin and Commit, so whether the side
// effect happened is unknown to idem. Retries see InFlight until the lease
// runs out. Resolve it with Claim.Commit (recover-and-commit) or
// Claim.Abort (recover-and-abort), as a two-phase-commit sink recovers.
type InDoubtClaim struct {
	Scope       string
	ID          []byte // id mode
	Client      string // sequence mode
	Seq         uint64
	Fingerprint []byte
	ClaimedAt   time.Time
	LeaseUntil  time.Time
	Claim       *Claim
}

type inDoubtRef struct {
	key      []byte
	claimLSN wal.LSN
}

// InDoubt lists the claims that were in flight when the engine opened and
// are still unresolved.
func (e *Engine) InDoubt() ([]InDoubtClaim, error) {
	if err := e.enter(); err != nil {
		return nil, err
	}
	defer e.leave()
	e.inDoubtMu.Lock()
	defer e.inDoubtMu.Unlock()
	var out []InDoubtClaim
	keep := e.inDoubt[:0]
	for _, r := range e.inDoubt {
		scope, mode, ident, err := index.ParseEntryKey(r.key)
		if err != nil {
			return nil, wrapCorrupt(err)
		}
		unlock := e.lockKeys(r.key)
		sl, err := e.slotLocked(r.key)
		if err != nil {
			unlock()
			return nil, err
		}
		cur := e.current(sl, mode) // a forget may have dropped the claim
		unlock()
		if cur == nil || !cur.InFlight || cur.ClaimLSN != r.claimLSN {
			continue // resolved, forgotten, or taken over by a new claim
		}
		keep = append(keep, r)
		k := reqKey{scope: scope, mode: mode, ident: append([]byte(nil), ident...), key: r.key}
		d := InDoubtClaim{Scope: scope, Fingerprint: cur.ClaimFP, ClaimedAt: time.Unix(0, cur.ClaimTime), LeaseUntil: time.Unix(0, cur.LeaseUntil)}
		if mode == index.ModeID {
			d.ID = k.ident
		} else {
			d.Client, d.Seq, k.seq = string(k.ident), cur.ClaimSeq, cur.ClaimSeq
		}
		d.Claim = &Claim{e: e, k: k, lsn: cur.ClaimLSN, fp: cur.ClaimFP, leaseUntil: d.LeaseUntil}
		out = append(out, d)
	}
	e.inDoubt = keep
	return out, nil
}

// Stats are the engine's counters and sizes.
type Stats struct {
	Hits               uint64 // Begin returned Done (idempotency.hit)
	Misses             uint64 // Begin returned Fresh (idempotency.miss)
	Conflicts          uint64 // ErrConflict (idempotency.conflict)
	InFlightCollisions uint64 // Begin returned InFlight (idempotency.processing_collision)
	Cleanups           uint64 // replies and abandoned claims removed by forget and expire records (TTL cleanup), since Open (idempotency.cleanup.count)
	Evictions          uint64 // replies removed because of MaxEntries, since Open
	Acked              uint64 // replies removed by acks, since Open
	Expired            uint64 // ids found expired by retention at Begin and run again
	SequenceGaps       uint64
	AlreadyCommitted   uint64
	LeaseLost          uint64
	Takeovers          uint64 // claims taken over after their lease ran out

	LiveEntries int64 // entries in the index (as of AppliedLSN): ids and sequence-mode clients
	Replies     int64 // entries keeping a reply (what MaxEntries bounds)
	InDoubt     int   // claims found in flight at Open and still unresolved
	CacheBytes  int64 // accounted size of the in-memory table

	WALBytes     int64
	WALSegments  int
	LastLSN      uint64 // last record appended
	DurableLSN   uint64 // last record fsynced
	AppliedLSN   uint64 // last record applied to the index
	TornTailsCut int
	// WALSyncs counts the group commit's fdatasyncs and WALSyncTime their
	// total duration (WALSyncTime / WALSyncs is the mean fsync latency).
	WALSyncs    uint64
	WALSyncTime time.Duration
	IndexBytes  uint64
	// IndexFilterBuilds counts the key filters built since Open (the first
	// one, then one each time most of its bits went stale).
	IndexFilterBuilds int64
	// Memory is what the engine accounts for against Options.MemoryBudget.
	Memory MemoryStats
}

// MemoryStats break down the memory the engine accounts for, in bytes.
type MemoryStats struct {
	Budget     int64 // Options.MemoryBudget
	Cache      int64 // the in-memory table in front of the index (CacheSize)
	Pending    int64 // applied updates waiting to enter the index (IndexIngestBytes, two sets)
	Filter     int64 // key filters (IndexFilterBytes; two while one is rebuilt)
	BlockCache int64 // Pebble's block cache in use (IndexCacheSize)
	MemTables  int64 // Pebble's memtables (3 x MemoryBudget/32 at most)
	// Backlog is what durable records waiting for the applier hold (at
	// most IndexIngestBytes/2; writers wait for durability past that). The
	// new entries among it are pinned in the table, so Cache counts them
	// as well.
	Backlog int64
	Total   int64 // the sum of the above
}

// Stats returns a snapshot of the counters.
func (e *Engine) Stats() Stats {
	s := Stats{
		Hits:               e.st.hits.Load(),
		Misses:             e.st.misses.Load(),
		Conflicts:          e.st.conflicts.Load(),
		InFlightCollisions: e.st.collisions.Load(),
		Expired:            e.st.expired.Load(),
		SequenceGaps:       e.st.gaps.Load(),
		AlreadyCommitted:   e.st.alreadyCommitted.Load(),
		LeaseLost:          e.st.leaseLost.Load(),
		Takeovers:          e.st.takeovers.Load(),
		LiveEntries:        e.ix.Count(),
		Cleanups:           e.ix.Forgotten() + e.st.ttlRemoved.Load(),
		Evictions:          e.ix.Evicted(),
		Acked:              e.st.acked.Load(),
		Replies:            e.ix.Replies(),
		AppliedLSN:         uint64(e.ix.Applied()),
		IndexFilterBuilds:  e.ix.FilterBuilds(),
	}
	ws := e.w.Stats()
	s.WALBytes, s.WALSegments = ws.Bytes, ws.Segments
	s.LastLSN, s.DurableLSN, s.TornTailsCut = uint64(ws.LastLSN), uint64(ws.SyncedLSN), ws.TornTailsCut
	s.WALSyncs, s.WALSyncTime = ws.Syncs, ws.SyncTime
	for i := range e.shards {
		sh := &e.shards[i]
		sh.mu.Lock()
		s.CacheBytes += sh.bytes
		sh.mu.Unlock()
	}
	if ds, err := e.InDoubt(); err == nil {
		s.InDoubt = len(ds)
	}
	if !e.closed.Load() {
		s.IndexBytes = e.ix.DiskUsage()
		m := e.ix.Memory()
		s.Memory = MemoryStats{Budget: e.o.MemoryBudget, Cache: s.CacheBytes, Pending: m.Pending, Filter: m.Filter,
			BlockCache: m.BlockCache, MemTables: m.MemTables, Backlog: e.backlogBytes.Load()}
		s.Memory.Total = s.Memory.Cache + m.Total() + s.Memory.Backlog
	}
	return s
}

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
