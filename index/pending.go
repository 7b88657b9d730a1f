package index

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	iofs "io/fs"
	"slices"
	"strings"
	"unsafe"

	"github.com/cockroachdb/pebble/v2/objstorage/objstorageprovider"
	"github.com/cockroachdb/pebble/v2/sstable"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/wal"
)

// Applied updates are not written into Pebble's memtable one batch at a
// time. They are merged into an in-memory pending set (a hash map: a lookup
// costs one map probe, where a seek in a 32 MiB memtable skiplist costs tens
// of cache misses, and nearly every lookup is of a fresh id that must be
// looked for everywhere). When the set reaches IngestBytes it is frozen, and
// a background goroutine writes it as one sorted sstable and ingests it
// into Pebble (DB.Ingest: the file is fsynced, linked in, and recorded in
// the MANIFEST atomically). A new set takes the writes meanwhile; lookups
// read the mutable set, then the frozen one, then Pebble.
//
// Crash safety is unchanged: the sstable carries the applied LSN, the
// counts and every row of its updates, so Pebble holds some prefix of the
// applied records (whole sets, in order) and replay redoes the rest. The
// few writes that still go through Pebble batches (forget marks, Load, the
// format version) are flushed before the next ingest, so that an ingested
// set never becomes durable before a batch applied earlier.

// pendingSet is a set of coalesced updates not yet in Pebble.
type pendingSet struct {
	m     map[string]*pendEntry
	bytes int64 // approximate memory held
	last  wal.LSN
	// count and replies as of last, for the meta rows.
	count, replies int64
	// The set's pendEntries and the bytes of its map keys are carved out
	// of chunks (slab, keys) rather than allocated one by one: they all
	// live exactly as long as the set, so per key this saves two
	// allocations and the collector two objects to trace.
	slab []pendEntry
	keys []byte
}

// pendEntry is one key's change: prev is what Pebble holds (once the sets
// before this one are ingested), next what it must hold.
type pendEntry struct{ prev, next *Entry }

func newPendingSet() *pendingSet { return &pendingSet{m: make(map[string]*pendEntry)} }

// Chunk sizes of a pending set's slab (entries) and key bytes.
const (
	pendSlabLen  = 256
	pendKeyChunk = 16 << 10
)

// add puts key into the set with a new pendEntry, which it returns.
func (s *pendingSet) add(key []byte, prev *Entry) *pendEntry {
	if len(s.slab) == cap(s.slab) {
		s.slab = make([]pendEntry, 0, pendSlabLen)
	}
	s.slab = s.slab[:len(s.slab)+1]
	p := &s.slab[len(s.slab)-1]
	p.prev, p.next = prev, prev
	k := ""
	if len(key) > 0 {
		if cap(s.keys)-len(s.keys) < len(key) {
			s.keys = make([]byte, 0, max(pendKeyChunk, len(key)))
		}
		off := len(s.keys)
		s.keys = append(s.keys, key...)
		// The bytes are never written again: appends go past them, and a
		// full chunk is replaced, not reused.
		k = unsafe.String(&s.keys[off], len(key))
	}
	s.m[k] = p
	return p
}

// pendingOverhead approximates the memory of one map slot and pendEntry.
const pendingOverhead = 96

func entryMem(e *Entry) int64 {
	if e == nil {
		return 0
	}
	return 160 + int64(len(e.Reply)+len(e.Fingerprint)+len(e.ClaimFP))
}

// lookupPending returns the pending state of key: ok is false when no
// pending set has it (Pebble must be asked).
func (ix *Index) lookupPending(key []byte) (e *Entry, ok bool) {
	ix.pmu.RLock()
	defer ix.pmu.RUnlock()
	if p, ok := ix.mut.m[string(key)]; ok {
		return p.next, true
	}
	if ix.frozen != nil {
		if p, ok := ix.frozen.m[string(key)]; ok {
			return p.next, true
		}
	}
	return nil, false
}

// addPending merges a run of key updates into the mutable set and starts an
// ingest when it is full. ix.applyMu is held.
func (ix *Index) addPending(ups []*Update, ingestAt int64) error {
	ix.pmu.Lock()
	s := ix.mut
	delta, rdelta := int64(0), int64(0)
	for _, u := range ups {
		for _, t := range u.Transitions {
			p := s.m[string(t.Key)]
			if p == nil {
				p = s.add(t.Key, t.Prev)
				s.bytes += int64(len(t.Key)) + pendingOverhead
			}
			// Counts follow the key's first prev and last next, as if the
			// updates were applied one by one.
			d, r := contribution(p.prev, t.Next)
			od, or := contribution(p.prev, p.next)
			delta += d - od
			rdelta += r - or
			s.bytes += entryMem(t.Next) - entryMem(p.next)
			if t.Next != nil && p.next == nil {
				// Absent to present: the key may be new to the key filter.
				// (A present key is there already: added when it became
				// present, or by the scan that built the filter.)
				ix.filterAddLocked(t.Key)
			}
			p.next = t.Next
		}
	}
	count, replies := ix.count.Load()+delta, ix.replies.Load()+rdelta
	last := ups[len(ups)-1].LSN
	s.last, s.count, s.replies = last, count, replies
	ix.pmu.Unlock()
	ix.count.Store(count)
	ix.replies.Store(replies)
	ix.applied.Store(uint64(last))
	ix.maybeRebuildFilterLocked()
	if s.bytes >= ingestAt {
		return ix.freezeLocked()
	}
	return nil
}

