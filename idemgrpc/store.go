package idemgrpc

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"sync"
)

// SequenceStore keeps a client's last used sequence number per scope, for a
// Tracker. Save must be durable when it returns: the Tracker saves a number
// before the request carrying it is sent, so that a client that restarts
// never sends a new request under a number it used before.
type SequenceStore interface {
	// Load returns the last used sequence number of key; ok is false when
	// the store has none (a new client, or a lost state: the Tracker then
	// asks the server). An error wrapping ErrStateCorrupt is treated as a
	// lost state.
	Load(key string) (last uint64, ok bool, err error)
	// Save records last as the last used number of key, durably.
	Save(key string, last uint64) error
}

// ErrStateCorrupt is wrapped by a SequenceStore's Load when the stored state
// cannot be trusted (a torn or damaged file).
var ErrStateCorrupt = errors.New("idemgrpc: sequence state corrupt")

// MemoryStore is a SequenceStore in memory: a process restart loses it (the
// Tracker then recovers through GetClientState). For tests and for clients
// whose identity does not outlive the process.
type MemoryStore struct {
	mu sync.Mutex
	m  map[string]uint64
}

// NewMemoryStore returns an empty MemoryStore.
func NewMemoryStore() *MemoryStore { return &MemoryStore{m: map[string]uint64{}} }

// Load implements SequenceStore.
func (s *MemoryStore) Load(key string) (uint64, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.m[key]
	return v, ok, nil
}

// Save implements SequenceStore.
func (s *MemoryStore) Save(key string, last uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.m[key] = last
	return nil
}

// FileStore is a SequenceStore on disk: one small file per key in a
// directory, rewritten in place and fsynced at every Save (one fsync per
// new request; the file's creation also fsyncs the directory). Each file
// holds a magic, a CRC-32C, the number and the key: a torn write is
// detected (ErrStateCorrupt) and the Tracker recovers from the server.
type FileStore struct {
	dir   string
	mu    sync.Mutex
	files map[string]*os.File
}

const fileStoreMagic = "IDSQ"

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// OpenFileStore opens (creating) the directory dir.
func OpenFileStore(dir string) (*FileStore, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("idemgrpc: file store: %w", err)
	}
	return &FileStore{dir: dir, files: map[string]*os.File{}}, nil
}

func (s *FileStore) path(key string) string {
	h := sha256.Sum256([]byte(key))
	return filepath.Join(s.dir, hex.EncodeToString(h[:16])+".seq")
}

func encodeSeqFile(key string, last uint64) []byte {
	b := make([]byte, 16+len(key))
	copy(b, fileStoreMagic)
	binary.BigEndian.PutUint64(b[8:], last)
	copy(b[16:], key)
	binary.BigEndian.PutUint32(b[4:], crc32.Checksum(b[8:], castagnoli))
	return b
}

// Load implements SequenceStore.
func (s *FileStore) Load(key string) (uint64, bool, error) {
	p := s.path(key)
	b, err := os.ReadFile(p)
	if errors.Is(err, os.ErrNotExist) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("idemgrpc: file store: %w", err)
	}
	if len(b) != 16+len(key) || string(b[:4]) != fileStoreMagic ||
		binary.BigEndian.Uint32(b[4:]) != crc32.Checksum(b[8:], castagnoli) {
		return 0, false, fmt.Errorf("%w: %s (%d bytes) fails its checksum", ErrStateCorrupt, p, len(b))
	}
	if string(b[16:]) != key {
		return 0, false, fmt.Errorf("%w: %s holds another key", ErrStateCorrupt, p)
	}
	return binary.BigEndian.Uint64(b[8:]), true, nil
}

// Save implements SequenceStore.
func (s *FileStore) Save(key string, last uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.files == nil {
		return errors.New("idemgrpc: file store closed")
	}
	b := encodeSeqFile(key, last)
	f := s.files[key]
	if f == nil {
		p := s.path(key)
		nf, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			return fmt.Errorf("idemgrpc: file store: %w", err)
		}
		st, err := nf.Stat()
		if err == nil && st.Size() > int64(len(b)) {
			err = nf.Truncate(int64(len(b)))
		}
		if err == nil {
			_, err = nf.WriteAt(b, 0)
		}
		if err == nil {
			err = nf.Sync()
		}
		if err == nil {
			err = syncDir(s.dir)
		}
		if err != nil {
			nf.Close()
			return fmt.Errorf("idemgrpc: file store %s: %w", p, err)
		}
		s.files[key] = nf
		return nil
	}
	if _, err := f.WriteAt(b, 0); err != nil {
		return fmt.Errorf("idemgrpc: file store %s: %w", f.Name(), err)
	}
	if err := f.Sync(); err != nil {
		// After a failed fsync the page cache state is unknown: reopen
		// next time.
		f.Close()
		delete(s.files, key)
		return fmt.Errorf("idemgrpc: file store %s: fsync: %w", f.Name(), err)
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	return err
}

// Close closes the store's files.
func (s *FileStore) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	for _, f := range s.files {
		if err := f.Close(); err != nil && !errors.Is(err, io.EOF) {
			errs = append(errs, err)
		}
	}
	s.files = nil
	return errors.Join(errs...)
}
