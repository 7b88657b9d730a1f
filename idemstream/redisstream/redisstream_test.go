package redisstream

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemdb/idem/idemstream/internal/brokertest"
	"github.com/redis/go-redis/v9"
)

// The consumers' scenarios against a real redis-server (exactly once,
// crashes, poison messages) are in idemstream's brokers_test.go.

// TestRedisClaimIdleExceedsCheckpointPeriod: entries stay pending until
// their checkpoint commits, so a claim idle time not above the checkpoint
// period is refused (naming both values) before anything touches Redis;
// unset, it is derived from the period.
func TestRedisClaimIdleExceedsCheckpointPeriod(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// No server behind this address: a refused configuration must not get
	// as far as connecting.
	nowhere := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	defer nowhere.Close()
	for _, c := range []struct {
		period, idle time.Duration
		want         []string
	}{
		{time.Second, 300 * time.Millisecond, []string{"ClaimMinIdle 300ms", "CheckpointPeriod 1s"}},
		{time.Second, time.Second, []string{"ClaimMinIdle 1s", "CheckpointPeriod 1s"}},
		{0, 10 * time.Second, []string{"ClaimMinIdle 10s", "CheckpointPeriod 30s"}}, // the default period
		{50 * time.Millisecond, 0, []string{"CheckpointPeriod 50ms", "Block 1s"}},
	} {
		_, err := NewSource(ctx, nowhere, &Options{Stream: "s", Group: "g", Consumer: "c",
			CheckpointPeriod: c.period, ClaimMinIdle: c.idle})
		if err == nil {
			t.Fatalf("period %v, claim idle %v: accepted", c.period, c.idle)
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Fatalf("period %v, claim idle %v: error %q does not name %q", c.period, c.idle, err, w)
			}
		}
	}
	rdb := brokertest.StartRedis(t)
	src, err := NewSource(ctx, rdb, &Options{Stream: "s", Group: "g", Consumer: "c", CheckpointPeriod: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if src.opts.ClaimMinIdle != 4*time.Second {
		t.Fatalf("derived claim idle %v, want twice the period", src.opts.ClaimMinIdle)
	}
	if src, err = NewSource(ctx, rdb, &Options{Stream: "s", Group: "g", Consumer: "d", ClaimMinIdle: -1}); err != nil || src.opts.ClaimMinIdle > 0 {
		t.Fatalf("claiming off: %v %v", src, err)
	}
}

func TestOffset(t *testing.T) {
	a, err1 := Offset("1700000000000-0")
	b, err2 := Offset("1700000000000-5")
	c, err3 := Offset("1700000000001-0")
	if err1 != nil || err2 != nil || err3 != nil || !(a < b && b < c) {
		t.Fatalf("%d %d %d %v %v %v", a, b, c, err1, err2, err3)
	}
	for _, bad := range []string{"", "x", "1-", "-1", "1-2000000", "99999999999999999-0"} {
		if _, err := Offset(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