// contribution is what a change from prev to next adds to the entry count
// and to the reply count.
func contribution(prev, next *Entry) (count, replies int64) {
	if next != nil {
		count++
	}
	if prev != nil {
		count--
	}
	if next.HasTimeKey() {
		replies++
	}
	if prev.HasTimeKey() {
		replies--
	}
	return count, replies
}

// freezeLocked waits for the ingest in progress, freezes the mutable set
// and starts ingesting it in the background. ix.applyMu is held.
func (ix *Index) freezeLocked() error {
	if err := ix.waitIngestLocked(); err != nil {
		return err
	}
	if len(ix.mut.m) == 0 {
		return nil
	}
	if ix.memDirty {
		// A batch written before this set must reach the sstables first.
		if err := ix.flushMemtables(); err != nil {
			return ix.setIngestErr(fmt.Errorf("index: flush before ingest: %w", err))
		}
		ix.memDirty = false
	}
	ix.pmu.Lock()
	f := ix.mut
	ix.frozen, ix.mut = f, newPendingSet()
	ix.pmu.Unlock()
	job := &ingestJob{done: make(chan struct{})}
	ix.job = job
	go func() {
		err := ix.ingest(f)
		if err == nil {
			ix.pmu.Lock()
			ix.frozen = nil
			ix.pmu.Unlock()
		}
		job.err = err
		close(job.done)
	}()
	return nil
}

// ingestJob is one background ingest; done is closed when it ended, with
// err set. Any number of goroutines may wait for it.
type ingestJob struct {
	done chan struct{}
	err  error
}

// waitIngestLocked waits for the ingest in progress, if any. A failed ingest
// is sticky: the frozen set stays readable, and every later Apply fails.
func (ix *Index) waitIngestLocked() error {
	if job := ix.job; job != nil {
		select {
		case <-job.done:
		case <-ix.bgFired:
			// The ingest is stuck in Pebble (parked by a fatal failure):
			// it will never finish.
			return ix.setIngestErr(ix.failure())
		}
		ix.job = nil
		if job.err != nil {
			return ix.setIngestErr(job.err)
		}
	}
	return ix.ingestErr
}

func (ix *Index) setIngestErr(err error) error {
	if ix.ingestErr == nil {
		ix.ingestErr = err
	}
	return ix.ingestErr
}

// persistLocked puts every pending update into Pebble and waits for it.
// ix.applyMu is held.
func (ix *Index) persistLocked() error {
	if err := ix.freezeLocked(); err != nil {
		return err
	}
	return ix.waitIngestLocked()
}

// persist is persistLocked for callers that need Pebble to hold every
// applied record (scans of the secondary indexes, images, flushes).
func (ix *Index) persist() error {
	ix.applyMu.Lock()
	defer ix.applyMu.Unlock()
	return ix.persistLocked()
}

// ingestDir holds the sstables being built, inside the index directory
// (Pebble ignores names it did not make). Leftovers of a crash are removed
// at Open.
const ingestDir = "ingest"

// ingest writes s as one sstable and ingests it.
func (ix *Index) ingest(s *pendingSet) error {
	fs := ix.fs
	dir := fs.PathJoin(ix.dir, ingestDir)
	ix.ingestSeq++
	path := fs.PathJoin(dir, fmt.Sprintf("%06d.sst", ix.ingestSeq))
	if err := ix.writeSST(path, s); err != nil {
		_ = fs.Remove(path)
		return fmt.Errorf("index: writing the sstable of LSNs through %d: %w", s.last, err)
	}
	ix.inPebble.Add(1)
	err := ix.db.Ingest(context.Background(), []string{path})
	ix.inPebble.Add(-1)
	if err != nil {
		_ = fs.Remove(path)
		return fmt.Errorf("index: ingesting LSNs through %d: %w", s.last, err)
	}
	// Pebble linked the file under its own name and removes ours once the
	// ingest is recorded; remove it in case it did not (it is gone either
	// way: a missing file is what we want).
	if err := fs.Remove(path); err != nil && !errors.Is(err, iofs.ErrNotExist) {
		ix.logger.Warn("index: removing an ingested sstable's temporary name", "path", path, "error", err)
	}
	return nil
}

// timeRow is a time-index row to set or delete.
type timeRow struct {
	t   int64
	key string
	del bool
}

// inDoubtRow is an in-doubt row to set or delete.
type inDoubtRow struct {
	key string
	del bool
}

