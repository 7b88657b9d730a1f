// Package idemraft adds exactly-once request handling to any
// github.com/hashicorp/raft state machine.
//
// Every operation is logged with its request id (or its client and
// sequence number) and the ids of the client's earlier requests whose
// replies it has received; each replica keeps the set of committed ids, in
// an idem engine beside the application's FSM and in the raft snapshots;
// an administrator appends "forget every id older than T" to the log. An
// existing raft application adopts it by wrapping its FSM:
//
//	fsm, err := idemraft.Wrap(myFSM, &idemraft.Options{Dir: "/var/lib/app/dedup"})
//	r, err := raft.NewRaft(conf, fsm, logStore, stableStore, snapshots, transport)
//
//	cmd, err := idemraft.Command(idem.Request{ID: requestID, Acked: ackedIDs}, op)
//	resp := r.Apply(cmd, timeout).Response().(*idemraft.Response)
//
// or, following leader changes and retrying until the reply comes back:
//
//	client, err := idemraft.NewClient(nodes, nil) // nodes: LocalNode, HTTPNode
//	resp, err := client.Do(ctx, idem.Request{ID: requestID}, op)
//
// Every constructor (Wrap, NewClient, LocalNode, HTTPNode, Handler)
// returns its configuration errors, naming the option and its value;
// options go by pointer, nil meaning the defaults.
//
// # Applying a command
//
// The wrapped FSM's Apply runs on raft's FSM goroutine, one entry at a
// time (see Batches for ApplyBatch). For a Command entry it calls the engine's Begin with the request;
// a new request runs the application's Apply with the operation as
// Log.Data (index, term, type and times of the original entry), and the
// result ([]byte, a string, nil or an error) is committed as the request's
// reply in the same Apply. A request committed already gets its stored
// reply (Response.Duplicate) and the application is not called: two
// appends of one request (a retry that reached the log before the first
// was applied) run once. Acked ids are removed in the same Apply. In
// sequence mode (Client and Seq) the engine's rules and errors apply:
// *idem.SequenceGapError, *idem.AlreadyCommittedError, idem.ErrConflict come
// back in Response.Err, and the client's reply window (Request.KeepReplies,
// KeepRepliesFor) travels in the entry, so a retry of an older number
// inside it gets that number's reply. Entries that are not commands (their
// data does not start with the command prefix) go to the application
// untouched.
//
// An error returned by the application is committed as the reply, not
// aborted: the operation ran (a deterministic FSM fails the same way on
// every replica, maybe after changing its state), so a retry must get the
// same error rather than run again. It comes back as *AppError.
//
// No claim stays open across entries, so a request is never "in flight"
// between Applies, and nothing is ever in doubt after a crash.
//
// # Batches
//
// *FSM is a raft.BatchingFSM: raft hands ApplyBatch the entries committed
// together (set raft.Config.BatchApplyCh so that the leader appends, and
// the FSMs apply, many requests at once). ApplyBatch looks each command's
// request up in the dedup set (the engine's Lookup, which answers exactly
// what Begin would), gives the application the new requests' operations
// and the entries that are not commands in log order (in one ApplyBatch
// call if the application implements raft.BatchingFSM, else one Apply per
// entry; configuration changes go to its ApplyBatch, or its
// StoreConfiguration), and writes the new requests' replies in one engine
// batch (idem.Batch.Put, claim and commit in one step): one record for the
// batch instead of two per request, its results appended to a buffer the
// FSM reuses (idem.RunAppender) and clears after reading them. Every entry gets what Apply would give
// it, whatever the batch boundaries, which differ between the leader and
// the followers: the batch is taken in runs, and a run ends before a
// command that names a key a new request of the run writes (its id or
// client, or an id it acks: a second append of a request in one batch is
// answered as a duplicate of the first), before a command whose log time
// differs from the new requests' (each request is committed at its own
// entry's log time, to the millisecond), and at a ForgetCommand. The engine is the FSM's alone and
// only the FSM writes to it, so nothing changes between the lookup and the
// write.
//
// # Time
//
// Every time decision (commit time, per-request TTL and Retention expiry,
// the forget tombstone, leases) is made with the engine clock
// (idem.Options.Clock), and idemraft gives the engine a clock that returns
// the log time of the entry being applied: its AppendedAt rounded down to
// the millisecond, or the largest log time seen so far if that is later,
// so that a new leader whose clock is behind never moves it back. Its
// value is part of the snapshot. (The millisecond lets the entries raft
// appended within one millisecond share a time, so that ApplyBatch
// commits them in one engine record; expiries, forgets and reply windows
// are therefore decided to the millisecond.) Every replica therefore sees the
// same times after the same entries and keeps the same set; the local
// clock decides nothing. (Raft calls Apply, Snapshot and Restore from one
// goroutine; the clock is an atomic so that the engine's background work
// and Lookup read it safely.)
//
// # The dedup directory is derived state
//
// Raft rebuilds a restarted node's state from its snapshot store and log:
// it restores the newest snapshot (or starts from an empty FSM if there is
// none) and applies the log after it. The dedup set must follow the same
// path, or a request already in the node's dedup directory would not reach
// the fresh application FSM during the replay. So Wrap empties Options.Dir
// (refusing a directory it did not create) and starts an empty engine; a
// snapshot's Restore replaces it. The directory is never read at start, so
// no fsync of it protects anything: the raft log store is what makes a
// committed entry durable. Claims are relaxed (RelaxedClaims), and the
// engine writes no log of its own (idem.Options.Ephemeral, as
// idemcluster's engines): no WAL segment, no fsync; its records go to its
// index as soon as they are appended, and the index's ingests by bytes
// keep what it holds within its MemoryBudget. A node crash loses the
// engine's directory contents, which the next start removes anyway. A
// dedup set larger than memory is fine: the
// engine keeps it in Pebble, snapshots stream it out chunk by chunk, and
// Restore streams it back in (idem.Restore); it is never read whole into
// memory. The cost is that a restart rebuilds the set from the snapshot,
// as raft rebuilds the application's state.
//
// # Snapshots
//
// Snapshot (between two Applies) takes the application's FSMSnapshot and a
// point-in-time image of the dedup set (idem.Engine.SnapshotImage: the
// engine writes out its last records and takes a Pebble snapshot, no copy)
// at the same log index. Persist, concurrent with later
// Applies, streams one container: a header, a meta section (log index,
// clock), the dedup set in idem's checksummed snapshot format, and exactly
// the bytes the application's Persist wrote; each section is framed in
// crc32c-checked chunks with a length and checksum at its end. Restore
// discards everything and loads both, all or nothing: the dedup set is
// restored into a new directory beside the current one, the application's
// part is copied to a temporary file while every chunk is checked, and only
// when the whole snapshot is verified does the application's Restore read
// exactly its bytes and the new directory replace the old one. A truncated
// or damaged snapshot returns ErrCorruptSnapshot (or idem.ErrCorrupt) and
// changes nothing.
//
// # Answering from the local set
//
// Submit (and so Handler and Client) answers a request that the leader's
// set holds as committed from that set, without appending anything to the
// log: the engine's Lookup decides, with the fingerprint checked exactly
// as Begin checks it (Stats.LocalDuplicates counts these answers). This is safe without a read
// barrier (raft.VerifyLeader) or a lease, and on a deposed leader too:
//
//   - the set only ever holds requests whose entries were committed by the
//     cluster and applied in log order: a node's applied state is a prefix
//     of the one committed log, whatever it believes about its leadership;
//   - a committed request's reply never changes afterwards; every replica
//     computed the same one at the same log position;
//   - the request took effect at that log position, which lies after the
//     client first sent it and before this answer: a linearization point
//     inside the operation's interval. Reads of other state are not what
//     is answered here; only the request's own outcome.
//
// What a stale node can do is miss a change that removed the id (an ack,
// a forget, a TTL): it then returns the reply of the one execution instead
// of running the request again, which the removal allows but never
// requires; it never runs anything twice. A request it does not hold as
// committed (unknown, other fingerprint, no kept reply) goes through the
// log, where the answer is decided in order.
//
// # Failures
//
// A failure of the dedup engine (a disk error) stops the FSM: that entry
// and all later ones return the error (Err reports it) and the application
// is not called, so its state stays a prefix of the log rather than
// diverging. Restart the node: Wrap rebuilds the set from raft's snapshot
// and log.
//
// Every replica must use the same Options.Engine limits that decide
// answers (Retention, MaxIDLen, MaxReplySize); MaxEntries is refused,
// because capacity eviction is timed by each node, not by the log, and so
// are the options idemraft sets itself (Clock, Sync, SyncInterval,
// RelaxedClaims, KeepSnapshots) and FS. Ephemeral is always set.
//
// raft.Config.NoSnapshotRestoreOnStart is not supported: it is meant for
// applications whose state survives restarts on its own, while the dedup
// set is rebuilt from the snapshot at every start, so the two would
// disagree. The default (restore on start) is what idemraft needs.
package idemraft
