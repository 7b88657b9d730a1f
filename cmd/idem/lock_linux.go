package main

import (
	"bufio"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// lockHeld reports whether a process holds a lock on path, the LOCK file
// on which the engine takes a POSIX record lock (vfs.Default.Lock). It
// changes nothing: taking the lock would (vfs.Default.Lock creates, so
// truncates, the file), and so would merely opening and closing the file
// in a process that holds the lock (closing any descriptor of a file drops
// the process's record locks on it). So it looks the file up in
// /proc/locks by device and inode, which also sees a lock held by this very
// process. Without /proc it asks with F_OFD_GETLK on a read-only descriptor
// (which cannot drop a lock held by another process).
func lockHeld(path string) (bool, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return false, err
	}
	if pl, err := os.Open("/proc/locks"); err == nil {
		defer pl.Close()
		want := fmt.Sprintf("%02x:%02x:%d", unix.Major(st.Dev), unix.Minor(st.Dev), st.Ino)
		sc := bufio.NewScanner(pl)
		for sc.Scan() {
			// "1: POSIX  ADVISORY  WRITE 3964 fe:00:9991386 0 EOF"
			f := strings.Fields(sc.Text())
			if len(f) >= 6 && f[1] != "->" && f[5] == want {
				return true, nil
			}
		}
		if sc.Err() == nil {
			return false, nil
		}
	}
	f, err := os.Open(path)
	if err != nil {
		return false, err
	}
	defer f.Close()
	lk := unix.Flock_t{Type: unix.F_WRLCK}
	if err := unix.FcntlFlock(f.Fd(), unix.F_OFD_GETLK, &lk); err != nil {
		return false, err
	}
	return lk.Type != unix.F_UNLCK, nil
}
