package cputime

import "testing"

func TestProcessGrows(t *testing.T) {
	before := Process()
	x := 0
	for i := 0; i < 50_000_000; i++ {
		x += i % 7
	}
	if after := Process(); after < before {
		t.Fatalf("CPU time went back: %v -> %v (%d)", before, after, x)
	}
}
