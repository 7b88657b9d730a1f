// Package wal is idem's write-ahead log: an append-only sequence of records,
// each identified by a dense LSN (log sequence number), stored in segment
// files in one directory, written with group commit by a single flusher
// goroutine. All file I/O goes through pebble's vfs.FS.
//
// It is one of idem's building blocks (with packages index, snapshot and
// compaction), published as Pebble publishes its record and sstable
// packages: the engine, package idem, composes them, and tools use them
// directly (the idem command reads a directory's log with Scan, which never
// writes). Applications use package idem.
//
// # Files
//
// A segment is named fmt.Sprintf("%020d.wal", firstLSN), where firstLSN is
// the LSN of its first record. Only names of exactly that form are segments;
// other files in the directory are ignored by Scan: "<segment>.torn" (bytes
// cut off by Open), "next.prealloc" (the spare file that becomes the next
// segment, see Preallocation), "recycled0.prealloc" and "recycled1.prealloc"
// (old segments kept for reuse, see Recycling), "close.hint" and
// "positions.hint" (see Reopen). The segments
// of a log form one LSN sequence: the first frame of a segment carries the firstLSN of the segment header
// (which matches the file name), every next frame the previous LSN plus one,
// and the next segment starts at the previous segment's last LSN plus one.
// The first segment may start anywhere (older segments are removed by
// RemoveSegmentsThrough).
//
// A segment file is: the header, the frames, then zero bytes up to the end
// of the file (the preallocated space not used yet); in a recycled segment
// (version 3), zero bytes up to padEnd and then stale bytes of the older
// segment the file held (see Recycling). The offset where the frames end is
// the segment's logical end (SegmentInfo.Size); the file size is
// SegmentInfo.Allocated. Segments written before preallocation existed
// simply have no zero tail.
//
// # Segment header (32 bytes, little-endian)
//
//	 0               8      10            16              24      28      32
//	+---------------+-------+-------------+---------------+-------+-------+
//	| magic         |version| reserved    | firstLSN      | rsvd  | crc   |
//	| "IDEMWAL1"    |u16 2/3| 6 zero bytes| uint64        | 4 B 0 | u32   |
//	+---------------+-------+-------------+---------------+-------+-------+
//	crc = CRC-32C (Castagnoli) of bytes [0, 28).
//
// The version selects the frame layout of the whole segment. New segments
// are version 2, or version 3 when the file is a recycled one: version 2
// frames, and the recycling rules below (the padding after every write, the
// stale bytes after the log). A reader that predates version 3 refuses such
// a segment ("unsupported segment version 3") rather than misread it.
// Version 1 segments (written before frames carried the
// synced LSN) are still read, with the version 1 frame layout and the
// crash-hole rules alone (they cannot prove a region was fsynced); Open
// never appends to one: if the last segment is version 1 and holds frames,
// it is fsynced and a version 2 segment is started after it, as at a
// rotation; if it holds none, its header is rewritten as version 2 in place.
//
// # Frame (one per record; starts at an 8-aligned offset, first at 32)
//
// Version 2:
//
//	 0       4       8               16              24  25                  25+len    8-aligned
//	+-------+-------+---------------+---------------+---+---------------------+---------+
//	| crc   | len   | lsn           | synced        |typ| payload (len bytes) | padding |
//	| u32   | u32   | uint64        | uint64        |u8 |                     | zeros   |
//	+-------+-------+---------------+---------------+---+---------------------+---------+
//	        |<-------------------------- crc covers ------------------------>|
//	crc = CRC-32C of bytes [4, 25+len): length, lsn, synced, type and payload.
//
// Version 1 is the same without the synced field (type at byte 16, payload
// at 17, crc over [4, 17+len)).
//
// synced is the highest LSN known to be fsynced when the frame was encoded
// (the WAL's synced LSN at Append; always below lsn): every record up to
// synced was durable before this frame could reach the file. Like the
// synced offset in Pebble's WAL chunks, it lets recovery tell a region of
// fsynced frames lost by the storage from a torn, never-fsynced tail (see
// "Torn tail vs corruption").
//
// len is bounded by MaxRecordSize and by the bytes left in the file before
// anything is allocated. lsn and typ are never 0, so an all-zero header is
// never a valid frame (and its CRC would not match either). The padding must
// be zero. The frame size is (25+len) rounded up to a multiple of 8 (17+len
// in version 1).
//
// # Preallocation
//
// Like Pebble's LogWriter (which writes into recycled WAL files), the WAL
// writes into files that are already full-size, so that a group-commit fsync has no file-size change (metadata,
// a journal commit) to persist and can be an fdatasync
// (vfs.File.SyncData). Every segment file is created by zero-filling a spare
// file, "next.prealloc", up to Options.SegmentSize with real writes of zero
// blocks (1 MiB at a time; not fallocate, whose unwritten extents would need
// a metadata update on their first write) and fsyncing it. A segment is
// started by renaming the spare file to the segment's name (the first LSN is
// only known then), writing the header over its first 32 bytes, fsyncing it
// and fsyncing the directory, all before any frame is written into it.
//
// The spare file is prepared in the background, off the commit path: the
// flusher starts a goroutine right after every rotation (once segments are
// recycled, that one only takes a recycled file, see Recycling; and, after Open,
// once the active segment is half full, so that a log opened and written
// little never allocates a spare), and waits for it (normally long
// finished) at the next rotation; a failed preparation is retried there
// once, in the flusher, before the rotation fails, and one never started (a
// single batch filled the segment) is done there too. Only the very first
// segment (Open on an empty directory) is zero-filled synchronously. A
// "next.prealloc" left over by Close or a crash is reused by the next
// preparation if it has the right size and its bytes after the first 32 are
// all zero (a crash between the rename and the directory fsync can leave the
// header in it), after fsyncing it; otherwise it is replaced.
//
// A flush batch that does not fit in the preallocated space extends the file
// (frames are never split, and the batch is not held back for a rotation);
// fdatasync then commits the new size as well, since it is needed to read
// the data back. The segment is rotated after that flush, since its logical
// end exceeds SegmentSize. An old segment without preallocation (or any
// segment when SegmentSize grew) is extended the same way until it is full.
//
// # Recycling
//
// Zero-filling writes every byte of the log twice (zeros, then frames). So,
// as Pebble and RocksDB recycle WAL files, an old segment that
// RemoveSegmentsThrough releases is kept, instead of removed, when
// segments are preallocated (Options.Preallocate), its file is full (at
// least SegmentSize bytes, at most twice that) and fewer than two recycled
// files are kept (one while the disk has less than two segments' worth of
// free space). It is renamed to "recycled<i>.prealloc", the directory is
// fsynced (so the segment can no longer reappear: a crash before leaves the
// segment, which is simply removed again), then its header is overwritten
// with a spare header, fsynced: a version 3 segment header whose first LSN
// is a bound B (the removed segment's last LSN plus one) such that every
// valid frame in the file has an LSN below B.
//
// Preparing the spare file then takes a recycled file (renamed to
// "next.prealloc"; either name is recognised after a crash, and a leftover
// whose header is not a spare header is replaced) instead of zero-filling
// one. Open without Preallocate (a log reopened with preallocation off, or
// under SyncNever) removes the recycled files an earlier run kept, which
// it would never take. Once segments are being recycled, the preparation that follows a
// rotation only takes a recycled file; if none is kept yet (truncation
// releases the previous segment a little after the rotation), zero-filling
// waits until the active segment is half full. Starting a segment from a
// recycled spare file writes the version 3 header followed by zeros up to
// padEnd(32) = 4096 and fsyncs it before the rename (then fsyncs the
// directory), the reverse of a zero-filled spare file's order: a segment
// never has a torn header over stale bytes, and a crash before the rename
// leaves a spare file whose version 3 header is still a spare header (with
// the new first LSN as its bound). A recycled spare file becomes a segment
// only for a first LSN at or above its bound (otherwise, which only a
// directory whose log was replaced can cause, it is replaced by an empty
// spare file). So:
//
//   - every valid frame left in a recycled segment's file from before (a
//     stale frame) has an LSN below the segment's first LSN, and so below
//     every LSN of its log: a stale frame is never taken for one of the log;
//
//   - every write into a recycled segment (one WriteAt per flush) is
//     followed, in the same WriteAt, by zero bytes from the logical end up to
//     padEnd(end): the next 4 KiB boundary at least 8 bytes on (a frame
//     never begins with 8 zero bytes). The next write overwrites them. Once a
//     write is fsynced, its padding is too: a clean end of the log is always
//     followed by at least 8 zero bytes, whatever stale bytes come after.
//     Padding to a page boundary also means that no write leaves a page of
//     the file partly written: the kernel would read such a page from the
//     disk first if the recycled file's page is no longer in the page cache
//     (the first page of a write was just written by the previous one). It
//     costs up to 4 KiB of zeros per write, in memory: the disk writes
//     whole pages anyway.
//
// The tail rules of a recycled segment (see "Torn tail vs corruption") use
// these two facts instead of "only zeros follow the log". No salt is
// needed: the LSN in every frame tells the generations apart. Recycled
// files are not counted in Stats.AllocatedBytes; RemoveSegmentsThrough
// counts a recycled segment as removed. Stats.SegmentsRecycled and
// Stats.SparesRecycled count the segments kept and the segments started
// from them.
//
// # Durability
//
// Appenders take their LSNs and their frames' places in an in-memory buffer
// under a mutex, in LSN order, and encode the frames (payload copy and
// checksum) after releasing it. The flusher goroutine swaps that buffer
// out, waits until every frame reserved in it is encoded, writes it with one WriteAt at the
// logical end of the active segment, and fdatasyncs according to the
// SyncMode; then it publishes the written and synced LSNs, wakes waiters (by
// closing a per-generation channel) and reports the fsynced records to
// Options.OnSynced. Each fdatasync covers a prefix of the log: everything
// written before it. (Below, "fsync" and "fsynced" include fdatasync.)
//
// Under SyncNever a WaitDurable caller whose record is not written yet,
// finding no flush running, makes that flush itself on its own goroutine
// (the same flush: the whole buffer, its waiters woken): no goroutine
// hand-off per wait where nothing waits for an fsync. It does so only as
// a lone writer (the last flush wrote one record and woke at most one
// waiter); concurrent appenders leave the flush to the flusher, whose
// gather lets them share a write. One flush runs at a time (a mutex), so
// the log is written in LSN order either way.
//
// When the logical end of the active segment exceeds SegmentSize (checked
// between flushes, so frames are never split), it is fsynced, the next
// segment is started from the spare file (renamed, header written and
// fsynced, directory fsynced) before any frame goes into it. Hence every
// segment but the last one was completely fsynced, its zero tail included
// (zero-filled and fsynced before it became a segment; in a recycled
// segment, the padding of its last write), and a segment header is durable
// before its first frame is written.
//
// A failed write, fsync or segment creation makes the WAL fail for good:
// every later Append, WaitDurable (for a record not yet fsynced) and Sync
// returns an error wrapping ErrFailed and the cause. Nothing that may not be
// durable is ever acknowledged or reported to OnSynced.
//
// # Torn tail vs corruption
//
// A crash can leave the unsynced end of the last segment in any state the
// storage allows: cut short, zero-filled holes (a block that never reached
// the disk, in 512-byte sectors or 4 KiB pages, reads as zeros whether it
// was preallocated or past the end of the file), kept blocks after a hole,
// frames cut in the middle. A crash cannot damage fsynced bytes, and fsyncs
// cover prefixes, so everything after a hole was never fsynced. Scanning
// applies these rules:
//
//   - In a segment other than the last, let X be the offset of the first
//     invalid frame. If X is the end of the file, the segment is clean. If
//     the bytes [X, EOF) are all zero (preallocated space left when the
//     segment was rotated), the segment ends cleanly at X, but only if the
//     next segment's first LSN is this segment's last valid LSN plus one:
//     zeros that replaced fsynced frames would break that continuity, and
//     are then a *CorruptError naming this segment and X. Any non-zero byte
//     in [X, EOF) (a bad frame, a truncated frame, garbage, valid frames
//     after a zero run) is a *CorruptError at X, and so is a bad header:
//     that segment was fsynced completely before the next one was started.
//     An LSN gap between two segments that end cleanly (a missing segment)
//     is a *CorruptError naming the later segment.
//
//   - In the last segment, let X be the offset of the first invalid frame
//     (bad CRC, impossible length, length past EOF, truncated header, zero
//     LSN or type, non-zero padding, LSN not the expected one):
//
//     1. if the bytes [X, EOF) are all zero, the log ends cleanly at X (not
//     a torn tail; the zeros are the preallocated space, which Open keeps:
//     appends continue at X);
//
//     2. otherwise, if no 8-aligned offset Y > X holds a valid frame (CRC
//     ok, LSN above the last good one), the bytes are a torn tail: cut at
//     X (see below for what cutting means);
//
//     3. otherwise, if some valid frame after X (any of them, not only
//     the first: a frame appended while the flush before it was in flight
//     records an older synced LSN than the frames after it) records a
//     synced LSN above the last good LSN, it is a *CorruptError at X:
//     that frame was written after the records at X had been fsynced, so
//     the bytes at X held fsynced frames that the storage lost. A torn
//     tail only ever holds records that were never fsynced;
//
//     4. otherwise, if [X, Y) contains a crash hole, it is a torn tail:
//     cut at X. A crash hole is a zero-filled 512-byte sector at a
//     512-aligned offset, or zero bytes from X itself up to the next sector
//     boundary. The second form exists because the first unsynced write
//     starts exactly at the frame boundary X (where the last fsync ended),
//     which need not be sector aligned: if the block holding X is lost and
//     the next one kept, the hole is [X, block end), possibly shorter than
//     a sector. A valid frame begins with its CRC and length, so it never
//     begins with 8 or more zero bytes;
//
//     5. otherwise it is a *CorruptError at X: a damaged frame in the middle
//     of the log, which must not be silently dropped along with the valid
//     records after it.
//
//   - In a recycled segment (version 3), what follows the log is its zero
//     padding, then stale bytes; a block lost by a crash reads as the stale
//     bytes it overwrote, not as zeros. Let X be the offset of the first
//     invalid frame (as above; a stale frame is one: its LSN is not the
//     expected one). In a segment other than the last, the bytes [X,
//     padEnd(X)) must be zero (else a *CorruptError at X), and the next
//     segment must continue the LSN sequence, as for zeros above; the bytes
//     after the padding are not read. In the last segment:
//
//     1. every 8-aligned offset after X holding a valid frame whose LSN is
//     above the last good one (a frame of this log, never a stale one) is
//     checked as in rule 3 above: one whose synced LSN is above the last
//     good LSN is a *CorruptError at X;
//
//     2. if there is no such frame and [X, padEnd(X)) is zero, the log ends
//     cleanly at X: the padding of the last fsynced write, then stale bytes.
//     Nothing is reported or cut;
//
//     3. otherwise it is a torn tail (non-zero bytes in the padding were
//     written after its fsync; valid frames after X that prove nothing were
//     never fsynced, whatever lies between them and X: the hole rule 4
//     cannot apply where lost blocks read as stale bytes). The cut bytes are
//     [X, E), E the furthest of padEnd(X), the end of the last such valid
//     frame, and, if the frame header at X carries the expected LSN, the end
//     its length gives; they are saved and zeroed as below, which leaves no
//     frame of this log after X and restores the padding. Stale bytes
//     beyond E are left alone.
//
//     What recycled segments give up: a damaged frame followed only by
//     frames that do not prove it was fsynced (rule 3) is cut as a torn
//     tail, where a zero-filled segment would ask for a crash hole (rule 4)
//     first; and an unsynced write whose first block was lost and whose
//     later blocks hold no complete frame is taken for a clean end (its
//     bytes, never fsynced, stay invalid and are overwritten by the next
//     appends).
//
//   - A last segment whose header is invalid and which contains no valid
//     frame (of either version) was torn while being started (renamed from the spare file, its
//     header not yet fsynced): Open removes it (saving its bytes up to the
//     last non-zero one, if any). A bad header followed by a valid frame is
//     a *CorruptError.
//
// A damaged last frame of the log is indistinguishable from a torn write
// and is cut as a torn tail; it was never fsynced if the damage comes from
// a crash. Let E be the offset just past the last non-zero byte of the file;
// the cut bytes are [X, E) (TornTail.Offset and Bytes). Open saves them to
// "<segment>.torn" (fsynced, directory fsynced), then cuts them by
// overwriting them with zeros in place (WriteAt + fsync), keeping the file
// size and so the preallocation: the zeros become the clean end of rule 1
// and appends continue at X. It logs a warning and counts the cut in
// Stats.TornTailsCut; Scan only reports it. A crash during the cut leaves
// some of the bytes non-zero, which the next Open cuts (and saves) again.
//
// What the rules cannot see: fsynced frames lost at the very end of the log
// (nothing valid follows them) look like a clean or torn end. The caller
// holds the other witness: the engine's index records the last applied
// (fsynced) LSN, and Open fails if the log ends before it.
//
// # Reopen
//
// Open(o, after, fn) delivers only records above after, and by default
// reads only what can hold them (Options.CheckApplied restores a full
// check; Scan, used by idem verify, always reads every frame):
//
//   - a segment whose successor starts at or below after+1 holds only
//     records at or below after: Open reads and checks its 32-byte header
//     (magic, version, checksum, first LSN matching the name) and takes
//     its last LSN from the next segment's name. Its Size is reported as
//     its file size. The segment before the last is always read in full if
//     the last one's header is torn (Open then appends to it);
//
//   - the segment holding after+1 and the later ones are read and checked
//     frame by frame, with the tail rules above;
//
//   - after a clean Close, the last segment is entered at its end: Close
//     writes "close.hint" (52 bytes: magic "IDEMWCLS", version, the active
//     segment's first LSN, the offset and LSN of its last frame and its
//     logical end, CRC-32C), through a temporary file and a rename, after
//     the final fsync. Open uses the hint only if it names the last
//     segment, its last LSN is at or below after, the frame it names is
//     valid with that LSN and ends where the hint says, and the first 4 KiB
//     after that end (in a recycled segment, its padding) are zero; the log then ends there and the rest of the
//     preallocated zeros is not read. Otherwise (no hint, torn, stale,
//     mismatched, or non-zero bytes after the end) Open reads from the hint's
//     end when it is otherwise valid, or as after a crash (below). Open
//     removes the hint before anything is appended, and its directory fsync
//     makes the removal durable, so a hint never describes a log that grew
//     after it. It is not fsynced when written: a hint lost or torn by a
//     crash only costs a longer Open.
//
//   - after a crash (no usable close hint), the segment holding after+1 is
//     entered at a position hint: every SegmentSize/16 bytes written, the
//     flusher notes the offset and LSN of the first frame of a flush
//     batch, and once an fsync covered it, a background goroutine rewrites
//     "positions.hint" with the last 32 such positions (magic "IDEMWPOS",
//     version, count, then segment first LSN, frame offset and LSN per
//     entry, CRC-32C; written to a temporary file, fsynced, renamed, the
//     directory fsynced; positions made while a write runs are written
//     right after it, the newest ring only).
//     Open takes the hint with the highest LSN at or below after+1 in that
//     segment whose frame is valid and carries that LSN, and reads on from
//     there. Every hint names a frame that was fsynced before the hint was
//     made, and fsynced frames are never cut, so a hint is never wrong about
//     the log it was written for; one naming a removed segment, or a frame
//     that does not check, is ignored.
//
// So a reopen after a clean Close reads a few headers and one frame,
// whatever the history size; after a crash it reads the WAL from about one
// hint interval before after+1 to the end of the last segment, including
// that segment's preallocated zeros, which the tail rules must check.
//
// # Full disks
//
// A recycled spare file is used whatever the free space: it takes no new
// space. A spare file is zero-filled only while the filesystem reports at least
// two segments' worth of free space (vfs.FS.GetDiskUsage; filesystems that
// cannot tell are assumed to have it): filling the disk to the brim, even
// for a moment, would fail whoever else writes there then. Otherwise, and
// if zero-filling fails because the disk is full (ENOSPC, EDQUOT, EFBIG),
// the partial file is removed and an empty spare file is used instead: that
// segment grows as it is written. Both fallbacks are logged ("little free
// space", "no space to preallocate"). A write or fsync that fails on a full disk
// makes the WAL fail (ErrFailed, wrapping the error with the operation and
// the segment name); Close still returns, and everything acknowledged before
// is on disk for the next Open.
//
// # Ephemeral
//
// Options.Ephemeral makes a log that writes nothing, for state its owner
// rebuilds after a restart (idem's Options.Ephemeral: the engines under
// idemraft and idemcluster, rebuilt from raft's snapshot and log). Open
// creates no directory or file and replays nothing; LSNs start at
// FirstLSN. Append assigns the LSN under the lock, keeps the value for
// OnSynced and wakes the flusher; the payload is never encoded or copied.
// A flush (the flusher's, or a WaitDurable caller's when none runs, as
// under SyncNever) takes the records appended so far, publishes them as
// written and synced, wakes their waiters and hands them to OnSynced in
// LSN order: to the owner they look fsynced at once. There are no
// segments (Segments is empty, RemoveSegmentsThrough removes nothing), no
// fsyncs, no hints; Close delivers the last records. A process crash loses
// the log, which is the point.
package wal
