package idemhttp

import (
	"bytes"
	"net/http/httptest"
	"testing"
)

// The fingerprint's fields are framed: moving bytes from one field to the
// next changes it.
func TestFingerprintFraming(t *testing.T) {
	fp := func(method, target, body string) []byte {
		return fingerprint(httptest.NewRequest(method, target, nil), []byte(body))
	}
	cases := [][3]string{
		{"POST", "/ab", "c"},
		{"POST", "/a", "bc"},
		{"POST", "/a?b", "c"},
		{"POST", "/a?b=", "c"},
		{"POST", "/a", "?bc"},
		{"POS", "/Ta", "bc"},
		{"PUT", "/ab", "c"},
		{"POST", "/a%2Fb", "c"},
		{"POST", "/a/b", "c"},
		{"POST", "/ab", ""},
	}
	for i, a := range cases {
		for j, b := range cases {
			if i != j && bytes.Equal(fp(a[0], a[1], a[2]), fp(b[0], b[1], b[2])) {
				t.Errorf("%q and %q share a fingerprint", a, b)
			}
		}
	}
	if !bytes.Equal(fp("POST", "/a?x=1", "b"), fp("POST", "/a?x=1", "b")) {
		t.Fatal("not deterministic")
	}
	// An empty query is no query: the same request.
	if !bytes.Equal(fp("POST", "/a?", "b"), fp("POST", "/a", "b")) {
		t.Fatal("an empty query changed the fingerprint")
	}
}
