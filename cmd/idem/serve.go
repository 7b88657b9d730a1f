package main

import (
	"flag"
	"fmt"
	"log/slog"
	"net"
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

--grpc-addr is where the client protocol listens; the node publishes a gRPC
address to the others (its entry in the members table, which clients and
'idem cluster' follow): --advertise-addr when given, else --grpc-addr,
which must then name a host. A node listening on every interface
(--grpc-addr :7070 or 0.0.0.0:7070) needs --advertise-addr HOST:PORT, the
address other hosts reach it at; without it the node refuses to start
(it would publish "[::]:7070", which no other host can dial).
--raft-addr is what raft listens on and advertises: it must name a host.

When the node is up it prints one line: "idem serve: node <id> up: raft
<addr> grpc <addr>" (the published gRPC address).`,
	examples: []string{
		"idem serve --node-id n1 --dir /var/lib/idem/n1 --raft-addr 10.0.0.1:7000 --grpc-addr 10.0.0.1:7070 --peers n1=10.0.0.1:7000,n2=10.0.0.2:7000,n3=10.0.0.3:7000",
		"idem serve --node-id n4 --dir /var/lib/idem/n4 --raft-addr 10.0.0.4:7000 --grpc-addr 10.0.0.4:7070 --join 10.0.0.1:7070",
		"idem serve --node-id n5 --dir /var/lib/idem/n5 --raft-addr 10.0.0.5:7000 --grpc-addr :7070 --advertise-addr idem-5.internal:7070 --join 10.0.0.1:7070",
	},
	setup: func(fs *flag.FlagSet) func(*cli, []string) error {
		o := &serveOpts{}
		o.define(fs)
		return o.run
	},
}

// define declares serve's flags into o.
func (o *serveOpts) define(fs *flag.FlagSet) {
	fs.StringVar(&o.id, "node-id", "", "this node's `name` in the cluster (required)")
	fs.StringVar(&o.dir, "dir", "", "the node's data `directory` (required)")
	fs.StringVar(&o.raftAddr, "raft-addr", "", "`host:port` raft listens on (required)")
	fs.StringVar(&o.grpcAddr, "grpc-addr", "", "`host:port` the client protocol listens on (required)")
	fs.StringVar(&o.peers, "peers", "", "initial members of a new cluster, `n1=RAFTADDR,n2=RAFTADDR,...`")
	fs.StringVar(&o.advertise, "advertise-addr", "", "`host:port` other nodes and clients reach the gRPC service at (default: --grpc-addr, which must then name a host)")
	fs.StringVar(&o.join, "join", "", "gRPC `address` of a member of a running cluster to join")
	fs.BoolVar(&o.noLeaseReads, "no-lease-reads", false, "confirm every linearizable read with a leadership round instead of answering on the leader's lease (for a rolling upgrade from a version without leases: every node runs with it until all run this version)")
	fs.BoolVar(&o.verbose, "v", false, "log raft's and the node's messages to stderr")
}

type serveOpts struct {
	id, dir, raftAddr, grpcAddr, advertise, peers, join string
	verbose, noLeaseReads                               bool
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
	level := slog.LevelError
	if o.verbose {
		level = slog.LevelInfo
	}
	no, err := o.nodeOptions(slog.New(slog.NewTextHandler(c.stderr, &slog.HandlerOptions{Level: level})))
	if err != nil {
		return err
	}
	n, err := idemcluster.StartNode(no)
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

// nodeOptions checks the flags and makes the node's options: a mistake is
// a usage error naming the flag, found before anything starts.
func (o *serveOpts) nodeOptions(logger *slog.Logger) (*idemcluster.NodeOptions, error) {
	for _, f := range []struct{ name, v string }{{"--node-id", o.id}, {"--dir", o.dir}, {"--raft-addr", o.raftAddr}, {"--grpc-addr", o.grpcAddr}} {
		if f.v == "" {
			return nil, usagef("%s is required", f.name)
		}
	}
	if everyInterface(o.raftAddr) {
		return nil, usagef("--raft-addr %s names no host: raft advertises the address it listens on, so give the host other nodes reach this node at (such as 10.0.0.1:7000)", o.raftAddr)
	}
	if o.advertise != "" {
		if err := idemcluster.CheckAdvertisable(o.advertise); err != nil {
			return nil, usagef("--advertise-addr: %v", err)
		}
	} else if everyInterface(o.grpcAddr) {
		return nil, usagef("--grpc-addr %s listens on every interface and names no host other nodes and clients can dial: give --advertise-addr HOST:PORT (the address they reach this node at), or a host in --grpc-addr", o.grpcAddr)
	}
	peers, err := parsePeers(o.peers)
	if err != nil {
		return nil, err
	}
	if len(peers) == 0 && o.join == "" {
		return nil, usagef("give --peers (a new cluster) or --join (a running one)")
	}
	if len(peers) > 0 && peers[o.id] != o.raftAddr {
		return nil, usagef("--peers must name this node %q with its --raft-addr %s", o.id, o.raftAddr)
	}
	return &idemcluster.NodeOptions{ID: o.id, Dir: o.dir, RaftAddr: o.raftAddr, GRPCAddr: o.grpcAddr, AdvertiseAddr: o.advertise,
		Peers: peers, Join: o.join, NoLeaseReads: o.noLeaseReads, Logger: logger}, nil
}

// everyInterface reports whether a listen address has no host or an
// unspecified one (":7070", "0.0.0.0:7070", "[::]:7070"): what the
// listener is bound to then names no host another can dial. A malformed
// address is left to the listener's own error.
func everyInterface(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	ip := net.ParseIP(host)
	return host == "" || (ip != nil && ip.IsUnspecified())
}
