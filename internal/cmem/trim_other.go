//go:build !(cgo && linux)

package cmem

// Trim does nothing: without cgo Pebble's memory is Go memory, which the Go
// runtime returns itself; other systems' allocators are left alone.
func Trim() bool { return false }

// SetArenaMax does nothing here (see the cgo Linux build).
func SetArenaMax(n int) bool { return false }
