package main

import (
	"fmt"
	"os"
	"testing"
)

// TestMain lets the test binary act as the consumer process the example
// re-executes (os.Executable is the test binary here).
func TestMain(m *testing.M) {
	if dir := os.Getenv("STREAMLEDGER_CHILD"); dir != "" {
		if err := child(dir, os.Getenv("STREAMLEDGER_NATS")); err != nil {
			fmt.Fprintln(os.Stderr, "consumer:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestStreamLedger runs the example end to end (a small stream, two
// kills): it fails if the ledger is not exactly once.
func TestStreamLedger(t *testing.T) {
	if err := parent(300, 2, false); err != nil {
		t.Fatal(err)
	}
}
