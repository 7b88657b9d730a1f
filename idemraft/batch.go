package idemraft

import (
	"context"
	"fmt"
	"hash/maphash"
	"math/bits"
	"slices"
	"sync"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
)

var _ raft.BatchingFSM = (*FSM)(nil)

// ApplyBatch implements raft.BatchingFSM: raft hands it consecutive
// committed entries (commands and configuration changes), and it returns
// for each exactly what Apply returns for it (a configuration change gives
// what the application's ApplyBatch gives for it, else nil), whatever the
// batch boundaries: replicas whose raft cut the log into other batches
// keep the same dedup set.
//
// The entries are taken in runs. A command's request is looked up in the
// dedup set (idem.Engine.LookupHint: Lookup, which answers what Begin
// would, keeping the request's key and slot for its Put) at the entry's
// log time, several at once where nothing can change between them
// (lookAhead); the application then gets the new requests' operations
// and the entries that are not commands, in log order, in one ApplyBatch
// call when it implements raft.BatchingFSM (one Apply per entry
// otherwise, and configuration changes to its StoreConfiguration); and the
// replies of the run are written in one engine batch (idem.Batch.Put: claim
// and commit in one step), one record instead of two per request. The
// engine is this FSM's alone and only ApplyBatch and Apply write to it, so
// what the lookup said still holds when the batch runs, provided that no
// request of the run depends on another one's write. A run therefore ends
// before a command whose key (its id, or its client in sequence mode) a
// new request of the run writes (its own key, or an id it acks: the second
// of two appends of one request is then answered as a duplicate of the
// first), before a command whose log time differs from the new requests'
// (a record has one time, and each request is committed at its own
// entry's log time, as Apply commits it), and at a ForgetCommand. Log time
// is to the millisecond (see logTime): under load a batch spans one or a
// few, so a run is most of a batch.
func (f *FSM) ApplyBatch(logs []*raft.Log) []any {
	f.mu.RLock()
	defer f.mu.RUnlock()
	a := batchApplyPool.Get().(*batchApply)
	out := a.apply(f, logs)
	batchApplyPool.Put(a)
	return out
}

// apply is ApplyBatch with a (f.mu read-locked): it returns the entries'
// results, and a keeps nothing of the call.
func (a *batchApply) apply(f *FSM, logs []*raft.Log) []any {
	a.f, a.logs, a.out, a.clk = f, logs, make([]any, len(logs)), f.now.Load()
	a.run()
	out := a.out
	a.f, a.logs, a.out = nil, nil, nil
	return out
}

// batchApplyPool holds batchApply values between ApplyBatch calls, with
// their slices and map, so that a call allocates per run of entries
// rather than per entry. What they held is cleared at each reset: a
// pooled value keeps no log entry, request or result alive.
var batchApplyPool = sync.Pool{New: func() any { return new(batchApply) }}

// maxKeptEnvs bounds the envelope buffer a pooled batchApply keeps.
const maxKeptEnvs = 1 << 20

// batchApply is one ApplyBatch call.
type batchApply struct {
	f    *FSM
	logs []*raft.Log
	out  []any
	// clk is the clock as of the entry being looked at: the largest log
	// time so far. f.now follows it at each lookup, and stays at
	// the new requests' time until their batch is written.
	clk int64

	// The run: entries taken but not yet applied, in log order.
	pending []runEntry
	fresh   int   // new requests in the run
	freshAt int64 // their log time (the clock of all of them)
	// written holds the keyHash of every key a new request of the run
	// writes. A hash shared by two keys only ends a run early, which
	// changes no result (the results do not depend on where runs end).
	written map[uint64]struct{}

	// The batch's commands, decoded before any is looked up (decodeAll):
	// reqs holds each request's idem.Request by log position (the zero
	// Request for any other entry), for the engine's Prefetch and
	// LookupHints, and cmds the rest of each entry's decoding. Cleared at
	// the end of the call.
	reqs []idem.Request
	cmds []decodedEntry
	// The lookups of the requests, by log position, made a segment at a
	// time (lookAhead): looked[i] is what the engine answered for reqs[i]
	// and hints[i] what it read (idem.PutHint), which the request's Put
	// reuses if it is new (its key, validated once, and its slot in the
	// engine's table) instead of reading its key again. The lookups of
	// positions up to lookedTo (exclusive) were made at clock lookedClk
	// and hold until the engine is written (flush, a forget), which sets
	// lookedTo to 0. Cleared at the end of the call.
	looked    []idem.BatchResult
	hints     []idem.PutHint
	lookedTo  int
	lookedClk int64
	segKeys   []uint64 // lookAhead's scratch: the keys its segment reads or writes

	// Scratch of flush, kept for the next run (cleared after each).
	results []any           // the application's results by run position
	items   []int           // run positions of the engine batch's items
	ends    []int           // where each item's envelope ends in envs
	envs    *envelopeWriter // the items' envelopes, back to back (the engine copies them); nil until the first
	appPos  []int           // run positions of the entries given to the application's ApplyBatch
	// bres holds the engine batch's results (idem.RunAppender), cleared
	// once read so that it keeps no reply or error between runs.
	bres []idem.BatchResult
}

