package idem

import (
	"syscall"
	"time"
)

// threadCPU is the CPU time (user and system) of the calling OS thread,
// or 0 where the platform does not say; the caller locks its goroutine
// to the thread (runtime.LockOSThread). The batch benchmarks read it
// around the batches they run, for the CPU the batch path itself takes
// (with the GC assists it is charged), apart from the WAL's flusher, the
// applier and Pebble on other threads.
func threadCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(1 /* RUSAGE_THREAD */, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
