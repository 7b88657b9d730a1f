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

// Glibc answers as Trim does: both look for malloc_trim.
func TestGlibc(t *testing.T) {
	if got, want := Glibc(), Trim(); got != want {
		t.Fatalf("Glibc = %v, Trim = %v", got, want)
	}
}
