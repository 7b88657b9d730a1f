package idemhttp

import "github.com/idemdb/idem"

// request builds the engine request for a key.
func (c *config) request(scope string, id, fp []byte, acked [][]byte) idem.Request {
	return idem.Request{Scope: scope, ID: id, Fingerprint: fp, Acked: acked}
}
