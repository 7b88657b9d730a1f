package idemcluster

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// server implements the gRPC services on a node.
type server struct {
	clusterpb.UnimplementedIdemServer
	clusterpb.UnimplementedClusterServer
	n *Node
}

func reqFromPB(r *clusterpb.Request) (idem.Request, error) {
	if r == nil {
		return idem.Request{}, fmt.Errorf("%w: no request", idem.ErrInvalidRequest)
	}
	return idem.Request{Scope: r.Scope, ID: r.Id, Client: r.Client, Seq: r.Seq, Fingerprint: r.Fingerprint, Acked: r.Acked, TTL: r.Ttl.AsDuration(),
		KeepReplies: int(r.KeepReplies), KeepRepliesFor: r.KeepRepliesFor.AsDuration()}, nil
}

func reqToPB(r idem.Request) *clusterpb.Request {
	p := &clusterpb.Request{}
	fillReqPB(p, r)
	return p
}

// fillReqPB sets p to r (reqToPB into a message the caller allocated).
func fillReqPB(p *clusterpb.Request, r idem.Request) {
	*p = clusterpb.Request{Scope: r.Scope, Id: r.ID, Client: r.Client, Seq: r.Seq, Fingerprint: r.Fingerprint, Acked: r.Acked, KeepReplies: int32(r.KeepReplies)}
	if r.TTL != 0 {
		p.Ttl = durationpb.New(r.TTL)
	}
	if r.KeepRepliesFor != 0 {
		p.KeepRepliesFor = durationpb.New(r.KeepRepliesFor)
	}
}

