// Package idemcluster is an idem cluster: one exactly-once store shared by
// a fleet of processes, replicated on hashicorp/raft.
//
// A Node (what `idem serve` runs) is raft (TCP transport, raft-wal log,
// file snapshots) with a state machine over an idem engine whose clock is
// the log's time; the gRPC services Idem and Cluster (cluster.proto in
// package clusterpb, server reflection on) serve clients in any language.
// A Client (Dial) satisfies idem.Store, so idemhttp, idemgrpc and
// idemstream use a cluster as they use an embedded *idem.Engine:
//
//	c, err := idemcluster.Dial(ctx, []string{"10.0.0.1:7070", "10.0.0.2:7070"}, &idemcluster.Options{Owner: "orders-api@host-3"})
//	mw, err := idemhttp.Middleware(c, nil)
//
// A Fresh Begin, a Commit and an Abort return once a majority has the
// entry. Every request is idempotent across an ambiguous outcome: a Begin
// carries its owner and a token, and its retries get the same claim back;
// a Commit or Abort retried after its answer was lost gets the recorded
// outcome. A claim whose owner died stays in flight until its lease ends
// (in the log's time); a restarted process with the same Owner lists it
// with InDoubt and resolves it. Reads are linearizable (the leader
// confirms its leadership with a majority, and has applied everything
// committed before the read) unless Options.FollowerReads.
//
// idemcluster/README.md shows how to run the nodes, use the cluster from
// Go and from other languages (a grpcurl session) and change its members
// (`idem cluster`); docs/design.md, "The idem cluster", is the design.
package idemcluster
