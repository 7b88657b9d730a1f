package idemraft

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"

	"github.com/hashicorp/raft"
	"github.com/vmihailenco/msgpack/v5"
)

// ErrCorruptSnapshot: a snapshot handed to Restore is truncated, damaged or
// not an idemraft snapshot. Nothing was loaded: the application's FSM and
// the dedup set are as they were.
var ErrCorruptSnapshot = errors.New("idemraft: corrupt snapshot")

// The snapshot container (all integers big-endian):
//
//	"idemraft-snapshot\x00" version(1 byte, = 1)
//	section: meta (msgpack snapMeta)
//	section: the dedup set in idem's snapshot format (itself checksummed)
//	section: exactly the bytes the application's FSMSnapshot.Persist wrote
//	"idemraft-end\x00"
//
// A section is a run of chunks, each len(u32, 1..1 MiB) crc32c(u32) and
// len bytes, closed by a zero len, the section's total length (u64) and
// the crc32c of all its bytes (u32). Every chunk is checked before a byte
// of it is handed on, and the section's end checks that no chunk was
// dropped, repeated or reordered.
const (
	snapMagic   = "idemraft-snapshot\x00"
	snapEnd     = "idemraft-end\x00"
	snapVersion = 1
	chunkSize   = 64 << 10
	maxChunk    = 1 << 20
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// snapMeta is the first section: where in the log the image was taken and
// the state of the log-driven clock.
type snapMeta struct {
	Index   uint64 `msgpack:"index"`    // last log index applied
	Time    int64  `msgpack:"time"`     // the FSM clock (Unix ns)
	IdemLSN uint64 `msgpack:"idem_lsn"` // the dedup image's LSN
}

type chunkWriter struct {
	w     io.Writer
	buf   []byte
	total uint64
	crc   uint32
}

func newChunkWriter(w io.Writer) *chunkWriter {
	return &chunkWriter{w: w, buf: make([]byte, 8, 8+chunkSize)}
}

func (c *chunkWriter) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		room := 8 + chunkSize - len(c.buf)
		k := min(room, len(p))
		c.buf = append(c.buf, p[:k]...)
		p, n = p[k:], n+k
		if len(c.buf) == 8+chunkSize {
			if err := c.flush(); err != nil {
				return n, err
			}
		}
	}
	return n, nil
}

func (c *chunkWriter) flush() error {
	payload := c.buf[8:]
	if len(payload) == 0 {
		return nil
	}
	binary.BigEndian.PutUint32(c.buf[0:4], uint32(len(payload)))
	binary.BigEndian.PutUint32(c.buf[4:8], crc32.Checksum(payload, castagnoli))
	c.total += uint64(len(payload))
	c.crc = crc32.Update(c.crc, castagnoli, payload)
	_, err := c.w.Write(c.buf)
	c.buf = c.buf[:8]
	return err
}

// Close ends the section (it does not close the underlying writer).
func (c *chunkWriter) Close() error {
	if err := c.flush(); err != nil {
		return err
	}
	var end [20]byte // zero len, zero crc, total, crc
	binary.BigEndian.PutUint64(end[8:16], c.total)
	binary.BigEndian.PutUint32(end[16:20], c.crc)
	_, err := c.w.Write(end[:])
	return err
}

// sectionReader reads one section, returning io.EOF only after its end
// was read and checked.
type sectionReader struct {
	r     io.Reader
	name  string
	buf   []byte
	off   int
	total uint64
	crc   uint32
	done  bool
	err   error
}

func newSectionReader(r io.Reader, name string) *sectionReader {
	return &sectionReader{r: r, name: name}
}

func (s *sectionReader) corrupt(format string, args ...any) error {
	s.err = fmt.Errorf("%w: %s part, after %d bytes: %s", ErrCorruptSnapshot, s.name, s.total, fmt.Sprintf(format, args...))
	return s.err
}

func (s *sectionReader) Read(p []byte) (int, error) {
	for s.off == len(s.buf) {
		if s.err != nil {
			return 0, s.err
		}
		if s.done {
			return 0, io.EOF
		}
		if err := s.next(); err != nil {
			return 0, err
		}
	}
	n := copy(p, s.buf[s.off:])
	s.off += n
	return n, nil
}

