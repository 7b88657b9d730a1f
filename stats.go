package idem

import (
	"context"
	"time"
)

// Stats are the engine's counters and sizes.
type Stats struct {
	Hits               uint64 // Begin returned Done (idempotency.hit)
	Misses             uint64 // Begin returned Fresh (idempotency.miss)
	Conflicts          uint64 // ErrConflict (idempotency.conflict)
	InFlightCollisions uint64 // Begin returned InFlight (idempotency.processing_collision)
	Cleanups           uint64 // replies and abandoned claims removed by forget and expire records (TTL cleanup), and older sequence replies that left their client's reply window, since Open (idempotency.cleanup.count)
	Evictions          uint64 // replies removed because of MaxEntries, since Open
	Acked              uint64 // replies removed by acks, since Open
	Expired            uint64 // ids found expired by retention at Begin and run again
	SequenceGaps       uint64
	AlreadyCommitted   uint64
	LeaseLost          uint64
	Takeovers          uint64 // claims taken over after their lease ran out

	LiveEntries int64 // entries in the index (as of AppliedLSN): ids, sequence-mode clients and their kept older replies
	Replies     int64 // entries keeping a reply (what MaxEntries bounds)
	InDoubt     int   // claims found in flight at Open and still unresolved
	CacheBytes  int64 // accounted size of the in-memory table

	WALBytes     int64
	WALSegments  int
	LastLSN      uint64 // last record appended
	DurableLSN   uint64 // last record fsynced (Options.Ephemeral: taken for the applier)
	AppliedLSN   uint64 // last record applied to the index
	TornTailsCut int
	// WALSyncs counts the group commit's fdatasyncs and WALSyncTime their
	// total duration (WALSyncTime / WALSyncs is the mean fsync latency).
	WALSyncs    uint64
	WALSyncTime time.Duration
	// WALSegmentsRecycled counts the old WAL segments a compaction kept for
	// reuse instead of removing them, and WALSparesRecycled the segments
	// started from such a file instead of a newly zero-filled one, since
	// Open (docs/design.md, "Disk space"). With preallocation on and
	// compaction keeping up, the second grows with the first and the log's
	// bytes are written once; a WALSparesRecycled falling behind the
	// segments written means new segments are being zero-filled.
	WALSegmentsRecycled uint64
	WALSparesRecycled   uint64
	IndexBytes          uint64
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
	s.WALSegmentsRecycled, s.WALSparesRecycled = ws.SegmentsRecycled, ws.SparesRecycled
	for i := range e.shards {
		sh := &e.shards[i]
		sh.mu.Lock()
		s.CacheBytes += sh.bytes
		sh.mu.Unlock()
	}
	if ds, err := e.InDoubt(context.Background(), ""); err == nil {
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
