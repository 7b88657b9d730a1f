package idemcluster

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"maps"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
	"github.com/vmihailenco/msgpack/v5"
)

// Command kinds, the first field of every entry the cluster appends.
const (
	cmdBegin byte = iota + 1
	cmdCommit
	cmdAbort
	cmdAck
	cmdAdvance
	cmdForget
	cmdMember
	cmdBatch   // several begin, commit and abort commands in one entry (Cmds), applied in order
	cmdRemoved // node Node is being removed (appended before raft's removal): a retried Remove is answered as done
)

// claimKey names a request's key (not its sequence number): a scope and an
// id, or a scope and a client.
type claimKey struct {
	Scope  string `msgpack:"s"`
	ID     []byte `msgpack:"i,omitempty"`
	Client string `msgpack:"c,omitempty"`
}

// String is the key's name in the claims table (and in snapshots, which
// hold the table: the format is frozen): "c<len(scope)>:<scope>/<client>"
// or "i<len(scope)>:<scope>/<id in lowercase hex>".
func (k claimKey) String() string {
	return string(k.appendName(make([]byte, 0, 8+len(k.Scope)+len(k.Client)+2*len(k.ID))))
}

// appendName appends the key's name (String) to b.
func (k claimKey) appendName(b []byte) []byte {
	if k.Client != "" {
		b = append(b, 'c')
	} else {
		b = append(b, 'i')
	}
	b = strconv.AppendInt(b, int64(len(k.Scope)), 10)
	b = append(b, ':')
	b = append(b, k.Scope...)
	b = append(b, '/')
	if k.Client != "" {
		b = append(b, k.Client...)
	} else {
		b = hex.AppendEncode(b, k.ID)
	}
	return b
}

func keyOf(r *idem.Request) claimKey {
	return claimKey{Scope: r.Scope, ID: r.ID, Client: r.Client}
}

// command is one raft entry's payload (msgpack).
type command struct {
	Op     byte           `msgpack:"op"`
	Req    *wireRequest   `msgpack:"req,omitempty"`
	Owner  string         `msgpack:"owner,omitempty"`
	Token  []byte         `msgpack:"tok,omitempty"`
	Key    claimKey       `msgpack:"key"`
	Seq    uint64         `msgpack:"seq,omitempty"`
	Reply  []byte         `msgpack:"reply,omitempty"`
	Adv    []idem.Advance `msgpack:"adv,omitempty"`
	IDs    [][]byte       `msgpack:"ids,omitempty"`
	Before int64          `msgpack:"before,omitempty"`
	Node   string         `msgpack:"node,omitempty"`
	Addr   string         `msgpack:"addr,omitempty"`
	Cmds   []*command     `msgpack:"cmds,omitempty"` // cmdBatch
}

// wireRequest is idem.Request as logged.
type wireRequest struct {
	Scope       string   `msgpack:"s"`
	ID          []byte   `msgpack:"i,omitempty"`
	Client      string   `msgpack:"c,omitempty"`
	Seq         uint64   `msgpack:"q,omitempty"`
	Fingerprint []byte   `msgpack:"f,omitempty"`
	Acked       [][]byte `msgpack:"a,omitempty"`
	TTL         int64    `msgpack:"t,omitempty"`
	KeepReplies int      `msgpack:"kr,omitempty"`
	KeepFor     int64    `msgpack:"kf,omitempty"`
}

func toWire(r idem.Request) *wireRequest {
	return &wireRequest{Scope: r.Scope, ID: r.ID, Client: r.Client, Seq: r.Seq, Fingerprint: r.Fingerprint, Acked: r.Acked, TTL: int64(r.TTL),
		KeepReplies: r.KeepReplies, KeepFor: int64(r.KeepRepliesFor)}
}

func (w *wireRequest) request() idem.Request {
	return idem.Request{Scope: w.Scope, ID: w.ID, Client: w.Client, Seq: w.Seq, Fingerprint: w.Fingerprint, Acked: w.Acked, TTL: time.Duration(w.TTL),
		KeepReplies: w.KeepReplies, KeepRepliesFor: time.Duration(w.KeepFor)}
}

