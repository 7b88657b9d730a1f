package idemraft

import (
	"context"
	"sync"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
)

// ApplyBatch implements raft.BatchingFSM: raft hands over up to
// MaxAppendEntries committed entries at once. They are applied in order,
// with the same results as one Apply each; the difference is that the
// Commits of the replies of consecutive new requests run together, so the
// dedup engine writes them in one go instead of one write per entry.
//
// A group of such Commits is waited for before an entry that could see
// them: one whose request (or an id it acks) is among the group's, a
// forget, or an entry with a later AppendedAt (the Commits read the clock,
// and so record the time of their own entry on every replica). The
// wrapped FSM's Apply is still called once per entry, in log order;
// configuration entries go to its StoreConfiguration if it has one.
func (f *FSM) ApplyBatch(logs []*raft.Log) []any {
	out := make([]any, len(logs))
	f.mu.RLock()
	defer f.mu.RUnlock()
	g := &commitGroup{f: f, out: out, keys: map[string]struct{}{}}
	for i, l := range logs {
		switch l.Type {
		case raft.LogCommand:
		case raft.LogConfiguration:
			g.wait() // as Apply would: everything before it is done
			f.StoreConfiguration(l.Index, raft.DecodeConfiguration(l.Data))
			continue
		default:
			continue
		}
		if !l.AppendedAt.IsZero() && l.AppendedAt.UnixNano() > f.now.Load() {
			g.wait() // the clock moves: earlier Commits must read the old time
		}
		var d decoded
		var derr error
		if IsCommand(l.Data) {
			d, derr = decodeCommand(l.Data)
			if derr == nil && (d.kind == kindForget || g.touches(d.req)) {
				g.wait()
			}
		}
		out[i] = f.applyEntry(l, d, derr, g, i) // a failed Commit replaces it in g.wait
	}
	g.wait()
	return out
}

// commitGroup is a set of Commits in progress for distinct keys.
type commitGroup struct {
	f    *FSM
	out  []any
	keys map[string]struct{}
	wg   sync.WaitGroup
	mu   sync.Mutex
	errs []groupErr
}

type groupErr struct {
	slot  int
	index uint64
	err   error
}

func entryKey(scope string, mode byte, ident string) string {
	return scope + "\x00" + string(mode) + ident
}

func reqKey(req idem.Request) string {
	if len(req.ID) > 0 {
		return entryKey(req.Scope, 'i', string(req.ID))
	}
	return entryKey(req.Scope, 'c', req.Client)
}

// touches reports whether req's Begin would read a key whose Commit is in
// progress: its own, or one of the ids it acks.
func (g *commitGroup) touches(req idem.Request) bool {
	if len(g.keys) == 0 {
		return false
	}
	if _, ok := g.keys[reqKey(req)]; ok {
		return true
	}
	for _, id := range req.Acked {
		if _, ok := g.keys[entryKey(req.Scope, 'i', string(id))]; ok {
			return true
		}
	}
	return false
}

func (g *commitGroup) commit(c *idem.Claim, reply []byte, req idem.Request, index uint64, slot int) {
	g.keys[reqKey(req)] = struct{}{}
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		if err := c.Commit(context.Background(), reply); err != nil {
			g.mu.Lock()
			g.errs = append(g.errs, groupErr{slot, index, err})
			g.mu.Unlock()
		}
	}()
}

// wait waits for the Commits in progress; a failed one fails the FSM and
// turns its entry's result into the error.
func (g *commitGroup) wait() {
	if len(g.keys) == 0 {
		return
	}
	g.wg.Wait()
	for _, e := range g.errs {
		g.out[e.slot] = &Response{Err: g.f.fail(e.index, e.err)}
	}
	g.errs = g.errs[:0]
	clear(g.keys)
}
