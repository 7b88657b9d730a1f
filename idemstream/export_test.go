package idemstream

import (
	"encoding/binary"

	"github.com/idemdb/idem"
)

// frontierReq is the claim of frontier update seq to offset (a crash test
// leaves it in doubt).
func frontierReq(s *Sink, partition string, seq, offset uint64) idem.Request {
	var enc [8]byte
	binary.BigEndian.PutUint64(enc[:], offset)
	return idem.Request{Scope: s.fscope, Client: frontierClient(partition), Seq: seq, Fingerprint: enc[:]}
}
