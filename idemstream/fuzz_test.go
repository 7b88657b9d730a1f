package idemstream

import (
	"testing"
)

// FuzzDecodeRecords: every record read back from idem is validated; no
// input panics, and what decodes re-encodes to an equal record.
func FuzzDecodeRecords(f *testing.F) {
	ev, _ := encodeEventRecord(&eventRecord{Result: []byte("r"), Partition: "p", Offset: 9, Outbox: []OutboxMessage{{Destination: "d", Payload: []byte("x")}}})
	ck, _ := seal(&checkpointRecord{K: 3, Handle: []byte{0x81, 0xa2}, Events: [][]byte{[]byte("e")}, Frontier: map[string]uint64{"p": 4}}, 1<<20)
	ob, _ := outboxID("sink", []byte("ev"), 2)
	for _, s := range [][]byte{ev, ck, ob, nil, []byte("ISCK"), []byte{0x93, 0xa1, 0x61}} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if r, err := decodeEventRecord("s", []byte("id"), b); err == nil {
			again, err := encodeEventRecord(r)
			if err != nil {
				t.Fatal(err)
			}
			r2, err := decodeEventRecord("s", []byte("id"), again)
			if err != nil || r2.Offset != r.Offset || r2.Partition != r.Partition || string(r2.Result) != string(r.Result) || len(r2.Outbox) != len(r.Outbox) {
				t.Fatalf("re-encoded event record differs: %+v vs %+v (%v)", r, r2, err)
			}
		}
		var c checkpointRecord
		if err := unseal(b, 1<<20, &c); err == nil {
			if _, err := seal(&c, 1<<20); err != nil {
				t.Fatal(err)
			}
		}
		var m markerRecord
		_ = unseal(b, 64, &m)
		if sink, id, i, err := parseOutboxID(b); err == nil {
			if again, _ := outboxID(sink, id, i); len(again) == 0 {
				t.Fatal("outbox id does not re-encode")
			}
		}
	})
}
