package idemgrpc

import (
	"context"
	"time"
)

// WithRetryClock returns a copy of o whose retries read the time from now
// and sleep with sleep (tests: a manual clock, counted sleeps).
func WithRetryClock(o RetryOptions, now func() time.Time, sleep func(ctx context.Context, d time.Duration) error) *RetryOptions {
	o.now, o.sleep = now, sleep
	return &o
}