// runEntry is an entry of the run: a new request (op set; its request is
// in the run's hints), a command with its answer already known (resp), or
// an entry for the application (any other LogCommand entry, or a
// configuration change). It is kept small: a run is copied through it
// once per entry.
type runEntry struct {
	i    int
	kind runKind
	op   []byte // runFresh: the operation, the application's Data
	resp *Response
}

type runKind uint8

const (
	runApp      runKind = iota // not a command: to the application untouched
	runFresh                   // a new request: its operation to the application, its reply to the engine
	runAnswered                // a command answered without the application (duplicate, refused)
)

// keySeed seeds keyHash. Replicas need not agree on it: a hash only
// decides where a run ends, never a result.
var keySeed = maphash.MakeSeed()

// keyHash hashes a key a request reads in the dedup set: an id, or in
// sequence mode its client's name (the client's older replies live under
// it), in scope.
func keyHash(scope string, id []byte, client string) uint64 {
	var h uint64
	if client != "" {
		h = ^maphash.String(keySeed, client)
	} else {
		h = maphash.Bytes(keySeed, id)
	}
	if scope != "" {
		h ^= bits.RotateLeft64(maphash.String(keySeed, scope), 17)
	}
	return h
}

// decodedEntry is an entry of the batch as decodeAll decoded it; its
// request, if any, is in batchApply.reqs at the same position.
type decodedEntry struct {
	cmd    bool  // a LogCommand entry that IsCommand: d and err hold its decoding
	err    error // decodeCommand's error
	kind   byte
	op     []byte
	before time.Time
	key    uint64 // a request's keyHash
}

// decodeAll decodes the batch's commands into a.cmds and a.reqs, and
// hands the requests to the engine's Prefetch, which loads what their
// lookups (run, one by one) read first, all at once. Decoding has no
// effect, so doing it ahead of the lookups changes nothing but when.
func (a *batchApply) decodeAll() {
	n := len(a.logs)
	if cap(a.reqs) < n {
		a.reqs, a.cmds = make([]idem.Request, n), make([]decodedEntry, n)
		a.looked, a.hints = make([]idem.BatchResult, n), make([]idem.PutHint, n)
	}
	a.reqs, a.cmds = a.reqs[:n], a.cmds[:n]
	a.looked, a.hints = a.looked[:n], a.hints[:n]
	fresh := 0
	for i, l := range a.logs {
		if l.Type != raft.LogCommand || !IsCommand(l.Data) {
			continue
		}
		d, err := decodeCommand(l.Data)
		a.cmds[i] = decodedEntry{cmd: true, err: err, kind: d.kind, op: d.op, before: d.before}
		if err == nil && d.kind != kindForget {
			a.reqs[i] = d.req
			a.cmds[i].key = keyHash(d.req.Scope, d.req.ID, d.req.Client)
			fresh++
		}
	}
	if fresh > 1 {
		if testHookPrefetch != nil {
			testHookPrefetch(a.reqs)
		}
		a.f.cur.e.Prefetch(a.reqs)
	}
}

// testHookPrefetch, when set by a test, sees what decodeAll hands Prefetch.
var testHookPrefetch func(reqs []idem.Request)

// clearDecoded drops what decodeAll kept: requests and operations point
// into the batch's entries.
func (a *batchApply) clearDecoded() {
	clear(a.reqs)
	clear(a.cmds)
	clear(a.looked) // replies and errors
	clear(a.hints)  // what they read: requests, keys and slots
	a.lookedTo = 0
	if cap(a.reqs) > maxKeptDecoded {
		a.reqs, a.cmds, a.looked, a.hints = nil, nil, nil, nil
	}
}

