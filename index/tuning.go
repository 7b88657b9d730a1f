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
// it. The levels (L0's compaction threshold, the base level's size, the
// multiplier, the compaction concurrency) keep Pebble's defaults: the
// alternatives measured wrote less only at some sizes, or at the lookups'
// expense (docs/design.md, "Index writes").
func tunePebble(o *pebble.Options) {
	// Compression: Snappy where it pays, none where it does not
	// (snappyAdaptive), on every level, so the ingested tables and every
	// compaction's output alike.
	for i := range o.Levels {
		o.Levels[i].Compression = func() *sstable.CompressionProfile { return snappyAdaptive }
	}
}

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
