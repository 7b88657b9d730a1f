package idemraft

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
)

// Options configure Wrap.
type Options struct {
	// Dir is this node's directory for the dedup set (required; created if
	// missing). It holds idem directories that idemraft owns and rebuilds
	// from raft's snapshot and log on every start: the raft log and
	// snapshot stores stay the application's. Wrap refuses a non-empty
	// directory it did not create, rather than delete what is there.
	Dir string
	// Engine tunes the dedup engine: memory (MemoryBudget, default 256 MiB,
	// or the parts it is shared among: CacheSize, IndexCacheSize,
	// IndexIngestBytes, IndexFilterBytes), CompactInterval, MaxIDLen,
	// MaxReplySize, Retention, CleanupInterval, Logger (SegmentSize,
	// CompactWALBytes and NoPreallocate are accepted and have no effect:
	// the engine writes no log). Every replica must use the same
	// Retention, MaxIDLen and MaxReplySize, since they decide replies.
	//
	// idemraft sets Clock (the time of the entry being applied), Ephemeral
	// (on: the engine writes no WAL, so Sync and SyncInterval have no
	// use), RelaxedClaims (on) and KeepSnapshots (none) itself: the dedup
	// set is derived state that raft rebuilds, so a log of it would
	// protect nothing (see the package documentation). Wrap refuses Clock,
	// Sync, SyncInterval, RelaxedClaims and KeepSnapshots when set, with
	// an error naming the field, rather than ignore them; Ephemeral is set
	// whatever it was. MaxEntries must be zero: capacity
	// eviction is timed by each node's engine, not by the log, so replicas
	// would disagree about which ids they still know. FS must be nil (the
	// operating system's).
	Engine idem.Options
	// Logger receives idemraft's own messages (a failed dedup engine, a
	// refused snapshot). Default: Engine.Logger, else discard.
	Logger *slog.Logger
}

// FSM wraps an application's raft.FSM with exactly-once handling of
// Command entries. It implements raft.FSM and raft.ConfigurationStore.
type FSM struct {
	app      raft.FSM
	batchApp raft.BatchingFSM // app, when it implements raft.BatchingFSM
	dir      string
	eopts    idem.Options
	logger   *slog.Logger
	lock     io.Closer

	// mu guards cur and closed: Apply, Snapshot and Lookup read them,
	// Restore and Close change them.
	mu     sync.RWMutex
	cur    *generation
	closed bool
	genSeq int

	// refMu guards the reference counts of generations and live.
	refMu sync.Mutex
	live  int // generations not yet closed

	now       atomic.Int64 // the clock: max log time so far (Unix ns; see logTime)
	lastIndex atomic.Uint64
	failed    atomic.Pointer[error]

	applied, duplicates, localDuplicates, refused, restores, snapshots atomic.Uint64
}

// generation is one idem directory under Dir. A new one is made by every
// Restore; the old one is closed and removed once no snapshot image of it
// is still being persisted.
type generation struct {
	e    *idem.Engine
	dir  string
	refs int
}

var openDirs sync.Map // absolute Dir -> struct{}: one FSM per Dir in a process

const markerName = "IDEMRAFT"

