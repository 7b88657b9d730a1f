package main

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// lockHeld reports whether a process holds a lock on path, the LOCK file
// on which the engine takes a POSIX record lock (vfs.Default.Lock). It
// changes nothing: taking the lock would (vfs.Default.Lock creates, so
// truncates, the file), and so would merely opening and closing the file
// in a process that holds the lock (closing any descriptor of a file drops
// the process's record locks on it).
//
// So it looks the file up in /proc/locks, which also sees a lock held by
// this very process. A line naming the file's device and inode answers. A
// line naming only its inode (btrfs reports another device to stat than to
// /proc/locks) answers too when the holder is this process; when it is
// another, asking with F_OFD_GETLK on a read-only descriptor is safe (it
// cannot drop another process's lock) and answers. Without /proc it asks
// with F_OFD_GETLK.
func lockHeld(path string) (bool, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return false, err
	}
	if pl, err := os.Open("/proc/locks"); err == nil {
		defer pl.Close()
		dev := fmt.Sprintf("%02x:%02x:", unix.Major(st.Dev), unix.Minor(st.Dev))
		ino := ":" + strconv.FormatUint(st.Ino, 10)
		inodeOnly := false
		sc := bufio.NewScanner(pl)
		for sc.Scan() {
			// "1: POSIX  ADVISORY  WRITE 3964 fe:00:9991386 0 EOF"; a
			// waiter's line has "->" after the number.
			f := strings.Fields(sc.Text())
			if len(f) < 6 || f[1] == "->" || !strings.HasSuffix(f[5], ino) {
				continue
			}
			if f[5] == dev+ino[1:] || f[4] == strconv.Itoa(os.Getpid()) {
				return true, nil
			}
			inodeOnly = true
		}
		if sc.Err() == nil && !inodeOnly {
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
