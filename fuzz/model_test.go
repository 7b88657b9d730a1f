package fuzz

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/crc32"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/idemdb/idem"
)

// The reference model: what a caller of idem has been told, as a plain map
// from identity to state. It follows docs/design.md ("State machine",
// "Decisions made by Begin", "Fingerprints") and is deliberately written
// without looking at how the engine stores things: forget marks are applied
// eagerly to every entry, retention is a predicate on the clock.

// The universe of identities the programs use: small, so that programs
// collide on ids, and every identity is observed after every step.
var (
	modelScopes  = []string{"", "s1", "s2"}
	modelIDs     = []string{"a", "b", "c", "d", "e", "f"}
	modelClients = []string{"c1", "c2"}
)

const (
	modeID     = 'i'
	modeClient = 'c'
)

type mkey struct {
	scope string
	mode  byte
	ident string
}

func (k mkey) String() string {
	if k.mode == modeID {
		return fmt.Sprintf("%s/id:%s", k.scope, k.ident)
	}
	return fmt.Sprintf("%s/client:%s", k.scope, k.ident)
}

// mentry is one identity's state. An id is in flight or committed, never
// both; a client has its last committed number (with its reply while kept)
// and possibly the claim of the next number.
type mentry struct {
	committed  bool
	seq        uint64 // client: last committed sequence number
	replyKept  bool
	reply      []byte
	fp         []byte // of the committed request; nil = none
	commitTime int64

	inflight   bool
	claimSeq   uint64
	claimFP    []byte
	leaseUntil int64
	tok        int // identifies the claim (the handle the program holds)
	epoch      int // the engine incarnation that made the claim
}

type model struct {
	ents       map[mkey]mentry
	markBefore int64 // newest forget mark
	epoch      int   // engine incarnation: claims of earlier ones are in doubt
	nextTok    int
	retention  time.Duration
	lease      time.Duration
}

func newModel(retention, lease time.Duration) *model {
	return &model{ents: map[mkey]mentry{}, retention: retention, lease: lease, nextTok: 1, markBefore: minInt64}
}

const minInt64 = -1 << 63

func (m *model) clone() *model {
	c := *m
	c.ents = maps.Clone(m.ents)
	return &c
}

// expect is what the model predicts a call returns.
type expect struct {
	status      idem.Status
	reply       []byte
	err         error // a sentinel, matched with errors.Is; nil = success
	gapLast     uint64
	seq         uint64
	leaseUntil  int64
	committedAt int64
	tok         int // Fresh: the claim's token
}

func (x expect) String() string {
	if x.err != nil {
		if errors.Is(x.err, idem.ErrSequenceGap) {
			return fmt.Sprintf("gap(last %d)", x.gapLast)
		}
		return "error " + x.err.Error()
	}
	switch x.status {
	case idem.Done:
		return fmt.Sprintf("done %s at %d seq %d", showReply(x.reply), x.committedAt, x.seq)
	case idem.InFlight:
		return fmt.Sprintf("in-flight until %d seq %d", x.leaseUntil, x.seq)
	case idem.Fresh:
		return fmt.Sprintf("fresh until %d seq %d", x.leaseUntil, x.seq)
	}
	return "ok"
}

func showReply(b []byte) string {
	if len(b) <= 24 {
		return fmt.Sprintf("%q", b)
	}
	return fmt.Sprintf("%q...(%d bytes, crc %08x)", b[:16], len(b), crc32.ChecksumIEEE(b))
}

func fpMatch(stored, asked []byte) bool {
	if asked == nil {
		return true
	}
	return stored != nil && bytes.Equal(stored, asked)
}

func (m *model) expired(e mentry, now int64) bool {
	return m.retention > 0 && e.committed && e.replyKept && e.commitTime < now-int64(m.retention)
}

// ackIDs removes the committed ids among acked (expired ones too: they are
// still stored until a forget removes them); in-flight and unknown ids stay.
func (m *model) ackIDs(scope string, acked []string) {
	for _, a := range acked {
		k := mkey{scope, modeID, a}
		if e, ok := m.ents[k]; ok && e.committed {
			delete(m.ents, k)
		}
	}
}

