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

// StoreKey is the SequenceStore key of client in the scope fields.
var StoreKey = storeKey

// Delete forgets key (a lost state).
func (s *MemoryStore) Delete(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, key)
}