// Wrap returns fsm with exactly-once handling of Command entries added.
// Give the returned *FSM to raft.NewRaft in place of fsm.
//
// Wrap creates opts.Dir if missing and empties it of what an earlier run
// left: the dedup set is rebuilt from raft's snapshot and log (see the
// package documentation, "Restarts"). Close releases the directory.
func Wrap(fsm raft.FSM, opts *Options) (*FSM, error) {
	if fsm == nil {
		return nil, errors.New("idemraft: Wrap: nil FSM")
	}
	if opts == nil || opts.Dir == "" {
		return nil, errors.New("idemraft: Wrap: Options.Dir is required (this node's dedup directory)")
	}
	if err := checkEngineOptions(&opts.Engine); err != nil {
		return nil, err
	}
	dir, err := filepath.Abs(opts.Dir)
	if err != nil {
		return nil, fmt.Errorf("idemraft: Wrap: %w", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("idemraft: Wrap: %w", err)
	}
	if _, dup := openDirs.LoadOrStore(dir, struct{}{}); dup {
		return nil, fmt.Errorf("idemraft: Wrap %s: %w (another FSM of this process has it; Close it first)", dir, idem.ErrLocked)
	}
	f := &FSM{app: fsm, dir: dir}
	f.batchApp, _ = fsm.(raft.BatchingFSM)
	ok := false
	defer func() {
		if !ok {
			if f.lock != nil {
				f.lock.Close()
			}
			openDirs.Delete(dir)
		}
	}()
	lock, err := vfs.Default.Lock(filepath.Join(dir, "LOCK"))
	if err != nil {
		return nil, fmt.Errorf("idemraft: Wrap %s: %w: %v", dir, idem.ErrLocked, err)
	}
	f.lock = lock
	if err := resetDir(dir); err != nil {
		return nil, err
	}
	f.logger = opts.Logger
	if f.logger == nil {
		f.logger = opts.Engine.Logger
	}
	if f.logger == nil {
		f.logger = slog.New(slog.DiscardHandler)
	}
	f.eopts = opts.Engine
	f.eopts.Clock = f.clock
	// No log is needed (see the package documentation): the engine is
	// Ephemeral, as in idemcluster. It writes no WAL and fsyncs nothing;
	// its records go to its index as soon as they are appended, and the
	// index's ingests by bytes bound what it holds in memory.
	f.eopts.Ephemeral = true
	f.eopts.RelaxedClaims = true
	f.eopts.KeepSnapshots = 0 // no on-disk snapshots: raft's are the copies
	if f.eopts.Logger == nil {
		f.eopts.Logger = f.logger
	}
	if f.eopts.MaxReplySize <= 0 {
		f.eopts.MaxReplySize = 12 << 20 // the engine's default
	}
	g, err := f.openGeneration(nil)
	if err != nil {
		return nil, err
	}
	f.cur = g
	ok = true
	return f, nil
}

// checkEngineOptions refuses the engine options that idemraft sets itself
// or that would let replicas disagree, naming the field and its value.
func checkEngineOptions(o *idem.Options) error {
	bad := func(field string, v any, why string) error {
		return fmt.Errorf("idemraft: Wrap: Options.Engine.%s = %v: must be left unset: %s", field, v, why)
	}
	switch {
	case o.MaxEntries != 0:
		return bad("MaxEntries", o.MaxEntries, "capacity eviction is timed by each node, not by the log, so replicas would disagree about the ids they know")
	case o.FS != nil:
		return bad("FS", fmt.Sprintf("%T", o.FS), "idemraft's directory is on the operating system's file system")
	case o.Clock != nil:
		return bad("Clock", "a func", "idemraft's clock is the log time of the entry being applied (its AppendedAt), the same on every replica")
	case o.Sync != idem.SyncAlways: // the zero value: unset
		return bad("Sync", o.Sync, "idemraft's engine is idem.Ephemeral, with no log to sync (the raft log is what makes an entry durable)")
	case o.SyncInterval != 0:
		return bad("SyncInterval", o.SyncInterval, "idemraft's engine is idem.Ephemeral, with no log to sync")
	case o.RelaxedClaims:
		return bad("RelaxedClaims", true, "idemraft sets it (a claim never outlives its Apply)")
	case o.KeepSnapshots != 0:
		return bad("KeepSnapshots", o.KeepSnapshots, "raft's snapshots are the copies of the dedup set")
	}
	return nil
}

// resetDir removes what an earlier run left in dir (generations and
// temporary files), after checking that dir is idemraft's.
func resetDir(dir string) error {
	names, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("idemraft: Wrap: %w", err)
	}
	marked := false
	var foreign []string
	for _, n := range names {
		switch {
		case n.Name() == markerName:
			marked = true
		case n.Name() == "LOCK":
		case strings.HasPrefix(n.Name(), "gen-"), strings.HasPrefix(n.Name(), "tmp-"):
		default:
			foreign = append(foreign, n.Name())
		}
	}
	if !marked && len(names) > 1 || len(foreign) > 0 {
		if len(foreign) == 0 {
			foreign = []string{names[0].Name()}
			if foreign[0] == "LOCK" {
				foreign[0] = names[1].Name()
			}
		}
		return fmt.Errorf("idemraft: Wrap: %s is not an idemraft directory (it holds %q among %d entries); give an empty or new directory", dir, foreign[0], len(names))
	}
	for _, n := range names {
		if strings.HasPrefix(n.Name(), "gen-") || strings.HasPrefix(n.Name(), "tmp-") {
			if err := os.RemoveAll(filepath.Join(dir, n.Name())); err != nil {
				return fmt.Errorf("idemraft: Wrap: reset %s: %w", dir, err)
			}
		}
	}
	if !marked {
		msg := "This directory holds the dedup set of an idemraft FSM. It is rebuilt from the raft snapshot and log at every start.\n"
		if err := os.WriteFile(filepath.Join(dir, markerName), []byte(msg), 0o644); err != nil {
			return fmt.Errorf("idemraft: Wrap: %w", err)
		}
	}
	return nil
}

