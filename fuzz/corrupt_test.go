package fuzz

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/internal/vfstest"
)

// TestWALByteFlipsAndTruncations damages a small WAL in every way a single
// byte can be damaged, and cuts it at every length, then recovers:
//
//   - with the index (which has applied every record): Open refuses with
//     ErrCorrupt or recovers the full state; never anything else;
//   - without the index (the whole WAL is replayed): Open refuses with
//     ErrCorrupt or recovers the state after some prefix of the records (a
//     torn tail was cut); never a state the program did not go through,
//     never a wrong reply.
func TestWALByteFlipsAndTruncations(t *testing.T) {
	r := newRunner(config{lease: time.Minute, segmentSize: 2 << 10, keepSnapshots: -1}, 1, &counters{})
	steps := []func() error{
		func() error { return r.openAndMatch([]*model{r.m.clone()}) },
		func() error { return r.begin("", modeID, "a", 0, []byte("fp1"), nil) },
		func() error { return r.finish(0, true, 1) },
		func() error { return r.begin("s1", modeID, "b", 0, nil, nil) },
		func() error { return r.finish(0, true, 2) }, // compressed reply
		func() error { return r.begin("s1", modeClient, "c1", 1, nil, nil) },
		func() error { return r.finish(0, true, 0) },
		func() error { return r.begin("", modeID, "c", 0, nil, []string{"a"}) },
		func() error { return r.finish(0, false, 0) },
		func() error { return r.begin("s1", modeClient, "c1", 2, nil, nil) },
		func() error { return r.ack("s1", []string{"b"}) },
		func() error { r.advance(time.Second); return r.forget(0) },
		func() error { return r.begin("", modeID, "d", 0, nil, nil) },
	}
	for i, step := range steps {
		if err := step(); err != nil {
			t.Fatalf("step %d: %v\n%s", i, err, r.traceTail(20))
		}
		r.record()
	}
	if err := r.closeEngine(true); err != nil {
		t.Fatal(err)
	}
	hist := r.hist
	last := hist[len(hist)-1]
	base := r.mem
	names, err := base.List(dbDir + "/wal")
	if err != nil {
		t.Fatal(err)
	}
	var segs []string
	for _, n := range names {
		if strings.HasSuffix(n, ".wal") {
			segs = append(segs, dbDir+"/wal/"+n)
		}
	}
	sort.Strings(segs)
	if len(segs) != 1 {
		t.Fatalf("want one segment, have %v", segs)
	}
	seg := segs[0]
	orig := vfstest.ReadFile(t, base, seg)
	validEnd := walValidEnd(orig)
	// On a disk the segment is preallocated: zeros follow the last frame.
	orig = append(orig[:validEnd:validEnd], make([]byte, 1024)...)
	t.Logf("WAL: %d records in %d valid bytes of a %d-byte (zero-filled) segment", last.lsn, validEnd, len(orig))

	var opens, refused, cut int
	recoverFrom := func(what string, b []byte, withIndex bool) {
		t.Helper()
		fs := base.CrashClone(vfs.CrashCloneCfg{})
		vfstest.WriteFile(t, fs, seg, b)
		if !withIndex {
			if err := fs.RemoveAll(dbDir + "/index"); err != nil {
				t.Fatal(err)
			}
		}
		opens++
		e, err := idem.Open(dbDir, r.cfg.options(fs, r.clk))
		if err != nil {
			if !errors.Is(err, idem.ErrCorrupt) {
				t.Fatalf("%s (index kept: %v): Open: %v is not ErrCorrupt", what, withIndex, err)
			}
			refused++
			return
		}
		defer e.Close()
		got, err := observeEngine(e)
		if err != nil {
			t.Fatalf("%s (index kept: %v): %v", what, withIndex, err)
		}
		allowed := hist
		if withIndex {
			allowed = hist[len(hist)-1:]
		}
		var diff string
		for i := len(allowed) - 1; i >= 0; i-- {
			c := allowed[i].m.clone()
			c.epoch++
			d := diffObs(observeModel(c, r.now()), got)
			if d == "" {
				if allowed[i].lsn != last.lsn {
					cut++
				}
				return
			}
			if i == len(allowed)-1 {
				diff = d
			}
		}
		t.Fatalf("%s (index kept: %v): recovered a state the program never had; against the full state:\n%s", what, withIndex, diff)
	}
	for i := 0; i < min(len(orig), validEnd+64); i++ {
		for _, withIndex := range []bool{true, false} {
			b := append([]byte(nil), orig...)
			b[i] ^= 0xff
			recoverFrom(fmt.Sprintf("byte %d flipped", i), b, withIndex)
		}
	}
	var lengths []int
	for l := 0; l <= validEnd+8; l++ {
		lengths = append(lengths, l)
	}
	for _, l := range []int{validEnd + 511, validEnd + 512, len(orig) - 512, len(orig) - 1} {
		if l > validEnd+8 && l < len(orig) {
			lengths = append(lengths, l)
		}
	}
	for _, l := range lengths {
		for _, withIndex := range []bool{true, false} {
			recoverFrom(fmt.Sprintf("cut to %d bytes", l), orig[:l], withIndex)
		}
	}
	t.Logf("TestWALByteFlipsAndTruncations: %d single-byte flips and %d truncations, %d recoveries: %d refused with ErrCorrupt, %d recovered a prefix (torn tail cut), the rest the full state; 0 wrong states",
		min(len(orig), validEnd+64), len(lengths), opens, refused, cut)
}

// walValidEnd is the end of the last frame of a segment, found the way a
// scan does: frames are 8-aligned after the 32-byte header, each starting
// with a non-zero checksum and length.
func walValidEnd(seg []byte) int {
	end := len(seg)
	for end > 32 && seg[end-1] == 0 {
		end--
	}
	return (end + 7) &^ 7
}
