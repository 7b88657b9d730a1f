package idemcluster

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"testing"
	"time"
	"unsafe"
)

// TestDecodedBytesDoNotOverlap: the strings and byte slices of a decoded
// command (cut from shared blocks: entryReader.alloc) are each their own:
// no slice's capacity reaches into another's bytes, so an append to one
// (or a write to it) changes no other, as when each was allocated alone.
func TestDecodedBytesDoNotOverlap(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	type span struct {
		what       string
		start, end uintptr // the bytes it may write: up to its capacity
		used       uintptr // the end of its bytes
	}
	for i := range 2000 {
		entry, err := encodeCommand(randomCommand(rng, 0))
		if err != nil {
			t.Fatal(err)
		}
		c, err := decodeCommand(entry)
		if err != nil {
			t.Fatal(err)
		}
		var spans []span
		var walk func(v reflect.Value, path string)
		walk = func(v reflect.Value, path string) {
			switch v.Kind() {
			case reflect.Pointer, reflect.Interface:
				if !v.IsNil() {
					walk(v.Elem(), path)
				}
			case reflect.Struct:
				for j := range v.NumField() {
					walk(v.Field(j), path+"."+v.Type().Field(j).Name)
				}
			case reflect.Slice:
				if v.Type().Elem().Kind() == reflect.Uint8 {
					if v.Len() > 0 {
						p := v.Pointer()
						spans = append(spans, span{path, p, p + uintptr(v.Cap()), p + uintptr(v.Len())})
					}
					return
				}
				for j := range v.Len() {
					walk(v.Index(j), fmt.Sprintf("%s[%d]", path, j))
				}
			case reflect.String:
				if v.Len() > 0 {
					p := uintptr(unsafe.Pointer(unsafe.StringData(v.String())))
					spans = append(spans, span{path, p, p + uintptr(v.Len()), p + uintptr(v.Len())})
				}
			}
		}
		walk(reflect.ValueOf(c), "command")
		for _, a := range spans {
			for _, b := range spans {
				if a != b && a.start < b.used && b.start < a.end {
					t.Fatalf("entry %d: %s (capacity to %#x) reaches into %s (%#x-%#x)", i, a.what, a.end, b.what, b.start, b.used)
				}
			}
		}
	}
}