// begin predicts Begin and applies it.
func (m *model) begin(scope string, mode byte, ident string, seq uint64, fp []byte, acked []string, now int64) expect {
	if len(fp) == 0 {
		fp = nil
	}
	k := mkey{scope, mode, ident}
	e, ok := m.ents[k]
	// Past the checks below the key is claimed: new, expired, or taken
	// over from a claim whose lease ran out.
	if mode == modeID {
		switch {
		case ok && e.committed && !m.expired(e, now):
			if !fpMatch(e.fp, fp) {
				return expect{err: idem.ErrConflict}
			}
			return expect{status: idem.Done, reply: e.reply, committedAt: e.commitTime, seq: e.seq}
		case ok && e.inflight:
			if !fpMatch(e.claimFP, fp) {
				return expect{err: idem.ErrConflict}
			}
			if now < e.leaseUntil {
				return expect{status: idem.InFlight, leaseUntil: e.leaseUntil}
			}
		}
	} else {
		var last uint64
		if ok && e.committed {
			last = e.seq
		}
		switch {
		case seq <= last:
			if seq == last && e.replyKept && !m.expired(e, now) {
				if !fpMatch(e.fp, fp) {
					return expect{err: idem.ErrConflict}
				}
				return expect{status: idem.Done, reply: e.reply, committedAt: e.commitTime, seq: e.seq}
			}
			return expect{err: idem.ErrAlreadyCommitted, seq: seq}
		case seq == last+1:
			if ok && e.inflight {
				if !fpMatch(e.claimFP, fp) {
					return expect{err: idem.ErrConflict}
				}
				if now < e.leaseUntil {
					return expect{status: idem.InFlight, leaseUntil: e.leaseUntil, seq: seq}
				}
			}
		default:
			return expect{err: idem.ErrSequenceGap, gapLast: last}
		}
	}
	m.ackIDs(scope, acked)
	var n mentry
	if mode == modeClient && ok {
		n = e
		// Starting seq N promises N-1 is never retried: its reply goes.
		n.replyKept, n.reply = false, nil
	}
	n.inflight = true
	n.claimSeq = seq
	n.claimFP = fp
	n.leaseUntil = now + int64(m.lease)
	n.tok = m.nextTok
	n.epoch = m.epoch
	m.nextTok++
	m.ents[k] = n
	return expect{status: idem.Fresh, leaseUntil: n.leaseUntil, seq: seq, tok: n.tok}
}

// claimKey finds the key whose current claim is tok.
func (m *model) claimKey(tok int) (mkey, mentry, bool) {
	for k, e := range m.ents {
		if e.inflight && e.tok == tok {
			return k, e, true
		}
	}
	return mkey{}, mentry{}, false
}

// commit predicts Claim.Commit and applies it.
func (m *model) commit(tok int, reply []byte, now int64) expect {
	k, e, ok := m.claimKey(tok)
	if !ok || tok == 0 {
		return expect{err: idem.ErrLeaseLost}
	}
	if reply == nil {
		reply = []byte{}
	}
	m.ents[k] = mentry{
		committed: true, seq: e.claimSeq, replyKept: true, reply: bytes.Clone(reply),
		fp: e.claimFP, commitTime: now,
	}
	return expect{}
}

// abort predicts Claim.Abort and applies it.
func (m *model) abort(tok int) expect {
	k, e, ok := m.claimKey(tok)
	if !ok || tok == 0 {
		return expect{err: idem.ErrLeaseLost}
	}
	if k.mode == modeClient && e.committed {
		e.inflight, e.claimSeq, e.claimFP, e.leaseUntil, e.tok, e.epoch = false, 0, nil, 0, 0, 0
		m.ents[k] = e
	} else {
		delete(m.ents, k)
	}
	return expect{}
}

// forget applies a forget mark: before only ever grows; claims whose lease
// ended before it are dropped, and so are replies committed before it (a
// client keeps its number).
func (m *model) forget(before int64) {
	before = max(before, m.markBefore)
	m.markBefore = before
	for k, e := range m.ents {
		if e.inflight && e.leaseUntil < before {
			if k.mode == modeID && !e.committed {
				delete(m.ents, k)
				continue
			}
			e.inflight, e.claimSeq, e.claimFP, e.leaseUntil, e.tok, e.epoch = false, 0, nil, 0, 0, 0
		}
		if e.committed && e.replyKept && e.commitTime < before {
			if k.mode == modeID {
				delete(m.ents, k)
				continue
			}
			e.replyKept, e.reply = false, nil
		}
		m.ents[k] = e
	}
}

// compact applies what Compact logs: the retention forget when it is due.
func (m *model) compact(now int64) {
	if m.retention > 0 {
		if before := now - int64(m.retention); before > m.markBefore {
			m.forget(before)
		}
	}
}

// lookup predicts Lookup of an id (mode id) or of a sequence number (mode client).
func (m *model) lookup(k mkey, seq uint64, now int64) expect {
	e, ok := m.ents[k]
	if !ok {
		return expect{status: idem.Absent, seq: seq}
	}
	if k.mode == modeClient {
		if e.inflight && seq == e.claimSeq {
			return expect{status: idem.InFlight, leaseUntil: e.leaseUntil, seq: e.claimSeq}
		}
		if e.committed && e.replyKept && !m.expired(e, now) && seq == e.seq {
			return expect{status: idem.Done, reply: e.reply, committedAt: e.commitTime, seq: e.seq}
		}
		return expect{status: idem.Absent, seq: seq}
	}
	if e.inflight {
		return expect{status: idem.InFlight, leaseUntil: e.leaseUntil}
	}
	if e.committed && !m.expired(e, now) {
		return expect{status: idem.Done, reply: e.reply, committedAt: e.commitTime, seq: e.seq}
	}
	return expect{status: idem.Absent}
}

func (m *model) clientState(scope, client string) uint64 {
	if e, ok := m.ents[mkey{scope, modeClient, client}]; ok && e.committed {
		return e.seq
	}
	return 0
}