// openGeneration opens a new, empty generation, or, with r, restores one
// from the idem snapshot read from r.
func (f *FSM) openGeneration(r io.Reader) (*generation, error) {
	f.genSeq++
	dir := filepath.Join(f.dir, "gen-"+strconv.Itoa(f.genSeq))
	var e *idem.Engine
	var err error
	if r == nil {
		e, err = idem.Open(dir, &f.eopts)
	} else {
		e, err = idem.Restore(dir, r, &f.eopts)
	}
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	f.refMu.Lock()
	f.live++
	f.refMu.Unlock()
	return &generation{e: e, dir: dir, refs: 1}, nil
}

func (f *FSM) acquire(g *generation) {
	f.refMu.Lock()
	g.refs++
	f.refMu.Unlock()
}

// release drops a reference; the last one closes the engine and removes
// its directory, and once the FSM is closed and no generation is left,
// releases Dir.
func (f *FSM) release(g *generation) {
	f.refMu.Lock()
	g.refs--
	last := g.refs == 0
	f.refMu.Unlock()
	if !last {
		return
	}
	if err := g.e.Close(); err != nil {
		f.logger.Warn("idemraft: closing a dedup engine", "dir", g.dir, "err", err)
	}
	if err := os.RemoveAll(g.dir); err != nil {
		f.logger.Warn("idemraft: removing a dedup directory", "dir", g.dir, "err", err)
	}
	f.refMu.Lock()
	f.live--
	done := f.live == 0
	f.refMu.Unlock()
	if done {
		f.mu.RLock()
		closed := f.closed
		f.mu.RUnlock()
		if closed {
			f.lock.Close()
			openDirs.Delete(f.dir)
		}
	}
}

// clock is the engine's Options.Clock: the log time of the entry being
// applied (the largest seen so far, so it never goes back).
func (f *FSM) clock() time.Time { return time.Unix(0, f.now.Load()) }

// clockResolution is the resolution of the log clock: an entry's log time
// is its AppendedAt rounded down to the millisecond. Replicas must agree
// on it (it decides expiries and forgets), so it is frozen. It makes the
// entries of a batch that raft appended within one millisecond share a
// time, so that ApplyBatch commits them in one engine record (a record has
// one time; see ApplyBatch).
const clockResolution = time.Millisecond

// logTime is the entry's log time (Unix ns), or 0 if it has none: its
// AppendedAt truncated to clockResolution, as
// AppendedAt.Truncate(clockResolution).UnixNano() gives it, for every
// time (TestLogTimeIsTruncate): a millisecond divides a second, so
// Truncate only drops the nanoseconds of the second past the last whole
// millisecond (Nanosecond() % 1e6, which is never negative, whatever the
// year), and UnixNano is then that much less. It runs for every entry,
// and the arithmetic costs a few instructions where Truncate's general
// division cost a few tens of nanoseconds.
func logTime(l *raft.Log) int64 {
	t := l.AppendedAt
	if t.IsZero() {
		return 0
	}
	return t.UnixNano() - int64(t.Nanosecond()%int(clockResolution))
}

