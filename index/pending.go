package index

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/maphash"
	iofs "io/fs"
	"slices"
	"strings"
	"sync/atomic"
	"unsafe"

	"github.com/cockroachdb/pebble/v2/objstorage/objstorageprovider"
	"github.com/cockroachdb/pebble/v2/sstable"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/wal"
)

// Applied updates are not written into Pebble's memtable one batch at a
// time. They are merged into an in-memory pending set (a hash table: a lookup
// costs one probe, where a seek in a 32 MiB memtable skiplist costs tens
// of cache misses, and nearly every lookup is of a fresh id that must be
// looked for everywhere). When the set reaches IngestBytes it is frozen, and
// a background goroutine writes it as sorted sstables (one per key group:
// see writeSSTs) and ingests them into Pebble (DB.Ingest: the files are
// fsynced, linked in, and recorded in the MANIFEST atomically, in one
// edit). A new set takes the writes meanwhile; lookups ask the key filter,
// then read the mutable set, then the frozen one, then Pebble.
//
// Crash safety is unchanged: the sstables carry the applied LSN, the
// counts and every row of their updates, so Pebble holds some prefix of the
// applied records (whole sets, in order) and replay redoes the rest. The
// few writes that still go through Pebble batches (forget marks, Load, the
// format version) are flushed before the next ingest, so that an ingested
// set never becomes durable before a batch applied earlier.

// pendingSet is a set of coalesced updates not yet in Pebble.
type pendingSet struct {
	// ix finds a key's pendEntry: an open-addressing table of slab
	// positions, which holds no pointers (a Go map of the keys would be
	// traced by every collection, key and entry pointer alike, for as long
	// as the set lives).
	ix    pendIndex
	n     int   // keys in the set
	bytes int64 // approximate memory held
	last  wal.LSN
	// count and replies as of last, for the meta rows.
	count, replies int64
	// The set's pendEntries and the bytes of its keys are carved out
	// of chunks (slabs, keys) rather than allocated one by one: they all
	// live exactly as long as the set, so per key this saves two
	// allocations and the collector two objects to trace. slabs holds
	// every pendEntry of the set, in the order the keys were added: the
	// ingest and every scan of the set walk them there (memory in order).
	slabs [][]pendEntry
	keys  []byte
}

// pendEntry is one key's change: prev is what Pebble holds (once the sets
// before this one are ingested), next what it must hold. key is its key
// (bytes in the set's key chunks).
type pendEntry struct {
	prev, next *Entry
	key        string
}

// newPendingSet returns an empty set whose index is sized for about hint
// keys: the set it follows held that many when it was frozen, and the next
// one, filled by the same workload to the same size, would otherwise grow
// its index (rehashing every key) several times.
func newPendingSet(hint int) *pendingSet {
	s := &pendingSet{}
	s.ix.init(hint)
	return s
}

// pendSeed hashes the keys of every pending set.
var pendSeed = maphash.MakeSeed()

// pendIndex is a pendingSet's hash index, linear probing: each slot is 0
// (empty) or the key hash's top 32 bits above the key's position in the
// set's slabs plus one. A probe compares the key bytes only when those 32
// bits match, so a key absent from the set (nearly every key a batch adds
// is new) costs one hash and, usually, one cache line. Keys are never
// removed from a set.
type pendIndex struct {
	slots []uint64 // len a power of two, at most 7/8 full
}

func (x *pendIndex) init(hint int) {
	n := 16
	for n*7/8 < hint {
		n *= 2
	}
	x.slots = make([]uint64, n)
}

// find returns key's position in s (hash h), or -1.
func (x *pendIndex) find(s *pendingSet, key string, h uint64) int {
	mask := uint64(len(x.slots) - 1)
	for i := h & mask; ; i = (i + 1) & mask {
		v := x.slots[i]
		if v == 0 {
			return -1
		}
		if v>>32 == h>>32 {
			if pos := int(uint32(v)) - 1; s.at(pos).key == key {
				return pos
			}
		}
	}
}