// maxSegment bounds the requests lookAhead looks up at once.
const maxSegment = 64

// lookAhead looks the requests from log position i on up in one
// idem.Engine.LookupHints call, into a.looked and a.hints, with the clock
// a.clk: the requests at i and after, up to the first entry that is not a
// request, has a later log time (it would move the clock), or has a key
// (keyHash) that a request of the run or an earlier one of the segment
// reads or writes (its own key, an id it acks), at most maxSegment. Up to
// there the run writes nothing to the engine (it flushes only at a
// forget, at a key its new requests write, at a later log time), so each
// lookup answers what it would have answered alone, at its entry. What
// makes that a rule rather than a prediction is run's: a lookup made
// ahead is used only while a.lookedTo and a.lookedClk say so, and every
// write to the engine (flush, a forget) sets a.lookedTo to 0. Entry i is
// a request, and a.clk is its clock.
func (a *batchApply) lookAhead(i int) {
	j := i + 1
	seg := append(a.segKeys[:0], a.cmds[i].key)
	seg = a.ackKeys(seg, i)
	for ; j < len(a.logs) && j-i < maxSegment; j++ {
		c, l := &a.cmds[j], a.logs[j]
		if l.Type != raft.LogCommand || !c.cmd || c.err != nil || c.kind == kindForget || logTime(l) > a.clk {
			break
		}
		if _, dep := a.written[c.key]; dep || slices.Contains(seg, c.key) {
			break
		}
		seg = append(seg, c.key)
		seg = a.ackKeys(seg, j)
	}
	a.segKeys = seg[:0]
	if testHookLookAhead != nil {
		testHookLookAhead(i, j)
	}
	e := a.f.cur.e
	if j == i+1 {
		a.looked[i].Result, a.looked[i].Err = e.LookupHint(context.Background(), a.reqs[i], &a.hints[i])
	} else {
		e.LookupHints(context.Background(), a.reqs[i:j], a.hints[i:j], a.looked[i:j])
	}
	a.lookedTo, a.lookedClk = j, a.clk
}

// testHookLookAhead, when set by a test, sees the log positions of each
// segment lookAhead looks up (from, to exclusive).
var testHookLookAhead func(from, to int)

// ackKeys appends the keyHash of every id the request at log position i
// acks to seg.
func (a *batchApply) ackKeys(seg []uint64, i int) []uint64 {
	r := &a.reqs[i]
	for _, id := range r.Acked {
		seg = append(seg, keyHash(r.Scope, id, ""))
	}
	return seg
}

// maxKeptDecoded bounds the entries whose decoding a pooled batchApply
// keeps room for (a few hundred bytes each).
const maxKeptDecoded = 4096

func (a *batchApply) run() {
	f := a.f
	last := -1 // the last LogCommand entry: Apply sets lastIndex for those only
	a.decodeAll()
	defer a.clearDecoded()
	for i, l := range a.logs {
		if l.Type != raft.LogCommand {
			// A configuration change: raft's single path hands it to
			// StoreConfiguration, not to Apply, so it moves no clock.
			a.pending = append(a.pending, runEntry{i: i, kind: runApp})
			continue
		}
		last = i
		a.clk = max(a.clk, logTime(l))
		if f.Err() != nil || f.closed {
			a.refuse(i)
			continue
		}
		c := &a.cmds[i]
		if !c.cmd {
			a.pending = append(a.pending, runEntry{i: i, kind: runApp})
			continue
		}
		if err := c.err; err != nil {
			f.refused.Add(1)
			a.answer(i, &Response{Err: fmt.Errorf("%w (log index %d)", err, l.Index)})
			continue
		}
		d := decoded{kind: c.kind, op: c.op, before: c.before, req: a.reqs[i]}
		if d.kind == kindForget {
			a.flush()
			if f.Err() != nil {
				a.refuse(i)
				continue
			}
			f.now.Store(a.clk)
			a.lookedTo = 0 // the forget changes what a lookup reads
			resp := &Response{}
			if err := f.cur.e.Forget(context.Background(), d.before); err != nil {
				resp.Err = f.fail(l.Index, err)
			}
			a.out[i] = resp
			continue
		}
		k := c.key
		if _, dep := a.written[k]; dep || a.fresh > 0 && a.clk != a.freshAt {
			a.flush()
			if f.Err() != nil {
				a.refuse(i)
				continue
			}
		}
		f.now.Store(a.clk)
		if i >= a.lookedTo || a.clk != a.lookedClk {
			a.lookAhead(i)
		}
		res, err := a.looked[i].Result, a.looked[i].Err
		if resp := f.answered(l.Index, res, err); resp != nil {
			if f.Err() != nil {
				a.refuse(i)
				continue
			}
			a.answer(i, resp)
			continue
		}
		if a.written == nil {
			a.written = make(map[uint64]struct{})
		}
		a.written[k] = struct{}{}
		for _, id := range d.req.Acked {
			a.written[keyHash(d.req.Scope, id, "")] = struct{}{}
		}
		a.pending = append(a.pending, runEntry{i: i, kind: runFresh, op: d.op})
		a.fresh++
		a.freshAt = a.clk
	}
	a.flush()
	if f.Err() != nil {
		a.refuseRest()
	}
	f.now.Store(max(f.now.Load(), a.clk))
	if last >= 0 {
		f.lastIndex.Store(a.logs[last].Index)
	}
}

