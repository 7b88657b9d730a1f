package idem

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/wal"
)

// SyncMode says when a write counts as durable.
type SyncMode int

const (
	// SyncAlways: Commit (and a Fresh Begin) return only after the record
	// is fsynced. Concurrent callers share one fsync (group commit). Nothing
	// acknowledged is lost in a machine crash. The default.
	SyncAlways SyncMode = iota
	// SyncInterval: records are written to the OS at once and fsynced every
	// Options.SyncInterval. A process crash loses nothing; a machine crash
	// may lose the last interval.
	SyncInterval
	// SyncNever: records are written to the OS at once; fsync happens only
	// at segment rotation, compaction, Close and after each MemoryBudget/128
	// of log written (2 MiB by default: records are held in memory until
	// their fsync). A process crash loses nothing; a machine crash may lose
	// everything since the last of those.
	SyncNever
)

// String returns "always", "interval" or "never".
func (m SyncMode) String() string { return m.wal().String() }

// wal is the WAL's mode of the same name.
func (m SyncMode) wal() wal.SyncMode {
	switch m {
	case SyncInterval:
		return wal.SyncInterval
	case SyncNever:
		return wal.SyncNever
	case SyncAlways:
		return wal.SyncAlways
	}
	return wal.SyncMode(m)
}

