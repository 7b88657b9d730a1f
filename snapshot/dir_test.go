package snapshot

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
	"github.com/idemdb/idem/internal/vfstest"
)

const testDir = "data/snapshot"

// writeEntries is the write func of WriteFile for a header and entries.
func writeEntries(h Header, entries []testEntry) func(io.Writer) error {
	return func(w io.Writer) error {
		sw, err := NewWriter(w, h)
		if err != nil {
			return err
		}
		for _, e := range entries {
			if err := sw.Add(e.key, e.value); err != nil {
				return err
			}
		}
		_, err = sw.Close()
		return err
	}
}

func mustWriteFile(t *testing.T, fs vfs.FS, lsn uint64, entries []testEntry) string {
	t.Helper()
	h := testHeader
	h.LSN = lsn
	p, err := WriteFile(fs, testDir, lsn, writeEntries(h, entries))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func listNames(t *testing.T, fs vfs.FS, dir string) []string {
	t.Helper()
	names, err := fs.List(dir)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(names)
	return names
}

func TestFileName(t *testing.T) {
	for _, lsn := range []uint64{0, 1, 42, 1<<64 - 1} {
		name := FileName(lsn)
		if len(name) != fileNameLen {
			t.Fatalf("FileName(%d) = %q", lsn, name)
		}
		if got, ok := parseFileName(name); !ok || got != lsn {
			t.Fatalf("parseFileName(%q) = %d, %v", name, got, ok)
		}
	}
	if FileName(42) != "00000000000000000042.snap" {
		t.Fatalf("FileName(42) = %q", FileName(42))
	}
	for _, bad := range []string{"42.snap", "0000000000000000004x.snap", "00000000000000000042.snap.tmp",
		"00000000000000000042.wal", "+0000000000000000042.snap", "99999999999999999999.snap", ""} {
		if _, ok := parseFileName(bad); ok {
			t.Fatalf("parseFileName(%q) accepted", bad)
		}
	}
}

func TestWriteFileVerifyListPrune(t *testing.T) {
	fs := vfs.NewMem()
	entries := realisticEntries(5, 300, false)
	for _, lsn := range []uint64{30, 10, 50, 20, 40} {
		p := mustWriteFile(t, fs, lsn, entries)
		if p != fs.PathJoin(testDir, FileName(lsn)) {
			t.Fatalf("path %q", p)
		}
		h, tr, err := Verify(fs, p)
		if err != nil {
			t.Fatal(err)
		}
		if h.LSN != lsn || tr.Count != uint64(len(entries)) {
			t.Fatalf("Verify: %+v %+v", h, tr)
		}
	}
	// Names List must ignore.
	vfstest.WriteFile(t, fs, fs.PathJoin(testDir, FileName(60)+".tmp"), []byte("partial"))
	vfstest.WriteFile(t, fs, fs.PathJoin(testDir, "notes.txt"), nil)
	vfstest.WriteFile(t, fs, fs.PathJoin(testDir, "junk.tmp"), nil)
	vfstest.WriteFile(t, fs, fs.PathJoin(testDir, "70.snap"), nil)
	if err := fs.MkdirAll(fs.PathJoin(testDir, FileName(80)), 0o755); err != nil {
		t.Fatal(err)
	}

	infos, err := List(fs, testDir)
	if err != nil {
		t.Fatal(err)
	}
	var lsns []uint64
	for _, in := range infos {
		lsns = append(lsns, in.LSN)
		if in.Path != fs.PathJoin(testDir, FileName(in.LSN)) || in.Size != int64(len(vfstest.ReadFile(t, fs, in.Path))) {
			t.Fatalf("info %+v", in)
		}
	}
	if !slices.Equal(lsns, []uint64{50, 40, 30, 20, 10}) {
		t.Fatalf("List LSNs %v", lsns)
	}

	removed, err := Prune(fs, testDir, 2)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{FileName(30), FileName(20), FileName(10), FileName(60) + ".tmp"}
	for i := range want {
		want[i] = fs.PathJoin(testDir, want[i])
	}
	if !slices.Equal(removed, want) {
		t.Fatalf("Prune removed %v, want %v", removed, want)
	}
	got := listNames(t, fs, testDir)
	wantNames := []string{FileName(40), FileName(50), FileName(80), "70.snap", "junk.tmp", "notes.txt"}
	if !slices.Equal(got, wantNames) {
		t.Fatalf("after Prune: %v, want %v", got, wantNames)
	}
	if removed, err := Prune(fs, testDir, 2); err != nil || len(removed) != 0 {
		t.Fatalf("second Prune: %v, %v", removed, err)
	}
	if removed, err := Prune(fs, testDir, 0); err != nil || len(removed) != 2 {
		t.Fatalf("Prune(0): %v, %v", removed, err)
	}
	if _, err := Prune(fs, testDir, -1); err == nil {
		t.Fatal("Prune(-1) succeeded")
	}

	// A missing directory holds nothing.
	if infos, err := List(fs, "nowhere"); err != nil || infos != nil {
		t.Fatalf("List(missing): %v, %v", infos, err)
	}
	if removed, err := Prune(fs, "nowhere", 1); err != nil || removed != nil {
		t.Fatalf("Prune(missing): %v, %v", removed, err)
	}
}

func TestWriteFileReplacesSameLSN(t *testing.T) {
	fs := vfs.NewMem()
	mustWriteFile(t, fs, 5, realisticEntries(6, 10, false))
	p := mustWriteFile(t, fs, 5, realisticEntries(7, 20, false))
	if _, tr, err := Verify(fs, p); err != nil || tr.Count != 20 {
		t.Fatalf("Verify: %+v, %v", tr, err)
	}
	if names := listNames(t, fs, testDir); len(names) != 1 {
		t.Fatalf("files %v", names)
	}
}

func TestWriteFileWriteError(t *testing.T) {
	fs := vfs.NewMem()
	boom := errors.New("boom")
	_, err := WriteFile(fs, testDir, 9, func(w io.Writer) error {
		sw, _ := NewWriter(w, Header{LSN: 9})
		_ = sw.Add([]byte("a"), make([]byte, 1<<20))
		return boom
	})
	if !errors.Is(err, boom) {
		t.Fatalf("got %v", err)
	}
	if names := listNames(t, fs, testDir); len(names) != 0 {
		t.Fatalf("left behind: %v", names)
	}
}

// TestWriteFileFaults fails the i-th file system operation of WriteFile, for
// every i until a run succeeds: each failure is reported, no temp file is
// left behind, and the final name holds either nothing or a complete
// snapshot (once the rename happened).
func TestWriteFileFaults(t *testing.T) {
	entries := realisticEntries(8, 3000, false)
	h := testHeader
	for i := int32(0); ; i++ {
		mem := vfs.NewMem()
		fs := errorfs.Wrap(mem, errorfs.OnIndex(i))
		p, err := WriteFile(fs, testDir, 77, writeEntries(h, entries))
		final := mem.PathJoin(testDir, FileName(77))
		names, _ := mem.List(testDir)
		for _, n := range names {
			if strings.HasSuffix(n, tmpSuffix) {
				t.Fatalf("fault %d (%v): temp file %s left behind", i, err, n)
			}
		}
		_, _, verr := Verify(mem, final)
		if err == nil {
			if p != final || verr != nil {
				t.Fatalf("fault %d: no error but %q: %v", i, p, verr)
			}
			if i < 5 {
				t.Fatalf("only %d operations", i)
			}
			t.Logf("WriteFile takes %d file system operations", i)
			return
		}
		if !errors.Is(err, errorfs.ErrInjected) {
			t.Fatalf("fault %d: %v", i, err)
		}
		if verr != nil && !errors.Is(verr, os.ErrNotExist) {
			t.Fatalf("fault %d (%v): final file is neither absent nor valid: %v", i, err, verr)
		}
	}
}

// TestWriteFileCrash takes crash clones of a crashable MemFS before every
// file system operation of WriteFile (and after it) with several amounts of
// unsynced data kept: the final name never holds a partial snapshot, the
// older snapshot is never damaged, and once WriteFile returned the new
// snapshot survives any crash.
func TestWriteFileCrash(t *testing.T) {
	mem := vfs.NewCrashableMem()
	old := realisticEntries(9, 500, false)
	mustWriteFile(t, mem, 10, old)
	entries := realisticEntries(10, 5000, false)
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 1))
	final := mem.PathJoin(testDir, FileName(20))

	ops, sawFinal := 0, 0
	check := func(when string, mustHaveNew bool) {
		for _, pct := range []int{0, 50, 100} {
			clone := mem.CrashClone(vfs.CrashCloneCfg{UnsyncedDataPercent: pct, RNG: rand.New(rand.NewPCG(rng.Uint64(), 2))})
			infos, err := List(clone, testDir)
			if err != nil {
				t.Fatalf("%s, %d%%: %v", when, pct, err)
			}
			hasNew := false
			for _, in := range infos {
				_, tr, err := Verify(clone, in.Path)
				if err != nil {
					t.Fatalf("%s, %d%% unsynced kept: %s is partial: %v", when, pct, in.Path, err)
				}
				want := len(old)
				if in.LSN == 20 {
					want, hasNew = len(entries), true
					sawFinal++
				}
				if tr.Count != uint64(want) {
					t.Fatalf("%s: %s holds %d entries", when, in.Path, tr.Count)
				}
			}
			if len(infos) == 0 || infos[len(infos)-1].LSN != 10 {
				t.Fatalf("%s, %d%%: the old snapshot is gone: %+v", when, pct, infos)
			}
			if mustHaveNew && !hasNew {
				t.Fatalf("%s, %d%%: %s did not survive", when, pct, final)
			}
		}
	}
	fs := errorfs.Wrap(mem, errorfs.InjectorFunc(func(op errorfs.Op) error {
		ops++
		check(fmt.Sprintf("before op %d (kind %d) on %s", ops, op.Kind, op.Path), false)
		return nil
	}))
	if _, err := WriteFile(fs, testDir, 20, writeEntries(Header{LSN: 20}, entries)); err != nil {
		t.Fatal(err)
	}
	check("after WriteFile", true)
	t.Logf("%d operations checked; the new snapshot was visible in %d clones", ops, sawFinal)
}