// touch loads the slots where the keys of the hashes hs start their
// probes, in one run of independent loads (see addPending).
func (x *pendIndex) touch(hs []uint64) {
	mask := uint64(len(x.slots) - 1)
	var v uint64
	for _, h := range hs {
		v += x.slots[h&mask]
	}
	if v == 1 { // rarely: a store only to keep the loads above
		filterSink.Store(v)
	}
}

// insert records that the key with hash h is at pos; the key is not in
// the index, which has room for it.
func (x *pendIndex) insert(pos int, h uint64) {
	mask := uint64(len(x.slots) - 1)
	i := h & mask
	for x.slots[i] != 0 {
		i = (i + 1) & mask
	}
	x.slots[i] = h>>32<<32 | uint64(pos+1)
}

// at returns the pendEntry at position pos of s's slabs.
func (s *pendingSet) at(pos int) *pendEntry {
	return &s.slabs[pos/pendSlabLen][pos%pendSlabLen]
}

// get returns key's pendEntry in s, or nil.
func (s *pendingSet) get(key string) *pendEntry {
	if pos := s.ix.find(s, key, maphash.String(pendSeed, key)); pos >= 0 {
		return s.at(pos)
	}
	return nil
}

// Chunk sizes of a pending set's slab (entries) and key bytes.
const (
	pendSlabLen  = 256
	pendKeyChunk = 16 << 10
)

// add puts key, which s does not hold, into the set with a new pendEntry,
// which it returns. h is the key's hash (pendSeed).
func (s *pendingSet) add(key []byte, h uint64, prev *Entry) *pendEntry {
	if (s.n+1)*8 > len(s.ix.slots)*7 {
		// Grow: rehash every key (the set was sized by the one before it,
		// so this is rare).
		s.ix.init(2 * (s.n + 1))
		for pos := 0; pos < s.n; pos++ {
			s.ix.insert(pos, maphash.String(pendSeed, s.at(pos).key))
		}
	}
	n := len(s.slabs)
	if n == 0 || len(s.slabs[n-1]) == pendSlabLen {
		s.slabs = append(s.slabs, make([]pendEntry, 0, pendSlabLen))
		n++
	}
	slab := s.slabs[n-1][:len(s.slabs[n-1])+1]
	s.slabs[n-1] = slab
	p := &slab[len(slab)-1]
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
	p.key = k
	s.ix.insert(s.n, h)
	s.n++
	return p
}

// pendingOverhead approximates the memory of one index slot, pendEntry and
// key header.
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
	k := unsafe.String(unsafe.SliceData(key), len(key)) // not kept
	h := maphash.String(pendSeed, k)
	if pos := ix.mut.ix.find(ix.mut, k, h); pos >= 0 {
		return ix.mut.at(pos).next, true
	}
	if f := ix.frozen; f != nil {
		if pos := f.ix.find(f, k, h); pos >= 0 {
			return f.at(pos).next, true
		}
	}
	return nil, false
}

// pendChunk is about the number of transitions that addPending publishes
// per hold of pmu's write lock (whole records: a record's transitions are
// published together). A reader that the key filter lets through (a key
// present, or a false positive) waits for one chunk, not for a whole
// applier batch, which at hundreds of callers holds thousands of records.
const pendChunk = 256

