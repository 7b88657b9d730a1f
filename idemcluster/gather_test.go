package idemcluster

import (
	"runtime"
	"testing"
)

// After a batch of two calls, gather waits (yielding) for the second
// caller's next call even when one yield saw the queue not grow: the
// caller was still on its way (its goroutine yields three times before it
// queues its call). One processor, so that the yields hand it over in
// order. Before, gather stopped at the first yield without growth and the
// call waited a whole batch for the next one.
func TestGatherWaitsForAnsweredCallers(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	b := &batcher{queue: []*batchCall{{}}} // the first caller's next call is queued
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 3 {
			runtime.Gosched()
		}
		b.mu.Lock()
		b.queue = append(b.queue, &batchCall{})
		b.mu.Unlock()
	}()
	b.gather(2)
	b.mu.Lock()
	n := len(b.queue)
	b.mu.Unlock()
	<-done
	if n != 2 {
		t.Fatalf("gather took %d calls after a batch of 2 answered, want 2 (the second caller's call came after a yield without growth)", n)
	}
}