// applied is what Apply returns to the leader's caller.
type applied struct {
	res   idem.Result
	token []byte
	owner string
	err   error
	subs  []*applied // a cmdBatch entry's answers, one per command
}

// held is a claim the cluster handed out: its owner, its token and the
// engine's claim. It is replicated state: every node holds the same table,
// and snapshots carry it.
type held struct {
	Key         claimKey `msgpack:"k"`
	Owner       string   `msgpack:"o"`
	Token       []byte   `msgpack:"t"`
	Seq         uint64   `msgpack:"q"`
	Fingerprint []byte   `msgpack:"f,omitempty"`
	ClaimedAt   int64    `msgpack:"at"`
	LeaseUntil  int64    `msgpack:"lease"`
	claim       *idem.Claim
}

// finished records the outcome of a token's commit or abort for one lease
// of log time, so that a retry after a lost answer gets the same outcome.
type finished struct {
	Committed bool  `msgpack:"c"`
	At        int64 `msgpack:"at"`
}

// finishedTable holds the finished tokens. The client's tokens are 16
// bytes: those are kept by value (a map without pointers, which the
// garbage collector does not scan, and no string allocated per token; the
// table holds every token finished within a lease of log time, hundreds
// of thousands of them under load); any other length in a map by string.
type finishedTable struct {
	by16  map[[16]byte]finished
	other map[string]finished
}

// newFinishedTable is a table holding m's tokens (a snapshot's).
func newFinishedTable(m map[string]finished) finishedTable {
	t := finishedTable{by16: map[[16]byte]finished{}, other: map[string]finished{}}
	for k, v := range m {
		t.put([]byte(k), v)
	}
	return t
}

func (t *finishedTable) get(token []byte) (finished, bool) {
	if len(token) == 16 {
		fin, ok := t.by16[[16]byte(token)]
		return fin, ok
	}
	fin, ok := t.other[string(token)]
	return fin, ok
}

func (t *finishedTable) put(token []byte, fin finished) {
	if len(token) == 16 {
		t.by16[[16]byte(token)] = fin
		return
	}
	t.other[string(token)] = fin
}

func (t *finishedTable) len() int { return len(t.by16) + len(t.other) }

// purge drops the tokens finished before cut.
func (t *finishedTable) purge(cut int64) {
	for k, fin := range t.by16 {
		if fin.At < cut {
			delete(t.by16, k)
		}
	}
	for k, fin := range t.other {
		if fin.At < cut {
			delete(t.other, k)
		}
	}
}

// copyTo adds the table's tokens to m (a snapshot's, keyed by the token's
// bytes as a string, whatever its length: the format is unchanged).
func (t *finishedTable) copyTo(m map[string]finished) {
	for k, v := range t.by16 {
		m[string(k[:])] = v
	}
	for k, v := range t.other {
		m[k] = v
	}
}

// fsm is the cluster's state machine: an idem engine whose clock is the
// log's time, the table of claims handed out (with their owners and
// tokens), the recently finished tokens, the members' gRPC addresses and
// the ids of the nodes removed.
//
// Raft calls Apply, ApplyBatch, Snapshot and Restore on one goroutine (the
// FSM goroutine); reads come from the gRPC handlers concurrently.
type fsm struct {
	dir    string
	eopts  idem.Options
	lease  time.Duration
	now    atomic.Int64                  // the largest AppendedAt applied (Unix ns): the engine's clock
	index  atomic.Uint64                 // the last entry applied
	notify atomic.Pointer[chan struct{}] // closed and replaced after every applied batch (readers wait on it)

	mu      sync.RWMutex // guards e and gen: Restore and close replace them (write lock); applies and reads use them (read lock)
	e       *idem.Engine
	gen     int
	rUnlock func() // mu.RUnlock, made once (engine returns it; a method value made per call is an allocation)

	// tmu guards holds, finished, members and removed against readers on other
	// goroutines. Only the FSM goroutine writes them (under tmu); it reads
	// them without tmu.
	tmu       sync.Mutex
	holds     map[string]*held
	finished  finishedTable
	members   map[string]string // node id -> gRPC address
	removed   map[string]int64  // node id -> log time (Unix ns) of the latest removal asked for it (cmdRemoved); never shrinks
	lastPurge int64             // log time of the last purge of finished (FSM goroutine only)

	// seg is the segment ApplyBatch fills (FSM goroutine only), kept so
	// that its items and its table of touched names are reused from one
	// batch to the next instead of grown again for each.
	seg segment
}

