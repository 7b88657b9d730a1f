//go:build !(cgo && linux)

package cmem

// Trim does nothing: without cgo Pebble's memory is Go memory, which the Go
// runtime returns itself; other systems' allocators are left alone.
func Trim() bool { return false }

// Glibc reports false: without cgo on Linux the C library is not looked at.
func Glibc() bool { return false }
