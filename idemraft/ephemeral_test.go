package idemraft

import (
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"

	"github.com/idemdb/idem"
)

// The dedup engine is derived state: an idemraft node writes no WAL for it
// (idem.Options.Ephemeral), neither segment files nor fsyncs.
func TestNoEngineWAL(t *testing.T) {
	dir := t.TempDir()
	app := newCounterFSM()
	fd := &feeder{t: t, f: wrapT(t, app, dir), at: t0}
	for i := 0; i < 2000; i++ {
		id := fmt.Sprint("id", i)
		if r := fd.cmd(idem.Request{ID: []byte(id)}, counterOp{ID: id, Key: "k", Delta: 1}); r.Err != nil {
			t.Fatalf("%s: %v", id, r.Err)
		}
	}
	st := fd.f.Stats().Engine
	if st.WALBytes != 0 || st.WALSegments != 0 || st.WALSyncs != 0 {
		t.Fatalf("engine WAL: %d bytes in %d segments, %d fsyncs; want none", st.WALBytes, st.WALSegments, st.WALSyncs)
	}
	if st.LastLSN < 2000 {
		t.Fatalf("engine LastLSN %d: the commands did not reach it", st.LastLSN)
	}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == "wal" || strings.HasSuffix(p, ".log") && strings.Contains(p, string(filepath.Separator)+"wal"+string(filepath.Separator)) {
			return fmt.Errorf("%s written", p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
