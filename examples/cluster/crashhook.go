//go:build crashhook

package main

import (
	"os"
	"syscall"
)

// crashKey is the Idempotency-Key whose transfer makes this process kill
// itself (SIGKILL) right after the transfer is in the effects log, before
// the reply is stored in the cluster: a crash between the side effect and
// the Commit, on demand. Only in test builds (-tags crashhook).
var crashKey = os.Getenv("CLUSTER_CRASH_AFTER_EFFECT")

func afterEffect(key string) {
	if crashKey != "" && key == crashKey {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is on its way: nothing more happens here
	}
}
