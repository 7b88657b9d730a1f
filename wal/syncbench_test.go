package wal

import (
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// BenchmarkSyncCost compares the two ways a WAL flush can be made durable on
// the real file system, with one 64 KiB write per sync:
//
//   - append+Sync: the write extends the file, so fsync must also commit the
//     new size (a metadata/journal commit); this is what the WAL did before
//     segments were preallocated;
//   - overwrite+SyncData: the write lands inside a file that was zero-filled
//     and fsynced beforehand, so fdatasync only has data to write; this is
//     what the WAL does now.
//
// The two mixed variants show where the difference comes from. The
// preallocated file is 64 MiB and written round robin.
func BenchmarkSyncCost(b *testing.B) {
	const (
		writeSize = 64 << 10
		fileSize  = 64 << 20
	)
	fs := vfs.Default
	data := make([]byte, writeSize)
	for i := range data {
		data[i] = byte(i*7 + 1)
	}
	run := func(b *testing.B, prealloc, syncData bool) {
		dir := b.TempDir()
		path := fs.PathJoin(dir, "f")
		f, err := fs.Create(path, vfs.WriteCategoryUnspecified)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		if prealloc {
			if err := writeZeros(f, fileSize); err != nil {
				b.Fatal(err)
			}
			if err := f.Sync(); err != nil {
				b.Fatal(err)
			}
		}
		if err := SyncDir(fs, dir); err != nil {
			b.Fatal(err)
		}
		b.SetBytes(writeSize)
		b.ResetTimer()
		var off int64
		for i := 0; i < b.N; i++ {
			var err error
			if prealloc {
				_, err = f.WriteAt(data, off)
				off = (off + writeSize) % fileSize
			} else {
				_, err = f.Write(data)
			}
			if err != nil {
				b.Fatal(err)
			}
			if syncData {
				err = f.SyncData()
			} else {
				err = f.Sync()
			}
			if err != nil {
				b.Fatal(err)
			}
		}
	}
	b.Run("append+Sync", func(b *testing.B) { run(b, false, false) })
	b.Run("append+SyncData", func(b *testing.B) { run(b, false, true) })
	b.Run("overwrite+Sync", func(b *testing.B) { run(b, true, false) })
	b.Run("overwrite+SyncData", func(b *testing.B) { run(b, true, true) })
}
