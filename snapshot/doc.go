// Package snapshot is idem's snapshot format: a point-in-time image of the
// dedup set (the index's entry rows) at an LSN, streamed to an io.Writer and
// read back to rebuild an index, for backups, replicated state machines and
// faster recovery. The package holds the file format, the streaming Writer
// and Reader, and the management of a directory of snapshot files. It knows
// nothing of the engine: keys and values are opaque bytes (in practice
// index entry keys and index.EncodeEntry values, in key order).
//
// It is one of idem's building blocks (with packages wal, index and
// compaction), published as Pebble publishes its record and sstable
// packages: the engine, package idem, composes them, and tools use them
// directly (the idem command checks every on-disk snapshot with Verify).
// Applications use package idem (Engine.Snapshot, Restore).
//
// All integers are little-endian unless noted; every constant in format.go
// marked frozen is wire format.
//
// # Stream
//
//	+--------+---------+---------+-----+-------------+---------+
//	| header | chunk 0 | chunk 1 | ... | chunk N-1   | trailer |
//	+--------+---------+---------+-----+-------------+---------+
//
// # Header
//
//	 0            8        10          14            14+n        18+n
//	+------------+--------+-----------+-------------+-----------+
//	| magic      |version | n         | body        | crc       |
//	| "IDEMSNP1" |u16 = 1 | u32 <=4KiB| n bytes     | u32       |
//	+------------+--------+-----------+-------------+-----------+
//	body = msgpack array [lsn, created, forgetBefore, forgetLSN]
//	       (uint, int unix ns (0 = unset), int unix ns, uint); fields are
//	       only ever appended, a reader skips the ones it does not know.
//	crc  = CRC-32C (Castagnoli) of bytes [0, 14+n).
//
// # Chunk
//
//	 0          4          8          12         16                16+clen
//	+----------+----------+----------+----------+-------------------+
//	| clen     | rlen     | count    | crc      | data (clen bytes) |
//	| u32 >0   | u32      | u32 >0   | u32      | S2 block          |
//	+----------+----------+----------+----------+-------------------+
//	crc  = CRC-32C of data.
//	data = S2 block encoding (github.com/klauspost/compress/s2, not the
//	       framed stream format) of rlen raw bytes:
//	raw  = msgpack array of count pairs, each a 2-element array
//	       [bin key, bin value]  (0x92, bin8/16/32, bin8/16/32).
//
// Bounds, checked before anything is allocated: clen <= 16 MiB, rlen <= 64
// MiB, 1 <= count <= rlen/5 (a pair takes at least 5 bytes). The reader
// reads data as it arrives (so a truncated stream cannot make it allocate
// what a damaged clen claims), checks crc before decompressing, and
// allocates rlen only once the length declared inside the S2 block equals
// rlen. The array must hold exactly count pairs and nothing may follow them.
// Keys are strictly increasing (bytes.Compare) across the whole snapshot;
// the Writer refuses anything else and the Reader reports it as corruption.
//
// The Writer cuts a chunk before an entry that would take it past 64 KiB
// raw, so chunks are about 64 KiB unless one entry is larger (it then gets
// a chunk of its own). An entry (key + value) is at most MaxEntrySize (13
// MiB), so that a chunk stays under the clen bound even when it does not
// compress.
//
// # Trailer
//
//	 0                                16         24         28           36
//	+----------------------------------+----------+----------+------------+
//	| end marker: a chunk header with  | count    | checksum | magic      |
//	| clen = 0 (all 16 bytes zero)     | u64      | u32      | "IDEMEND1" |
//	+----------------------------------+----------+----------+------------+
//	count    = number of entries in all chunks.
//	checksum = CRC-32C of every byte before the trailer (header + chunks).
//
// The end marker is where a chunk header would be, so a reader tells the end
// of the snapshot from a truncation: a stream that stops anywhere before the
// last byte of the magic is corrupt ("truncated at offset N"), never a
// short snapshot. Nothing may follow the trailer.
//
// # Codec: S2 rather than zstd
//
// Measured by BenchmarkCodec on ~64 KiB chunks of realistic entries (16-byte
// ids, 16-byte fingerprints, 128-byte JSON-like replies: about 200 raw bytes
// per entry), one core of an AMD EPYC:
//
//	codec          ratio  compress   decompress
//	s2 (default)   1.82   1450 MB/s  4290 MB/s   <- chosen
//	s2 better      1.90    600 MB/s  3180 MB/s
//	zstd fastest   2.47    295 MB/s  1815 MB/s
//	zstd default   2.41    190 MB/s  1670 MB/s
//	(128 random reply bytes: s2 1.10, zstd 1.15)
//
// zstd makes snapshots about 26% smaller, but costs five times the CPU to
// write and more than twice to read. A snapshot is written while the engine
// serves requests and read on the recovery path, where both should be bound
// by Pebble (iterating, ingesting), not by the codec. With S2 the whole
// Writer runs at about 3.5M entries/s (114 bytes per entry on disk) and the
// Reader at about 13M entries/s per core (BenchmarkWrite, BenchmarkRead);
// zstd would cap the Writer near 1.5M entries/s by compression alone. S2 is
// also what the WAL uses for replies, and its block format declares the
// decoded length up front, which makes bounding allocation trivial. A
// transport that needs fewer bytes (backups over slow links) can recompress
// the stream.
//
// # Errors
//
// Every problem with the bytes of a stream is a *CorruptError wrapping
// ErrCorrupt, with the byte offset and chunk number: bad magic, unknown
// version, checksum mismatches (header, chunk, whole stream), lengths out of
// bounds, count mismatches, keys out of order, bytes after the trailer, and
// truncation anywhere. Errors of the underlying io.Reader are returned
// wrapped with the offset. Entries are handed out chunk by chunk, each after
// its checksum matched, but the stream as a whole is only known to be sound
// when Next returns io.EOF: a caller rebuilding an index must not publish it
// before.
//
// # Files
//
// A snapshot file is named fmt.Sprintf("%020d.snap", lsn) (FileName) in the
// snapshot directory; other names are ignored. WriteFile writes
// "<name>.tmp", fsyncs it, renames it to <name> and fsyncs the directory,
// so a crash leaves either nothing or a complete file under <name> (and
// possibly a stale .tmp, which Prune removes). OpenNewestValid returns the
// newest snapshot that verifies, logging and skipping corrupt newer ones as
// Kafka does with its producer-state snapshots: the WAL stays the source of
// truth. All file I/O goes through pebble's vfs.FS.
package snapshot
