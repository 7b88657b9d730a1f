//go:build !unix

package cputime

import "time"

func process() time.Duration { return 0 }
