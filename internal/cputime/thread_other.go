//go:build !linux

package cputime

import "time"

// Thread is the CPU time the calling OS thread has used: 0 here, where
// the platform does not say (see thread_linux.go).
func Thread() time.Duration { return 0 }
