// Package peers measures idem against the stores a user would otherwise
// build exactly-once request handling on: Pebble used directly, bbolt,
// SQLite, Redis and PostgreSQL, plus the physical limit of the disk (the
// same records appended to a file with group commit and fdatasync, nothing
// else); and the idem cluster against the stores a fleet of processes
// shares: a three-member etcd cluster, Redis and PostgreSQL.
//
// Every peer does the same job at the same guarantee: look the request id
// up; if it is committed, return the stored reply (a duplicate); otherwise
// claim the id durably (exactly one caller wins), run the side effect, store
// its reply durably and return it (a fresh request). "Durably" means the
// write is on disk (fsync or fdatasync) before the call goes on. See
// README.md for how each peer implements it.
//
// The harness runs a peer in two phases, as `idem bench` does: fresh
// requests on new random 16-byte ids with 128-byte replies, then
// duplicates (lookups of ids committed by the fresh phase, in random
// order). It records throughput, latency percentiles and CPU time.
package peers

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
)

// Peer is one store doing the exactly-once job.
type Peer interface {
	// Do handles the request with this id. For a committed id it returns
	// the stored reply and fresh == false, without calling fn. For a new
	// id it claims the id durably, calls fn, stores fn's reply durably and
	// returns it with fresh == true. An id claimed but not committed
	// (another caller is running it) is ErrInFlight.
	Do(ctx context.Context, id []byte, fn func() []byte) (reply []byte, fresh bool, err error)
	// Close releases everything the peer holds (files, connections).
	Close() error
}

// Settler is implemented by peers with background work that makes
// committed requests visible to lookups (idem's index applier). The
// harness calls Settle between the fresh and the duplicate phase.
type Settler interface {
	Settle(ctx context.Context)
}

// Phased is implemented by peers with two orders of operations, each
// correct for any id but each cheaper for one kind of request: claim
// first (one write that claims a new id or returns what a committed one
// holds) for new ids, read first for duplicates. The harness calls
// Phase(true) before the fresh phase and Phase(false) before the duplicate
// phase, so that such a peer is measured in each phase with the order that
// suits it (the clusters: idemcluster, etcd).
type Phased interface {
	Phase(fresh bool)
}

// NoLookups is implemented by peers that cannot answer duplicates (the
// file-append limit): their duplicate phase is skipped.
type NoLookups interface {
	NoLookups()
}

// ErrInFlight is returned by Do for an id claimed but not yet committed.
var ErrInFlight = errors.New("request in flight (claimed, not committed)")

// Config is what a peer needs to open.
type Config struct {
	// Dir is an empty directory for the files of the embedded peers and
	// of the clusters started in this process (idemcluster, etcd).
	Dir string
	// Concurrency is the number of concurrent callers (pools are sized
	// from it).
	Concurrency int
	// RedisAddr is the Redis server's host:port.
	RedisAddr string
	// PostgresURL is the PostgreSQL connection string.
	PostgresURL string
}

// Names lists the peers in the order they are reported.
var Names = []string{"idem", "idemcluster", "etcd", "pebble", "bbolt", "sqlite", "redis", "postgres", "file"}

// Open opens the named peer on an empty store (an embedded peer in
// cfg.Dir; a server peer empties its table or keys first).
func Open(ctx context.Context, name string, cfg Config) (Peer, error) {
	if cfg.Concurrency < 1 {
		cfg.Concurrency = 1
	}
	switch name {
	case "idem":
		return openIdem(cfg)
	case "pebble":
		return openPebble(cfg)
	case "bbolt":
		return openBbolt(cfg)
	case "sqlite":
		return openSQLite(ctx, cfg)
	case "redis":
		if cfg.RedisAddr == "" {
			return nil, errors.New("peer redis: no server address (-redis host:port)")
		}
		return openRedis(ctx, cfg)
	case "postgres":
		if cfg.PostgresURL == "" {
			return nil, errors.New("peer postgres: no connection string (-postgres URL)")
		}
		return openPostgres(ctx, cfg)
	case "file":
		return openFile(cfg)
	case "idemcluster":
		return openIdemcluster(ctx, cfg)
	case "etcd":
		return openEtcd(ctx, cfg)
	}
	known := append([]string(nil), Names...)
	sort.Strings(known)
	return nil, fmt.Errorf("unknown peer %q (known: %s)", name, strings.Join(known, ", "))
}

// stored values of the key-value peers: a claim is the single byte 'p'; a
// committed reply is 'c' followed by the reply.
const (
	markClaim  = 'p'
	markCommit = 'c'
)

// decodeStored interprets a stored value of a key-value peer.
func decodeStored(v []byte) ([]byte, error) {
	switch {
	case len(v) == 1 && v[0] == markClaim:
		return nil, ErrInFlight
	case len(v) >= 1 && v[0] == markCommit:
		return append([]byte(nil), v[1:]...), nil
	}
	return nil, fmt.Errorf("stored value of %d bytes is neither a claim nor a reply", len(v))
}

func committedValue(reply []byte) []byte {
	return append([]byte{markCommit}, reply...)
}