// Options configure an Engine. The zero value (or nil) is a safe default.
type Options struct {
	// FS is the filesystem; nil means the operating system's (vfs.Default).
	FS vfs.FS
	// Sync is the durability mode (default SyncAlways).
	Sync SyncMode
	// SyncInterval is the fsync period in SyncInterval mode (default 100ms).
	SyncInterval time.Duration
	// Clock returns the current time (default time.Now). Times are written
	// into records, so replay never reads the clock.
	Clock func() time.Time
	// Lease is how long a claim owns its id (default 1 hour, as the Idempotency-Key
	// service keeps "processing" keys). After the lease another Begin may take the
	// id over; the old claim's Commit then returns ErrLeaseLost. Choose it
	// longer than your side effects take.
	Lease time.Duration
	// Logger receives warnings (torn tails cut, failures). Default: discard.
	Logger *slog.Logger
	// MemoryBudget bounds the memory the engine holds for its data, in
	// bytes (default 256 MiB, minimum 32 MiB). It is shared out among the
	// parts below that are left zero: CacheSize 1/16, IndexCacheSize 1/4,
	// Pebble's memtables 3 x 1/32, IndexIngestBytes 1/16 (two sets: 1/8),
	// IndexFilterBytes 1/16 (two while one is rebuilt: 1/8), and the
	// durable records waiting to be applied 1/32. What the engine accounts
	// for (Stats.Memory) stays under 11/16 of the budget. The rest is
	// headroom: the table, the pending sets, the filter and the waiting
	// records (11/32 at most) are Go heap, which Go's collector lets grow
	// to twice its live size (GOGC=100), and the WAL's buffers and requests
	// in flight need some too. The process's RSS
	// stays within about 1.25x the budget at 10 and 100 million ids
	// (docs/design.md, "Memory budget"). A part set explicitly is taken
	// as given (the total may then exceed the budget). A smaller budget
	// works, only slower: fewer lookups of committed ids are answered from
	// memory, and the index writes smaller tables more often. The default
	// budget gives the defaults listed below.
	MemoryBudget int64
	// NoMemoryTrim turns off the C heap trim the engine runs every 5 s
	// (glibc's malloc_trim, in cgo builds on Linux): Pebble's block cache
	// lives in C memory, and without it glibc kept 3-4x what the cache
	// used (docs/design.md, "Memory budget"). Set it if the process uses
	// another allocator or trims itself.
	NoMemoryTrim bool
	// CacheSize bounds, in bytes, the entries kept in memory in front of
	// the index (default MemoryBudget/16: 16 MiB). In-flight and not yet
	// applied entries are always kept; the rest are evicted past the bound
	// (the slots of batch records by the applier once it applied them:
	// until then they may take a quarter more). Each key counts what it
	// holds on the Go heap: its bytes, its slot and its part of the
	// shard's table (88 bytes), and when its entry is in memory the entry
	// (192 bytes) with its reply and fingerprints: a 30-byte id with a
	// 32-byte reply counts about 340 bytes, so the default holds about
	// 50,000 such keys.
	CacheSize int64
	// IndexCacheSize is Pebble's block cache (default MemoryBudget/4: 64 MiB).
	IndexCacheSize int64
	// IndexIngestBytes bounds the memory of applied updates waiting to
	// enter the index (default MemoryBudget/16: 16 MiB). Updates are gathered in memory and
	// written to Pebble as one sorted sstable when this much has
	// accumulated (see docs/design.md, "Index writes"); up to twice this
	// is held while one set is being ingested (during Open's replay, sets
	// of 4x this: faster replay, up to 8x this until the first ingests
	// after Open are done). Smaller values mean more,
	// smaller sstables; it does not affect durability (the WAL has every
	// record before it is applied).
	IndexIngestBytes int64
	// IndexFilterBytes is the memory of the in-memory key filter that
	// answers most lookups of new ids without asking Pebble (default
	// MemoryBudget/16: 16 MiB, good for about 13 million stored ids at 1%
	// false positives;
	// past that it helps less, and it never grows; twice this while a new
	// one is built). With more than 4x the ids it holds (54 million at
	// 16 MiB) it is dropped and lookups ask Pebble, until the ids fall
	// below half that. Negative turns it off.
	// It is rebuilt in the background from the index when most of its
	// bits are stale (see docs/design.md, "Key filter").
	IndexFilterBytes int64
	// SegmentSize is the WAL segment size (default 64 MiB).
	SegmentSize int64
	// NoPreallocate turns off the zero-filling of WAL segments before use.
	// Preallocation (on the OS filesystem only, and not under SyncNever)
	// lets each group-commit fdatasync skip persisting a new file size,
	// about 2x cheaper on ext4. Under SyncNever no caller waits for an
	// fsync (the WAL's one per MemoryBudget/128 of log runs on its own
	// goroutine), so zero-filling each segment first would only write
	// every byte twice: 5% of the CPU of a batch of Puts.
	NoPreallocate bool
	// Retention, when positive, expires committed replies this long after
	// their commit: an expired id runs again as new (the Idempotency-Key timing rule), and a
	// forget record is appended every CleanupInterval so that the log and
	// the index drop them too. Zero (the default) keeps replies until they
	// are acked or forgotten: expiry trades exactly-once for bounded
	// storage, so it is opt-in.
	Retention time.Duration
	// CleanupInterval is how often retention forget records are appended
	// (default 10 minutes, the Idempotency-Key service's cleanup period).
	CleanupInterval time.Duration
	// RelaxedClaims makes Begin return Fresh as soon as the claim is
	// appended, without waiting for its fsync. Commit still waits. Faster
	// (one fsync per request instead of two) but a machine crash after the
	// side effect and before the next fsync can lose the claim, and the
	// side effect may then run again. Off by default.
	RelaxedClaims bool
	// MaxEntries, when positive, bounds the number of kept replies (a replay
	// cache's bounded capacity): beyond it the oldest committed replies are
	// evicted by a logged forget record (within milliseconds of crossing
	// it, and at every compaction), counted in Stats.Evictions. An evicted
	// id runs again if retried; a sequence-mode client keeps its number.
	MaxEntries int64
	// CompactInterval is how often Compact runs in the background
	// (default 10 minutes).
	CompactInterval time.Duration
	// CompactWALBytes also triggers a background Compact whenever the WAL
	// has grown by this much since the previous one (default 128 MiB), so
	// that a busy engine keeps its disk bounded between CompactIntervals.
	// A compaction costs what changed since the previous one (it makes the
	// index durable and removes the WAL before it), so the WAL stays near
	// this size under load. With KeepSnapshots the WAL is kept back to the
	// oldest kept snapshot instead. Negative: no size trigger.
	CompactWALBytes int64
	// KeepSnapshots, when positive, makes every Compact write an on-disk
	// snapshot of the whole live set (<dir>/snapshot/) and keep this many,
	// with the WAL back to the oldest one, so that Open can rebuild a lost
	// or deleted index from them. It costs a full copy of the live set per
	// compaction (time and disk grow with the set, not with what changed),
	// so it is off by default (0 or negative): the index is then the only
	// copy of what the removed WAL held. Its sstables are checksummed, so
	// damage is detected (ErrCorrupt), never read as data; back it up with
	// Engine.Snapshot or `idem snapshot`, which stream while writes go on.
	KeepSnapshots int
	// MaxIDLen bounds ids, scopes, client names and fingerprints (default 1024 bytes).
	MaxIDLen int
	// MaxReplySize bounds replies (default and maximum 12 MiB: an entry must
	// fit in one snapshot chunk, see snapshot.MaxEntrySize).
	MaxReplySize int
	// Ephemeral makes an engine whose state is derived, rebuilt by its
	// owner at every start (idemraft and idemcluster rebuild theirs from
	// raft's snapshot and log): it writes no log. Records get their LSNs
	// and go to the index as soon as they are appended, in LSN order, as
	// if fsynced at once; no WAL segment is written and nothing is
	// fsynced for them. Everything else works as usual: batches, acks,
	// Forget, expiry, Lookup and Wait, Snapshot and Compact (which still
	// writes the index's sstables), and the memory bounds (the index
	// ingests by bytes). A process crash loses the engine's state.
	//
	// The directory holds only the index and a marker file, EPHEMERAL.
	// Open refuses a directory that holds a WAL, an index or on-disk
	// snapshots of an engine that was not ephemeral (ErrInvalidRequest,
	// naming it), as a normal Open refuses one marked EPHEMERAL; an
	// ephemeral Open removes the index an earlier ephemeral engine left
	// (its state is not kept across Opens) and starts empty, at LSN 1
	// (Restore: at the snapshot's LSN). Close removes the index and the
	// marker, leaving the directory empty but for its LOCK file.
	//
	// Sync, SyncInterval and a positive KeepSnapshots are refused
	// (ErrInvalidRequest, naming the field): there is no log to sync or
	// to keep back for snapshots. SegmentSize, NoPreallocate and
	// CompactWALBytes have no effect; RelaxedClaims only spares a Fresh
	// Begin the wait for its record to be handed to the applier. Restore
	// refuses a directory holding an index, as for any engine. Stats report
	// WALBytes, WALSegments, WALSyncs and TornTailsCut as zero and
	// DurableLSN as the last record handed to the index's applier.
	Ephemeral bool
}

