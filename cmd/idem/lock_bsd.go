//go:build darwin || dragonfly || freebsd || netbsd || openbsd

package main

import (
	"os"

	"golang.org/x/sys/unix"
)

// lockHeld reports whether another process holds the POSIX record lock on
// path that the engine takes on its LOCK file (vfs.Default.Lock). It opens
// the file read-only and asks with F_GETLK, which changes nothing (taking
// the lock would: vfs.Default.Lock creates, so truncates, the file). A lock
// held by this process is not seen.
func lockHeld(path string) (bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: 0, Len: 0}
	if err := unix.FcntlFlock(f.Fd(), unix.F_GETLK, &lk); err != nil {
		return false, err
	}
	return lk.Type != unix.F_UNLCK, nil
}
