//go:build !linux && !darwin && !dragonfly && !freebsd && !netbsd && !openbsd

package main

// isTerminal reports whether fd is a terminal. Without a portable check we
// assume it is not, so no progress bar is drawn.
func isTerminal(fd uintptr) bool { return false }
