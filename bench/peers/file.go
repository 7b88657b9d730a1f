package peers

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"
)

// filePeer is the physical limit: the records idem writes for a request (a
// claim, then a reply) appended to a file, each waited for until it is on
// disk, with nothing else (no lookup, no index, no reply for a
// duplicate). Concurrent appends share one write and one fdatasync (group
// commit: while one flush runs, the next batch gathers, and it is flushed
// as soon as the first one ends). As idem's WAL does, it writes into
// segment files zero-filled in advance (64 MiB; the next one is prepared
// in the background once the active one is half full), so that an
// fdatasync has no file size to persist.
type filePeer struct {
	dir string

	mu  sync.Mutex
	cur *fileBatch
	err error // sticky: a failed write or sync fails everything after it

	kick chan struct{}
	quit chan struct{}
	done chan struct{}

	// owned by the flusher goroutine
	f     *os.File
	off   int64
	seq   int
	spare chan error // result of preparing the next segment
}

type fileBatch struct {
	buf  []byte
	done chan struct{}
	err  error
}

// fileSegmentSize is the size of a segment (a variable for the tests).
var fileSegmentSize int64 = 64 << 20

var crcTable = crc32.MakeTable(crc32.Castagnoli)

func openFile(cfg Config) (Peer, error) {
	p := &filePeer{dir: cfg.Dir, cur: &fileBatch{done: make(chan struct{})},
		kick: make(chan struct{}, 1), quit: make(chan struct{}), done: make(chan struct{})}
	if err := p.rotate(); err != nil {
		return nil, err
	}
	go p.flusher()
	return p, nil
}

func (p *filePeer) sparePath() string { return filepath.Join(p.dir, "next.prealloc") }

// zeroFill writes a file of size zero bytes (real writes, not fallocate,
// whose unwritten extents need a metadata update on their first write) and
// fsyncs it.
func zeroFill(path string, size int64) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	zeros := make([]byte, 1<<20)
	for off := int64(0); off < size; off += int64(len(zeros)) {
		if _, err := f.Write(zeros[:min(int64(len(zeros)), size-off)]); err != nil {
			f.Close()
			return err
		}
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// rotate makes the spare file the next segment (preparing it now if that
// was not started in the background).
func (p *filePeer) rotate() error {
	if p.spare == nil {
		p.startSpare()
	}
	if err := <-p.spare; err != nil {
		return fmt.Errorf("preparing the next segment: %w", err)
	}
	p.spare = nil
	p.seq++
	name := filepath.Join(p.dir, fmt.Sprintf("%06d.log", p.seq))
	if err := os.Rename(p.sparePath(), name); err != nil {
		return err
	}
	d, err := os.Open(p.dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	d.Close()
	if err != nil {
		return err
	}
	f, err := os.OpenFile(name, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if p.f != nil {
		p.f.Close()
	}
	p.f, p.off = f, 0
	return nil
}

// startSpare starts preparing the next segment in the background. As
// idem's WAL does, the flusher starts it once the active segment is half
// full: zero-filling 64 MiB competes with the commits' fdatasyncs, and a
// short run should not pay for a segment it never uses.
func (p *filePeer) startSpare() {
	p.spare = make(chan error, 1)
	go func(ch chan error) { ch <- zeroFill(p.sparePath(), fileSegmentSize) }(p.spare)
}

func (p *filePeer) flusher() {
	defer close(p.done)
	for {
		select {
		case <-p.quit:
			return
		case <-p.kick:
		}
		p.mu.Lock()
		b := p.cur
		if len(b.buf) == 0 {
			p.mu.Unlock()
			continue
		}
		p.cur = &fileBatch{buf: make([]byte, 0, cap(b.buf)), done: make(chan struct{})}
		p.mu.Unlock()
		err := p.flush(b.buf)
		if err != nil {
			p.mu.Lock()
			p.err = err
			p.mu.Unlock()
		}
		b.err = err
		close(b.done)
	}
}

func (p *filePeer) flush(buf []byte) error {
	if p.off > 0 && p.off+int64(len(buf)) > fileSegmentSize {
		if err := p.rotate(); err != nil {
			return err
		}
	}
	if _, err := p.f.WriteAt(buf, p.off); err != nil {
		return err
	}
	p.off += int64(len(buf))
	if p.spare == nil && p.off > fileSegmentSize/2 {
		p.startSpare()
	}
	return unix.Fdatasync(int(p.f.Fd()))
}

// append adds one record and waits until it is on disk.
func (p *filePeer) append(typ byte, id, payload []byte) error {
	n := 1 + len(id) + len(payload)
	p.mu.Lock()
	if p.err != nil {
		err := p.err
		p.mu.Unlock()
		return err
	}
	b := p.cur
	start := len(b.buf)
	b.buf = binary.LittleEndian.AppendUint32(b.buf, uint32(n))
	b.buf = append(b.buf, 0, 0, 0, 0) // CRC, below
	b.buf = append(b.buf, typ)
	b.buf = append(b.buf, id...)
	b.buf = append(b.buf, payload...)
	binary.LittleEndian.PutUint32(b.buf[start+4:], crc32.Checksum(b.buf[start+8:], crcTable))
	p.mu.Unlock()
	select {
	case p.kick <- struct{}{}:
	default:
	}
	<-b.done
	return b.err
}

func (p *filePeer) Do(_ context.Context, id []byte, fn func() []byte) ([]byte, bool, error) {
	if err := p.append(markClaim, id, nil); err != nil {
		return nil, false, err
	}
	reply := fn()
	if err := p.append(markCommit, id, reply); err != nil {
		return nil, false, err
	}
	return reply, true, nil
}

func (p *filePeer) NoLookups() {}

func (p *filePeer) Close() error {
	close(p.quit)
	<-p.done
	var errs []error
	if p.spare != nil {
		errs = append(errs, <-p.spare)
	}
	if p.f != nil {
		errs = append(errs, p.f.Close())
	}
	return errors.Join(errs...)
}
