package recovery

import (
	"errors"
	"os"
	"slices"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem/internal/vfstest"
)

// TestReadOnlyFS: every change is refused, naming the call and the file,
// reads go through, and the underlying FS is left as it was.
func TestReadOnlyFS(t *testing.T) {
	mem := vfs.NewMem()
	if err := mem.MkdirAll("d", 0o755); err != nil {
		t.Fatal(err)
	}
	vfstest.WriteFile(t, mem, "d/f", []byte("data"))
	ro := ReadOnlyFS(mem)
	if ReadOnlyFS(ro) != ro {
		t.Error("ReadOnlyFS of a read-only view wraps it again")
	}
	if ro.Unwrap() != nil || vfs.Root(ro) != ro {
		t.Error("the view hands out the writable FS under it")
	}
	changes := map[string]func() error{
		"create":            func() error { _, err := ro.Create("d/g", vfs.WriteCategoryUnspecified); return err },
		"link":              func() error { return ro.Link("d/f", "d/h") },
		"open for writing":  func() error { _, err := ro.OpenReadWrite("d/f", vfs.WriteCategoryUnspecified); return err },
		"remove":            func() error { return ro.Remove("d/f") },
		"remove all":        func() error { return ro.RemoveAll("d") },
		"rename":            func() error { return ro.Rename("d/f", "d/i") },
		"reuse for writing": func() error { _, err := ro.ReuseForWrite("d/f", "d/j", vfs.WriteCategoryUnspecified); return err },
		"mkdir":             func() error { return ro.MkdirAll("e", 0o755) },
		"lock":              func() error { _, err := ro.Lock("d/LOCK"); return err },
	}
	for name, fn := range changes {
		err := fn()
		var pe *os.PathError
		if !errors.Is(err, ErrReadOnly) || !errors.Is(err, os.ErrPermission) || !errors.As(err, &pe) || pe.Path == "" {
			t.Errorf("%s: %v, want a *os.PathError matching ErrReadOnly and os.ErrPermission", name, err)
		}
	}
	// Reads go through; a file opened for reading cannot be written.
	if got := string(vfstest.ReadFile(t, ro, "d/f")); got != "data" {
		t.Errorf("read %q", got)
	}
	f, err := ro.Open("d/f")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Write([]byte("x")); err == nil {
		t.Error("a file opened through the view was written")
	}
	f.Close()
	names, err := mem.List("d")
	if err != nil {
		t.Fatal(err)
	}
	if slices.Sort(names); !slices.Equal(names, []string{"f"}) {
		t.Errorf("the FS under the view holds %v, want [f]", names)
	}
	if got := string(vfstest.ReadFile(t, mem, "d/f")); got != "data" {
		t.Errorf("d/f holds %q after the refused changes", got)
	}
}
