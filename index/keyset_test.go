package index

import (
	"fmt"
	"testing"
)

// KeySet finds repeats whether it holds a few keys (compared one by one)
// or many (in a map), also of keys added before it switched.
func TestKeySet(t *testing.T) {
	var s KeySet
	for i := 0; i < 20; i++ {
		if !s.Add([]byte(fmt.Sprint("k", i))) {
			t.Fatalf("k%d new, Add said repeated", i)
		}
		for j := 0; j <= i; j++ {
			if s.Add([]byte(fmt.Sprint("k", j))) {
				t.Fatalf("with %d keys: k%d repeated, Add said new", i+1, j)
			}
		}
	}
}
