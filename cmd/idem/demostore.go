package main

// The demo's world outside the engine: a ledger, where the side effect of a
// request is recorded (think: the payments table the server writes), and a
// client journal, where the simulated clients write down the replies they
// received. Both are append-only JSON lines, fsynced, so that after the
// server is killed they say exactly what happened. The in-memory variant
// serves the in-process fallback, which crashes a vfs.MemFS instead of a
// process.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// ledgerLine is one executed side effect.
type ledgerLine struct {
	ID    string `json:"id"`
	Reply string `json:"reply"`
}

// journalEvent is what a client saw.
type journalEvent struct {
	// Kind: "reply" (a reply was received), "lost" (a reply was lost on the
	// way back; the client will retry), "conflict" (a buggy retry was
	// refused with ErrConflict), "accepted" (a buggy retry was not refused:
	// a failed check).
	Kind   string `json:"kind"`
	ID     string `json:"id"`
	Reply  string `json:"reply,omitempty"`
	Replay bool   `json:"replay,omitempty"` // the engine returned the stored reply; nothing ran
	Phase  string `json:"phase"`
}

// demoStore holds the ledger and the journal.
type demoStore interface {
	// execute is the side effect: it records id in the ledger, durably,
	// and returns the reply it produced.
	execute(id string) (reply string, err error)
	// record appends a journal event; "reply" events are durable when it
	// returns.
	record(ev journalEvent) error
	ledger() ([]ledgerLine, error)
	journal() ([]journalEvent, error)
}

// errCrashed is returned by the in-memory store once the simulated process
// has crashed: nothing it does any more can reach the world.
var errCrashed = errors.New("the simulated server crashed")

func replyFor(n int, id string) string { return fmt.Sprintf("receipt #%d for %s", n, id) }

// fileStore keeps the ledger and the journal in files.
type fileStore struct {
	mu      sync.Mutex // guards ledgerF, lines, executed
	ledgerF *os.File
	lines   int // ledger lines, this process and earlier ones
	// executed counts the side effects run by this process; at crashAt the
	// process kills itself (SIGKILL), right after the ledger write and
	// before the engine hears of it.
	executed int
	crashAt  int
	onCrash  func()

	jmu      sync.Mutex // guards journalF
	journalF *os.File

	ledgerPath, journalPath string
}

func openFileStore(root string) (*fileStore, []string, error) {
	s := &fileStore{ledgerPath: filepath.Join(root, "ledger.jsonl"), journalPath: filepath.Join(root, "journal.jsonl")}
	var notes []string
	var err error
	var note string
	if s.ledgerF, s.lines, note, err = openLines(s.ledgerPath); err != nil {
		return nil, nil, err
	}
	if note != "" {
		notes = append(notes, note)
	}
	if s.journalF, _, note, err = openLines(s.journalPath); err != nil {
		s.ledgerF.Close()
		return nil, nil, err
	}
	if note != "" {
		notes = append(notes, note)
	}
	return s, notes, nil
}

// openLines opens a JSON-lines file for appending. A last line without its
// newline (a write cut by the crash) is cut off, so the next line starts
// clean; the note says so.
func openLines(path string) (*os.File, int, string, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, 0, "", err
	}
	b, err := os.ReadFile(path)
	if err != nil {
		f.Close()
		return nil, 0, "", err
	}
	note := ""
	keep := bytes.LastIndexByte(b, '\n') + 1
	if keep < len(b) {
		if err := f.Truncate(int64(keep)); err != nil {
			f.Close()
			return nil, 0, "", err
		}
		note = fmt.Sprintf("%s: cut %d bytes of a line torn by the crash", filepath.Base(path), len(b)-keep)
	}
	if _, err := f.Seek(int64(keep), 0); err != nil {
		f.Close()
		return nil, 0, "", err
	}
	return f, bytes.Count(b[:keep], []byte{'\n'}), note, nil
}

func (s *fileStore) close() {
	s.ledgerF.Close()
	s.journalF.Close()
}

func (s *fileStore) execute(id string) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	reply := replyFor(s.lines+1, id)
	if err := appendLine(s.ledgerF, ledgerLine{ID: id, Reply: reply}); err != nil {
		return "", err
	}
	s.lines++
	s.executed++
	if s.crashAt > 0 && s.executed == s.crashAt && s.onCrash != nil {
		s.onCrash() // does not return
	}
	return reply, nil
}

func (s *fileStore) record(ev journalEvent) error {
	s.jmu.Lock()
	defer s.jmu.Unlock()
	b, err := json.Marshal(ev)
	if err != nil {
		return err
	}
	if _, err := s.journalF.Write(append(b, '\n')); err != nil {
		return err
	}
	if ev.Kind == "reply" {
		return s.journalF.Sync()
	}
	return nil
}

func appendLine(f *os.File, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if _, err := f.Write(append(b, '\n')); err != nil {
		return err
	}
	return f.Sync()
}

func (s *fileStore) ledger() ([]ledgerLine, error) {
	return readLines[ledgerLine](s.ledgerPath)
}

func (s *fileStore) journal() ([]journalEvent, error) {
	return readLines[journalEvent](s.journalPath)
}

func readLines[T any](path string) ([]T, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []T
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		var v T
		if err := json.Unmarshal(sc.Bytes(), &v); err != nil {
			return nil, fmt.Errorf("%s line %d: %v", filepath.Base(path), n, err)
		}
		out = append(out, v)
	}
	return out, sc.Err()
}

// killSelf ends the process the hard way: no deferred function, no Close,
// no flush. What is on disk is what a real crash of the process leaves.
func killSelf() {
	if p, err := os.FindProcess(os.Getpid()); err == nil {
		_ = p.Kill() // SIGKILL on Unix
	}
	for {
		time.Sleep(time.Hour) // the signal is on its way
	}
}

// memStore is the in-memory ledger and journal of the in-process fallback.
type memStore struct {
	mu       sync.Mutex // guards everything below
	lines    []ledgerLine
	events   []journalEvent
	executed int
	crashAt  int
	onCrash  func() // called with mu held at the crash point
	crashed  bool
}

func (s *memStore) execute(id string) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.crashed {
		return "", errCrashed
	}
	reply := replyFor(len(s.lines)+1, id)
	s.lines = append(s.lines, ledgerLine{ID: id, Reply: reply})
	s.executed++
	if s.crashAt > 0 && s.executed == s.crashAt {
		s.crashed = true
		if s.onCrash != nil {
			s.onCrash()
		}
		return "", errCrashed // the reply never leaves the crashed process
	}
	return reply, nil
}

func (s *memStore) record(ev journalEvent) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.crashed {
		return errCrashed
	}
	s.events = append(s.events, ev)
	return nil
}

// restart ends the crash: the next process uses the store again.
func (s *memStore) restart() {
	s.mu.Lock()
	s.crashed, s.crashAt, s.onCrash = false, 0, nil
	s.mu.Unlock()
}

func (s *memStore) ledger() ([]ledgerLine, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]ledgerLine(nil), s.lines...), nil
}

func (s *memStore) journal() ([]journalEvent, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]journalEvent(nil), s.events...), nil
}