// tick advances the clock to the entry's log time. Apply runs on raft's
// FSM goroutine only, so the load and store do not race with each other;
// the atomic is for readers (the engine's background work, Lookup).
func (f *FSM) tick(l *raft.Log) {
	if t := logTime(l); t > f.now.Load() {
		f.now.Store(t)
	}
}

// Err returns the failure that stopped this FSM, or nil. After a failure
// of the dedup engine (a disk error) the FSM applies nothing more: every
// Command entry's Response carries the error and other entries return it,
// so the application's state stays a prefix of the log instead of
// diverging. Restart the node: Wrap rebuilds the dedup set from raft's
// snapshot and log. A successful Restore also clears it.
func (f *FSM) Err() error {
	if p := f.failed.Load(); p != nil {
		return *p
	}
	return nil
}

func (f *FSM) fail(idx uint64, err error) error {
	err = fmt.Errorf("idemraft: dedup engine failed at log index %d; this node applies nothing more until it is restarted: %w", idx, err)
	if f.failed.CompareAndSwap(nil, &err) {
		f.logger.Error("idemraft: FSM stopped", "index", idx, "err", err)
	}
	return f.Err()
}

// Apply implements raft.FSM. Entries that are not commands go to the
// wrapped FSM untouched. A command's request is begun in the dedup set at
// the entry's time; a new one runs the wrapped FSM's Apply with the
// operation as Log.Data and commits its result as the reply; a known one
// returns the stored reply. The result is a *Response.
func (f *FSM) Apply(l *raft.Log) any {
	f.mu.RLock()
	defer f.mu.RUnlock()
	var d decoded
	var derr error
	if IsCommand(l.Data) {
		d, derr = decodeCommand(l.Data)
	}
	return f.applyEntry(l, d, derr)
}

// applyEntry applies one LogCommand entry (d and derr: its decoding, if it
// is a command). The caller holds f.mu for reading.
func (f *FSM) applyEntry(l *raft.Log, d decoded, derr error) any {
	f.tick(l)
	defer f.lastIndex.Store(l.Index) // once applied
	isCmd := IsCommand(l.Data)
	if err := f.Err(); err != nil {
		if isCmd {
			return &Response{Err: err}
		}
		return err
	}
	if f.closed {
		err := f.fail(l.Index, idem.ErrClosed)
		return &Response{Err: err}
	}
	if !isCmd {
		return f.app.Apply(l)
	}
	if derr != nil {
		f.refused.Add(1)
		return &Response{Err: fmt.Errorf("%w (log index %d)", derr, l.Index)}
	}
	e := f.cur.e
	ctx := context.Background()
	if d.kind == kindForget {
		if err := e.Forget(ctx, d.before); err != nil {
			return &Response{Err: f.fail(l.Index, err)}
		}
		return &Response{}
	}
	res, err := e.Begin(ctx, d.req)
	if resp := f.answered(l.Index, res, err); resp != nil {
		return resp
	}
	entry := *l
	entry.Data = d.op
	out := f.app.Apply(&entry)
	env, resp := resultEnvelope(out, f.eopts.MaxReplySize)
	w := getEnvelopeWriter()
	w.write(env)
	err = res.Claim.Commit(ctx, w.buf.Bytes()) // the engine copies the reply
	putEnvelopeWriter(w)
	if err != nil {
		return &Response{Err: f.fail(l.Index, err)}
	}
	f.applied.Add(1)
	return &resp
}

