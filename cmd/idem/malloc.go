package main

import (
	"os"
	"syscall"

	"github.com/idemdb/idem/internal/cmem"
)

// Pebble's block cache and memtables live in C memory (malloc). glibc gives
// each thread that allocates its own arena, and the blocks that a busy cache
// frees and refills fragment them: at 10 million ids, random lookups left
// the process at 359 MiB RSS with a 256 MiB budget (Go heap 35 MiB); with
// two arenas, 176 MiB. Applications embedding idem can do the same with the
// environment variable MALLOC_ARENA_MAX=2 (docs/design.md, "Memory
// budget").
//
// The tool sets it for itself by executing itself again with the variable
// set, before anything else runs. mallopt(M_ARENA_MAX) from an init
// function came too late: glibc fixes its arena limit when a second thread
// first allocates, and cgo's thread starts allocate before main's init, so
// a 100M-id run had 6 arenas (480 MB of address space, 98 MB in use).
// Only where the C library is glibc (internal/cmem finds malloc_trim), and
// only once: a failed exec goes on as is.
func setArenaMax() {
	if os.Getenv("MALLOC_ARENA_MAX") != "" || !cmem.Glibc() {
		return
	}
	exe, err := os.Executable()
	if err != nil {
		return
	}
	os.Setenv("MALLOC_ARENA_MAX", "2")
	_ = syscall.Exec(exe, os.Args, os.Environ()) // returns only on failure
}
