package idemraft

import (
	"context"
	"fmt"

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
// dedup set (idem.Engine.Lookup, which answers what Begin would) at the
// entry's log time; the application then gets the new requests' operations
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
	a := batchApply{f: f, logs: logs, out: make([]any, len(logs)), clk: f.now.Load()}
	a.run()
	return a.out
}

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
	written map[reqKey]struct{}
}

// runEntry is an entry of the run: a new request (d set), a command with
// its answer already known (resp), or an entry for the application (any
// other LogCommand entry, or a configuration change).
type runEntry struct {
	i    int
	kind runKind
	d    decoded
	resp *Response
}

type runKind uint8

const (
	runApp      runKind = iota // not a command: to the application untouched
	runFresh                   // a new request: its operation to the application, its reply to the engine
	runAnswered                // a command answered without the application (duplicate, refused)
)

// reqKey names what a request reads in the dedup set: its id, or its
// client in sequence mode (whose older replies live under the client).
type reqKey struct {
	scope  string
	client bool
	ident  string
}

func keyOf(req *idem.Request) reqKey {
	if req.Client != "" {
		return reqKey{scope: req.Scope, client: true, ident: req.Client}
	}
	return reqKey{scope: req.Scope, ident: string(req.ID)}
}

func (a *batchApply) run() {
	f := a.f
	last := -1 // the last LogCommand entry: Apply sets lastIndex for those only
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
		if !IsCommand(l.Data) {
			a.pending = append(a.pending, runEntry{i: i, kind: runApp})
			continue
		}
		d, err := decodeCommand(l.Data)
		if err != nil {
			f.refused.Add(1)
			a.answer(i, &Response{Err: fmt.Errorf("%w (log index %d)", err, l.Index)})
			continue
		}
		if d.kind == kindForget {
			a.flush()
			if f.Err() != nil {
				a.refuse(i)
				continue
			}
			f.now.Store(a.clk)
			resp := &Response{}
			if err := f.cur.e.Forget(context.Background(), d.before); err != nil {
				resp.Err = f.fail(l.Index, err)
			}
			a.out[i] = resp
			continue
		}
		k := keyOf(&d.req)
		if _, dep := a.written[k]; dep || a.fresh > 0 && a.clk != a.freshAt {
			a.flush()
			if f.Err() != nil {
				a.refuse(i)
				continue
			}
		}
		f.now.Store(a.clk)
		res, err := f.cur.e.Lookup(context.Background(), d.req)
		if resp := f.answered(l.Index, res, err); resp != nil {
			if f.Err() != nil {
				a.refuse(i)
				continue
			}
			a.answer(i, resp)
			continue
		}
		if a.written == nil {
			a.written = make(map[reqKey]struct{})
		}
		a.written[k] = struct{}{}
		for _, id := range d.req.Acked {
			a.written[reqKey{scope: d.req.Scope, ident: string(id)}] = struct{}{}
		}
		a.pending = append(a.pending, runEntry{i: i, kind: runFresh, d: d})
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
	a.pending = a.pending[:0]
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
	if f.Err() != nil {
		a.refuseRest()
		return
	}
	results := a.applyApp()
	if results == nil {
		a.refuseRest()
		return
	}
	resps := make([]*Response, len(a.pending))
	ok := a.write(results, resps)
	for p, r := range a.pending {
		switch {
		case r.kind == runApp:
			a.out[r.i] = results[p]
		case !ok:
			a.out[r.i] = &Response{Err: f.Err()}
		case r.kind == runFresh:
			a.out[r.i] = resps[p]
		default:
			a.out[r.i] = r.resp
		}
	}
	a.reset()
}

// write commits the replies of the run's new requests (the application's
// results by run position) in one engine batch, and sets their Responses
// in resps. It reports false once the FSM has stopped.
func (a *batchApply) write(results []any, resps []*Response) bool {
	f := a.f
	b := f.cur.e.NewBatch()
	var items []int // run positions of b's items
	for p := range a.pending {
		r := &a.pending[p]
		if r.kind != runFresh {
			continue
		}
		env, resp := resultEnvelope(results[p], f.eopts.MaxReplySize)
		resps[p] = resp
		b.Put(r.d.req, encodeEnvelope(env))
		items = append(items, p)
	}
	if len(items) == 0 {
		return true
	}
	out, err := b.Run(context.Background())
	for n := 0; err == nil && n < len(items); n++ {
		switch {
		case n >= len(out):
			err = fmt.Errorf("the engine batch gave %d results for %d items", len(out), len(items))
		case out[n].Err != nil:
			err = out[n].Err
		case out[n].Result.Status != idem.Fresh:
			err = fmt.Errorf("the dedup set answered %v on writing a request it had just looked up as new", out[n].Result.Status)
		}
	}
	if err != nil {
		f.fail(a.logs[a.pending[items[0]].i].Index, err)
		return false
	}
	f.applied.Add(uint64(len(items)))
	return true
}

// applyApp hands the run's entries for the application to it, in log
// order: in one ApplyBatch call when it implements raft.BatchingFSM, else
// one Apply per entry (and StoreConfiguration for a configuration change,
// as raft does). It returns the results by run position (nil where an
// entry did not go to the application), or nil once the FSM has stopped.
func (a *batchApply) applyApp() []any {
	f := a.f
	results := make([]any, len(a.pending))
	if f.batchApp == nil {
		for p, r := range a.pending {
			l := a.logs[r.i]
			switch {
			case r.kind == runFresh:
				entry := *l
				entry.Data = r.d.op
				results[p] = f.app.Apply(&entry)
			case r.kind == runAnswered:
			case l.Type == raft.LogCommand:
				results[p] = f.app.Apply(l)
			case l.Type == raft.LogConfiguration:
				if cs, ok := f.app.(raft.ConfigurationStore); ok {
					cs.StoreConfiguration(l.Index, raft.DecodeConfiguration(l.Data))
				}
			}
		}
		return results
	}
	var (
		logs []*raft.Log
		pos  []int
	)
	for p, r := range a.pending {
		switch r.kind {
		case runFresh:
			entry := *a.logs[r.i]
			entry.Data = r.d.op
			logs = append(logs, &entry)
		case runApp:
			logs = append(logs, a.logs[r.i])
		default:
			continue
		}
		pos = append(pos, p)
	}
	if len(logs) == 0 {
		return results
	}
	out := f.batchApp.ApplyBatch(logs)
	if len(out) != len(logs) {
		f.fail(logs[0].Index, fmt.Errorf("the application's ApplyBatch returned %d results for %d entries", len(out), len(logs)))
		return nil
	}
	for n, p := range pos {
		results[p] = out[n]
	}
	return results
}
