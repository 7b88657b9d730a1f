package main

import "github.com/idemdb/idem/internal/cmem"

// Pebble's block cache and memtables live in C memory (malloc). glibc gives
// each thread that allocates its own arena, and the blocks that a busy cache
// frees and refills fragment them: at 10 million ids, random lookups left
// the process at 359 MiB RSS with a 256 MiB budget (Go heap 35 MiB); with
// two arenas, 176 MiB. Applications embedding idem can do the same with the
// environment variable MALLOC_ARENA_MAX=2 (docs/design.md, "Memory
// budget"); the command-line tool sets it itself, before any arena is made.
// mallopt is found at run time (internal/cmem): a build against another C
// library (musl has no M_ARENA_MAX) compiles and leaves malloc alone.
func init() { cmem.SetArenaMax(2) }