// writeSST writes the rows of s, in key order, to a new file at path and
// fsyncs it. The prefixes order the groups (meta < entries < time index <
// in-doubt index < expiry index), so each group is sorted on its own: entry keys as
// strings (with their pending state, so the map is not probed again),
// time rows by (time, key), which is their byte order.
func (ix *Index) writeSST(path string, s *pendingSet) error {
	type keyRef struct {
		k string
		p *pendEntry
	}
	keys := make([]keyRef, 0, len(s.m))
	var times, expiries []timeRow
	var doubts []inDoubtRow
	for k, p := range s.m {
		prev, next := p.prev, p.next
		if prev == nil && next == nil {
			continue // created and removed while pending: Pebble never saw it
		}
		keys = append(keys, keyRef{k, p})
		pt, nt := prev.HasTimeKey(), next.HasTimeKey()
		if pt && (!nt || prev.CommitTime != next.CommitTime) {
			times = append(times, timeRow{t: prev.CommitTime, key: k, del: true})
		}
		if nt && (!pt || prev.CommitTime != next.CommitTime) {
			times = append(times, timeRow{t: next.CommitTime, key: k})
		}
		pe, ne := prev.HasExpiryKey(), next.HasExpiryKey()
		if pe && (!ne || prev.ExpiresAt != next.ExpiresAt) {
			expiries = append(expiries, timeRow{t: prev.ExpiresAt, key: k, del: true})
		}
		if ne && (!pe || prev.ExpiresAt != next.ExpiresAt) {
			expiries = append(expiries, timeRow{t: next.ExpiresAt, key: k})
		}
		if pf, nf := prev != nil && prev.InFlight, next != nil && next.InFlight; pf != nf {
			doubts = append(doubts, inDoubtRow{key: k, del: !nf})
		}
	}
	slices.SortFunc(keys, func(a, b keyRef) int { return strings.Compare(a.k, b.k) })
	byTimeKey := func(a, b timeRow) int {
		if a.t != b.t {
			if a.t < b.t {
				return -1
			}
			return 1
		}
		return strings.Compare(a.key, b.key)
	}
	slices.SortFunc(times, byTimeKey)
	slices.SortFunc(expiries, byTimeKey)
	slices.SortFunc(doubts, func(a, b inDoubtRow) int { return strings.Compare(a.key, b.key) })

	if err := ix.fs.MkdirAll(ix.fs.PathDir(path), 0o755); err != nil {
		return err
	}
	f, err := ix.fs.Create(path, vfs.WriteCategoryUnspecified)
	if err != nil {
		return err
	}
	w := sstable.NewWriter(objstorageprovider.NewFileWritable(f), ix.writerOpts)
	// The writer copies keys and values, so one buffer serves every row.
	var kb, vb []byte
	put := func(key, value []byte, del bool) error {
		if del {
			return w.Delete(key)
		}
		return w.Set(key, value)
	}
	// Meta rows, in key order: applied ('a'), count ('n'), replies ('r').
	err = put(metaApplied, binary.AppendUvarint(vb[:0], uint64(s.last)), false)
	if err == nil {
		err = put(metaCount, binary.AppendUvarint(vb[:0], uint64(max(s.count, 0))), false)
	}
	if err == nil {
		err = put(metaReplies, binary.AppendUvarint(vb[:0], uint64(max(s.replies, 0))), false)
	}
	for i := 0; err == nil && i < len(keys); i++ {
		next := keys[i].p.next
		kb = append(kb[:0], keys[i].k...)
		if next == nil {
			err = put(kb, nil, true)
		} else {
			vb = EncodeEntry(vb[:0], next)
			err = put(kb, vb, false)
		}
	}
	for i := 0; err == nil && i < len(times); i++ {
		kb = append(kb[:0], times[i].key...)
		vb = timeKey(vb[:0], times[i].t, kb)
		err = put(vb, nil, times[i].del)
	}
	for i := 0; err == nil && i < len(doubts); i++ {
		kb = append(kb[:0], doubts[i].key...)
		vb = inDoubtKey(vb[:0], kb)
		err = put(vb, nil, doubts[i].del)
	}
	for i := 0; err == nil && i < len(expiries); i++ {
		kb = append(kb[:0], expiries[i].key...)
		vb = expiryKey(vb[:0], expiries[i].t, kb)
		err = put(vb, nil, expiries[i].del)
	}
	if err != nil {
		_ = w.Close()
		return err
	}
	// Close finishes the table, fsyncs and closes the file.
	return w.Close()
}

// removeIngestLeftovers deletes sstables a crash left half built.
func (ix *Index) removeIngestLeftovers() error {
	dir := ix.fs.PathJoin(ix.dir, ingestDir)
	names, err := ix.fs.List(dir)
	if err != nil {
		return nil // no directory yet
	}
	for _, n := range names {
		if strings.HasSuffix(n, ".sst") {
			if err := ix.fs.Remove(ix.fs.PathJoin(dir, n)); err != nil {
				return fmt.Errorf("index: removing leftover %s: %w", n, err)
			}
		}
	}
	return nil
}