// inDoubt lists the claims made by an earlier incarnation that are still
// open: what Engine.InDoubt must return.
func (m *model) inDoubt() []string {
	var out []string
	for k, e := range m.ents {
		if e.inflight && e.epoch < m.epoch {
			out = append(out, inDoubtString(k.scope, k.mode, k.ident, e.claimSeq, e.leaseUntil))
		}
	}
	slices.Sort(out)
	return out
}

func inDoubtString(scope string, mode byte, ident string, seq uint64, lease int64) string {
	return fmt.Sprintf("%s seq %d lease %d", mkey{scope, mode, ident}, seq, lease)
}

// ---- observation: the whole state as seen through the API ----

func resultString(status idem.Status, reply []byte, committedAt, leaseUntil int64, seq uint64) string {
	switch status {
	case idem.Done:
		return fmt.Sprintf("done %s at %d seq %d", showReply(reply), committedAt, seq)
	case idem.InFlight:
		return fmt.Sprintf("in-flight until %d seq %d", leaseUntil, seq)
	}
	return status.String()
}

func (x expect) obs() string {
	return resultString(x.status, x.reply, x.committedAt, x.leaseUntil, x.seq)
}

func resObs(r idem.Result) string {
	var at, lease int64
	if r.Status == idem.Done {
		at = r.CommittedAt.UnixNano()
	}
	if r.Status == idem.InFlight {
		lease = r.LeaseUntil.UnixNano()
	}
	return resultString(r.Status, r.Reply, at, lease, r.Seq)
}

// observeModel is what every Lookup (ids and sequences), ClientState and InDoubt
// must answer in state m at time now.
func observeModel(m *model, now int64) map[string]string {
	out := map[string]string{}
	for _, s := range modelScopes {
		for _, id := range modelIDs {
			out[mkey{s, modeID, id}.String()] = m.lookup(mkey{s, modeID, id}, 0, now).obs()
		}
		for _, c := range modelClients {
			k := mkey{s, modeClient, c}
			n := m.clientState(s, c)
			line := fmt.Sprintf("state %d", n)
			if n > 0 {
				line += "; last: " + m.lookup(k, n, now).obs()
			}
			line += "; next: " + m.lookup(k, n+1, now).obs()
			out[k.String()] = line
		}
	}
	out["in-doubt"] = strings.Join(m.inDoubt(), ", ")
	return out
}

// observeEngine asks the engine the same questions.
func observeEngine(e *idem.Engine) (map[string]string, error) {
	out := map[string]string{}
	for _, s := range modelScopes {
		for _, id := range modelIDs {
			r, err := e.Lookup(context.Background(), idem.Request{Scope: s, ID: []byte(id)})
			if err != nil {
				return nil, fmt.Errorf("lookup %s/%s: %w", s, id, err)
			}
			out[mkey{s, modeID, id}.String()] = resObs(r)
		}
		for _, c := range modelClients {
			n, err := e.ClientState(context.Background(), s, c)
			if err != nil {
				return nil, fmt.Errorf("client state %s/%s: %w", s, c, err)
			}
			line := fmt.Sprintf("state %d", n)
			if n > 0 {
				r, err := e.Lookup(context.Background(), idem.Request{Scope: s, Client: c, Seq: n})
				if errors.Is(err, idem.ErrAlreadyCommitted) {
					// Lookup answers as Begin: the last number whose reply
					// is no longer kept (the model's absent).
					r, err = idem.Result{Status: idem.Absent}, nil
				}
				if err != nil {
					return nil, fmt.Errorf("lookup seq %s/%s/%d: %w", s, c, n, err)
				}
				line += "; last: " + resObs(r)
			}
			r, err := e.Lookup(context.Background(), idem.Request{Scope: s, Client: c, Seq: n + 1})
			if err != nil {
				return nil, fmt.Errorf("lookup seq %s/%s/%d: %w", s, c, n+1, err)
			}
			line += "; next: " + resObs(r)
			out[mkey{s, modeClient, c}.String()] = line
		}
	}
	ds, err := e.InDoubt(context.Background(), "")
	if err != nil {
		return nil, fmt.Errorf("in doubt: %w", err)
	}
	var ids []string
	for _, d := range ds {
		if d.Client != "" {
			ids = append(ids, inDoubtString(d.Scope, modeClient, d.Client, d.Seq, d.LeaseUntil.UnixNano()))
		} else {
			ids = append(ids, inDoubtString(d.Scope, modeID, string(d.ID), 0, d.LeaseUntil.UnixNano()))
		}
	}
	slices.Sort(ids)
	out["in-doubt"] = strings.Join(ids, ", ")
	return out, nil
}

// diffObs lists the differences between two observations ("" = equal).
func diffObs(want, got map[string]string) string {
	var d []string
	for _, k := range slices.Sorted(maps.Keys(want)) {
		if got[k] != want[k] {
			d = append(d, fmt.Sprintf("  %s: model %q, engine %q", k, want[k], got[k]))
		}
	}
	for _, k := range slices.Sorted(maps.Keys(got)) {
		if _, ok := want[k]; !ok {
			d = append(d, fmt.Sprintf("  %s: engine only %q", k, got[k]))
		}
	}
	return strings.Join(d, "\n")
}
