package peers

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/redis/go-redis/v9"
)

// redisPeer is a Redis server run with appendonly yes and appendfsync
// always: Redis writes and fsyncs its append-only file once per pass of
// its event loop, before it sends the replies of the commands run in that
// pass, so every acknowledged write is on disk and concurrent clients share
// an fsync. Per request: GET the id; if absent, SET it to the claim with NX
// (true = this caller claimed it); run; SET it to the reply.
//
// The client pool has one connection per caller (go-redis's default is
// 10 per core, which would queue the callers in the client).
type redisPeer struct{ c *redis.Client }

// RedisMaxConns bounds the pool.
var RedisMaxConns = 512

func openRedis(ctx context.Context, cfg Config) (Peer, error) {
	c := redis.NewClient(&redis.Options{
		Addr:            cfg.RedisAddr,
		PoolSize:        min(cfg.Concurrency, RedisMaxConns),
		Protocol:        2,
		DisableIdentity: true,
	})
	p := &redisPeer{c: c}
	if err := c.FlushAll(ctx).Err(); err != nil {
		c.Close()
		return nil, fmt.Errorf("redis %s: FLUSHALL: %w", cfg.RedisAddr, err)
	}
	// Check the durability setting rather than trust the command line.
	got, err := c.ConfigGet(ctx, "appendfsync").Result()
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("redis %s: CONFIG GET appendfsync: %w", cfg.RedisAddr, err)
	}
	if got["appendfsync"] != "always" {
		c.Close()
		return nil, fmt.Errorf("redis %s: appendfsync is %q, want always", cfg.RedisAddr, got["appendfsync"])
	}
	// Open every connection of the pool now (concurrently), not during
	// the measurement.
	n := min(cfg.Concurrency, RedisMaxConns)
	conns := make([]*redis.Conn, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conns[i] = c.Conn()
			errs[i] = conns[i].Ping(ctx).Err()
		}()
	}
	wg.Wait()
	for _, cn := range conns {
		cn.Close() // back to the pool
	}
	if err := errors.Join(errs...); err != nil {
		c.Close()
		return nil, fmt.Errorf("redis %s: opening %d connections: %w", cfg.RedisAddr, len(conns), err)
	}
	return p, nil
}

func (p *redisPeer) lookup(ctx context.Context, id []byte) ([]byte, bool, error) {
	v, err := p.c.Get(ctx, string(id)).Bytes()
	if errors.Is(err, redis.Nil) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	reply, err := decodeStored(v)
	return reply, true, err
}

func (p *redisPeer) Do(ctx context.Context, id []byte, fn func() []byte) ([]byte, bool, error) {
	if reply, found, err := p.lookup(ctx, id); found || err != nil {
		return reply, false, err
	}
	key := string(id)
	ok, err := p.c.SetNX(ctx, key, []byte{markClaim}, 0).Result()
	if err != nil {
		return nil, false, err
	}
	if !ok { // claimed by another caller meanwhile
		reply, _, err := p.lookup(ctx, id)
		return reply, false, err
	}
	reply := fn()
	if err := p.c.Set(ctx, key, committedValue(reply), 0).Err(); err != nil {
		return nil, false, err
	}
	return reply, true, nil
}

func (p *redisPeer) Close() error { return p.c.Close() }