// answer adds a command answered without the application to the run: its
// Response stands unless the run's write fails.
func (a *batchApply) answer(i int, resp *Response) {
	a.pending = append(a.pending, runEntry{i: i, kind: runAnswered, resp: resp})
}

// refuse answers entry i of a stopped FSM as Apply does: a command gets
// the failure in its Response, another entry the error itself. Once the
// FSM has stopped, the run is dropped too: nothing more reaches the
// application.
func (a *batchApply) refuse(i int) {
	a.refuseRest()
	a.setRefused(i)
}

func (a *batchApply) refuseRest() {
	for _, r := range a.pending {
		a.setRefused(r.i)
	}
	a.reset()
}

func (a *batchApply) setRefused(i int) {
	err := a.f.Err()
	if err == nil { // closed, not failed
		err = a.f.fail(a.logs[i].Index, idem.ErrClosed)
	}
	l := a.logs[i]
	switch {
	case l.Type != raft.LogCommand:
		a.out[i] = nil
	case IsCommand(l.Data):
		a.out[i] = &Response{Err: err}
	default:
		a.out[i] = err
	}
}

func (a *batchApply) reset() {
	clear(a.pending) // drop the references to log entries and results
	a.pending = a.pending[:0]
	clear(a.results)
	if a.envs != nil && a.envs.buf.Cap() > maxKeptEnvs {
		a.envs = nil
	}
	a.fresh = 0
	clear(a.written)
}

// flush applies the run: the application first (new requests' operations
// and the other entries, in log order), then the new requests' replies in
// one engine batch at their log time (f.now is still freshAt). If the
// engine fails, every command of the run gets the failure (the node must
// be restarted, as after any failure); the entries the application got
// keep its results.
func (a *batchApply) flush() {
	if len(a.pending) == 0 {
		return
	}
	f := a.f
	a.lookedTo = 0 // the run's write changes what a lookup reads
	if f.Err() != nil {
		a.refuseRest()
		return
	}
	if !a.applyApp() {
		a.refuseRest()
		return
	}
	// One allocation for the Responses of the run's new requests.
	resps := make([]Response, a.fresh)
	ok := a.write(resps)
	n := 0
	for p, r := range a.pending {
		switch {
		case r.kind == runApp:
			a.out[r.i] = a.results[p]
		case !ok:
			a.out[r.i] = &Response{Err: f.Err()}
		case r.kind == runFresh:
			a.out[r.i] = &resps[n]
			n++
		default:
			a.out[r.i] = r.resp
		}
	}
	a.reset()
}

