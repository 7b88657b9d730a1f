package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/idemdb/idem/idemcluster"
	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

var clusterCmd = &command{
	name:    "cluster",
	args:    "status | remove <node-id> | forget",
	summary: "a running idem cluster: members and leader, remove a node, forget old replies",
	help: `
Administers a running idem cluster (the nodes 'idem serve' runs) over its gRPC
protocol. --addr names the nodes' --grpc-addr addresses, any subset of them,
comma-separated: the command finds the leader from there.

  idem cluster status           every member (voter or not, raft and gRPC
                                addresses), the leader, and each node's own
                                view: its raft state and term, the last index
                                in its log and the last one it applied. Exit 1
                                when no node answers or none knows a leader.
  idem cluster remove <node-id> asks the leader to remove the node from the
                                cluster (raft's RemoveServer). Idempotent: a
                                node removed before (the command run again
                                after its answer was lost) is reported as
                                removed, exit 0. Refused: a node id that never
                                was a member, the last voter. Needs a
                                leader, so a majority of the members up. Then
                                stop the removed node's process; to bring it
                                back, start it on an empty --dir with --join.
  idem cluster forget           appends the administrator's forget to the
                                cluster's log: every node drops the replies
                                committed before --before, measured in the
                                log's time (the leader's clock when each entry
                                was appended).

A node is added with 'idem serve --join' (see 'idem help serve'). Every
answer the command prints comes from the nodes; nothing is cached.`,
	examples: []string{
		"idem cluster status --addr 10.0.0.1:7070,10.0.0.2:7070,10.0.0.3:7070",
		"idem cluster status --addr 10.0.0.1:7070 --json | jq .leader",
		"idem cluster remove n3 --addr 10.0.0.1:7070,10.0.0.2:7070",
		"idem cluster forget --addr 10.0.0.1:7070 --before 720h",
	},
	setup: func(fs *flag.FlagSet) func(*cli, []string) error {
		o := &clusterOpts{}
		fs.StringVar(&o.addr, "addr", "", "gRPC `host:port` of one or more nodes, comma-separated (required)")
		fs.DurationVar(&o.timeout, "timeout", 30*time.Second, "give up after this `duration` (finding a leader included)")
		fs.BoolVar(&o.json, "json", false, "status: print one JSON object")
		fs.StringVar(&o.before, "before", "", "forget: drop replies committed before `t` (RFC 3339 time, date, or duration before now such as 720h)")
		return o.run
	},
}

type clusterOpts struct {
	addr    string
	timeout time.Duration
	json    bool
	before  string
}

func (o *clusterOpts) run(c *cli, pos []string) error {
	if len(pos) == 0 {
		return usagef("say what to do: status, remove <node-id> or forget")
	}
	action, args := pos[0], pos[1:]
	var addrs []string
	for _, a := range strings.Split(o.addr, ",") {
		if a = strings.TrimSpace(a); a != "" {
			addrs = append(addrs, a)
		}
	}
	if len(addrs) == 0 {
		return usagef("--addr is required: the gRPC address of a node (its idem serve --grpc-addr)")
	}
	if o.timeout <= 0 {
		return usagef("--timeout must be positive")
	}
	if o.json && action != "status" {
		return usagef("--json is for status only")
	}
	if o.before != "" && action != "forget" {
		return usagef("--before is for forget only")
	}
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()
	switch action {
	case "status":
		if len(args) > 0 {
			return usagef("status takes no arguments (got %q)", args)
		}
		return o.status(ctx, c, addrs)
	case "remove":
		if len(args) != 1 || args[0] == "" {
			return usagef("remove takes one node id (got %q)", args)
		}
		return o.remove(ctx, c, addrs, args[0])
	case "forget":
		if len(args) > 0 {
			return usagef("forget takes no arguments (got %q)", args)
		}
		return o.forget(ctx, c, addrs)
	}
	return usagef("unknown action %q: want status, remove <node-id> or forget", action)
}

// dial connects a client; its error says what to check.
func (o *clusterOpts) dial(ctx context.Context, addrs []string) (*idemcluster.Client, error) {
	cl, err := idemcluster.Dial(ctx, addrs, &idemcluster.Options{AttemptTimeout: min(o.timeout, 5*time.Second)})
	if err != nil {
		return nil, fmt.Errorf("no node answered at %s within %v: are the nodes up, and is --addr their --grpc-addr? (%v)", strings.Join(addrs, ","), o.timeout, err)
	}
	return cl, nil
}

