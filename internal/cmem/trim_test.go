package cmem

import "testing"

// Trim can be called at any time, from several goroutines.
func TestTrim(t *testing.T) {
	done := make(chan bool)
	for range 4 {
		go func() { done <- Trim() }()
	}
	got := <-done
	for range 3 {
		if <-done != got {
			t.Fatal("Trim answered differently")
		}
	}
	t.Logf("malloc_trim available: %v", got)
}

// SetArenaMax answers as Trim does: both are glibc's, or neither is there.
func TestSetArenaMax(t *testing.T) {
	if got, want := SetArenaMax(2), Trim(); got != want {
		t.Fatalf("SetArenaMax = %v, Trim = %v", got, want)
	}
}