// write commits the replies of the run's new requests (the application's
// results, a.results by run position) in one engine batch, and sets their
// Responses in resps, in run order. It reports false once the FSM has
// stopped.
func (a *batchApply) write(resps []Response) bool {
	f := a.f
	b := f.cur.e.NewBatch()
	a.items, a.ends = a.items[:0], a.ends[:0]
	if a.envs == nil {
		a.envs = newEnvelopeWriter()
	}
	a.envs.buf.Reset()
	for p := range a.pending {
		if a.pending[p].kind != runFresh {
			continue
		}
		var env envelope
		env, resps[len(a.items)] = resultEnvelope(a.results[p], f.eopts.MaxReplySize)
		a.envs.write(env)
		a.items = append(a.items, p)
		a.ends = append(a.ends, a.envs.buf.Len())
	}
	if len(a.items) == 0 {
		return true
	}
	// The envelopes are added once all are encoded (envs no longer grows).
	// The engine copies a reply it is given (idem.Result.Reply; its
	// TestCommitCopiesReply covers Batch.Put), so envs is reused by the
	// next run.
	envs, from := a.envs.buf.Bytes(), 0
	for n, p := range a.items {
		a.hints[a.pending[p].i].Put(b, envs[from:a.ends[n]:a.ends[n]])
		from = a.ends[n]
	}
	out, err := a.runBatch(b)
	for n := 0; err == nil && n < len(a.items); n++ {
		switch {
		case n >= len(out):
			err = fmt.Errorf("the engine batch gave %d results for %d items", len(out), len(a.items))
		case out[n].Err != nil:
			err = out[n].Err
		case out[n].Result.Status != idem.Fresh:
			err = fmt.Errorf("the dedup set answered %v on writing a request it had just looked up as new", out[n].Result.Status)
		}
	}
	clear(out)
	if cap(out) <= maxKeptDecoded {
		a.bres = out[:0]
	} else {
		a.bres = nil
	}
	if err != nil {
		f.fail(a.logs[a.pending[a.items[0]].i].Index, err)
		return false
	}
	f.applied.Add(uint64(len(a.items)))
	return true
}

// runBatch runs the engine batch b into a.bres: its results take no
// allocation of their own once a.bres has the room for a run's items.
// The caller clears them.
func (a *batchApply) runBatch(b idem.Batch) ([]idem.BatchResult, error) {
	if ra, ok := b.(idem.RunAppender); ok {
		return ra.AppendRun(context.Background(), a.bres[:0])
	}
	return b.Run(context.Background())
}

// applyApp hands the run's entries for the application to it, in log
// order: in one ApplyBatch call when it implements raft.BatchingFSM, else
// one Apply per entry (and StoreConfiguration for a configuration change,
// as raft does). It sets a.results, the results by run position (nil
// where an entry did not go to the application), and reports false once
// the FSM has stopped.
func (a *batchApply) applyApp() bool {
	f := a.f
	a.results = append(a.results[:0], make([]any, len(a.pending))...)
	// The application gets a new request's entry with the operation as its
	// Data: copies of the run's entries, made in one allocation. They are
	// the application's to keep, as raft's own entries are.
	entries := make([]raft.Log, a.fresh)
	fresh := func(l *raft.Log, op []byte) *raft.Log {
		e := &entries[0]
		entries = entries[1:]
		*e = *l
		e.Data = op
		return e
	}
	if f.batchApp == nil {
		for p, r := range a.pending {
			l := a.logs[r.i]
			switch {
			case r.kind == runFresh:
				a.results[p] = f.app.Apply(fresh(l, r.op))
			case r.kind == runAnswered:
			case l.Type == raft.LogCommand:
				a.results[p] = f.app.Apply(l)
			case l.Type == raft.LogConfiguration:
				if cs, ok := f.app.(raft.ConfigurationStore); ok {
					cs.StoreConfiguration(l.Index, raft.DecodeConfiguration(l.Data))
				}
			}
		}
		return true
	}
	a.appPos = a.appPos[:0]
	// The application's slice: raft gives ApplyBatch a new one each time too.
	logs := make([]*raft.Log, 0, len(a.pending))
	for p, r := range a.pending {
		switch r.kind {
		case runFresh:
			logs = append(logs, fresh(a.logs[r.i], r.op))
		case runApp:
			logs = append(logs, a.logs[r.i])
		default:
			continue
		}
		a.appPos = append(a.appPos, p)
	}
	if len(logs) == 0 {
		return true
	}
	out := f.batchApp.ApplyBatch(logs)
	if len(out) != len(logs) {
		f.fail(logs[0].Index, fmt.Errorf("the application's ApplyBatch returned %d results for %d entries", len(out), len(logs)))
		return false
	}
	for n, p := range a.appPos {
		a.results[p] = out[n]
	}
	return true
}