// answered is the Response to a command that does not run, from what the
// engine's Begin (or Lookup) said of its request: the stored reply
// (Done), or the engine's refusal. It returns nil for a new request
// (Begin's Fresh, Lookup's Absent); an error of this node stops the FSM.
func (f *FSM) answered(idx uint64, res idem.Result, err error) *Response {
	if err != nil {
		if requestError(err) {
			f.refused.Add(1)
			return &Response{Err: err}
		}
		return &Response{Err: f.fail(idx, err)}
	}
	switch res.Status {
	case idem.Fresh, idem.Absent:
		return nil
	case idem.Done:
		env, err := decodeEnvelope(res.Reply)
		if err != nil {
			return &Response{Err: f.fail(idx, err)}
		}
		f.duplicates.Add(1)
		return env.response(true)
	}
	// Claims never outlive an Apply (or ApplyBatch), so nothing can be in flight.
	return &Response{Err: f.fail(idx, fmt.Errorf("unexpected %v for a request (a claim outlived its Apply)", res.Status))}
}

// requestError reports whether err is the engine's answer to the request
// itself (the same on every replica), not a failure of this node.
func requestError(err error) bool {
	var gap *idem.SequenceGapError
	return errors.As(err, &gap) || errors.Is(err, idem.ErrConflict) ||
		errors.Is(err, idem.ErrAlreadyCommitted) || errors.Is(err, idem.ErrInvalidRequest)
}

// StoreConfiguration implements raft.ConfigurationStore: it passes the
// configuration to the wrapped FSM if that implements it too.
func (f *FSM) StoreConfiguration(index uint64, c raft.Configuration) {
	if cs, ok := f.app.(raft.ConfigurationStore); ok {
		cs.StoreConfiguration(index, c)
	}
}

// Lookup answers a request from this node's dedup set without the log: a
// request the set holds as committed, as the engine's Lookup says (the
// fingerprint checked exactly as Begin checks it), gives its stored reply
// (Duplicate set) and true, and counts in Stats.LocalDuplicates. Anything
// else (unknown, another fingerprint, a sequence number without a kept
// reply) gives false: send it through the log. Safe on any node, leader
// or not: see the package documentation, "Answering from the local set".
func (f *FSM) Lookup(req idem.Request) (*Response, bool) {
	if checkRequest(req) != nil {
		return nil, false
	}
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.closed || f.Err() != nil {
		return nil, false
	}
	res, err := f.cur.e.Lookup(context.Background(), idem.Request{
		Scope: req.Scope, ID: req.ID, Client: req.Client, Seq: req.Seq, Fingerprint: req.Fingerprint,
	})
	if err != nil || res.Status != idem.Done {
		return nil, false
	}
	env, err := decodeEnvelope(res.Reply)
	if err != nil {
		return nil, false
	}
	f.localDuplicates.Add(1)
	return env.response(true), true
}

// Stats are counters of one FSM since Wrap.
type Stats struct {
	Applied    uint64 // commands that ran the wrapped FSM
	Duplicates uint64 // commands in the log answered with a stored reply (every replica counts them)
	// LocalDuplicates counts requests answered with a stored reply from
	// this node's local set by Lookup (and so by Submit, Handler and
	// Client), without a log append. Only the node that answered counts
	// them; a duplicate is counted in Duplicates or here, never in both.
	LocalDuplicates uint64
	Refused         uint64 // commands refused (conflict, gap, already committed, invalid)
	Snapshots       uint64 // snapshots persisted
	Restores        uint64 // snapshots restored
	LastIndex       uint64 // last log index applied
	Time            time.Time
	Engine          idem.Stats
}

// Stats returns the FSM's counters and its dedup engine's.
func (f *FSM) Stats() Stats {
	s := Stats{
		Applied: f.applied.Load(), Duplicates: f.duplicates.Load(), LocalDuplicates: f.localDuplicates.Load(), Refused: f.refused.Load(),
		Snapshots: f.snapshots.Load(), Restores: f.restores.Load(), LastIndex: f.lastIndex.Load(), Time: f.clock(),
	}
	f.mu.RLock()
	if !f.closed {
		s.Engine = f.cur.e.Stats()
	}
	f.mu.RUnlock()
	return s
}

// Close closes the dedup engine and releases Dir (once no snapshot of it
// is still being persisted: shut raft down first). Safe to call twice.
// It does not close the wrapped FSM.
func (f *FSM) Close() error {
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return nil
	}
	f.closed = true
	g := f.cur
	f.mu.Unlock()
	f.release(g)
	return nil
}
