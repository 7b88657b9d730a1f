//go:build !linux && !darwin && !dragonfly && !freebsd && !netbsd && !openbsd

package main

import "github.com/cockroachdb/pebble/v2/vfs"

// lockHeld reports whether an engine holds the lock on path. Without a way
// to ask without taking it, it takes the lock (vfs.Default.Lock) and
// releases it at once.
func lockHeld(path string) (bool, error) {
	l, err := vfs.Default.Lock(path)
	if err != nil {
		return true, nil
	}
	return false, l.Close()
}
