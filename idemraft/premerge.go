package idemraft

// Stand-ins until the engine's per-request TTL and SnapshotImage land on
// main; this file is removed by the merge.

import (
	"context"
	"io"
	"os"
	"time"

	"github.com/idemdb/idem"
)

func requestTTL(req idem.Request) time.Duration          { return 0 }
func setRequestTTL(req *idem.Request, ttl time.Duration) {}

type image interface {
	LSN() uint64
	WriteTo(ctx context.Context, w io.Writer) (idem.SnapshotInfo, error)
	Close() error
}

type spoolImage struct {
	f    *os.File
	info idem.SnapshotInfo
}

func (s *spoolImage) LSN() uint64 { return s.info.LSN }
func (s *spoolImage) WriteTo(ctx context.Context, w io.Writer) (idem.SnapshotInfo, error) {
	if _, err := s.f.Seek(0, io.SeekStart); err != nil {
		return idem.SnapshotInfo{}, err
	}
	_, err := io.Copy(w, s.f)
	return s.info, err
}
func (s *spoolImage) Close() error { s.f.Close(); return os.Remove(s.f.Name()) }

func takeImage(ctx context.Context, f *FSM, e *idem.Engine) (image, error) {
	tf, err := os.CreateTemp(f.dir, "tmp-img-*")
	if err != nil {
		return nil, err
	}
	info, err := e.Snapshot(ctx, tf)
	if err != nil {
		tf.Close()
		os.Remove(tf.Name())
		return nil, err
	}
	return &spoolImage{f: tf, info: info}, nil
}
