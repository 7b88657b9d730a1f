package idemcluster

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
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
)

// claimKey names a request's key (not its sequence number): a scope and an
// id, or a scope and a client.
type claimKey struct {
	Scope  string `msgpack:"s"`
	ID     []byte `msgpack:"i,omitempty"`
	Client string `msgpack:"c,omitempty"`
}

func (k claimKey) String() string {
	if k.Client != "" {
		return fmt.Sprintf("c%d:%s/%s", len(k.Scope), k.Scope, k.Client)
	}
	return fmt.Sprintf("i%d:%s/%x", len(k.Scope), k.Scope, k.ID)
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

// fsm is the cluster's state machine: an idem engine whose clock is the
// log's time, the table of claims handed out (with their owners and
// tokens), the recently finished tokens and the members' gRPC addresses.
type fsm struct {
	dir    string
	eopts  idem.Options
	lease  time.Duration
	now    atomic.Int64 // the largest AppendedAt applied (Unix ns)
	index  atomic.Uint64
	notify chan struct{} // closed and replaced on every apply (readers wait on it)

	mu       sync.RWMutex // guards e, gen, holds, finished, members against Restore
	e        *idem.Engine
	gen      int
	holds    map[string]*held
	finished map[string]finished
	members  map[string]string // node id -> gRPC address
}

func newFSM(dir string, eopts idem.Options) (*fsm, error) {
	f := &fsm{dir: dir, eopts: eopts, notify: make(chan struct{})}
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	f.eopts.Clock = f.clock
	f.eopts.Sync = idem.SyncNever // the raft log is the durable copy
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
	f.finished = map[string]finished{}
	f.members = map[string]string{}
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
	return f.e, f.mu.RUnlock, nil
}

// waitApplied blocks until index is applied or ctx ends.
func (f *fsm) waitApplied(ctx context.Context, index uint64) error {
	for {
		f.mu.RLock()
		ch := f.notify
		f.mu.RUnlock()
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

// Apply applies one entry. Raft calls it on one goroutine.
func (f *fsm) Apply(l *raft.Log) any {
	if t := l.AppendedAt.UnixNano(); !l.AppendedAt.IsZero() && t > f.now.Load() {
		f.now.Store(t)
	}
	out := f.apply(l)
	f.mu.Lock()
	f.index.Store(l.Index)
	close(f.notify)
	f.notify = make(chan struct{})
	f.mu.Unlock()
	return out
}

func (f *fsm) apply(l *raft.Log) *applied {
	if l.Type != raft.LogCommand {
		return nil
	}
	var c command
	if err := msgpack.Unmarshal(l.Data, &c); err != nil {
		return &applied{err: fmt.Errorf("%w: idemcluster: undecodable entry %d: %v", idem.ErrInvalidRequest, l.Index, err)}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.e == nil {
		return &applied{err: idem.ErrClosed}
	}
	ctx := context.Background()
	f.expireFinished()
	switch c.Op {
	case cmdBegin:
		return f.begin(ctx, &c)
	case cmdCommit, cmdAbort:
		return f.finish(ctx, &c)
	case cmdAck:
		return &applied{err: f.e.Ack(ctx, c.Key.Scope, c.IDs...)}
	case cmdAdvance:
		return &applied{err: f.e.Advance(ctx, c.Adv...)}
	case cmdForget:
		return &applied{err: f.e.Forget(ctx, time.Unix(0, c.Before))}
	case cmdMember:
		if c.Addr == "" {
			delete(f.members, c.Node)
		} else {
			f.members[c.Node] = c.Addr
		}
		return &applied{}
	}
	return &applied{err: fmt.Errorf("%w: idemcluster: unknown command %d at entry %d", idem.ErrInvalidRequest, c.Op, l.Index)}
}

// expireFinished drops finished tokens older than one lease of log time.
func (f *fsm) expireFinished() {
	if len(f.finished) < 1024 {
		return
	}
	cut := f.now.Load() - int64(f.lease)
	for t, fin := range f.finished {
		if fin.At < cut {
			delete(f.finished, t)
		}
	}
}

func (f *fsm) begin(ctx context.Context, c *command) *applied {
	if c.Req == nil || len(c.Token) == 0 {
		return &applied{err: fmt.Errorf("%w: idemcluster: begin without a request or a token", idem.ErrInvalidRequest)}
	}
	req := c.Req.request()
	k := keyOf(&req).String()
	// A retry of the same Begin (a lost answer, a leader change) gets its
	// own claim back, not InFlight against itself.
	if h := f.holds[k]; h != nil && h.Owner == c.Owner && string(h.Token) == string(c.Token) && h.Seq == req.Seq {
		if r, err := f.e.Lookup(ctx, req); err == nil && r.Status == idem.InFlight && !r.LeaseUntil.Before(f.clock()) {
			return &applied{res: idem.Result{Status: idem.Fresh, LeaseUntil: h.claim.LeaseUntil(), Seq: req.Seq}, token: h.Token, owner: h.Owner}
		}
	}
	if fin, ok := f.finished[string(c.Token)]; ok && fin.Committed {
		// The Begin's claim was committed already (the Begin's answer was
		// lost and the owner went on): answer as a retry would.
		r, err := f.e.Lookup(ctx, req)
		return &applied{res: r, err: err}
	}
	r, err := f.e.Begin(ctx, req)
	if err != nil || r.Status != idem.Fresh {
		return &applied{res: r, err: err}
	}
	f.holds[k] = &held{Key: keyOf(&req), Owner: c.Owner, Token: c.Token, Seq: req.Seq, Fingerprint: req.Fingerprint,
		ClaimedAt: f.now.Load(), LeaseUntil: r.LeaseUntil.UnixNano(), claim: r.Claim}
	r.Claim = nil
	return &applied{res: r, token: c.Token, owner: c.Owner}
}

func (f *fsm) finish(ctx context.Context, c *command) *applied {
	k := c.Key.String()
	h := f.holds[k]
	if h == nil || string(h.Token) != string(c.Token) || h.Seq != c.Seq {
		if fin, ok := f.finished[string(c.Token)]; ok && fin.Committed == (c.Op == cmdCommit) {
			return &applied{} // a retry of a finish whose answer was lost
		}
		return &applied{err: fmt.Errorf("%w: idemcluster: no claim of %s with this token (taken over after its lease, or finished)", idem.ErrLeaseLost, k)}
	}
	var err error
	if c.Op == cmdCommit {
		err = h.claim.CommitAdvance(ctx, c.Reply, c.Adv...)
	} else {
		err = h.claim.Abort(ctx)
	}
	if errors.Is(err, idem.ErrInvalidRequest) || errors.Is(err, idem.ErrInFlight) {
		return &applied{err: err} // nothing written: the claim stays open
	}
	delete(f.holds, k)
	if err == nil {
		f.finished[string(c.Token)] = finished{Committed: c.Op == cmdCommit, At: f.now.Load()}
	}
	return &applied{err: err}
}

// inDoubt lists the claims the cluster holds (every claim not yet
// committed or aborted: across a fleet, any of them may be an owner's that
// died) whose scope starts with prefix and, when owner is set, that owner
// holds, in key order.
func (f *fsm) inDoubt(prefix, owner string) []held {
	f.mu.RLock()
	defer f.mu.RUnlock()
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
	Holds    map[string]*held    `msgpack:"holds"`
	Finished map[string]finished `msgpack:"finished"`
	Members  map[string]string   `msgpack:"members"`
}

// Snapshot captures the state at the last applied entry (raft calls it
// between Applies).
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
	st := snapshotState{Now: f.now.Load(), Holds: map[string]*held{}, Finished: map[string]finished{}, Members: map[string]string{}}
	for k, h := range f.holds {
		c := *h
		st.Holds[k] = &c
	}
	for k, v := range f.finished {
		st.Finished[k] = v
	}
	for k, v := range f.members {
		st.Members[k] = v
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
	f.holds = map[string]*held{}
	for k, h := range st.Holds {
		if c := byKey[k]; c != nil {
			h.claim = c
			f.holds[k] = h
		}
	}
	f.finished = st.Finished
	if f.finished == nil {
		f.finished = map[string]finished{}
	}
	f.members = st.Members
	if f.members == nil {
		f.members = map[string]string{}
	}
	return nil
}
