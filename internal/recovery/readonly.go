package recovery

import (
	"fmt"
	"io"
	"os"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// ErrReadOnly is matched by every change refused by a ReadOnlyFS.
var ErrReadOnly = fmt.Errorf("read-only view: %w", os.ErrPermission)

// ReadOnlyFS returns a view of fs that refuses every change: creating,
// opening for writing, linking, renaming, removing, making directories and
// taking a lock fail with an error matching ErrReadOnly (and
// os.ErrPermission) that names the call and the file. Reading, listing and
// stat'ing go to fs. Files opened through it are fs's read-only files.
// Recover reads a directory through it when it runs read-only, so a
// mistake that would write fails instead.
func ReadOnlyFS(fs vfs.FS) vfs.FS {
	if r, ok := fs.(readOnlyFS); ok {
		return r
	}
	return readOnlyFS{fs}
}

type readOnlyFS struct{ vfs.FS }

func refuse(op, name string) error {
	return &os.PathError{Op: op, Path: name, Err: ErrReadOnly}
}

func (r readOnlyFS) Create(name string, _ vfs.DiskWriteCategory) (vfs.File, error) {
	return nil, refuse("create", name)
}

func (r readOnlyFS) Link(oldname, newname string) error { return refuse("link", newname) }

func (r readOnlyFS) OpenReadWrite(name string, _ vfs.DiskWriteCategory, _ ...vfs.OpenOption) (vfs.File, error) {
	return nil, refuse("open for writing", name)
}

func (r readOnlyFS) Remove(name string) error    { return refuse("remove", name) }
func (r readOnlyFS) RemoveAll(name string) error { return refuse("remove", name) }

func (r readOnlyFS) Rename(oldname, newname string) error { return refuse("rename", oldname) }

func (r readOnlyFS) ReuseForWrite(oldname, newname string, _ vfs.DiskWriteCategory) (vfs.File, error) {
	return nil, refuse("reuse for writing", oldname)
}

func (r readOnlyFS) MkdirAll(dir string, _ os.FileMode) error { return refuse("mkdir", dir) }

func (r readOnlyFS) Lock(name string) (io.Closer, error) { return nil, refuse("lock", name) }

// Unwrap returns nil: the view does not hand out the writable FS under it
// (vfs.Root then stops at the view).
func (r readOnlyFS) Unwrap() vfs.FS { return nil }
