// Package vfstest holds the file-system helpers that the tests of several
// packages (idem, wal, snapshot, fuzz) share: whole-file reads and writes
// through a vfs.FS, and a vfs.FS that reports every successful sync (the
// moments at which a crash image can differ from the previous one).
package vfstest

import (
	"io"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// ReadFile returns the contents of path, failing t on any error.
func ReadFile(t testing.TB, fs vfs.FS, path string) []byte {
	t.Helper()
	f, err := fs.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b, err := io.ReadAll(f)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// WriteFile creates (or replaces) path with b and fsyncs it, failing t on
// any error.
func WriteFile(t testing.TB, fs vfs.FS, path string, b []byte) {
	t.Helper()
	f, err := fs.Create(path, vfs.WriteCategoryUnspecified)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write(b); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

// SyncHookFS calls Hook after every successful Sync, SyncData or full
// SyncTo of a file or directory opened through it.
type SyncHookFS struct {
	vfs.FS
	Hook func()
}

// Unwrap returns the wrapped FS (vfs.Root uses it).
func (fs *SyncHookFS) Unwrap() vfs.FS { return fs.FS }

func (fs *SyncHookFS) wrap(f vfs.File, err error) (vfs.File, error) {
	if err != nil {
		return nil, err
	}
	return &syncHookFile{File: f, hook: fs.Hook}, nil
}

// Create implements vfs.FS.
func (fs *SyncHookFS) Create(name string, c vfs.DiskWriteCategory) (vfs.File, error) {
	return fs.wrap(fs.FS.Create(name, c))
}

// OpenReadWrite implements vfs.FS.
func (fs *SyncHookFS) OpenReadWrite(name string, c vfs.DiskWriteCategory, opts ...vfs.OpenOption) (vfs.File, error) {
	return fs.wrap(fs.FS.OpenReadWrite(name, c, opts...))
}

// ReuseForWrite implements vfs.FS.
func (fs *SyncHookFS) ReuseForWrite(oldname, newname string, c vfs.DiskWriteCategory) (vfs.File, error) {
	return fs.wrap(fs.FS.ReuseForWrite(oldname, newname, c))
}

// OpenDir implements vfs.FS.
func (fs *SyncHookFS) OpenDir(name string) (vfs.File, error) {
	return fs.wrap(fs.FS.OpenDir(name))
}

type syncHookFile struct {
	vfs.File
	hook func()
}

func (f *syncHookFile) Sync() error {
	if err := f.File.Sync(); err != nil {
		return err
	}
	f.hook()
	return nil
}

func (f *syncHookFile) SyncData() error {
	if err := f.File.SyncData(); err != nil {
		return err
	}
	f.hook()
	return nil
}

func (f *syncHookFile) SyncTo(n int64) (bool, error) {
	full, err := f.File.SyncTo(n)
	if err == nil && full {
		f.hook()
	}
	return full, err
}
