package idemgrpc_test

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/idemdb/idem/idemgrpc"
)

// TestFileStore: values survive a reopen; a missing file is no state; a
// truncated (torn) or foreign file is ErrStateCorrupt, never a wrong number.
func TestFileStore(t *testing.T) {
	dir := t.TempDir()
	fs, err := idemgrpc.OpenFileStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	k1, k2 := idemgrpc.StoreKey("c", "ns"), idemgrpc.StoreKey("c", "ns", "v")
	if _, ok, err := fs.Load(k1); ok || err != nil {
		t.Fatalf("empty store: %v %v", ok, err)
	}
	for _, v := range []uint64{1, 2, 1 << 40} {
		if err := fs.Save(k1, v); err != nil {
			t.Fatal(err)
		}
	}
	if err := fs.Save(k2, 7); err != nil {
		t.Fatal(err)
	}
	fs.Close()
	if err := fs.Save(k1, 3); err == nil {
		t.Fatal("Save after Close succeeded")
	}
	fs, err = idemgrpc.OpenFileStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer fs.Close()
	if v, ok, err := fs.Load(k1); v != 1<<40 || !ok || err != nil {
		t.Fatalf("k1 = %d %v %v", v, ok, err)
	}
	if v, ok, err := fs.Load(k2); v != 7 || !ok || err != nil {
		t.Fatalf("k2 = %d %v %v", v, ok, err)
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.seq"))
	if len(files) != 2 {
		t.Fatalf("files %v", files)
	}
	// a torn write: the file cut short.
	b1, _ := os.ReadFile(files[0])

	if err := os.WriteFile(files[0], b1[:10], 0o644); err != nil {
		t.Fatal(err)
	}
	// another key's content in this key's file.
	if err := os.WriteFile(files[1], b1, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{k1, k2} {
		if _, ok, err := fs.Load(k); ok || !errors.Is(err, idemgrpc.ErrStateCorrupt) {
			t.Fatalf("Load of a damaged file: %v %v", ok, err)
		}
	}
	// saving repairs it.
	if err := fs.Save(k1, 9); err != nil {
		t.Fatal(err)
	}
	if v, ok, err := fs.Load(k1); v != 9 || !ok || err != nil {
		t.Fatalf("after repair: %d %v %v", v, ok, err)
	}
}
