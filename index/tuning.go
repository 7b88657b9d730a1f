package index

import (
	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/sstable"
)

// tunePebble sets the options that shape what Pebble writes for the
// index's workload: sstables of random keys ingested into L0 (pending.go),
// each rewritten by compactions on its way down the levels. It runs after
// EnsureDefaults, so it changes only what it names; the ingested tables'
// writer options (Index.writerOpts) are derived from L0's options after
// it. L0 is compacted at four times the depth Pebble's default allows
// (l0CompactionThreshold); the other level settings (the base level's
// size, the multiplier, the compaction concurrency) keep Pebble's
// defaults: the alternatives measured wrote less only at some sizes, or at
// the lookups' expense (docs/design.md, "Index writes").
func tunePebble(o *pebble.Options) {
	o.L0CompactionThreshold = l0CompactionThreshold
	o.L0StopWritesThreshold = 2 * l0CompactionThreshold
	// Compression: Snappy where it pays, none where it does not
	// (snappyAdaptive), on every level, so the ingested tables and every
	// compaction's output alike.
	for i := range o.Levels {
		o.Levels[i].Compression = func() *sstable.CompressionProfile { return snappyAdaptive }
	}
}

// l0CompactionThreshold is Pebble's L0CompactionThreshold: L0 is compacted
// into the base level once it is half that many sublevels deep (Pebble
// scores L0 at 2 x depth / threshold), so at 8 sublevels rather than 2 with
// Pebble's default of 4. Every ingested entries table holds random keys, so
// it overlaps the whole base level, and each L0 compaction rewrites all of
// that level (up to 64 MB) whatever it brings down: bringing down more
// sublevels at once makes that rarer. In a warm LSM written at a steady
// 150,000 ids/s (docs/design.md, "Index writes") the L0 compactions wrote
// 588-593 MB into the base level for 67 MB ingested at 8 (4 sublevels),
// 345-347 MB at 16; all compactions 6.9 -> 4.4 bytes per byte ingested,
// and BenchmarkApplySteady's CPU per item 4,970 -> 3,696 ns (medians of 3
// interleaved pairs). The price is up to 7 sublevels left in L0 when the
// writes pause, each a bloom filter probe for a lookup that reaches Pebble
// (about 0.6 us), and under writes a present id's lookup +8% (20.9 -> 22.5
// us, BenchmarkLookupWhileWriting/writing, L0 4.1 -> 5.9 sublevels).
// Pebble requires L0StopWritesThreshold (default 12) to be at least this;
// it is set to twice it. It stalls only memtable writes (the index's few
// batches: forget marks, Load), not ingests: under a burst L0 held 39
// sublevels with the default 12.
const l0CompactionThreshold = 16

// snappyAdaptive compresses data blocks with Snappy only while Snappy
// makes them at least 12% smaller, judged on a sample: Pebble's adaptive
// compressor (internal/compression/adaptive.go, v2.1.7) compresses one
// block in ten, chosen at random, both ways, keeps a moving average of the
// reduction (256 KiB half-life), and writes the other blocks with Snappy
// while the average reaches the cutoff, uncompressed otherwise. The
// default profile (sstable.SnappyCompression) compresses every block and
// then stores uncompressed any that shrank by less than 12% (its
// MinReductionPercent, kept here): with replies that do not compress,
// every block of every table the index ingests and every compaction writes
// was compressed for nothing (Snappy's encodeBlock was 12% of the CPU of
// BenchmarkApplyFresh/random-reply). Replies that compress keep Snappy.
//
// Index and other metadata blocks are written uncompressed (the fallback
// setting is shared with them): their keys are random ids, which Snappy
// does not shrink by 12% either. The blocks are Snappy or uncompressed, as
// before, so any Pebble reads them; only the table property naming the
// profile differs (Pebble's metrics count such tables as "unknown").
var snappyAdaptive = func() *sstable.CompressionProfile {
	p := *sstable.SnappyCompression
	p.Name = "SnappyAdaptive"
	p.OtherBlocks = sstable.NoCompression.OtherBlocks
	p.AdaptiveReductionCutoffPercent = p.MinReductionPercent
	return &p
}()