func (o *Options) withDefaults() Options {
	var r Options
	if o != nil {
		r = *o
	}
	if r.FS == nil {
		r.FS = vfs.Default
	}
	if r.SyncInterval <= 0 {
		r.SyncInterval = 100 * time.Millisecond
	}
	if r.Clock == nil {
		r.Clock = time.Now
	}
	if r.Lease <= 0 {
		r.Lease = time.Hour
	}
	if r.Logger == nil {
		r.Logger = slog.New(slog.DiscardHandler)
	}
	if r.MemoryBudget <= 0 {
		r.MemoryBudget = DefaultMemoryBudget
	}
	r.MemoryBudget = max(r.MemoryBudget, minMemoryBudget)
	b := r.MemoryBudget
	if r.CacheSize <= 0 {
		r.CacheSize = b / 16
	}
	if r.IndexCacheSize <= 0 {
		r.IndexCacheSize = b / 4
	}
	if r.IndexIngestBytes <= 0 {
		r.IndexIngestBytes = b / 16
	}
	if r.IndexFilterBytes == 0 {
		r.IndexFilterBytes = b / 16
	}
	if r.SegmentSize <= 0 {
		r.SegmentSize = 64 << 20
	}
	if r.CleanupInterval <= 0 {
		r.CleanupInterval = 10 * time.Minute
	}
	if r.CompactInterval <= 0 {
		r.CompactInterval = 10 * time.Minute
	}
	if r.CompactWALBytes == 0 {
		r.CompactWALBytes = 128 << 20
	}
	if r.MaxIDLen <= 0 {
		r.MaxIDLen = 1024
	}
	if r.MaxReplySize <= 0 || r.MaxReplySize > maxReplySize {
		r.MaxReplySize = maxReplySize
	}
	return r
}

// DefaultMemoryBudget is Options.MemoryBudget's default.
const DefaultMemoryBudget = 256 << 20

const minMemoryBudget = 32 << 20

// memTableSize is the size of each of Pebble's memtables (three may be
// alive at once: the mutable one, one being flushed, one queued).
func (o *Options) memTableSize() uint64 { return uint64(o.MemoryBudget / 32) }

// maxReplySize leaves room under snapshot.MaxEntrySize for the key and the
// rest of the entry (ids, scope and fingerprints are bounded by MaxIDLen).
const maxReplySize = 12 << 20

// preallocate says whether WAL segments are zero-filled before use (see
// NoPreallocate).
func (o *Options) preallocate() bool {
	return o.FS == vfs.Default && !o.NoPreallocate && o.Sync != SyncNever && !o.Ephemeral
}

// checkEphemeral refuses the options an ephemeral engine has no use for
// (see Ephemeral). It is checked on the caller's options, before defaults.
func checkEphemeral(o *Options) error {
	if o == nil || !o.Ephemeral {
		return nil
	}
	switch {
	case o.Sync != SyncAlways:
		return fmt.Errorf("%w: Options.Sync is %s, but an Ephemeral engine writes no log (leave Sync zero)", ErrInvalidRequest, o.Sync)
	case o.SyncInterval != 0:
		return fmt.Errorf("%w: Options.SyncInterval is %v, but an Ephemeral engine writes no log (leave SyncInterval zero)", ErrInvalidRequest, o.SyncInterval)
	case o.KeepSnapshots > 0:
		return fmt.Errorf("%w: Options.KeepSnapshots is %d, but an Ephemeral engine keeps no log to rebuild from on-disk snapshots (leave it zero or negative)", ErrInvalidRequest, o.KeepSnapshots)
	}
	return nil
}
