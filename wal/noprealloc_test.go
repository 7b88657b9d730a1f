package wal

import (
	"math/rand/v2"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestCrashWithoutPreallocation runs the crash checks with segments that
// grow as frames are written (Options.Preallocate off, as the engine uses
// on in-memory filesystems): only synced data, and half of the unsynced
// blocks, across rotations.
func TestCrashWithoutPreallocation(t *testing.T) {
	for seed := uint64(0); seed <= 6; seed++ {
		mode := SyncAlways
		if seed%2 == 1 {
			mode = SyncNever
		}
		fs := vfs.NewCrashableMem()
		o := testOptions(fs)
		o.Preallocate = false
		o.SegmentSize = 16 << 10
		o.SyncMode = mode
		cfg := vfs.CrashCloneCfg{}
		if seed > 0 {
			cfg = vfs.CrashCloneCfg{UnsyncedDataPercent: 50, RNG: rand.New(rand.NewPCG(seed, seed))}
		}
		crashed, acked, synced := crashWhileAppending(t, fs, o, cfg, 800)
		o.FS = crashed
		checkRecovered(t, o, acked, synced)
	}
}
