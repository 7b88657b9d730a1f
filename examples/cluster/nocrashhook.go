//go:build !crashhook

package main

// afterEffect runs after a transfer is in the effects log and before its
// reply: a no-op, but in test builds (crashhook.go).
func afterEffect(string) {}