// nodeView is one node as status shows it: the member (from the leader's
// configuration, else the first node's) and what the node itself says.
type nodeView struct {
	NodeID       string `json:"node_id"`
	RaftAddr     string `json:"raft_addr"`
	GRPCAddr     string `json:"grpc_addr,omitempty"`
	Voter        bool   `json:"voter"`
	Member       bool   `json:"member"`          // in the configuration shown
	State        string `json:"state,omitempty"` // the node's raft state, as it reports it
	Term         uint64 `json:"term,omitempty"`  // the node's raft term, as it reports it
	LeaderID     string `json:"leader_id,omitempty"`
	AppliedIndex uint64 `json:"applied_index,omitempty"`
	LastIndex    uint64 `json:"last_index,omitempty"`
	Error        string `json:"error,omitempty"` // why the node gave no view
}

type clusterStatus struct {
	Leader     string      `json:"leader"` // "" when no node knows one
	LeaderGRPC string      `json:"leader_grpc_addr,omitempty"`
	Term       uint64      `json:"term,omitempty"` // the leader's term, when the leader answered
	Voters     int         `json:"voters"`
	Nodes      []*nodeView `json:"nodes"`
}

// askStatus asks each address for its Status, concurrently, each within
// the per-attempt bound.
func askStatus(ctx context.Context, addrs []string, each time.Duration) (map[string]*clusterpb.StatusResponse, map[string]error) {
	var (
		mu   sync.Mutex
		wg   sync.WaitGroup
		got  = map[string]*clusterpb.StatusResponse{}
		errs = map[string]error{}
	)
	for _, a := range addrs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := statusOf(ctx, a, each)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs[a] = err
			} else {
				got[a] = st
			}
		}()
	}
	wg.Wait()
	return got, errs
}

// statusOf asks the node at addr (that node, not the leader) for its view.
func statusOf(ctx context.Context, addr string, each time.Duration) (*clusterpb.StatusResponse, error) {
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(ctx, each)
	defer cancel()
	return clusterpb.NewClusterClient(cc).Status(ctx, &clusterpb.StatusRequest{})
}

// gatherStatus asks every address given and every member whose gRPC
// address the answers name, and puts the views together.
func (o *clusterOpts) gatherStatus(ctx context.Context, addrs []string) (*clusterStatus, error) {
	each := min(o.timeout, 5*time.Second)
	got, errs := askStatus(ctx, addrs, each)
	if len(got) == 0 {
		var msgs []string
		for _, a := range addrs {
			msgs = append(msgs, fmt.Sprintf("%s: %v", a, errs[a]))
		}
		return nil, fmt.Errorf("no node answered at %s: are the nodes up, and is --addr their --grpc-addr? (%s)", strings.Join(addrs, ","), strings.Join(msgs, "; "))
	}
	// The configuration: the leader's when a node that answered is the
	// leader, else the answer of the first address that answered.
	var conf *clusterpb.StatusResponse
	for _, a := range addrs {
		if st := got[a]; st != nil && (conf == nil || st.State == "Leader") {
			conf = st
		}
	}
	// Ask the members the addresses given do not cover, and those that
	// the leader's view names when the first view came from a follower
	// that had not applied their addresses yet.
	asked := map[string]bool{}
	for _, a := range addrs {
		asked[a] = true
	}
	all := append([]string(nil), addrs...)
	for {
		var more []string
		for _, m := range conf.Members {
			if m.GrpcAddr != "" && !asked[m.GrpcAddr] {
				more = append(more, m.GrpcAddr)
				asked[m.GrpcAddr] = true
			}
		}
		if len(more) == 0 {
			break
		}
		g2, e2 := askStatus(ctx, more, each)
		for a, st := range g2 {
			got[a] = st
		}
		for a, err := range e2 {
			errs[a] = err
		}
		all = append(all, more...)
		if conf.State != "Leader" {
			for _, a := range more {
				if st := g2[a]; st != nil && st.State == "Leader" {
					conf = st
				}
			}
		}
	}

	out := &clusterStatus{Leader: conf.LeaderId, LeaderGRPC: conf.LeaderGrpcAddr}
	byID := map[string]*nodeView{}
	for _, m := range conf.Members {
		v := &nodeView{NodeID: m.NodeId, RaftAddr: m.RaftAddr, GRPCAddr: m.GrpcAddr, Voter: m.Voter, Member: true}
		if m.Voter {
			out.Voters++
		}
		byID[m.NodeId] = v
		out.Nodes = append(out.Nodes, v)
	}
	for _, a := range all {
		st := got[a]
		if st == nil {
			continue
		}
		v := byID[st.NodeId]
		if v == nil { // a node that answered but is not in the configuration shown (removed, or not yet joined)
			v = &nodeView{NodeID: st.NodeId}
			byID[st.NodeId] = v
			out.Nodes = append(out.Nodes, v)
		}
		v.GRPCAddr = a
		v.State, v.Term, v.LeaderID, v.AppliedIndex, v.LastIndex = st.State, st.Term, st.LeaderId, st.AppliedIndex, st.LastIndex
		if out.Leader == "" && st.LeaderId != "" {
			out.Leader, out.LeaderGRPC = st.LeaderId, st.LeaderGrpcAddr
		}
	}
	// The nodes that did not answer, and those that were not asked.
	for _, v := range out.Nodes {
		switch {
		case v.State != "":
		case v.GRPCAddr == "":
			v.Error = "not asked: its gRPC address is not known yet (a node records its own once it sees a leader); add it to --addr"
		case errs[v.GRPCAddr] != nil:
			v.Error = "unreachable: " + oneLine(errs[v.GRPCAddr].Error())
		}
	}
	for _, v := range out.Nodes {
		if v.State == "Leader" && v.NodeID == out.Leader {
			out.Term = v.Term
		}
	}
	slices.SortFunc(out.Nodes, func(a, b *nodeView) int { return strings.Compare(a.NodeID, b.NodeID) })
	return out, nil
}