func TestOpenNewestValid(t *testing.T) {
	e10, e20, e30 := realisticEntries(11, 100, false), realisticEntries(12, 200, false), realisticEntries(13, 300, false)
	setup := func(t *testing.T) *vfs.MemFS {
		fs := vfs.NewMem()
		mustWriteFile(t, fs, 10, e10)
		mustWriteFile(t, fs, 20, e20)
		mustWriteFile(t, fs, 30, e30)
		return fs
	}
	damage := func(t *testing.T, fs vfs.FS, lsn uint64, f func([]byte) []byte) string {
		p := fs.PathJoin(testDir, FileName(lsn))
		vfstest.WriteFile(t, fs, p, f(vfstest.ReadFile(t, fs, p)))
		return p
	}
	flip := func(b []byte) []byte { b[len(b)/2] ^= 0x10; return b }
	cut := func(b []byte) []byte { return b[:len(b)-1] }
	readAll := func(t *testing.T, r *Reader) []testEntry {
		var out []testEntry
		for {
			k, v, err := r.Next()
			if err == io.EOF {
				return out
			}
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, testEntry{bytes.Clone(k), bytes.Clone(v)})
		}
	}
	open := func(t *testing.T, fs vfs.FS) (*Reader, Info, io.Closer, string, error) {
		var log bytes.Buffer
		logger := slog.New(slog.NewTextHandler(&log, nil))
		r, in, c, err := OpenNewestValid(fs, testDir, logger)
		return r, in, c, log.String(), err
	}

	t.Run("newest", func(t *testing.T) {
		fs := setup(t)
		r, in, c, log, err := open(t, fs)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if in.LSN != 30 || r.Header().LSN != 30 || log != "" {
			t.Fatalf("got %+v, log %q", in, log)
		}
		sameEntries(t, readAll(t, r), e30)
	})
	for _, dmg := range []struct {
		name string
		f    func([]byte) []byte
	}{{"flipped", flip}, {"truncated", cut}} {
		t.Run("falls back from "+dmg.name, func(t *testing.T) {
			fs := setup(t)
			bad := damage(t, fs, 30, dmg.f)
			r, in, c, log, err := open(t, fs)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if in.LSN != 20 || r.Header().LSN != 20 {
				t.Fatalf("got %+v", in)
			}
			if !strings.Contains(log, bad) || !strings.Contains(log, "snapshot: corrupt") {
				t.Fatalf("log %q does not name %s and the error", log, bad)
			}
			sameEntries(t, readAll(t, r), e20)
		})
	}
	t.Run("none valid", func(t *testing.T) {
		fs := setup(t)
		for _, lsn := range []uint64{10, 20, 30} {
			damage(t, fs, lsn, flip)
		}
		_, _, _, log, err := open(t, fs)
		if !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("got %v", err)
		}
		if strings.Count(log, "skipping") != 3 {
			t.Fatalf("log %q", log)
		}
	})
	t.Run("empty and missing", func(t *testing.T) {
		fs := vfs.NewMem()
		if _, _, _, _, err := open(t, fs); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("missing dir: %v", err)
		}
		if err := fs.MkdirAll(testDir, 0o755); err != nil {
			t.Fatal(err)
		}
		if _, _, _, err := OpenNewestValid(fs, testDir, nil); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("empty dir: %v", err)
		}
	})
	t.Run("I/O error is not a fallback", func(t *testing.T) {
		mem := setup(t)
		newest := mem.PathJoin(testDir, FileName(30))
		fs := errorfs.Wrap(mem, errorfs.InjectorFunc(func(op errorfs.Op) error {
			if op.Kind == errorfs.OpFileRead && op.Path == newest {
				return errorfs.ErrInjected
			}
			return nil
		}))
		_, _, _, err := OpenNewestValid(fs, testDir, nil)
		if !errors.Is(err, errorfs.ErrInjected) || errors.Is(err, ErrCorrupt) {
			t.Fatalf("got %v, want the injected error", err)
		}
	})
}
