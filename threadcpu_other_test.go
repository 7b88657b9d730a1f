//go:build !linux

package idem

import "time"

// threadCPU: see threadcpu_linux_test.go (0: not known here).
func threadCPU() time.Duration { return 0 }