func (o *clusterOpts) status(ctx context.Context, c *cli, addrs []string) error {
	st, err := o.gatherStatus(ctx, addrs)
	if err != nil {
		return err
	}
	if o.json {
		enc := json.NewEncoder(c.stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(st); err != nil {
			return err
		}
	} else {
		printClusterStatus(c, st)
	}
	if st.Leader == "" {
		fmt.Fprintf(c.stderr, "idem cluster: no node knows a leader: an election is running, or fewer than a majority of the %d voters are up (writes and linearizable reads wait until one is elected)\n", st.Voters)
		return errReported
	}
	return nil
}

func printClusterStatus(c *cli, st *clusterStatus) {
	leader := "none known"
	if st.Leader != "" {
		leader = st.Leader
		if st.LeaderGRPC != "" {
			leader += " (grpc " + st.LeaderGRPC + ")"
		}
		if st.Term != 0 {
			leader += fmt.Sprintf(", term %d", st.Term)
		}
	}
	fmt.Fprintf(c.stdout, "leader:  %s\n", leader)
	fmt.Fprintf(c.stdout, "members: %d voters, a majority is %d: the cluster serves while %d are up\n\n", st.Voters, st.Voters/2+1, st.Voters/2+1)
	tw := tabwriter.NewWriter(c.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tSUFFRAGE\tSTATE\tTERM\tRAFT\tGRPC\tLAST INDEX\tAPPLIED")
	var notes []string
	dash := func(s string) string {
		if s == "" {
			return "-"
		}
		return s
	}
	for _, v := range st.Nodes {
		suffrage := "nonvoter"
		switch {
		case !v.Member:
			suffrage = "not a member"
		case v.Voter:
			suffrage = "voter"
		}
		state, term, last, applied := v.State, fmt.Sprint(v.Term), fmt.Sprint(v.LastIndex), fmt.Sprint(v.AppliedIndex)
		if v.State == "" {
			state, term, last, applied = "?", "-", "-", "-"
			notes = append(notes, v.NodeID+": "+v.Error)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", v.NodeID, suffrage, state, term, dash(v.RaftAddr), dash(v.GRPCAddr), last, applied)
	}
	tw.Flush()
	if len(notes) > 0 {
		fmt.Fprintln(c.stdout)
		for _, n := range notes {
			fmt.Fprintln(c.stdout, n)
		}
	}
}

func (o *clusterOpts) remove(ctx context.Context, c *cli, addrs []string, id string) error {
	cl, err := o.dial(ctx, addrs)
	if err != nil {
		return err
	}
	defer cl.Close()
	// Check the request against the configuration first: raft accepts
	// the removal of a node it does not have (and changes nothing), and
	// refuses the last voter's with an error the client would retry.
	st, err := cl.Status(ctx)
	if err != nil {
		return fmt.Errorf("asking for the members: %w", err)
	}
	var ids []string
	voters, found, voter := 0, false, false
	for _, m := range st.Members {
		ids = append(ids, m.NodeId)
		if m.Voter {
			voters++
		}
		if m.NodeId == id {
			found, voter = true, m.Voter
		}
	}
	if !found {
		// Not a member: removed before (this command run again after its
		// answer was lost), which the cluster remembers and answers as
		// done, or never one (NOT_FOUND).
		err := cl.Remove(ctx, id)
		switch {
		case err == nil:
			fmt.Fprintf(c.stdout, "%s was removed from the cluster before: nothing to do (members: %s)\n", id, strings.Join(ids, ", "))
			return nil
		case status.Code(err) == codes.NotFound:
			return fmt.Errorf("no node %q in the cluster, and none by that name was removed (members: %s): nothing removed; 'idem cluster status' lists them", id, strings.Join(ids, ", "))
		}
		return fmt.Errorf("remove %s: %w", id, err)
	}
	switch {
	case voter && voters == 1:
		return fmt.Errorf("%s is the cluster's last voter: raft cannot remove it (no member would be left); to retire the cluster stop its process, or --join another node first", id)
	}
	if err := cl.Remove(ctx, id); err != nil {
		if errors.Is(err, context.DeadlineExceeded) && (st.LeaderId == "" || strings.Contains(err.Error(), "not the leader") || strings.Contains(err.Error(), "code = Unavailable")) {
			// No leader known, or the one known did not take the call
			// (it said it no longer leads, or it could not be reached).
			known := "none"
			if st.LeaderId != "" {
				known = st.LeaderId
			}
			return fmt.Errorf("no leader answered within %v (the leader known at the start: %s): removing a node needs a leader, so a majority of the %d voters up; see 'idem cluster status', or give a longer --timeout (%v)", o.timeout, known, voters, err)
		}
		if errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("remove %s: not done within %v; 'idem cluster status' shows whether it left (%w)", id, o.timeout, err)
		}
		return fmt.Errorf("remove %s: %w", id, err)
	}
	after, err := cl.Status(ctx)
	if err != nil {
		fmt.Fprintf(c.stdout, "removed %s from the cluster\n", id)
		return fmt.Errorf("removed, but asking for the members afterwards failed: %w", err)
	}
	var left []string
	for _, m := range after.Members {
		s := m.NodeId
		if m.Leader {
			s += " (leader)"
		}
		left = append(left, s)
	}
	fmt.Fprintf(c.stdout, "removed %s from the cluster; members now: %s\n", id, strings.Join(left, ", "))
	fmt.Fprintf(c.stdout, "stop %s's process (idem serve); to bring it back, start it on an empty --dir with --join\n", id)
	switch len(after.Members) {
	case 1:
		fmt.Fprintf(c.stderr, "idem cluster: note: one member left: the cluster stops serving if it goes down\n")
	case 2:
		fmt.Fprintf(c.stderr, "idem cluster: note: two members left: the cluster stops serving if either goes down (a majority of 2 is 2)\n")
	}
	return nil
}

func (o *clusterOpts) forget(ctx context.Context, c *cli, addrs []string) error {
	if o.before == "" {
		return usagef("forget needs --before (for example --before 720h)")
	}
	now := c.now()
	before, err := parseTimeArg(o.before, now)
	if err != nil {
		return err
	}
	if before.After(now) {
		fmt.Fprintf(c.stderr, "idem cluster: note: --before %s is in the future: every reply committed so far is forgotten\n", before.UTC().Format(time.RFC3339Nano))
	}
	cl, err := o.dial(ctx, addrs)
	if err != nil {
		return err
	}
	defer cl.Close()
	if err := cl.Forget(ctx, before); err != nil {
		return fmt.Errorf("forget: %w", err)
	}
	fmt.Fprintf(c.stdout, "forget appended to the cluster's log: every node drops the replies committed before %s (log time)\n", before.UTC().Format(time.RFC3339Nano))
	return nil
}
