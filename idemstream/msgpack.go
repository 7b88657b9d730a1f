package idemstream

import (
	"bytes"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// checkMsgpack walks b before it is decoded and refuses an array or map
// that declares more elements than bytes remain, or nesting deeper than 32.
// msgpack v5.4.1 preallocates a slice of the declared length, so a corrupt
// length would otherwise allocate gigabytes (found by FuzzDecodeRecords).
func checkMsgpack(b []byte) error {
	r := bytes.NewReader(b)
	d := msgpack.NewDecoder(r)
	for r.Len() > 0 {
		if err := checkValue(d, r, 0); err != nil {
			return err
		}
	}
	return nil
}

func checkValue(d *msgpack.Decoder, r *bytes.Reader, depth int) error {
	if depth > 32 {
		return fmt.Errorf("msgpack nested deeper than 32")
	}
	c, err := d.PeekCode()
	if err != nil {
		return err
	}
	var n int
	switch {
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		if n, err = d.DecodeArrayLen(); err != nil {
			return err
		}
	case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		if n, err = d.DecodeMapLen(); err != nil {
			return err
		}
		n *= 2
	default:
		return d.Skip()
	}
	if n > r.Len() {
		return fmt.Errorf("msgpack container declares %d elements with %d bytes left", n, r.Len())
	}
	for i := 0; i < n; i++ {
		if err := checkValue(d, r, depth+1); err != nil {
			return err
		}
	}
	return nil
}

// unmarshal is msgpack.Unmarshal after checkMsgpack.
func unmarshal(b []byte, v any) error {
	if err := checkMsgpack(b); err != nil {
		return err
	}
	return msgpack.Unmarshal(b, v)
}
