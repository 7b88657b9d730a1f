package index

import "bytes"

// KeySet is a set of keys that costs nothing while it holds a few (the
// advances of one commit are usually one or two): up to 8 are compared
// one by one, more go into a map. The zero value is empty. Keys must not
// change while in the set.
type KeySet struct {
	few [8][]byte
	n   int
	m   map[string]struct{}
}

// Add adds k and says whether it was not in the set yet.
func (s *KeySet) Add(k []byte) bool {
	if s.m != nil {
		if _, ok := s.m[string(k)]; ok {
			return false
		}
		s.m[string(k)] = struct{}{}
		return true
	}
	for _, x := range s.few[:s.n] {
		if bytes.Equal(x, k) {
			return false
		}
	}
	if s.n < len(s.few) {
		s.few[s.n] = k
		s.n++
		return true
	}
	s.m = make(map[string]struct{}, 2*len(s.few))
	for _, x := range s.few[:s.n] {
		s.m[string(x)] = struct{}{}
	}
	s.m[string(k)] = struct{}{}
	return true
}