func (s *sectionReader) next() error {
	var h [8]byte
	if _, err := io.ReadFull(s.r, h[:]); err != nil {
		return s.corrupt("truncated chunk header (%v)", err)
	}
	n := binary.BigEndian.Uint32(h[0:4])
	sum := binary.BigEndian.Uint32(h[4:8])
	if n == 0 {
		var end [12]byte
		if _, err := io.ReadFull(s.r, end[:]); err != nil {
			return s.corrupt("truncated section end (%v)", err)
		}
		if total := binary.BigEndian.Uint64(end[0:8]); sum != 0 || total != s.total {
			return s.corrupt("section end says %d bytes, read %d", total, s.total)
		}
		if crc := binary.BigEndian.Uint32(end[8:12]); crc != s.crc {
			return s.corrupt("section checksum %08x, computed %08x", crc, s.crc)
		}
		s.done = true
		s.buf, s.off = s.buf[:0], 0
		return nil
	}
	if n > maxChunk {
		return s.corrupt("chunk length %d exceeds %d", n, maxChunk)
	}
	if cap(s.buf) < int(n) {
		s.buf = make([]byte, n)
	}
	s.buf = s.buf[:n]
	if _, err := io.ReadFull(s.r, s.buf); err != nil {
		return s.corrupt("truncated chunk of %d bytes (%v)", n, err)
	}
	if got := crc32.Checksum(s.buf, castagnoli); got != sum {
		return s.corrupt("chunk checksum %08x, computed %08x", sum, got)
	}
	s.total += uint64(n)
	s.crc = crc32.Update(s.crc, castagnoli, s.buf)
	s.off = 0
	return nil
}

// drain reads the section to its checked end.
func (s *sectionReader) drain() error {
	_, err := io.Copy(io.Discard, s)
	return err
}

// Snapshot implements raft.FSM. Raft calls it between two Applies: the
// application's snapshot and an image of the dedup set are taken at the
// same log index. Both are cheap to take; the copying happens in Persist,
// concurrently with later Applies.
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	if err := f.Err(); err != nil {
		return nil, err
	}
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.closed {
		return nil, errors.New("idemraft: Snapshot: FSM closed")
	}
	g := f.cur
	img, err := takeImage(context.Background(), f, g.e)
	if err != nil {
		return nil, fmt.Errorf("idemraft: snapshot of the dedup set: %w", err)
	}
	appSnap, err := f.app.Snapshot()
	if err != nil {
		img.Close()
		return nil, err
	}
	f.acquire(g)
	return &fsmSnapshot{
		f: f, g: g, img: img, app: appSnap,
		meta: snapMeta{Index: f.lastIndex.Load(), Time: f.now.Load(), IdemLSN: img.LSN()},
	}, nil
}

type fsmSnapshot struct {
	f    *FSM
	g    *generation
	img  image
	app  raft.FSMSnapshot
	meta snapMeta
	once bool
}