func ts(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

func tm(t *timestamppb.Timestamp) time.Time {
	if t == nil {
		return time.Time{}
	}
	return t.AsTime()
}

// resultToPB is r as a message, allocated with its timestamps
// (resultMsgs).
func resultToPB(r idem.Result) *clusterpb.Result { return (&resultMsgs{}).result(r) }

// result is r as a message in m.
func (m *resultMsgs) result(r idem.Result) *clusterpb.Result {
	m.res = clusterpb.Result{Status: clusterpb.Status(r.Status), Reply: r.Reply, Seq: r.Seq,
		LeaseUntil: m.time(0, r.LeaseUntil), CommittedAt: m.time(1, r.CommittedAt), ExpiresAt: m.time(2, r.ExpiresAt)}
	return &m.res
}

// itemAnswer is a Batch item's answer. A Batch allocates its items'
// answers as one slice (answers), and a result with its timestamps as
// one allocation (resultMsgs), instead of two to five messages per item
// (at 64 calls per batch, 4-5 of a duplicate's 26 allocations; allocation
// and GC were a fifth of its CPU).
type itemAnswer struct {
	out clusterpb.BatchResult
	res resultMsgs // its result, when it has one
}

// resultMsgs is a Result and its timestamps, allocated together
// (resultToPB).
type resultMsgs struct {
	res   clusterpb.Result
	times [3]timestamppb.Timestamp // lease_until, committed_at, expires_at
}

// answers is a Batch's answers, one per item, in one allocation.
func answers(n int) []itemAnswer { return make([]itemAnswer, n) }

// time is ts(t) in m's i-th timestamp.
func (m *resultMsgs) time(i int, t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	m.times[i] = timestamppb.Timestamp{Seconds: t.Unix(), Nanos: int32(t.Nanosecond())} // timestamppb.New's
	return &m.times[i]
}

// item is itemResult(res, err) in a's BatchResult.
func (a *itemAnswer) item(res *clusterpb.Result, err error) *clusterpb.BatchResult {
	a.out = clusterpb.BatchResult{Result: res}
	if err != nil {
		st := status.Convert(err).Proto()
		a.out.Status = &clusterpb.ItemStatus{Code: st.Code, Message: st.Message, Details: st.Details}
	}
	return &a.out
}

func (s *server) Begin(ctx context.Context, in *clusterpb.BeginRequest) (*clusterpb.BeginResponse, error) {
	req, c, err := beginCmd(in)
	if err != nil {
		return nil, toStatus(err)
	}
	if r, ok := s.committed(ctx, req); ok {
		return &clusterpb.BeginResponse{Result: resultToPB(r)}, nil
	}
	a, err := s.n.apply(ctx, c)
	return beginAnswer(req, a, err)
}

// beginCmd is a Begin's request and its command.
func beginCmd(in *clusterpb.BeginRequest) (idem.Request, *command, error) {
	req, err := reqFromPB(in.Request)
	if err != nil {
		return req, nil, err
	}
	return req, &command{Op: cmdBegin, Req: toWire(req), Owner: in.Owner, Token: in.Token}, nil
}

// beginAnswer is the answer to a Begin whose command was applied (a) or
// not (err).
func beginAnswer(req idem.Request, a *applied, err error) (*clusterpb.BeginResponse, error) {
	if err == nil {
		err = a.err
	}
	if err != nil {
		return nil, toStatus(err)
	}
	return &clusterpb.BeginResponse{Result: beginResult(req, a)}, nil
}

// beginResult is the result of a Begin whose command was applied (a,
// without an error): with its claim when Fresh.
func beginResult(req idem.Request, a *applied) *clusterpb.Result {
	return beginResultIn(&resultMsgs{}, req, a)
}

// beginResultIn is beginResult in m.
func beginResultIn(m *resultMsgs, req idem.Request, a *applied) *clusterpb.Result {
	res := m.result(a.res)
	if a.res.Status == idem.Fresh {
		res.Claim = &clusterpb.ClaimRef{Scope: req.Scope, Id: req.ID, Client: req.Client, Seq: req.Seq, Owner: a.owner, Token: a.token}
	}
	return res
}

// committed answers a Begin of a committed request (a duplicate) as a
// linearizable read, without a raft entry: Begin writes nothing for a Done
// request (unless it acknowledges replies: req.Acked), so the answer is
// the one the entry would have given. The leader's own state is asked
// first, so a new request pays no leadership round; a Done there is
// confirmed by a read round and asked again (it may have expired since).
// ok false: take the write path, which gives every other answer.
func (s *server) committed(ctx context.Context, req idem.Request) (idem.Result, bool) {
	if _, ok := s.localDone(ctx, req); !ok {
		return idem.Result{}, false
	}
	if err := s.n.readIndex(ctx, false); err != nil {
		return idem.Result{}, false
	}
	return s.localDone(ctx, req)
}

// localDone is what a Begin of req would find in this node's state, when
// it is a ready leader and that is Done (req acknowledges no replies).
func (s *server) localDone(ctx context.Context, req idem.Request) (idem.Result, bool) {
	if len(req.Acked) > 0 || !s.n.IsLeader() {
		return idem.Result{}, false
	}
	e, done, err := s.n.fsm.engine()
	if err != nil {
		return idem.Result{}, false
	}
	defer done()
	r, err := e.Lookup(ctx, req)
	return r, err == nil && r.Status == idem.Done
}

func claimCmd(op byte, c *clusterpb.ClaimRef) (*command, error) {
	if c == nil || len(c.Token) == 0 {
		return nil, fmt.Errorf("%w: no claim or no token", idem.ErrInvalidRequest)
	}
	return &command{Op: op, Key: claimKey{Scope: c.Scope, ID: c.Id, Client: c.Client}, Seq: c.Seq, Owner: c.Owner, Token: c.Token}, nil
}

func (s *server) Commit(ctx context.Context, in *clusterpb.CommitRequest) (*clusterpb.CommitResponse, error) {
	c, err := commitCmd(in)
	if err != nil {
		return nil, toStatus(err)
	}
	return &clusterpb.CommitResponse{}, s.write(ctx, c)
}

func commitCmd(in *clusterpb.CommitRequest) (*command, error) {
	c, err := claimCmd(cmdCommit, in.Claim)
	if err != nil {
		return nil, err
	}
	c.Reply = in.Reply
	if c.Reply == nil {
		c.Reply = []byte{}
	}
	for _, a := range in.Advances {
		c.Adv = append(c.Adv, idem.Advance{Scope: a.Scope, Client: a.Client, Seq: a.Seq})
	}
	return c, nil
}

func (s *server) Abort(ctx context.Context, in *clusterpb.AbortRequest) (*clusterpb.AbortResponse, error) {
	c, err := claimCmd(cmdAbort, in.Claim)
	if err != nil {
		return nil, toStatus(err)
	}
	return &clusterpb.AbortResponse{}, s.write(ctx, c)
}

func (s *server) write(ctx context.Context, c *command) error {
	a, err := s.n.apply(ctx, c)
	if err == nil {
		err = a.err
	}
	return toStatus(err)
}

func (s *server) Ack(ctx context.Context, in *clusterpb.AckRequest) (*clusterpb.AckResponse, error) {
	return &clusterpb.AckResponse{}, s.write(ctx, &command{Op: cmdAck, Key: claimKey{Scope: in.Scope}, IDs: in.Ids})
}

func (s *server) Advance(ctx context.Context, in *clusterpb.AdvanceRequest) (*clusterpb.AdvanceResponse, error) {
	c := &command{Op: cmdAdvance}
	for _, a := range in.Advances {
		c.Adv = append(c.Adv, idem.Advance{Scope: a.Scope, Client: a.Client, Seq: a.Seq})
	}
	return &clusterpb.AdvanceResponse{}, s.write(ctx, c)
}

func (s *server) Forget(ctx context.Context, in *clusterpb.ForgetRequest) (*clusterpb.ForgetResponse, error) {
	if in.Before == nil {
		return nil, toStatus(fmt.Errorf("%w: forget without a time", idem.ErrInvalidRequest))
	}
	return &clusterpb.ForgetResponse{}, s.write(ctx, &command{Op: cmdForget, Before: in.Before.AsTime().UnixNano()})
}

// read runs f on the engine after readIndex.
func (s *server) read(ctx context.Context, followerRead bool, f func(e *idem.Engine) error) error {
	if err := s.n.readIndex(ctx, followerRead); err != nil {
		return toStatus(err)
	}
	return toStatus(s.onEngine(f))
}

// onEngine runs f on the state machine's engine.
func (s *server) onEngine(f func(e *idem.Engine) error) error {
	e, done, err := s.n.fsm.engine()
	if err != nil {
		return err
	}
	defer done()
	return f(e)
}

func (s *server) Lookup(ctx context.Context, in *clusterpb.LookupRequest) (*clusterpb.LookupResponse, error) {
	req, err := reqFromPB(in.Request)
	if err != nil {
		return nil, toStatus(err)
	}
	var out *clusterpb.LookupResponse
	err = s.read(ctx, in.FollowerRead, func(e *idem.Engine) error {
		r, err := e.Lookup(ctx, req)
		out = &clusterpb.LookupResponse{Result: resultToPB(r)}
		return err
	})
	return out, err
}

func (s *server) Wait(ctx context.Context, in *clusterpb.WaitRequest) (*clusterpb.WaitResponse, error) {
	req, err := reqFromPB(in.Request)
	if err != nil {
		return nil, toStatus(err)
	}
	if err := s.n.readIndex(ctx, false); err != nil {
		return nil, toStatus(err)
	}
	// Wait on the leader's engine without holding the state machine's
	// lock (a Restore may replace the engine: then ask again).
	for {
		e, done, err := s.n.fsm.engine()
		if err != nil {
			return nil, toStatus(err)
		}
		done()
		r, err := e.Wait(ctx, req)
		if errors.Is(err, idem.ErrClosed) && ctx.Err() == nil && !s.n.closed.Load() {
			continue
		}
		if err != nil {
			return nil, toStatus(err)
		}
		return &clusterpb.WaitResponse{Result: resultToPB(r)}, nil
	}
}

// Batch runs a client's coalesced calls, each answered as its own call
// would be, in the items' order. The writes (Begins that this node does
// not find Done, Commits, Aborts) go to the log as one entry (cmdBatch:
// one append, one replication round, applied in order in one engine
// batch); the reads (Lookups, and Begins of ids this node finds Done)
// share one leadership round and run one after the other, beside the
// writes.
func (s *server) Batch(ctx context.Context, in *clusterpb.BatchRequest) (*clusterpb.BatchResponse, error) {
	out := &clusterpb.BatchResponse{Results: make([]*clusterpb.BatchResult, len(in.Items))}
	ans := answers(len(in.Items))
	// Sized for the items that may write (all but the Lookups): growing
	// them item by item cost a few reallocations and copies of the
	// requests per batch, on the path every call of the batch waits on.
	n := 0
	for _, it := range in.Items {
		if _, ok := it.GetCall().(*clusterpb.BatchItem_Lookup); !ok {
			n++
		}
	}
	var (
		cmds   = make([]*command, 0, n)
		writes = make([]int, 0, n) // the items of cmds, in order
		reqs   = make([]idem.Request, 0, n)
		reads  []int // the items answered as reads
	)
	for i, it := range in.Items {
		var (
			c   *command
			req idem.Request
			err error
		)
		switch call := it.GetCall().(type) {
		case *clusterpb.BatchItem_Begin:
			if req, c, err = beginCmd(call.Begin); err == nil {
				if _, done := s.localDone(ctx, req); done {
					c = nil // a duplicate: answered as a read
				}
			}
		case *clusterpb.BatchItem_Commit:
			c, err = commitCmd(call.Commit)
		case *clusterpb.BatchItem_Abort:
			c, err = claimCmd(cmdAbort, call.Abort.GetClaim())
		}
		switch {
		case err != nil:
			out.Results[i] = itemResult(nil, toStatus(err))
		case c != nil:
			cmds, writes, reqs = append(cmds, c), append(writes, i), append(reqs, req)
		default:
			reads = append(reads, i)
		}
	}
	var wg sync.WaitGroup
	if len(reads) > 0 {
		if len(cmds) == 0 {
			s.batchReads(ctx, in.Items, reads, out.Results, ans)
		} else {
			wg.Add(1)
			go func() {
				defer wg.Done()
				s.batchReads(ctx, in.Items, reads, out.Results, ans)
			}()
		}
	}
	if len(cmds) > 0 {
		as, aerr := s.n.applyAll(ctx, cmds)
		for j, i := range writes {
			a, err := &applied{err: aerr}, aerr
			if aerr == nil {
				a, err = as[j], as[j].err
			}
			if err == nil && cmds[j].Op == cmdBegin {
				out.Results[i] = ans[i].item(beginResultIn(&ans[i].res, reqs[j], a), nil)
				continue
			}
			out.Results[i] = ans[i].item(nil, toStatus(err))
		}
	}
	wg.Wait()
	return out, nil
}

// batchReads answers the reads of a Batch (items[i] for i in idx): one
// leadership round for all of them (beginRead, endRead), and each on the
// engine. The engine is read while the round runs: what it gives is a
// committed state of the log that this node, if the round confirms it
// leads, had reached when it was read, after every read here arrived; so
// it holds every write completed before then, unless the node had not
// applied up to the round's index yet, and then it is read again after
// that (endRead). A Begin that the node does not find Done (it expired
// meanwhile), and any item after a failed round, runs as its own call,
// which gives it the answer it would have had alone.
func (s *server) batchReads(ctx context.Context, items []*clusterpb.BatchItem, idx []int, out []*clusterpb.BatchResult, ans []itemAnswer) {
	var (
		round *readRound
		rerr  error
	)
	for _, i := range idx {
		if l, ok := items[i].GetCall().(*clusterpb.BatchItem_Lookup); !ok || !l.Lookup.GetFollowerRead() {
			round, rerr = s.n.beginRead()
			break
		}
	}
	at := s.n.fsm.index.Load()
	s.readItems(ctx, items, idx, out, ans)
	if round != nil {
		var current bool
		if current, rerr = s.n.endRead(ctx, round, at); rerr == nil && !current {
			s.readItems(ctx, items, idx, out, ans)
		}
	}
	for _, i := range idx {
		it := items[i]
		switch call := it.GetCall().(type) {
		case *clusterpb.BatchItem_Lookup:
			if rerr != nil && !call.Lookup.GetFollowerRead() {
				out[i] = itemResult(nil, toStatus(rerr))
			}
			continue
		case *clusterpb.BatchItem_Begin:
			if rerr == nil && out[i] != nil {
				continue
			}
		}
		out[i] = s.item(ctx, it)
	}
}

// readItems reads the engine for batchReads: a Lookup's result (or
// error), a Begin's Done result (else nil: it runs as its own call).
func (s *server) readItems(ctx context.Context, items []*clusterpb.BatchItem, idx []int, out []*clusterpb.BatchResult, ans []itemAnswer) {
	e, done, err := s.n.fsm.engine()
	if err == nil {
		defer done()
	}
	for _, i := range idx {
		out[i] = nil
		switch call := items[i].GetCall().(type) {
		case *clusterpb.BatchItem_Lookup:
			req, rerr := reqFromPB(call.Lookup.Request)
			var res *clusterpb.Result
			if rerr == nil && err == nil {
				var r idem.Result
				r, rerr = e.Lookup(ctx, req)
				res = ans[i].res.result(r)
			}
			if rerr == nil {
				rerr = err
			}
			out[i] = ans[i].item(res, toStatus(rerr))
		case *clusterpb.BatchItem_Begin:
			if req, rerr := reqFromPB(call.Begin.Request); rerr == nil && err == nil && len(req.Acked) == 0 {
				if r, rerr := e.Lookup(ctx, req); rerr == nil && r.Status == idem.Done {
					out[i] = ans[i].item(ans[i].res.result(r), nil)
				}
			}
		}
	}
}

// itemResult is an item's answer: its result, or its error as a status.
func itemResult(res *clusterpb.Result, err error) *clusterpb.BatchResult {
	out := &clusterpb.BatchResult{Result: res}
	if err != nil {
		st := status.Convert(err).Proto()
		out.Status = &clusterpb.ItemStatus{Code: st.Code, Message: st.Message, Details: st.Details}
	}
	return out
}

// item runs one item of a Batch.
func (s *server) item(ctx context.Context, it *clusterpb.BatchItem) *clusterpb.BatchResult {
	out := &clusterpb.BatchResult{}
	var err error
	switch c := it.GetCall().(type) {
	case *clusterpb.BatchItem_Begin:
		var r *clusterpb.BeginResponse
		if r, err = s.Begin(ctx, c.Begin); r != nil {
			out.Result = r.Result
		}
	case *clusterpb.BatchItem_Commit:
		_, err = s.Commit(ctx, c.Commit)
	case *clusterpb.BatchItem_Abort:
		_, err = s.Abort(ctx, c.Abort)
	case *clusterpb.BatchItem_Lookup:
		var r *clusterpb.LookupResponse
		if r, err = s.Lookup(ctx, c.Lookup); r != nil {
			out.Result = r.Result
		}
	default:
		err = toStatus(fmt.Errorf("%w: a batch item without a call", idem.ErrInvalidRequest))
	}
	return itemResult(out.Result, err)
}

func (s *server) ClientState(ctx context.Context, in *clusterpb.ClientStateRequest) (*clusterpb.ClientStateResponse, error) {
	var out *clusterpb.ClientStateResponse
	err := s.read(ctx, in.FollowerRead, func(e *idem.Engine) error {
		n, err := e.ClientState(ctx, in.Scope, in.Client)
		out = &clusterpb.ClientStateResponse{LastCommittedSequence: n}
		return err
	})
	return out, err
}

func (s *server) InDoubt(ctx context.Context, in *clusterpb.InDoubtRequest) (*clusterpb.InDoubtResponse, error) {
	if err := s.n.readIndex(ctx, false); err != nil {
		return nil, toStatus(err)
	}
	out := &clusterpb.InDoubtResponse{}
	for _, h := range s.n.fsm.inDoubt(in.ScopePrefix, in.Owner) {
		out.Claims = append(out.Claims, &clusterpb.InDoubtClaim{
			Claim:       &clusterpb.ClaimRef{Scope: h.Key.Scope, Id: h.Key.ID, Client: h.Key.Client, Seq: h.Seq, Owner: h.Owner, Token: h.Token},
			Fingerprint: h.Fingerprint, ClaimedAt: ts(time.Unix(0, h.ClaimedAt)), LeaseUntil: ts(time.Unix(0, h.LeaseUntil)),
		})
	}
	return out, nil
}

func (s *server) members() ([]*clusterpb.Member, error) {
	f := s.n.r.GetConfiguration()
	if err := f.Error(); err != nil {
		return nil, err
	}
	_, leader := s.n.r.LeaderWithID()
	var out []*clusterpb.Member
	for _, sv := range f.Configuration().Servers {
		out = append(out, &clusterpb.Member{NodeId: string(sv.ID), RaftAddr: string(sv.Address), GrpcAddr: s.n.fsm.member(string(sv.ID)),
			Voter: sv.Suffrage == raft.Voter, Leader: sv.ID == leader})
	}
	return out, nil
}

// Join adds a node as a voter. It is idempotent: a Join retried after
// its answer was lost (the node is a voter at that raft address already)
// appends no configuration change, records the gRPC address only when
// the members table lacks it, and answers as the first did.
func (s *server) Join(ctx context.Context, in *clusterpb.JoinRequest) (*clusterpb.JoinResponse, error) {
	if in.NodeId == "" || in.RaftAddr == "" {
		return nil, toStatus(fmt.Errorf("%w: join needs a node id and a raft address", idem.ErrInvalidRequest))
	}
	if !s.n.IsLeader() {
		return nil, toStatus(&errNotLeader{leader: s.n.leaderAddr()})
	}
	cf := s.n.r.GetConfiguration()
	if err := cf.Error(); err != nil {
		return nil, toStatus(fmt.Errorf("idemcluster: join %s: reading the configuration: %w", in.NodeId, err))
	}
	joined := false
	for _, sv := range cf.Configuration().Servers {
		if string(sv.ID) == in.NodeId && sv.Suffrage == raft.Voter && string(sv.Address) == in.RaftAddr {
			joined = true
		}
	}
	if joined {
		// The configuration read is the latest, perhaps not committed yet
		// (the first attempt's change, still on its way): answer once it is.
		if err := s.n.committedConfiguration(ctx); err != nil {
			return nil, toStatus(fmt.Errorf("idemcluster: join %s: %w", in.NodeId, err))
		}
	} else if err := s.n.await(s.n.r.AddVoter(raft.ServerID(in.NodeId), raft.ServerAddress(in.RaftAddr), 0, 30*time.Second)); err != nil {
		return nil, toStatus(s.n.raftErr("add voter "+in.NodeId, err))
	}
	if in.GrpcAddr != "" && s.n.fsm.member(in.NodeId) != in.GrpcAddr {
		if err := s.write(ctx, &command{Op: cmdMember, Node: in.NodeId, Addr: in.GrpcAddr}); err != nil {
			return nil, err
		}
	}
	m, err := s.members()
	return &clusterpb.JoinResponse{Members: m}, toStatus(err)
}

// Remove removes a node from the cluster. It is idempotent across a lost
// answer: the removal is recorded in the log (a removed entry, kept in
// the members table's list of removed ids, in every snapshot) before
// raft's RemoveServer is appended, so every leader that has the removal
// has that record, and a Remove of a node that is no longer a member but
// was removed before succeeds with already_removed set (nothing changes).
// A node id that never was a member (none by that name was ever removed
// through Remove) is NOT_FOUND, so a typo still gets a clear error; so is
// one removed before the cluster recorded removals (older nodes), which
// is the one case a retry cannot tell apart. The last voter is
// FAILED_PRECONDITION.
func (s *server) Remove(ctx context.Context, in *clusterpb.RemoveRequest) (*clusterpb.RemoveResponse, error) {
	if in.NodeId == "" {
		return nil, toStatus(fmt.Errorf("%w: remove needs a node id", idem.ErrInvalidRequest))
	}
	if !s.n.IsLeader() {
		return nil, toStatus(&errNotLeader{leader: s.n.leaderAddr()})
	}
	// Refuse what raft would accept silently (an unknown id: nothing
	// changes) or fail on with an error a client retries (the last voter):
	// both are the caller's mistake, answered at once. A ready leader has
	// applied every entry of the earlier terms (its barrier), so it has
	// the removed record of any removal in its configuration.
	cf := s.n.r.GetConfiguration()
	if err := cf.Error(); err != nil {
		return nil, toStatus(fmt.Errorf("idemcluster: remove %s: reading the configuration: %w", in.NodeId, err))
	}
	var found, voter bool
	var voters int
	var ids []string
	for _, srv := range cf.Configuration().Servers {
		ids = append(ids, string(srv.ID))
		if srv.Suffrage == raft.Voter {
			voters++
		}
		if string(srv.ID) == in.NodeId {
			found, voter = true, srv.Suffrage == raft.Voter
		}
	}
	if !found {
		if s.n.fsm.wasRemoved(in.NodeId) {
			if err := s.n.committedConfiguration(ctx); err != nil {
				return nil, toStatus(fmt.Errorf("idemcluster: remove %s: %w", in.NodeId, err))
			}
			m, err := s.members()
			return &clusterpb.RemoveResponse{Members: m, AlreadyRemoved: true}, toStatus(err)
		}
		return nil, status.Errorf(codes.NotFound, "idemcluster: remove %q: no such member, and none by that name was removed (members: %s)", in.NodeId, strings.Join(ids, ", "))
	}
	if voter && voters == 1 {
		return nil, status.Errorf(codes.FailedPrecondition, "idemcluster: remove %q: it is the last voter (a cluster needs one)", in.NodeId)
	}
	if err := s.write(ctx, &command{Op: cmdRemoved, Node: in.NodeId}); err != nil {
		return nil, err
	}
	if err := s.n.await(s.n.r.RemoveServer(raft.ServerID(in.NodeId), 0, 30*time.Second)); err != nil {
		return nil, toStatus(s.n.raftErr("remove "+in.NodeId, err))
	}
	// The node is removed. Dropping its address from the members table is
	// tidying only (the table is read for the configuration's members):
	// the removal is what the caller gets, not an error that it would
	// retry on the next leader (which would answer already_removed). A
	// leader that removed itself has stepped down and its raft shuts down
	// (ShutdownOnRemove): a write there could wait for the caller's whole
	// deadline, so it is not tried; elsewhere it is bounded.
	if in.NodeId == s.n.o.ID {
		s.n.log.Info("idemcluster: removed this node, the leader; its address stays in the members table", "node", in.NodeId)
	} else {
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := s.write(wctx, &command{Op: cmdMember, Node: in.NodeId})
		cancel()
		if err != nil {
			s.n.log.Info("idemcluster: removed a node; its address stays in the members table", "node", in.NodeId, "error", err)
		}
	}
	m, err := s.members()
	return &clusterpb.RemoveResponse{Members: m}, toStatus(err)
}

// committedConfiguration returns once the latest configuration the node
// has is committed (a barrier: every entry before it is), so that an
// answer read from it holds on every later leader.
func (n *Node) committedConfiguration(ctx context.Context) error {
	timeout := 10 * time.Second
	if d, ok := ctx.Deadline(); ok {
		timeout = max(time.Until(d), time.Millisecond)
	}
	if err := n.await(n.r.Barrier(timeout)); err != nil {
		if errors.Is(err, raft.ErrNotLeader) || errors.Is(err, raft.ErrLeadershipLost) || errors.Is(err, raft.ErrLeadershipTransferInProgress) {
			return &errNotLeader{leader: n.leaderAddr()}
		}
		return fmt.Errorf("%w: committing the configuration: %v", idem.ErrInDoubt, err)
	}
	return nil
}

// raftErr is the error of a raft call a handler waited for (await; what
// names the call), in the words the client acts on (toStatus): raft
// refused it before appending anything (not the leader, a leadership
// transfer under way) is NOT_LEADER with the leader's address when the
// node knows it, retried there; the leadership lost after the append,
// raft shut down (a leader that removed itself: ShutdownOnRemove), the
// node stopping, are IN_DOUBT: the change may still commit through the
// next leader, and the client retries the same request, which is
// idempotent (Join, Remove). Neither is INTERNAL, which a client in
// another language takes for a bug.
func (n *Node) raftErr(what string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, raft.ErrNotLeader), errors.Is(err, raft.ErrLeadershipTransferInProgress):
		leader := n.leaderAddr()
		if leader == n.Addr() {
			leader = "" // still leading, handing over: the next one is not known yet
		}
		return &errNotLeader{leader: leader}
	case errors.Is(err, raft.ErrLeadershipLost), errors.Is(err, raft.ErrRaftShutdown), errors.Is(err, errStopped):
		return fmt.Errorf("%w: idemcluster: %s on node %s: %v", idem.ErrInDoubt, what, n.o.ID, err)
	}
	return fmt.Errorf("idemcluster: %s on node %s: %w", what, n.o.ID, err)
}

func (s *server) Status(ctx context.Context, in *clusterpb.StatusRequest) (*clusterpb.StatusResponse, error) {
	_, leader := s.n.r.LeaderWithID()
	m, err := s.members()
	if err != nil {
		return nil, toStatus(err)
	}
	return &clusterpb.StatusResponse{NodeId: s.n.o.ID, State: s.n.r.State().String(), LeaderId: string(leader),
		LeaderGrpcAddr: s.n.leaderAddr(), AppliedIndex: s.n.r.AppliedIndex(), LastIndex: s.n.r.LastIndex(), Members: m,
		Term: s.n.r.CurrentTerm()}, nil
}
