//go:build cgo && linux && !android

package main

// #include <malloc.h>
import "C"

// Pebble's block cache and memtables live in C memory (malloc). glibc gives
// each thread that allocates its own arena, and the blocks that a busy cache
// frees and refills fragment them: at 10 million ids, random lookups left
// the process at 359 MiB RSS with a 256 MiB budget (Go heap 35 MiB); with
// two arenas, 176 MiB. Applications embedding idem can do the same with the
// environment variable MALLOC_ARENA_MAX=2 (docs/design.md, "Memory
// budget"); the command-line tool sets it itself, before any arena is made.
func init() { C.mallopt(C.M_ARENA_MAX, 2) }
