//go:build cgo && linux

// Package cmem returns the C heap's free memory to the operating system.
//
// Pebble's block cache and memtables live in C memory (malloc) when built
// with cgo. A cache that keeps evicting and loading blocks of mixed sizes
// leaves glibc's arenas full of free pages it does not give back: at 100
// million ids, random lookups held 330 MiB of C heap for the 88 MiB Pebble
// used, and the process at 1.8-2.2x the memory budget. glibc's
// malloc_trim(0) returns those pages (madvise); calling it every few
// seconds held the same run at 300 MiB (1.17x). It is looked up at run time
// (dlsym), so a C library without it (musl) builds and simply does nothing.
package cmem

/*
#cgo LDFLAGS: -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

typedef int (*idem_trim_fn)(size_t);

static int idem_has_trim(void) {
	return dlsym(RTLD_DEFAULT, "malloc_trim") != NULL;
}

static int idem_trim(void) {
	static idem_trim_fn fn;
	static int looked;
	if (!looked) {
		fn = (idem_trim_fn)dlsym(RTLD_DEFAULT, "malloc_trim");
		looked = 1;
	}
	if (!fn) {
		return -1;
	}
	return fn(0);
}
*/
import "C"

import "sync"

var mu sync.Mutex // one trim at a time (engines of one process share the heap)

// Glibc reports whether the C library is glibc (it has malloc_trim).
func Glibc() bool {
	mu.Lock()
	defer mu.Unlock()
	return C.idem_has_trim() == 1
}

// Trim returns the C heap's free pages to the OS. It reports false where
// there is no such call (no glibc).
func Trim() bool {
	mu.Lock()
	defer mu.Unlock()
	return C.idem_trim() >= 0
}
