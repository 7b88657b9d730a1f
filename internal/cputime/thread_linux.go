package cputime

import (
	"syscall"
	"time"
)

// Thread is the CPU time (user and system) the calling OS thread has used
// so far, or 0 where the platform does not say. The caller locks its
// goroutine to the thread (runtime.LockOSThread), so that the figure is
// the CPU of the code it runs there, apart from every other goroutine's.
func Thread() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(1 /* RUSAGE_THREAD */, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
