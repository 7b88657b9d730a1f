// Package cputime reads the CPU time the process has used, for the
// benchmarks' cpu-per-request figures: on a shared machine a benchmark
// gets a varying share of the cores, and its CPU time per operation
// depends on that share far less than its wall-clock rate does.
package cputime

import "time"

// Process is the CPU time (user and system, every thread) the process has
// used so far, or 0 where the platform does not say.
func Process() time.Duration { return process() }
