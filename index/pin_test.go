package index

import (
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestReadPinHoldsObsoleteTables: the tables a compaction made obsolete
// are released by the read pin, not by the lookup that happens to close
// the last iterator on them (pin.go). While the pin holds them (its delay
// set to an hour), lookups leave them in place as zombie tables; once the
// delay is short again they are deleted without any lookup.
func TestReadPinHoldsObsoleteTables(t *testing.T) {
	m := &filterModel{t: t, fs: vfs.NewMem(), live: map[string]*Entry{}}
	ix, err := Open(Options{FS: m.fs, Dir: "ix", IngestBytes: 4 << 10, FilterBytes: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer ix.Close(false)
	m.ix = ix
	ix.pin.delay.Store(int64(time.Hour))
	for i := 0; i < 20; i++ {
		var ups []*Update
		for j := 0; j < 200; j++ {
			ups = append(ups, m.insert())
		}
		if err := ix.Apply(ups); err != nil {
			t.Fatal(err)
		}
		if err := ix.Flush(); err != nil {
			t.Fatal(err)
		}
		m.check()
	}
	met := ix.db.Metrics()
	if met.Compact.Count == 0 {
		t.Fatal("no compaction ran: nothing became obsolete")
	}
	if met.Table.ZombieCount == 0 {
		t.Fatalf("no zombie tables after %d compactions and %d lookups: a lookup or a compaction deleted the inputs, not the pin", met.Compact.Count, 20*len(m.live))
	}
	t.Logf("%d compactions; %d zombie tables held by the pin through the lookups", met.Compact.Count, met.Table.ZombieCount)

	ix.pin.delay.Store(int64(time.Millisecond))
	ix.pin.signal()
	deadline := time.Now().Add(10 * time.Second)
	for ix.db.Metrics().Table.ZombieCount != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d zombie tables 10 s after the delay was shortened: the pin did not let them go", ix.db.Metrics().Table.ZombieCount)
		}
		time.Sleep(time.Millisecond)
	}
	m.check()
}
