// Package idemstream gives stream consumers exactly-once side effects with
// idem as the durable, local piece: an idempotent sink, a commit frontier,
// a two-phase-commit coordinator and a transactional outbox, plus sources
// for NATS JetStream and Redis Streams that acknowledge a message only
// after its effect is committed.
//
// "Exactly once" here means the effect of each event happens once, not that
// each message is delivered once: brokers deliver at least once, and every
// redelivery is recognised by its stable event id.
//
// # The windows
//
// A consumer that applies an effect and acknowledges the message can crash
// in between, in one of three ways: the checkpoint is written but the sink
// has not committed; the sink has committed but the message is not acked;
// the message is acked but the sink has not committed. The last one loses
// an effect and must never happen: every consumer here acknowledges only
// after the effect is durably committed. The other two are closed by
// recovery, as follows.
//
// # Idempotent sink (Sink)
//
// Sink.Apply claims the event id in idem (durably), runs the handler,
// and commits one record holding the handler's result, the event's
// partition and offset, and its outbox messages (a small msgpack
// envelope), so that one Claim.Commit makes them durable together.
// Consume does the same for a whole fetched batch with two records when
// the store implements idem.Batcher (an *idem.Engine): one batch claims
// every event, the handlers run, and one batch commits the events that
// ran (each commit with its frontier advance), releases those whose
// handler failed and advances the frontier past replayed deliveries; both
// batches' results go to a buffer the consumer reuses (idem.RunAppender),
// cleared once read. A store without batches (an idemcluster client) gets the same items one
// request at a time; the outcome of each event is the same. The claims
// are durable before any handler runs, as Apply's: a crash before the
// second batch leaves them in doubt, resolved as below. A
// redelivery of a committed id returns the stored result (Replayed) and
// runs nothing; a redelivery while the first delivery still runs is Busy
// (do not ack it); a redelivery with another payload is ErrConflict (the
// payload's SHA-256 is the fingerprint). Each sink has its own TTL
// (SinkOptions.TTL, the engine's Request.TTL): after it, a redelivery runs
// again, on an engine opened with default options.
//
// A crash between the claim and the commit leaves the claim in doubt:
// whether the effect happened is known only to its target. NewSink lists
// those claims (Store.InDoubt) and asks SinkOptions.Recover, which looks
// at the target (the ledger has a row with the event id) and answers
// applied (the claim is committed with the result) or not (it is released
// and the redelivery runs the effect). Without Recover the claims are
// released: exactly once when the handler's only effects are its Effect
// (result and outbox messages), at least once for an external effect in
// that window.
//
// # Commit frontier
//
// Each event's commit raises its partition's frontier in the same engine
// record (idem's Claim.CommitAdvance: the partition is a sequence-mode
// client of the sink's frontier scope, the offset its number, and numbers
// only go up), so after any crash Sink.Frontier is exactly the highest
// committed offset: no effect above it, no offset without its effect. A
// consumer resumes at Frontier+1. A redelivery of a committed event found
// at a higher offset (the event published again) is replayed and moves the
// frontier past it (Store.Advance); a plain redelivery writes nothing.
// Offsets may have gaps. The frontier is the highest committed offset, not
// the end of a contiguous run: see Sink.Frontier for concurrent batches.
//
// # Two-phase commit (TwoPhase)
//
// TwoPhase coordinates a TwoPhaseCommitSink (BeginTransaction,
// Invoke, PreCommit, Commit, Abort, RecoverAndCommit, RecoverAndAbort)
// with idem as its log. Checkpoint k runs: look every event of the batch
// up (redeliveries of committed events are Replayed, events in progress
// elsewhere Busy; nothing is written for a batch of redeliveries);
// BeginTransaction, as soon as the first new event is found; record the
// opening of k with the transaction handle (record 1, written while the
// rest of the batch is looked up and the new events are invoked, durable
// before PreCommit); Invoke each new event; PreCommit; record the checkpoint (record 2: the pre-committed
// handle, the event ids and the frontier, "state + offsets + txn
// handle", raising the frontier, and every new event committed by a Put,
// in one batch); Commit; and only then may the consumer ack the batch.
// Two records per checkpoint, whatever its size.
// Transaction handles are serialized with msgpack, bounded
// (TwoPhaseOptions.MaxHandleSize) and sealed (magic, version, length,
// CRC-32C); a record that fails validation stops recovery with
// ErrCorruptRecord instead of committing garbage.
//
// Recovery (NewTwoPhase) reads the last checkpoint: if its record with the
// handle is durable and the sink's commit is not recorded (the commit is
// recorded by recovery only), it calls RecoverAndCommit (which must be
// idempotent), puts every event the record lists that is not committed,
// and records the commit; if only its opening is durable, it calls
// RecoverAndAbort; a checkpoint begun without a durable handle is aborted
// through CheckpointAborter if the sink implements it. Events left in
// doubt (claims of a store without batches, or of earlier versions) are
// committed if the recovered checkpoint lists them, and released
// otherwise, so that their redelivery runs them in a later checkpoint. A
// crash during recovery is recovered the same way (every step is
// idempotent).
//
// Why a crash anywhere is still exactly once: an event is committed in
// idem (its redeliveries replay) exactly when the record of its
// checkpoint is durable, because both are in one batch, which a store
// with batches writes as one record (all or nothing). Before that record
// the transaction is at most pre-committed and recovery aborts it (from
// the opening record, or by checkpoint id when even the opening is not
// durable), so the events run again when redelivered; after it, recovery
// commits the transaction (again, idempotently) and the events replay.
// The sink's own two-phase commit makes the effect durable, so the event
// needs no claim of its own before it runs: one coordinator per name and
// store is the only writer of its event scope, so an event looked up
// absent is still absent when its checkpoint is recorded. A store without
// batches writes the checkpoint record first and the events after it: a
// crash in between leaves events the record lists but idem does not hold,
// and recovery puts them (with their fingerprints, from the record)
// before anything is acknowledged. The frontier's advances are part of
// the checkpoint record's own item, so the frontier is never ahead of or
// behind a checkpoint.
//
// # Outbox (Outbox)
//
// A handler may return outbox messages instead of performing an external
// effect: they are committed in the event's record, so they exist exactly
// when the event is committed. Each is then registered as a pending
// delivery (an idem claim on its delivery key, left in flight), and the
// dispatcher (Outbox.Run) delivers it with retries and exponential
// backoff, then releases the claim, which removes it. Every attempt
// carries the same Delivery.Key, so the receiver drops repeats (a crash
// after the send resends). After a crash, the pending deliveries are the
// claims idem lists as in doubt, and their payloads are read back from the
// event records. Outbox.Stats reports the backlog.
//
// # Brokers
//
// The broker sources are packages of their own, so that a program using
// one broker (or none) links only its client: idemstream/jetstream and
// idemstream/redisstream; the Prometheus collector is idemstream/streamprom.
//
// jetstream.Source reads a durable JetStream pull consumer (AckExplicit):
// a message is double-acked after its effect is committed; until then
// JetStream redelivers it after AckWait, to this or another subscriber.
// redisstream.Source reads a consumer group with XREADGROUP, acknowledges
// with XACK after the commit, re-reads its own pending entries after a
// restart and takes over entries idle on other consumers with XAUTOCLAIM.
// A redelivered or claimed message whose event is committed is replayed
// and acked; one whose first delivery is still running is Busy and left
// pending. Consumers that share effects share one engine (one process):
// idem is an embedded engine.
//
// Consume and ConsumeTwoPhase drive a Source through a Sink or a TwoPhase.
//
// # Poison messages
//
// A delivery whose processing failed is settled with the broker, never
// left to be redelivered forever: an event that fails for good
// (ErrConflict, ErrInvalidEvent, a handler error wrapping ErrPermanent) is
// terminated at once; one whose handler (or Invoke) keeps failing is handed
// back with a growing delay (Message.Nak: JetStream NakWithDelay; a Redis
// entry stays pending and is re-read) and terminated at its
// ConsumeOptions.MaxDeliveries-th delivery (default 5). Terminating hands
// the message with its reason to the source's dead-letter destination if
// it has one (jetstream.Options.DeadLetterSubject,
// redisstream.Options.DeadLetterStream), then ends it at the broker
// (JetStream term, XACK). Each termination is logged at error level and
// counted (SinkStats / TwoPhaseStats Terminated and DeadLettered, and
// streamprom's collector).
//
// # Store and options
//
// Every component takes an idem.Store (an *idem.Engine, or another store)
// and its options by pointer: nil means the defaults, a zero field its
// default, and a bad value is a returned error naming the field. A claim's
// Commit and Abort are written whatever the caller's ctx says (the Store
// contract), so a cancelled request never strands an event in flight.
//
// # Records
//
//	scope "idemstream/<sink>"            id = event id -> envelope, a msgpack array [version 1, result, partition, offset,
//	                                     checkpoint, outbox] (maps keyed by field name, written before, still decode)
//	scope "idemstream.frontier/<sink>"   client "p:<partition>": its number is the frontier (raised by the event commits,
//	                                     and by each two-phase checkpoint record)
//	scope "idemstream.2pc/<name>"        client "ckpt", seq k -> sealed {k, handle, frontier}
//	                                     id "c/<k>" -> sealed {k, handle, event ids, event fingerprints, frontier}
//	                                     id "d/<k>" / "a/<k>" -> sealed {k, frontier} (committed by recovery / aborted)
//	scope "idemstream.outbox/<outbox>"   id = msgpack [sink, event id, index] (in flight while pending)
//
// What each batch holds (one engine record each on a store with batches;
// in this order, one request at a time, on a store without):
//
//	sink, per fetched batch    1: Begin of every event
//	                           2: Commit of each event that ran (its envelope, with Advance p:<partition> to its offset),
//	                              Abort of each whose handler failed, Advance past replayed deliveries above the frontier
//	two-phase, per checkpoint  1: Put client "ckpt" seq k (the opening); Ack of c/<k-1>, d/<k-1>, a/<k-1>
//	                           2: Put c/<k> with the Advances of the frontier; Put of each new event (envelope with
//	                              checkpoint k, partition, offset)
//	                           (an abort: Put a/<k>; recovery: Puts of listed events missing, then Put d/<k>)
package idemstream