func newFSM(dir string, eopts idem.Options) (*fsm, error) {
	f := &fsm{dir: dir, eopts: eopts}
	f.rUnlock = f.mu.RUnlock
	ch := make(chan struct{})
	f.notify.Store(&ch)
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	f.eopts.Clock = f.clock
	// The raft log is the durable copy: the engine writes no log of its
	// own (no WAL, no fsync; SyncInterval has no use there).
	f.eopts.Ephemeral = true
	f.eopts.SyncInterval = 0
	f.eopts.RelaxedClaims = true
	f.eopts.KeepSnapshots = -1
	f.lease = f.eopts.Lease
	if f.lease <= 0 {
		f.lease = time.Hour
		f.eopts.Lease = f.lease
	}
	e, err := idem.Open(f.genDir(0), &f.eopts)
	if err != nil {
		return nil, err
	}
	f.e = e
	f.holds = map[string]*held{}
	f.finished = newFinishedTable(nil)
	f.seg.seed = maphash.MakeSeed()
	f.members = map[string]string{}
	f.removed = map[string]int64{}
	return f, nil
}

func (f *fsm) genDir(g int) string { return filepath.Join(f.dir, fmt.Sprintf("gen-%06d", g)) }

func (f *fsm) clock() time.Time { return time.Unix(0, f.now.Load()) }

func (f *fsm) close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.e == nil {
		return nil
	}
	err := f.e.Close()
	f.e = nil
	return err
}

// engine returns the current engine for a read (under mu's read lock, which
// the caller releases with the returned func).
func (f *fsm) engine() (*idem.Engine, func(), error) {
	f.mu.RLock()
	if f.e == nil {
		f.mu.RUnlock()
		return nil, nil, idem.ErrClosed
	}
	return f.e, f.rUnlock, nil
}

// member is the gRPC address of node id, when the members table has it.
func (f *fsm) member(id string) string {
	f.tmu.Lock()
	defer f.tmu.Unlock()
	return f.members[id]
}

// wasRemoved reports whether a removal of node id was recorded (cmdRemoved).
func (f *fsm) wasRemoved(id string) bool {
	f.tmu.Lock()
	defer f.tmu.Unlock()
	_, ok := f.removed[id]
	return ok
}

