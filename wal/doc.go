// Package wal is idem's write-ahead log: an append-only sequence of records,
// each identified by a dense LSN (log sequence number), stored in segment
// files in one directory, written with group commit by a single flusher
// goroutine. All file I/O goes through pebble's vfs.FS.
//
// # Files
//
// A segment is named fmt.Sprintf("%020d.wal", firstLSN), where firstLSN is
// the LSN of its first record. Only names of exactly that form are segments;
// other files in the directory (such as "<segment>.torn", holding bytes cut
// off by Open) are ignored. The segments of a log form one LSN sequence: the
// first frame of a segment carries the firstLSN of the segment header (which
// matches the file name), every next frame the previous LSN plus one, and the
// next segment starts at the previous segment's last LSN plus one. The first segment may start anywhere (older
// segments are removed by RemoveSegmentsThrough).
//
// # Segment header (32 bytes, little-endian)
//
//	 0               8      10            16              24      28      32
//	+---------------+-------+-------------+---------------+-------+-------+
//	| magic         |version| reserved    | firstLSN      | rsvd  | crc   |
//	| "IDEMWAL1"    |u16 = 1| 6 zero bytes| uint64        | 4 B 0 | u32   |
//	+---------------+-------+-------------+---------------+-------+-------+
//	crc = CRC-32C (Castagnoli) of bytes [0, 28).
//
// # Frame (one per record; starts at an 8-aligned offset, first at 32)
//
//	 0       4       8               16  17                  17+len    8-aligned
//	+-------+-------+---------------+---+---------------------+---------+
//	| crc   | len   | lsn           |typ| payload (len bytes) | padding |
//	| u32   | u32   | uint64        |u8 |                     | zeros   |
//	+-------+-------+---------------+---+---------------------+---------+
//	        |<------------------ crc covers ---------------->|
//	crc = CRC-32C of bytes [4, 17+len): length, lsn, type and payload.
//
// len is bounded by MaxRecordSize and by the bytes left in the file before
// anything is allocated. lsn and typ are never 0, so an all-zero header is
// never a valid frame (and its CRC would not match either). The padding must
// be zero. The frame size is (17+len) rounded up to a multiple of 8.
//
// # Durability
//
// Appenders encode frames into an in-memory buffer under a mutex. The
// flusher goroutine swaps that buffer out, writes it with one Write, and
// fsyncs according to the SyncMode; then it publishes the written and
// synced LSNs, wakes waiters (by closing a per-generation channel) and
// reports the fsynced records to Options.OnSynced. Each fsync covers a
// prefix of the log: everything written before it.
//
// When the active segment exceeds SegmentSize (checked between flushes, so
// frames are never split), it is fsynced, the next segment is created, its
// header is written and fsynced and the directory is fsynced before any
// frame goes into it. Hence every segment but the last one was completely
// fsynced, and a segment header is durable before its first frame is
// written.
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
// the disk, in 512-byte sectors or 4 KiB pages), kept blocks after a hole,
// frames cut in the middle. A crash cannot damage fsynced bytes, and fsyncs
// cover prefixes, so everything after a hole was never fsynced. Scanning
// applies these rules:
//
//   - In a segment other than the last, any invalid byte (bad header, bad
//     frame, LSN discontinuity, truncated frame, trailing bytes, zeros
//     included) is a *CorruptError: that segment was fsynced completely
//     before the next one was created. An LSN gap between segments (a
//     missing segment) is a *CorruptError too.
//
//   - In the last segment, let X be the offset of the first invalid frame
//     (bad CRC, impossible length, length past EOF, truncated header, zero
//     LSN or type, non-zero padding, LSN not the expected one):
//
//     1. if the bytes [X, EOF) are all zero, the log ends cleanly at X (not
//     a torn tail; Open truncates the zeros so appends continue at X);
//
//     2. otherwise, if no 8-aligned offset Y > X holds a valid frame (CRC
//     ok, LSN above the last good one), the bytes are a torn tail: cut at
//     X;
//
//     3. otherwise, if [X, Y) contains a crash hole, it is a torn tail too:
//     cut at X. A crash hole is a zero-filled 512-byte sector at a
//     512-aligned offset, or zero bytes from X itself up to the next sector
//     boundary. The second form exists because the first unsynced write
//     starts exactly at the frame boundary X (where the last fsync ended),
//     which need not be sector aligned: if the block holding X is lost and
//     the next one kept, the hole is [X, block end), possibly shorter than
//     a sector. A valid frame begins with its CRC and length, so it never
//     begins with 8 or more zero bytes;
//
//     4. otherwise it is a *CorruptError at X: a damaged frame in the middle
//     of the log, which must not be silently dropped along with the valid
//     records after it.
//
//   - A last segment whose header is invalid and which contains no valid
//     frame was torn while being created: Open removes it (saving its bytes
//     if any is non-zero). A bad header followed by a valid frame is a
//     *CorruptError.
//
// A damaged last frame of the log is indistinguishable from a torn write
// and is cut as a torn tail; it was never fsynced if the damage comes from
// a crash. Open saves non-zero cut bytes to "<segment>.torn" (fsynced)
// before truncating, logs a warning and counts the cut in
// Stats.TornTailsCut; Scan only reports it.
package wal
