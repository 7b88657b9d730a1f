package main

import (
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/idemdb/idem/idemcluster"
)

var serveCmd = &command{
	name:    "serve",
	args:    "",
	summary: "run a node of an idem cluster (replicated on raft, served over gRPC)",
	help: `
Runs one node of an idem cluster: one exactly-once store shared by a fleet of
processes, replicated on raft (docs/design.md, "The idem cluster").
Applications reach it with idemcluster.Dial (Go) or the gRPC services
idem.cluster.v1.Idem and Cluster (server reflection is on).

A new cluster: start every node with the same --peers list (node id = raft
address, this node included); they bootstrap once. A node for a running
cluster: --join with the gRPC address of any member. A node restarted on its
--dir rejoins with what it has. SIGTERM or SIGINT shut the node down
cleanly (a leader hands leadership over first); a node killed with SIGKILL
loses nothing acknowledged (the raft log is fsynced before an answer).

When the node is up it prints one line: "idem serve: node <id> up: raft
<addr> grpc <addr>".`,
	examples: []string{
		"idem serve --node-id n1 --dir /var/lib/idem/n1 --raft-addr 10.0.0.1:7000 --grpc-addr 10.0.0.1:7070 --peers n1=10.0.0.1:7000,n2=10.0.0.2:7000,n3=10.0.0.3:7000",
		"idem serve --node-id n4 --dir /var/lib/idem/n4 --raft-addr 10.0.0.4:7000 --grpc-addr 10.0.0.4:7070 --join 10.0.0.1:7070",
	},
	setup: func(fs *flag.FlagSet) func(*cli, []string) error {
		o := &serveOpts{}
		fs.StringVar(&o.id, "node-id", "", "this node's `name` in the cluster (required)")
		fs.StringVar(&o.dir, "dir", "", "the node's data `directory` (required)")
		fs.StringVar(&o.raftAddr, "raft-addr", "", "`host:port` raft listens on (required)")
		fs.StringVar(&o.grpcAddr, "grpc-addr", "", "`host:port` the client protocol listens on (required)")
		fs.StringVar(&o.peers, "peers", "", "initial members of a new cluster, `n1=RAFTADDR,n2=RAFTADDR,...`")
		fs.StringVar(&o.join, "join", "", "gRPC `address` of a member of a running cluster to join")
		fs.BoolVar(&o.verbose, "v", false, "log raft's and the node's messages to stderr")
		return o.run
	},
}

type serveOpts struct {
	id, dir, raftAddr, grpcAddr, peers, join string
	verbose                                  bool
}

func parsePeers(s string) (map[string]string, error) {
	out := map[string]string{}
	if s == "" {
		return out, nil
	}
	for _, p := range strings.Split(s, ",") {
		id, addr, ok := strings.Cut(strings.TrimSpace(p), "=")
		if !ok || id == "" || addr == "" {
			return nil, usagef("--peers: %q is not id=host:port", p)
		}
		if _, dup := out[id]; dup {
			return nil, usagef("--peers: node %q is named twice", id)
		}
		out[id] = addr
	}
	return out, nil
}

func (o *serveOpts) run(c *cli, pos []string) error {
	if len(pos) > 0 {
		return usagef("serve takes no positional arguments (got %q)", pos)
	}
	for _, f := range []struct{ name, v string }{{"--node-id", o.id}, {"--dir", o.dir}, {"--raft-addr", o.raftAddr}, {"--grpc-addr", o.grpcAddr}} {
		if f.v == "" {
			return usagef("%s is required", f.name)
		}
	}
	peers, err := parsePeers(o.peers)
	if err != nil {
		return err
	}
	if len(peers) == 0 && o.join == "" {
		return usagef("give --peers (a new cluster) or --join (a running one)")
	}
	if len(peers) > 0 && peers[o.id] != o.raftAddr {
		return usagef("--peers must name this node %q with its --raft-addr %s", o.id, o.raftAddr)
	}
	level := slog.LevelError
	if o.verbose {
		level = slog.LevelInfo
	}
	logger := slog.New(slog.NewTextHandler(c.stderr, &slog.HandlerOptions{Level: level}))
	n, err := idemcluster.StartNode(&idemcluster.NodeOptions{ID: o.id, Dir: o.dir, RaftAddr: o.raftAddr, GRPCAddr: o.grpcAddr,
		Peers: peers, Join: o.join, Logger: logger})
	if err != nil {
		return err
	}
	fmt.Fprintf(c.stdout, "idem serve: node %s up: raft %s grpc %s\n", o.id, n.RaftAddr(), n.Addr())
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	s := <-sig
	fmt.Fprintf(c.stderr, "idem serve: %v: shutting down\n", s)
	return n.Close()
}
