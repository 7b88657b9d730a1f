package idemraft

import (
	"context"
	"io"

	"github.com/idemdb/idem"
)

// image is what Snapshot takes of the dedup set: *idem.SnapshotImage.
type image interface {
	LSN() uint64
	WriteTo(ctx context.Context, w io.Writer) (idem.SnapshotInfo, error)
	Close() error
}

// takeImage captures the dedup set now (its records written out, then a
// Pebble snapshot); it is streamed
// later by Persist, concurrently with Applies.
func takeImage(ctx context.Context, _ *FSM, e *idem.Engine) (image, error) {
	return e.SnapshotImage(ctx)
}
