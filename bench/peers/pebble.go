package peers

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/bloom"
)

// pebblePeer is Pebble used directly, as idem's root benchmarks
// (BenchmarkPebbleDirect) do: Get the id; if absent, Set the claim with
// Sync; run; Set the reply with Sync. Pebble's commit pipeline shares WAL
// fsyncs between concurrent Sync writes. A striped lock around the
// lookup and the claim makes concurrent duplicates safe (exactly one
// caller claims an id).
type pebblePeer struct {
	db    *pebble.DB
	locks [256]sync.Mutex
}

// pebbleOptions configure Pebble as idem configures its index: a 64 MiB
// block cache plus room for the memtables Pebble charges to it, 32 MiB
// memtables and bloom filters on every level.
func pebbleOptions() *pebble.Options {
	o := &pebble.Options{Logger: quietPebble{}, Cache: pebble.NewCache(64<<20 + 3*32<<20), MemTableSize: 32 << 20}
	for i := range o.Levels {
		o.Levels[i].FilterPolicy = bloom.FilterPolicy(10)
	}
	return o
}

func openPebble(cfg Config) (Peer, error) {
	o := pebbleOptions()
	defer o.Cache.Unref() // the DB holds its own reference
	db, err := pebble.Open(cfg.Dir, o)
	if err != nil {
		return nil, err
	}
	return &pebblePeer{db: db}, nil
}

func (p *pebblePeer) Do(_ context.Context, id []byte, fn func() []byte) ([]byte, bool, error) {
	l := &p.locks[int(id[len(id)-1])]
	l.Lock()
	v, c, err := p.db.Get(id)
	if err == nil {
		reply, derr := decodeStored(v)
		c.Close()
		l.Unlock()
		return reply, false, derr
	}
	if !errors.Is(err, pebble.ErrNotFound) {
		l.Unlock()
		return nil, false, err
	}
	if err := p.db.Set(id, []byte{markClaim}, pebble.Sync); err != nil {
		l.Unlock()
		return nil, false, err
	}
	l.Unlock()
	reply := fn()
	if err := p.db.Set(id, committedValue(reply), pebble.Sync); err != nil {
		return nil, false, err
	}
	return reply, true, nil
}

func (p *pebblePeer) Close() error { return p.db.Close() }

type quietPebble struct{}

func (quietPebble) Infof(string, ...any)  {}
func (quietPebble) Errorf(string, ...any) {}
func (quietPebble) Fatalf(f string, a ...any) {
	panic(fmt.Sprintf(f, a...))
}