// addPending merges a run of key updates into the mutable set and starts an
// ingest when it is full. ix.applyMu is held.
//
// The updates go in chunks of whole records (pendChunk), each published
// under pmu's write lock. A key becomes visible to readers when its chunk
// is; the key filter holds it before (filterAddLocked, see filter.go):
// the keys a chunk makes present are added to it first, without pmu (the
// filter is safe for concurrent use, and a key it holds too early costs a
// reader only the probes of the sets). Only the applier, which holds
// applyMu, writes the mutable set, so between chunks the set is always a
// prefix of the run applied record by record; the engine only reads keys
// whose records were all applied by an earlier Apply (their slots stay
// pinned until then), and so never sees a run in part.
func (ix *Index) addPending(ups []*Update, ingestAt int64) error {
	s := ix.mut
	delta, rdelta := int64(0), int64(0)
	last := ups[len(ups)-1].LSN
	for len(ups) > 0 {
		n, m := 0, 0
		for n < len(ups) && (n == 0 || m < pendChunk) {
			m += len(ups[n].Transitions)
			n++
		}
		chunk := ups[:n]
		ups = ups[n:]
		hs, ph := ix.filterHashes[:0], ix.pendHashes[:0]
		for _, u := range chunk {
			for i := range u.Transitions {
				t := &u.Transitions[i]
				// Absent to present: the key may be new to the key
				// filter. (A present key is there already: added when it
				// became present, or by the scan that built the filter.)
				if t.Next != nil && t.Prev == nil && ix.filterBytes > 0 {
					hs = append(hs, ix.keyHash(t.Key))
				}
				ph = append(ph, maphash.Bytes(pendSeed, t.Key))
			}
		}
		ix.filterAddHashesLocked(hs)
		ix.filterHashes, ix.pendHashes = hs[:0], ph[:0]
		ix.pmu.Lock()
		j := 0 // the transition's index in ph
		for _, u := range chunk {
			for _, t := range u.Transitions {
				if j%touchAhead == 0 {
					// The keys' index slots lie at random in a table
					// of megabytes: load the next ones at once, so
					// that their misses overlap.
					s.ix.touch(ph[j:min(j+touchAhead, len(ph))])
				}
				k := unsafe.String(unsafe.SliceData(t.Key), len(t.Key)) // not kept
				h := ph[j]
				j++
				var p *pendEntry
				if pos := s.ix.find(s, k, h); pos >= 0 {
					p = s.at(pos)
				} else {
					p = s.add(t.Key, h, t.Prev)
					s.bytes += int64(len(t.Key)) + pendingOverhead
				}
				// Counts follow the key's first prev and last next, as if
				// the updates were applied one by one.
				d, r := contribution(p.prev, t.Next)
				od, or := contribution(p.prev, p.next)
				delta += d - od
				rdelta += r - or
				s.bytes += entryMem(t.Next) - entryMem(p.next)
				if t.Next != nil && p.next == nil && t.Prev != nil {
					// Absent in the set but present by t.Prev: the pass
					// above did not add it (the engine's records never
					// disagree so; the set decides, as it always did).
					ix.filterAddLocked(t.Key)
				}
				p.next = t.Next
			}
		}
		if len(ups) == 0 {
			// The run's end: the set's meta rows as of its last record.
			s.last = last
			s.count, s.replies = ix.count.Load()+delta, ix.replies.Load()+rdelta
		}
		ix.pmu.Unlock()
	}
	ix.count.Store(s.count)
	ix.replies.Store(s.replies)
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
	if ix.mut.n == 0 {
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
	ix.frozen, ix.mut = f, newPendingSet(f.n)
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

// ingest writes s as sstables and ingests them, atomically (one MANIFEST
// edit for all of them).
func (ix *Index) ingest(s *pendingSet) error {
	fs := ix.fs
	dir := fs.PathJoin(ix.dir, ingestDir)
	ix.ingestSeq++
	paths, err := ix.writeSSTs(fs.PathJoin(dir, fmt.Sprintf("%06d", ix.ingestSeq)), s)
	if err != nil {
		for _, p := range paths {
			_ = fs.Remove(p)
		}
		return fmt.Errorf("index: writing the sstables of LSNs through %d: %w", s.last, err)
	}
	ix.inPebble.Add(1)
	err = ix.db.Ingest(context.Background(), paths)
	ix.inPebble.Add(-1)
	if err != nil {
		for _, p := range paths {
			_ = fs.Remove(p)
		}
		return fmt.Errorf("index: ingesting LSNs through %d: %w", s.last, err)
	}
	// Pebble linked the files under its own names and removes ours once
	// the ingest is recorded; remove them in case it did not (they are gone
	// either way: a missing file is what we want).
	for _, p := range paths {
		if err := fs.Remove(p); err != nil && !errors.Is(err, iofs.ErrNotExist) {
			ix.logger.Warn("index: removing an ingested sstable's temporary name", "path", p, "error", err)
		}
	}
	return nil
}

// entryRow is an entry row of an ingest: the key's pending state, and the
// key's first 8 bytes after the prefix that every key of the ingest shares
// (big-endian, zero-padded), which orders most pairs without reading the
// keys (see sortEntryRows).
type entryRow struct {
	abbr uint64
	p    *pendEntry
}

// timeRow is a time-index (or expiry-index) row to set or delete: the
// time, and the key as its position in the sorted entry rows.
type timeRow struct {
	t   int64
	i   int32
	del bool
}

// sortEntryRows sorts rows by key. Keys are compared by their abbreviation
// first: where two abbreviations differ they order the keys as the keys
// do (the bytes before them are the same in every key, and a key that ends
// inside the window is padded with zeros, below any byte that a longer key
// has there, unless that byte is zero too: then the abbreviations are equal
// and the keys are compared). Random 16-byte ids differ in their first 8
// bytes, so the sort compares integers held in the slice instead of
// reading two keys from memory at random places.
func sortEntryRows(rows []entryRow) {
	if len(rows) == 0 {
		return
	}
	first := rows[0].p.key
	common := len(first)
	for _, r := range rows[1:] {
		k := r.p.key
		n := min(common, len(k))
		i := 0
		for i < n && k[i] == first[i] {
			i++
		}
		common = i
	}
	for i := range rows {
		var w [8]byte
		k := rows[i].p.key
		copy(w[:], k[min(common, len(k)):])
		rows[i].abbr = binary.BigEndian.Uint64(w[:])
	}
	radixSortAbbr(rows)
	byKey := func(a, b entryRow) int { return strings.Compare(a.p.key, b.p.key) }
	for i := 0; i < len(rows); { // runs of equal abbreviations, by key
		j := i + 1
		for j < len(rows) && rows[j].abbr == rows[i].abbr {
			j++
		}
		if j-i > 1 {
			slices.SortFunc(rows[i:j], byKey)
		}
		i = j
	}
}

// radixSortAbbr sorts rows by abbr (radixSort).
func radixSortAbbr(rows []entryRow) {
	keys := make([]uint64, len(rows))
	for i := range rows {
		keys[i] = rows[i].abbr
	}
	radixSort(rows, keys)
}

// sortTimeRows sorts time (or expiry) rows made in entry-key order by
// (time, key): a stable sort by time keeps the key order within a time.
func sortTimeRows(trs []timeRow) {
	keys := make([]uint64, len(trs))
	for i := range trs {
		keys[i] = uint64(trs[i].t) ^ (1 << 63) // signed order
	}
	radixSort(trs, keys)
}

// radixSort sorts s by keys (keys[i] is the key of s[i]; both are
// reordered), stably: a least-significant-digit radix sort, one pass per
// byte (a byte that is the same in every key is skipped). For the random
// abbreviations of random ids it does a fixed, branch-free amount of work
// per element, where a comparison sort calls its comparison function about
// 15 times per row of a set and mispredicts half of them; time rows share
// their high bytes, so they take few passes.
func radixSort[T any](s []T, keys []uint64) {
	if len(s) < 2 {
		return
	}
	src, dst := s, make([]T, len(s))
	ks, kd := keys, make([]uint64, len(keys))
	for shift := uint(0); shift < 64; shift += 8 {
		var at [256]int
		for _, k := range ks {
			at[byte(k>>shift)]++
		}
		if at[byte(ks[0]>>shift)] == len(ks) {
			continue
		}
		pos := 0
		for d, n := range at {
			at[d] = pos
			pos += n
		}
		for i, k := range ks {
			d := byte(k >> shift)
			dst[at[d]] = src[i]
			kd[at[d]] = k
			at[d]++
		}
		src, dst = dst, src
		ks, kd = kd, ks
	}
	if &src[0] != &s[0] {
		copy(s, src)
	}
}

// touchAhead is the number of entry rows whose memory touch loads at once.
const touchAhead = 32

// touchSink keeps touch's loads from being optimized away.
var touchSink atomic.Uint32

// touch loads the memory that writing rows will read: each pendEntry, its
// entries, its key and its reply. Rows in key order sit at random places
// in memory, so writing them one by one waits for three or four cache
// misses per row in turn (the pendEntry, then the entry it points to, then
// the reply); here each stage's loads are independent of one another, so
// the processor has the misses of a whole stage in flight at once.
func touch(rows []entryRow) {
	var next [touchAhead]*Entry
	for j := range rows {
		next[j] = rows[j].p.next
	}
	var x uint32
	for j := range rows {
		if k := rows[j].p.key; len(k) > 0 {
			x += uint32(k[len(k)-1])
		}
		if e := next[j]; e != nil {
			x += uint32(len(e.Reply))
		}
	}
	for j := range rows {
		if e := next[j]; e != nil && len(e.Reply) > 0 {
			x += uint32(e.Reply[0]) + uint32(e.Reply[len(e.Reply)-1])
		}
	}
	touchSink.Add(x)
}

// touchKeys is touch for the keys of time or expiry rows.
func touchKeys(rows []entryRow, trs []timeRow) {
	var keys [touchAhead]string
	for j, r := range trs {
		keys[j] = rows[r.i].p.key
	}
	var x uint32
	for _, k := range keys[:len(trs)] {
		if len(k) > 0 {
			x += uint32(k[0]) + uint32(k[len(k)-1])
		}
	}
	touchSink.Add(x)
}

// writeSSTs writes the rows of s, in key order, to new files named
// base-N.sst and fsyncs them; it returns the paths written (also on
// error: the caller removes them). Each group of rows goes to a table of
// its own: meta and entries (keys 0x00 and 0x01), the time index (0x02),
// the in-doubt index (0x03) and the expiry index (0x04); a group with no
// rows has no table. Pebble ingests a table into the lowest level that
// holds no key within its bounds: random entry keys overlap every level
// (their table lands in L0 and is compacted down), but the time and expiry
// rows of a set mostly lie after every row stored (they are ordered by
// commit time and expiry time), so their tables go straight to the last
// level and no compaction rewrites them. In one table with the entries
// they were half the keys every compaction of the entries read and wrote
// again. Only the entries' table has a bloom filter: the other indexes are
// only ever scanned, never looked up by key.
//
// The entry rows are sorted by key (sortEntryRows); the time and expiry
// rows are made in that order and sorted by time, then by their place in
// it; the in-doubt rows come out in key order.
func (ix *Index) writeSSTs(base string, s *pendingSet) (paths []string, err error) {
	rows := make([]entryRow, 0, s.n)
	for _, slab := range s.slabs {
		for i := range slab {
			if p := &slab[i]; p.prev != nil || p.next != nil {
				rows = append(rows, entryRow{p: p})
			} // else created and removed while pending: Pebble never saw it
		}
	}
	sortEntryRows(rows)

	if err := ix.fs.MkdirAll(ix.fs.PathDir(base), 0o755); err != nil {
		return nil, err
	}
	// The writer copies keys and values, so one buffer serves every row.
	var vb []byte
	table := func(o *sstable.WriterOptions, rows func(w *sstable.Writer) error) error {
		path := fmt.Sprintf("%s-%d.sst", base, len(paths))
		f, err := ix.fs.Create(path, vfs.WriteCategoryUnspecified)
		if err != nil {
			return err
		}
		paths = append(paths, path)
		// Written in ioBufSize pieces, not block by block (iobuf.go).
		w := sstable.NewWriter(objstorageprovider.NewFileWritable(newBufWriteFile(f)), *o)
		if err := rows(w); err != nil {
			_ = w.Close()
			return err
		}
		// Close finishes the table, fsyncs and closes the file.
		return w.Close()
	}
	// Pebble copies keys and values: the keys are passed without copies.
	key := func(r entryRow) []byte { return unsafe.Slice(unsafe.StringData(r.p.key), len(r.p.key)) }
	// The entries' table; the other indexes' rows are collected on the
	// way, while each entry is in the processor's cache.
	// Sized as the last set's were (a set has about as many as the one
	// before it): grown by appends, they were copied a dozen times over
	// per set, and their garbage was a tenth of a sink's allocations.
	times := make([]timeRow, 0, min(ix.ingestTimes, 2*len(rows)))
	expiries := make([]timeRow, 0, min(ix.ingestExpiries, 2*len(rows)))
	var doubts []int32
	err = table(&ix.writerOpts, func(w *sstable.Writer) error {
		// Meta rows, in key order: applied ('a'), count ('n'), replies ('r').
		err := w.Set(metaApplied, binary.AppendUvarint(vb[:0], uint64(s.last)))
		if err == nil {
			err = w.Set(metaCount, binary.AppendUvarint(vb[:0], uint64(max(s.count, 0))))
		}
		if err == nil {
			err = w.Set(metaReplies, binary.AppendUvarint(vb[:0], uint64(max(s.replies, 0))))
		}
		for i := 0; err == nil && i < len(rows); i++ {
			if i%touchAhead == 0 {
				touch(rows[i:min(i+touchAhead, len(rows))])
			}
			prev, next := rows[i].p.prev, rows[i].p.next
			if next == nil {
				err = w.Delete(key(rows[i]))
			} else {
				vb = EncodeEntry(vb[:0], next)
				err = w.Set(key(rows[i]), vb)
			}
			pt, nt := prev.HasTimeKey(), next.HasTimeKey()
			if pt && (!nt || prev.CommitTime != next.CommitTime) {
				times = append(times, timeRow{t: prev.CommitTime, i: int32(i), del: true})
			}
			if nt && (!pt || prev.CommitTime != next.CommitTime) {
				times = append(times, timeRow{t: next.CommitTime, i: int32(i)})
			}
			pe, ne := prev.HasExpiryKey(), next.HasExpiryKey()
			if pe && (!ne || prev.ExpiresAt != next.ExpiresAt) {
				expiries = append(expiries, timeRow{t: prev.ExpiresAt, i: int32(i), del: true})
			}
			if ne && (!pe || prev.ExpiresAt != next.ExpiresAt) {
				expiries = append(expiries, timeRow{t: next.ExpiresAt, i: int32(i)})
			}
			if pf, nf := prev != nil && prev.InFlight, next != nil && next.InFlight; pf != nf {
				doubts = append(doubts, int32(i))
			}
		}
		return err
	})
	ix.ingestTimes, ix.ingestExpiries = len(times), len(expiries)
	sortTimeRows(times)
	sortTimeRows(expiries)
	timeTableOf := func(trs []timeRow, rowKey func(dst []byte, t int64, entryKey []byte) []byte) error {
		return table(&ix.indexWriterOpts, func(w *sstable.Writer) error {
			for j, r := range trs {
				if j%touchAhead == 0 {
					touchKeys(rows, trs[j:min(j+touchAhead, len(trs))])
				}
				vb = rowKey(vb[:0], r.t, key(rows[r.i]))
				var err error
				if r.del {
					err = w.Delete(vb)
				} else {
					err = w.Set(vb, nil)
				}
				if err != nil {
					return err
				}
			}
			return nil
		})
	}
	// A set's time (or expiry) rows may delete rows of earlier sets: the
	// deletes lie among the rows stored, so a table holding them goes to
	// L0 or above. The rows after the last delete are new rows later than
	// those (a reply committed now): they go in a table of their own,
	// which still lands in the last level.
	timeTable := func(trs []timeRow, rowKey func(dst []byte, t int64, entryKey []byte) []byte) error {
		cut := 0
		for j := len(trs) - 1; j >= 0; j-- {
			if trs[j].del {
				cut = j + 1
				break
			}
		}
		if cut > 0 && cut < len(trs) {
			if err := timeTableOf(trs[:cut], rowKey); err != nil {
				return err
			}
			trs = trs[cut:]
		}
		return timeTableOf(trs, rowKey)
	}
	if err == nil && len(times) > 0 {
		err = timeTable(times, timeKey)
	}
	if err == nil && len(doubts) > 0 {
		err = table(&ix.indexWriterOpts, func(w *sstable.Writer) error {
			for _, i := range doubts {
				vb = inDoubtKey(vb[:0], key(rows[i]))
				var err error
				if rows[i].p.next != nil && rows[i].p.next.InFlight {
					err = w.Set(vb, nil)
				} else {
					err = w.Delete(vb)
				}
				if err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err == nil && len(expiries) > 0 {
		err = timeTable(expiries, expiryKey)
	}
	return paths, err
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