// waitApplied blocks until index is applied or ctx ends.
func (f *fsm) waitApplied(ctx context.Context, index uint64) error {
	for {
		ch := *f.notify.Load() // before reading index: an apply stores index, then swaps and closes
		if f.index.Load() >= index {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// applied marks index applied and wakes the readers waiting for it.
func (f *fsm) applied(index uint64) {
	f.index.Store(index)
	ch := make(chan struct{})
	close(*f.notify.Swap(&ch))
}

// Apply applies one entry (raft calls ApplyBatch; Apply is the FSM
// interface's single form of it).
func (f *fsm) Apply(l *raft.Log) any {
	return f.ApplyBatch([]*raft.Log{l})[0]
}

var _ raft.BatchingFSM = (*fsm)(nil)

// ApplyBatch applies a batch of committed entries (raft.BatchingFSM): the
// claims, commits and aborts of many clients go to the engine as one
// idem.Batch (one engine record and one pass per run), with exactly the
// per-entry results of applying the entries one at a time.
//
// The answers must not depend on how raft cut the log into batches (each
// node cuts its own), so a batch is run in segments, each equivalent to
// its entries applied in order:
//   - a segment's entries share one log time (the engine's clock): an
//     entry appended later than the segment's time starts a new segment;
//   - the table of claims and finished tokens is consulted when an entry
//     is added to the segment, so an entry whose key (or token, or a key it
//     advances) an earlier entry of the segment touched starts a new one;
//   - every other command (ack, advance, forget, member) is applied alone.
func (f *fsm) ApplyBatch(logs []*raft.Log) []any {
	out := make([]any, len(logs))
	if len(logs) == 0 {
		return out
	}
	f.mu.RLock()
	defer f.mu.RUnlock()
	defer f.applied(logs[len(logs)-1].Index)
	if f.e == nil {
		for i := range out {
			out[i] = &applied{err: idem.ErrClosed}
		}
		return out
	}
	s := &f.seg
	s.f = f
	for i, l := range logs {
		if t := l.AppendedAt.UnixNano(); !l.AppendedAt.IsZero() && t > f.now.Load() {
			s.run() // the segment so far ran at the earlier time
			f.now.Store(t)
		}
		if l.Type != raft.LogCommand {
			continue
		}
		a := &applied{}
		out[i] = a
		c, err := decodeCommand(l.Data)
		if err != nil {
			a.err = fmt.Errorf("%w: idemcluster: undecodable entry %d: %v", idem.ErrInvalidRequest, l.Index, err)
			continue
		}
		if c.Op != cmdBatch {
			s.command(a, c, l.Index)
			continue
		}
		a.subs = make([]*applied, len(c.Cmds))
		subs := make([]applied, len(c.Cmds)) // one allocation for the batch's answers
		for j, sub := range c.Cmds {
			a.subs[j] = &subs[j]
			if sub == nil || sub.Op == cmdBatch {
				a.subs[j].err = fmt.Errorf("%w: idemcluster: entry %d: command %d of a batch is empty or a batch", idem.ErrInvalidRequest, l.Index, j)
				continue
			}
			s.command(a.subs[j], sub, l.Index)
		}
	}
	s.run()
	f.purgeFinished()
	return out
}

// command adds c to the segment (a begin, a commit, an abort) or applies
// it alone after running the segment; its answer goes to a.
func (s *segment) command(a *applied, c *command, index uint64) {
	switch c.Op {
	case cmdBegin:
		s.begin(a, c)
	case cmdCommit, cmdAbort:
		s.finish(a, c)
	default:
		s.run()
		*a = *s.f.applyAlone(c, index)
	}
}

// applyAlone applies a command that does not go through a batch.
func (f *fsm) applyAlone(c *command, index uint64) *applied {
	ctx := context.Background()
	switch c.Op {
	case cmdAck:
		return &applied{err: f.e.Ack(ctx, c.Key.Scope, c.IDs...)}
	case cmdAdvance:
		return &applied{err: f.e.Advance(ctx, c.Adv...)}
	case cmdForget:
		return &applied{err: f.e.Forget(ctx, time.Unix(0, c.Before))}
	case cmdMember:
		f.tmu.Lock()
		if c.Addr == "" {
			delete(f.members, c.Node)
		} else {
			f.members[c.Node] = c.Addr
		}
		f.tmu.Unlock()
		return &applied{}
	case cmdRemoved:
		if c.Node == "" {
			return &applied{err: fmt.Errorf("%w: idemcluster: a removal without a node id at entry %d", idem.ErrInvalidRequest, index)}
		}
		f.tmu.Lock()
		f.removed[c.Node] = f.now.Load()
		f.tmu.Unlock()
		return &applied{}
	}
	return &applied{err: fmt.Errorf("%w: idemcluster: unknown command %d at entry %d", idem.ErrInvalidRequest, c.Op, index)}
}

// finishedOK reports the recorded outcome of token, if it finished within
// one lease of log time (older outcomes are forgotten: a decision that
// depends only on the log, whenever purgeFinished runs).
func (f *fsm) finishedOK(token []byte) (finished, bool) {
	fin, ok := f.finished.get(token)
	if !ok || fin.At < f.now.Load()-int64(f.lease) {
		return finished{}, false
	}
	return fin, true
}

// purgeFinished drops the finished tokens older than one lease of log
// time, at most once per tenth of a lease (finishedOK ignores them
// already).
func (f *fsm) purgeFinished() {
	now := f.now.Load()
	if f.finished.len() < 1024 || now-f.lastPurge < int64(f.lease)/10 {
		return
	}
	f.lastPurge = now
	cut := now - int64(f.lease)
	f.tmu.Lock()
	defer f.tmu.Unlock()
	f.finished.purge(cut)
}

// segment is the part of a raft batch collected into one engine batch.
type segment struct {
	f     *fsm
	b     idem.Batch
	items []segItem
	// touched holds the hashes of the names (claim keys, "t:"+token) the
	// segment's entries touched. A hash keeps the names' strings from
	// being built for every command on every node; two names of one hash
	// only start a new segment early, which changes no answer (each
	// segment is its entries applied one by one).
	touched map[uint64]struct{}
	seed    maphash.Seed // of touched's hashes (the node's own)
	name    []byte       // reused to hash a name
	// res receives the batch's results (idem.RunAppender), reused from
	// segment to segment and cleared after each: it holds no claim, reply
	// or error between them.
	res []idem.BatchResult
}

// maxReusedTouched is the most names a segment's table of touched names
// may have held to be cleared and reused for the next segment.
const maxReusedTouched = 1024

// maxReusedResults bounds the results buffer a segment keeps for the
// next (a raft batch's largest segments; a larger one is dropped).
const maxReusedResults = 4096

// segItem is a command of the segment waiting for its batch item's result.
type segItem struct {
	a   *applied // the command's answer, set when the batch ran
	c   *command
	req idem.Request // begin
	key string
	h   *held // commit, abort
}

// touch reports whether any of names was touched by the segment so far;
// if so it runs the segment first. Then it marks them.
func (s *segment) touch(names ...uint64) {
	if s.touched == nil {
		s.touched = map[uint64]struct{}{}
	}
	for _, n := range names {
		if _, ok := s.touched[n]; ok {
			s.run() // clears touched
			break
		}
	}
	for _, n := range names {
		s.touched[n] = struct{}{}
	}
}

// keyName is the hash of k's name in touched.
func (s *segment) keyName(k claimKey) uint64 {
	s.name = k.appendName(s.name[:0])
	return maphash.Bytes(s.seed, s.name)
}

// tokenName is the hash of a token's name ("t:" and the token: no claim
// key starts so) in touched.
func (s *segment) tokenName(token []byte) uint64 {
	s.name = append(append(s.name[:0], "t:"...), token...)
	return maphash.Bytes(s.seed, s.name)
}

func (s *segment) batch() idem.Batch {
	if s.b == nil {
		s.b = s.f.e.NewBatch()
	}
	return s.b
}

func (s *segment) begin(a *applied, c *command) {
	f := s.f
	if c.Req == nil || len(c.Token) == 0 {
		*a = applied{err: fmt.Errorf("%w: idemcluster: begin without a request or a token", idem.ErrInvalidRequest)}
		return
	}
	req := c.Req.request()
	k := keyOf(&req).String()
	s.touch(s.keyName(keyOf(&req)), s.tokenName(c.Token))
	ctx := context.Background()
	// A retry of the same Begin (a lost answer, a leader change) gets its
	// own claim back, not InFlight against itself.
	if h := f.holds[k]; h != nil && h.Owner == c.Owner && string(h.Token) == string(c.Token) && h.Seq == req.Seq {
		if r, err := f.e.Lookup(ctx, req); err == nil && r.Status == idem.InFlight && !r.LeaseUntil.Before(f.clock()) {
			*a = applied{res: idem.Result{Status: idem.Fresh, LeaseUntil: h.claim.LeaseUntil(), Seq: req.Seq}, token: h.Token, owner: h.Owner}
			return
		}
	}
	if fin, ok := f.finishedOK(c.Token); ok && fin.Committed {
		// The Begin's claim was committed already (the Begin's answer was
		// lost and the owner went on): answer as a retry would.
		r, err := f.e.Lookup(ctx, req)
		*a = applied{res: r, err: err}
		return
	}
	s.batch().Begin(req)
	s.items = append(s.items, segItem{a: a, c: c, req: req, key: k})
}

func (s *segment) finish(a *applied, c *command) {
	f := s.f
	k := c.Key.String()
	var buf [4]uint64
	names := append(buf[:0], s.keyName(c.Key), s.tokenName(c.Token))
	for _, a := range c.Adv {
		names = append(names, s.keyName(claimKey{Scope: a.Scope, Client: a.Client}))
	}
	s.touch(names...)
	h := f.holds[k]
	if h == nil || string(h.Token) != string(c.Token) || h.Seq != c.Seq {
		if fin, ok := f.finishedOK(c.Token); ok && fin.Committed == (c.Op == cmdCommit) {
			*a = applied{} // a retry of a finish whose answer was lost
			return
		}
		*a = applied{err: fmt.Errorf("%w: idemcluster: no claim of %s with this token (taken over after its lease, or finished)", idem.ErrLeaseLost, k)}
		return
	}
	if c.Op == cmdCommit {
		s.batch().Commit(h.claim, c.Reply, c.Adv...)
	} else {
		s.batch().Abort(h.claim)
	}
	s.items = append(s.items, segItem{a: a, c: c, key: k, h: h})
}

// run runs the segment's batch and records its results in the tables.
func (s *segment) run() {
	if len(s.touched) > maxReusedTouched {
		s.touched = nil // clearing a map costs its capacity: start a small one
	}
	clear(s.touched)
	if s.b == nil {
		return
	}
	b, items := s.b, s.items
	s.b = nil
	defer func() {
		clear(items) // drop the commands and answers: the slice is reused
		s.items = items[:0]
	}()
	f := s.f
	var res []idem.BatchResult
	var err error
	if ra, ok := b.(idem.RunAppender); ok {
		res, err = ra.AppendRun(context.Background(), s.res[:0])
		defer func() {
			clear(res)
			if cap(res) <= maxReusedResults {
				s.res = res[:0]
			} else {
				s.res = nil
			}
		}()
	} else {
		res, err = b.Run(context.Background())
	}
	if err == nil && len(res) != len(items) {
		err = fmt.Errorf("idemcluster: the engine answered %d of a batch of %d", len(res), len(items))
	}
	if err != nil {
		for _, it := range items {
			*it.a = applied{err: err}
		}
		return
	}
	now := f.now.Load()
	f.tmu.Lock()
	defer f.tmu.Unlock()
	for j, it := range items {
		r, err := res[j].Result, res[j].Err
		c := it.c
		if c.Op == cmdBegin {
			if err != nil || r.Status != idem.Fresh {
				*it.a = applied{res: r, err: err}
				continue
			}
			f.holds[it.key] = &held{Key: keyOf(&it.req), Owner: c.Owner, Token: c.Token, Seq: it.req.Seq, Fingerprint: it.req.Fingerprint,
				ClaimedAt: now, LeaseUntil: r.LeaseUntil.UnixNano(), claim: r.Claim}
			r.Claim = nil
			*it.a = applied{res: r, token: c.Token, owner: c.Owner}
			continue
		}
		if errors.Is(err, idem.ErrInvalidRequest) || errors.Is(err, idem.ErrInFlight) {
			*it.a = applied{err: err} // nothing written: the claim stays open
			continue
		}
		delete(f.holds, it.key)
		if err == nil {
			f.finished.put(c.Token, finished{Committed: c.Op == cmdCommit, At: now})
		}
		*it.a = applied{err: err}
	}
}

// inDoubt lists the claims the cluster holds (every claim not yet
// committed or aborted: across a fleet, any of them may be an owner's that
// died) whose scope starts with prefix and, when owner is set, that owner
// holds, in key order.
func (f *fsm) inDoubt(prefix, owner string) []held {
	f.tmu.Lock()
	defer f.tmu.Unlock()
	var out []held
	for _, h := range f.holds {
		if (owner != "" && h.Owner != owner) || !strings.HasPrefix(h.Key.Scope, prefix) {
			continue
		}
		out = append(out, *h)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key.String() < out[j].Key.String() })
	return out
}

// snapshotState is what a raft snapshot carries beside the engine's image.
type snapshotState struct {
	Now      int64               `msgpack:"now"`
	Index    uint64              `msgpack:"index,omitempty"` // the last entry applied (absent in snapshots of older nodes)
	Holds    map[string]*held    `msgpack:"holds"`
	Finished map[string]finished `msgpack:"finished"`
	Members  map[string]string   `msgpack:"members"`
	Removed  map[string]int64    `msgpack:"removed,omitempty"` // the removed nodes' ids (absent in snapshots of older nodes)
}

// Snapshot captures the state at the last applied entry (raft calls it on
// the FSM goroutine, between batches).
func (f *fsm) Snapshot() (raft.FSMSnapshot, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if f.e == nil {
		return nil, idem.ErrClosed
	}
	img, err := f.e.SnapshotImage(context.Background())
	if err != nil {
		return nil, err
	}
	st := snapshotState{Now: f.now.Load(), Index: f.index.Load(), Holds: map[string]*held{}, Finished: map[string]finished{}, Members: map[string]string{}}
	for k, h := range f.holds {
		c := *h
		st.Holds[k] = &c
	}
	f.finished.copyTo(st.Finished)
	for k, v := range f.members {
		st.Members[k] = v
	}
	if len(f.removed) > 0 {
		st.Removed = maps.Clone(f.removed)
	}
	head, err := msgpack.Marshal(&st)
	if err != nil {
		img.Close()
		return nil, err
	}
	return &fsmSnapshot{head: head, img: img}, nil
}

type fsmSnapshot struct {
	head []byte
	img  *idem.SnapshotImage
}

func (s *fsmSnapshot) Persist(sink raft.SnapshotSink) error {
	w := bufio.NewWriterSize(sink, 1<<20)
	err := msgpack.NewEncoder(w).Encode(s.head)
	if err == nil {
		_, err = s.img.WriteTo(context.Background(), w)
	}
	if err == nil {
		err = w.Flush()
	}
	if err != nil {
		sink.Cancel()
		return err
	}
	return sink.Close()
}

func (s *fsmSnapshot) Release() { s.img.Close() }

// Restore replaces the state with a snapshot's: a new engine directory is
// built from the image, and the claims it holds in flight are matched with
// the snapshot's table of owners and tokens.
func (f *fsm) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	r := bufio.NewReaderSize(rc, 1<<20)
	var head []byte
	if err := msgpack.NewDecoder(r).Decode(&head); err != nil {
		return fmt.Errorf("idemcluster: snapshot header: %w", err)
	}
	var st snapshotState
	if err := msgpack.Unmarshal(head, &st); err != nil {
		return fmt.Errorf("idemcluster: snapshot header: %w", err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.e != nil {
		_ = f.e.Close()
		f.e = nil
		_ = os.RemoveAll(f.genDir(f.gen))
	}
	f.gen++
	if st.Now > f.now.Load() {
		f.now.Store(st.Now)
	}
	e, err := idem.Restore(f.genDir(f.gen), r, &f.eopts)
	if err != nil {
		return fmt.Errorf("idemcluster: restore: %w", err)
	}
	f.e = e
	claims, err := e.InDoubt(context.Background(), "")
	if err != nil {
		return err
	}
	byKey := map[string]*idem.Claim{}
	for _, d := range claims {
		k := claimKey{Scope: d.Scope, ID: d.ID, Client: d.Client}.String()
		byKey[k] = d.Claim
	}
	f.tmu.Lock()
	defer f.tmu.Unlock()
	f.holds = map[string]*held{}
	for k, h := range st.Holds {
		if c := byKey[k]; c != nil {
			h.claim = c
			f.holds[k] = h
		}
	}
	f.finished = newFinishedTable(st.Finished)
	f.members = st.Members
	if f.members == nil {
		f.members = map[string]string{}
	}
	f.removed = st.Removed
	if f.removed == nil {
		f.removed = map[string]int64{}
	}
	if st.Index > f.index.Load() {
		f.applied(st.Index)
	}
	return nil
}