// Persist writes the container described above to sink and closes it.
func (s *fsmSnapshot) Persist(sink raft.SnapshotSink) error {
	if s.once {
		return errors.New("idemraft: snapshot persisted twice")
	}
	s.once = true
	bw := bufio.NewWriterSize(sink, 256<<10)
	if err := s.persist(bw, sink.ID()); err != nil {
		return err // raft cancels the sink
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	s.f.snapshots.Add(1)
	return sink.Close()
}

func (s *fsmSnapshot) persist(bw *bufio.Writer, id string) error {
	bw.WriteString(snapMagic)
	bw.WriteByte(snapVersion)
	meta, err := msgpack.Marshal(&s.meta)
	if err != nil {
		return err
	}
	cw := newChunkWriter(bw)
	if _, err := cw.Write(meta); err != nil {
		return err
	}
	if err := cw.Close(); err != nil {
		return err
	}
	cw = newChunkWriter(bw)
	if _, err := s.img.WriteTo(context.Background(), cw); err != nil {
		return fmt.Errorf("idemraft: persist the dedup set: %w", err)
	}
	if err := cw.Close(); err != nil {
		return err
	}
	as := &appSink{w: newChunkWriter(bw), id: id}
	if err := s.app.Persist(as); err != nil {
		return err
	}
	if as.cancelled {
		return errors.New("idemraft: the application's snapshot was cancelled")
	}
	if err := as.w.Close(); err != nil {
		return err
	}
	_, err = bw.WriteString(snapEnd)
	return err
}

// Release implements raft.FSMSnapshot.
func (s *fsmSnapshot) Release() {
	if s.img == nil {
		return
	}
	s.img.Close()
	s.app.Release()
	s.f.release(s.g)
	s.img = nil
}

// appSink is the raft.SnapshotSink the application's Persist writes to:
// its bytes become the last section; Close and Cancel only mark the end.
type appSink struct {
	w                 *chunkWriter
	id                string
	closed, cancelled bool
}

func (a *appSink) Write(p []byte) (int, error) {
	if a.closed || a.cancelled {
		return 0, errors.New("idemraft: write to a closed snapshot sink")
	}
	return a.w.Write(p)
}
func (a *appSink) Close() error  { a.closed = true; return nil }
func (a *appSink) Cancel() error { a.cancelled = true; return nil }
func (a *appSink) ID() string    { return a.id }

// Restore implements raft.FSM: it discards the dedup set and the
// application's state and loads both from a snapshot written by Persist.
// The whole snapshot is checked before the application's Restore is
// called: the dedup part is restored into a new directory (idem checks its
// own format), the application's part is copied to a temporary file while
// its chunks are checked, and only then does the application's Restore
// read exactly its bytes. A bad snapshot changes nothing and returns an
// error wrapping ErrCorruptSnapshot (or idem.ErrCorrupt).
func (f *FSM) Restore(rc io.ReadCloser) error {
	f.mu.RLock()
	closed := f.closed
	f.mu.RUnlock()
	if closed {
		return errors.New("idemraft: Restore: FSM closed")
	}
	g, spool, meta, err := f.load(rc)
	if err != nil {
		f.logger.Warn("idemraft: snapshot refused", "err", err)
		return err
	}
	defer func() {
		spool.Close()
		os.Remove(spool.Name())
	}()
	if err := f.app.Restore(spool); err != nil {
		f.release(g)
		err = fmt.Errorf("idemraft: the application's Restore failed, its state is unknown: %w", err)
		f.failed.Store(&err)
		return err
	}
	f.mu.Lock()
	old := f.cur
	f.cur = g
	f.now.Store(meta.Time)
	f.lastIndex.Store(meta.Index)
	f.failed.Store(nil)
	f.mu.Unlock()
	f.release(old)
	f.restores.Add(1)
	return nil
}

func (f *FSM) load(rc io.Reader) (*generation, *os.File, snapMeta, error) {
	var meta snapMeta
	br := bufio.NewReaderSize(rc, 256<<10)
	head := make([]byte, len(snapMagic)+1)
	if _, err := io.ReadFull(br, head); err != nil {
		return nil, nil, meta, fmt.Errorf("%w: truncated header (%v)", ErrCorruptSnapshot, err)
	}
	if string(head[:len(snapMagic)]) != snapMagic {
		return nil, nil, meta, fmt.Errorf("%w: not an idemraft snapshot (first bytes %q)", ErrCorruptSnapshot, head)
	}
	if v := head[len(snapMagic)]; v != snapVersion {
		return nil, nil, meta, fmt.Errorf("%w: version %d, this idemraft reads %d", ErrCorruptSnapshot, v, snapVersion)
	}
	ms := newSectionReader(br, "meta")
	mb, err := io.ReadAll(io.LimitReader(ms, 1<<20))
	if err == nil {
		err = ms.drain()
	}
	if err != nil {
		return nil, nil, meta, err
	}
	if err := unmarshalStrict(mb, &meta); err != nil {
		return nil, nil, meta, fmt.Errorf("%w: meta: %v", ErrCorruptSnapshot, err)
	}
	is := newSectionReader(br, "dedup")
	g, err := f.openGeneration(is)
	if err == nil {
		if err = is.drain(); err != nil {
			f.release(g)
		}
	}
	if err != nil {
		if is.err != nil {
			err = is.err // the framing's diagnosis is the precise one
		}
		return nil, nil, meta, fmt.Errorf("idemraft: restore the dedup set: %w", err)
	}
	spool, err := os.CreateTemp(f.dir, "tmp-app-*")
	if err != nil {
		f.release(g)
		return nil, nil, meta, err
	}
	fail := func(err error) (*generation, *os.File, snapMeta, error) {
		spool.Close()
		os.Remove(spool.Name())
		f.release(g)
		return nil, nil, meta, err
	}
	as := newSectionReader(br, "application")
	if _, err := io.Copy(spool, as); err != nil {
		return fail(err)
	}
	end := make([]byte, len(snapEnd))
	if _, err := io.ReadFull(br, end); err != nil || string(end) != snapEnd {
		return fail(fmt.Errorf("%w: missing end marker", ErrCorruptSnapshot))
	}
	if _, err := spool.Seek(0, io.SeekStart); err != nil {
		return fail(err)
	}
	return g, spool, meta, nil
}
