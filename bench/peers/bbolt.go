package peers

import (
	"context"
	"path/filepath"
	"time"

	bolt "go.etcd.io/bbolt"
)

// bboltPeer is a bbolt file with one bucket. The lookup is a read
// transaction (View); the claim and the reply are write transactions
// through DB.Batch, bbolt's own way of sharing one commit (and its
// fdatasyncs) among concurrent writers. The claim's transaction looks the
// id up again before writing it, and write transactions are serialized, so
// exactly one caller claims an id without any other lock.
type bboltPeer struct{ db *bolt.DB }

var bboltBucket = []byte("req")

func openBbolt(cfg Config) (Peer, error) {
	db, err := bolt.Open(filepath.Join(cfg.Dir, "bbolt.db"), 0o600, &bolt.Options{
		Timeout: time.Second,
		// Room to grow without remapping (a remap waits for every
		// read transaction to end).
		InitialMmapSize: 1 << 30,
	})
	if err != nil {
		return nil, err
	}
	// A batch commits when MaxBatchSize calls have joined it, or
	// MaxBatchDelay after its first call. bbolt's defaults (1000 calls,
	// 10 ms) would make a lone caller wait 10 ms per write: a batch is
	// never larger than the number of callers, so it is closed at that
	// size, and the delay is about one commit's time on this disk.
	db.MaxBatchSize = cfg.Concurrency
	db.MaxBatchDelay = time.Millisecond
	if err := db.Update(func(tx *bolt.Tx) error {
		_, err := tx.CreateBucketIfNotExists(bboltBucket)
		return err
	}); err != nil {
		db.Close()
		return nil, err
	}
	return &bboltPeer{db: db}, nil
}

func (p *bboltPeer) get(id []byte) (v []byte, err error) {
	err = p.db.View(func(tx *bolt.Tx) error {
		if got := tx.Bucket(bboltBucket).Get(id); got != nil {
			v = append([]byte(nil), got...) // valid only in the transaction
		}
		return nil
	})
	return v, err
}

func (p *bboltPeer) Do(_ context.Context, id []byte, fn func() []byte) ([]byte, bool, error) {
	v, err := p.get(id)
	if err != nil {
		return nil, false, err
	}
	if v != nil {
		reply, err := decodeStored(v)
		return reply, false, err
	}
	var claimed bool
	// Batch may run the function more than once (it retries a failed
	// batch call by call): it sets its results from scratch each time.
	err = p.db.Batch(func(tx *bolt.Tx) error {
		b := tx.Bucket(bboltBucket)
		if got := b.Get(id); got != nil {
			claimed, v = false, append([]byte(nil), got...)
			return nil
		}
		claimed, v = true, nil
		return b.Put(id, []byte{markClaim})
	})
	if err != nil {
		return nil, false, err
	}
	if !claimed { // another caller claimed it between the lookup and the claim
		reply, err := decodeStored(v)
		return reply, false, err
	}
	reply := fn()
	val := committedValue(reply)
	if err := p.db.Batch(func(tx *bolt.Tx) error {
		return tx.Bucket(bboltBucket).Put(id, val)
	}); err != nil {
		return nil, false, err
	}
	return reply, true, nil
}

func (p *bboltPeer) Close() error { return p.db.Close() }
