package idemstream

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"time"

	"github.com/idemdb/idem/internal/msgp"
	"github.com/vmihailenco/msgpack/v5"
)

// Event is one message of a stream, as the sinks see it.
type Event struct {
	// ID is the stable event id: the same for every delivery of the event
	// (a producer-assigned id such as NATS's Nats-Msg-Id, a business key,
	// or else "<stream>/<position>"). It is the dedup key. Required,
	// 1..MaxEventIDLen bytes.
	ID []byte
	// Partition names the ordered log the event comes from (a NATS stream,
	// a Redis stream key, a Kafka topic-partition). Frontiers are kept per
	// partition. May be empty (one partition).
	Partition string
	// Offset is the event's position in its partition (a JetStream stream
	// sequence, a Redis stream id packed by redisstream.Offset, a Kafka offset).
	// Offsets grow along a partition and may have gaps. Zero means "no
	// position": the frontier is not advanced for the event.
	Offset uint64
	// Payload is the event's body. Its SHA-256 is the fingerprint: a
	// redelivery of the same id with another payload is ErrConflict.
	Payload []byte
}

// MaxEventIDLen bounds Event.ID (the engine's default MaxIDLen, 1024, minus
// room for the delivery keys derived from it).
const MaxEventIDLen = 512

func (ev *Event) validate() error {
	if len(ev.ID) == 0 {
		return fmt.Errorf("%w: event has no id (partition %q, offset %d)", ErrInvalidEvent, ev.Partition, ev.Offset)
	}
	if len(ev.ID) > MaxEventIDLen {
		return fmt.Errorf("%w: event id is %d bytes, more than %d (partition %q, offset %d)", ErrInvalidEvent, len(ev.ID), MaxEventIDLen, ev.Partition, ev.Offset)
	}
	if len(ev.Partition) > MaxEventIDLen {
		return fmt.Errorf("%w: partition name is %d bytes, more than %d", ErrInvalidEvent, len(ev.Partition), MaxEventIDLen)
	}
	return nil
}

func fingerprint(payload []byte) []byte {
	s := sha256.Sum256(payload)
	return s[:]
}

// fingerprints hands out the fingerprints of a batch's events from one
// allocation.
type fingerprints struct{ buf []byte }

// reserve makes room for the fingerprints of n events in one allocation.
func (f *fingerprints) reserve(n int) {
	if len(f.buf) < n*sha256.Size {
		f.buf = make([]byte, n*sha256.Size)
	}
}

func (f *fingerprints) of(payload []byte) []byte {
	if len(f.buf) < sha256.Size {
		f.buf = make([]byte, 64*sha256.Size)
	}
	s := sha256.Sum256(payload)
	fp := f.buf[:sha256.Size:sha256.Size]
	copy(fp, s[:])
	f.buf = f.buf[sha256.Size:]
	return fp
}

// OutboxMessage is a side effect recorded in idem together with the event's
// dedup entry and delivered later by an Outbox's dispatcher.
type OutboxMessage struct {
	// Destination tells the Deliver function where the message goes (a
	// URL, a topic); free form.
	Destination string `msgpack:"d"`
	Payload     []byte `msgpack:"p"`
}

// Effect is what a Handler returns for an event: the result to store and
// replay for redeliveries, and the outbox messages to record with it.
type Effect struct {
	Result []byte
	Outbox []OutboxMessage
}

// Status says what a sink did with an event.
type Status int

const (
	// Applied: the event's effect ran now and is committed.
	Applied Status = iota + 1
	// Replayed: the event was committed before (a redelivery); its stored
	// result is returned and nothing ran.
	Replayed
	// Busy: another delivery of the same event is being processed right
	// now (in this process, or left in doubt by a crash and not resolved
	// yet). Do not acknowledge this delivery: the one in progress will be
	// acknowledged, or the source redelivers it later.
	Busy
	// Failed: the event was not processed (Outcome.Err says why: an
	// invalid event, or ErrConflict); it is not acknowledgeable. Only
	// TwoPhase.Checkpoint reports it (Sink.Apply returns the error).
	Failed
)

func (s Status) String() string {
	switch s {
	case Applied:
		return "applied"
	case Replayed:
		return "replayed"
	case Busy:
		return "busy"
	case Failed:
		return "failed"
	}
	return fmt.Sprintf("status(%d)", int(s))
}

// Ackable reports whether the delivery may be acknowledged to the source:
// its effect is durably committed.
func (s Status) Ackable() bool { return s == Applied || s == Replayed }

// EventError is the error of one event's processing in a checkpoint
// (TwoPhaseCommitSink.Invoke failed for it, which aborted the checkpoint).
// TwoPhase.Checkpoint returns it wrapped; ConsumeTwoPhase counts it as that
// event's failure (ConsumeOptions.MaxDeliveries).
type EventError struct {
	ID  []byte
	Err error
}

func (e *EventError) Error() string { return fmt.Sprintf("event %q: %v", e.ID, e.Err) }
func (e *EventError) Unwrap() error { return e.Err }

// Outcome is what a sink did with an event.
type Outcome struct {
	Status Status
	// Result is the handler's result (Applied) or the stored one (Replayed).
	Result []byte
	// Partition and Offset are those committed with the event (for a
	// replay, those of the delivery that ran it).
	Partition string
	Offset    uint64
	// Checkpoint is the two-phase-commit checkpoint that committed the
	// event (TwoPhase only).
	Checkpoint uint64
	// ExpiresAt is when the event's dedup entry expires (zero: never).
	ExpiresAt time.Time
	// BusyUntil is when the claim of the delivery in progress runs out (Busy).
	BusyUntil time.Time
	// Err is why the event Failed.
	Err error

	outbox []OutboxMessage // of a replayed event's record
}

// window names a point of the exactly-once protocols where a crash is
// possible; the fault-injection tests crash at each one.
type window string

const (
	// Idempotent sink (and each event of a two-phase checkpoint).
	windowAfterClaim  window = "after-claim"  // event claimed durably, effect not run
	windowAfterEffect window = "after-effect" // effect ran, not committed
	windowAfterCommit window = "after-commit" // event and frontier committed, outbox not registered
	// Two-phase commit, in protocol order.
	windowBeforePreCommit window = "before-pre-commit"  // events invoked into the transaction
	windowAfterPreCommit  window = "after-pre-commit"   // pre-committed, checkpoint not durable
	windowAfterCheckpoint window = "after-checkpoint"   // checkpoint with the handle durable, sink not committed
	windowAfterSinkCommit window = "after-sink-commit"  // sink committed, not recorded
	windowBeforeAck       window = "before-ack"         // everything committed and recorded, source not acked
	windowDuringRecovery  window = "during-recovery"    // recovery re-committed the sink, not recorded yet
	windowBeforeDelivery  window = "outbox-before-send" // outbox message pending, not sent
	windowAfterDelivery   window = "outbox-after-send"  // outbox message sent, not marked delivered
)

// Errors of the package; match them with errors.Is.
var (
	// ErrInvalidEvent: the event cannot be processed (no id, too long).
	ErrInvalidEvent = errors.New("idemstream: invalid event")
	// ErrConflict: the event id was committed with another payload.
	ErrConflict = errors.New("idemstream: event id already committed with a different payload")
	// ErrPermanent: a Handler's error that wraps it fails the event for
	// good: the consumers terminate it (to the source's dead-letter
	// destination) at once instead of having it redelivered.
	ErrPermanent = errors.New("idemstream: event failed for good")
	// ErrCorruptRecord: a record read back from idem failed validation
	// (version, checksum, size bound); the message says which.
	ErrCorruptRecord = errors.New("idemstream: corrupt record")
	// ErrTooLarge: a result, outbox or transaction handle exceeds its bound.
	ErrTooLarge = errors.New("idemstream: record too large")
	// ErrNeedsRecovery: a step whose outcome is unknown failed (the engine
	// failed while recording a checkpoint, or the sink's commit of a
	// recorded checkpoint kept failing). Nothing more is done until the
	// coordinator is recreated, which runs recovery.
	ErrNeedsRecovery = errors.New("idemstream: coordinator must be recovered (recreate it)")
	// ErrClosed: the component was closed.
	ErrClosed = errors.New("idemstream: closed")
	// ErrInUse: another component of the same name is open on the engine.
	ErrInUse = errors.New("idemstream: name already in use on this engine")
)

// eventRecord is the reply committed for an event: the effect's result,
// the position it came from (the frontier) and its outbox messages, in one
// record so that one Claim.Commit makes them durable together.
//
// It is written as a msgpack array of its six fields in this order, with
// integers in their shortest form:
//
//	[1, result (bin or nil), partition (str), offset, checkpoint, outbox (nil or [{"d": dest, "p": payload}, ...])]
//
// Versions before this one wrote a msgpack map keyed by the field names
// ({"Version": 1, "Result": ..., ...}; the as_array tag they carried was
// misspelt and had no effect); decodeEventRecord reads both, and a
// version that wrote maps reads the arrays too (msgpack v5 decodes a
// struct from an array of its fields in order). The field order and
// count are frozen: a new field needs a new version.
type eventRecord struct {
	_msgpack   struct{}        `msgpack:",as_array"`
	Version    uint8           // 1
	Result     []byte          //
	Partition  string          //
	Offset     uint64          //
	Checkpoint uint64          // two-phase commit: the checkpoint that committed it
	Outbox     []OutboxMessage //
}

const eventRecordVersion = 1

func encodeEventRecord(r *eventRecord) ([]byte, error) {
	r.Version = eventRecordVersion
	var buf bytes.Buffer
	enc := msgpack.NewEncoder(&buf)
	enc.UseCompactInts(true)
	if err := enc.Encode(r); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// eventRecordEncoder encodes event records without an outbox (a result,
// a position, a checkpoint) byte for byte as encodeEventRecord does
// (TestEventRecordEncoder), appending the msgpack values directly
// (internal/msgp: no reflection, no Encoder calls) into shared chunks: no
// allocation per event. The slices it returns stay valid (a full chunk is
// left to them, never reused). Not safe for concurrent use.
type eventRecordEncoder struct {
	b []byte
}

// eventRecordOverhead bounds what an event record without an outbox adds
// to its result and partition.
const eventRecordOverhead = 32

func (e *eventRecordEncoder) encode(result []byte, checkpoint uint64, partition string, offset uint64) []byte {
	need := eventRecordOverhead + len(partition) + len(result)
	if cap(e.b)-len(e.b) < need {
		e.b = make([]byte, 0, max(16<<10, need))
	}
	start := len(e.b)
	// encodeEventRecord's encoding: an array of the six fields, version 1.
	b := msgp.AppendArrayLen(e.b, 6)
	b = msgp.AppendUint(b, eventRecordVersion)
	b = msgp.AppendBytes(b, result) // nil as nil
	b = msgp.AppendString(b, partition)
	b = msgp.AppendUint(b, offset)
	b = msgp.AppendUint(b, checkpoint)
	b = append(b, 0xc0) // nil: no outbox
	e.b = b
	return b[start:len(b):len(b)]
}

func decodeEventRecord(scope string, id, b []byte) (*eventRecord, error) {
	var r eventRecord
	if err := unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("%w: event %q in scope %q: %v", ErrCorruptRecord, id, scope, err)
	}
	if r.Version != eventRecordVersion {
		return nil, fmt.Errorf("%w: event %q in scope %q: record version %d, want %d", ErrCorruptRecord, id, scope, r.Version, eventRecordVersion)
	}
	return &r, nil
}

// Sealed records (checkpoints and transaction handles): magic, version,
// length and CRC-32C of the msgpack body, so that a record read back is
// checked before anything in it is trusted.
//
//	"ISCK" | version u8 | length u32 | crc32c u32 | body
var sealMagic = []byte("ISCK")

const sealVersion = 1

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func seal(v any, maxBody int) ([]byte, error) {
	var out []byte
	if c, ok := v.(*checkpointRecord); ok {
		out = c.appendBody(make([]byte, sealHeader, sealHeader+c.sizeHint()))
	} else {
		body, err := msgpack.Marshal(v)
		if err != nil {
			return nil, err
		}
		out = append(make([]byte, sealHeader, sealHeader+len(body)), body...)
	}
	body := out[sealHeader:]
	if len(body) > maxBody {
		return nil, fmt.Errorf("%w: %d bytes, bound %d", ErrTooLarge, len(body), maxBody)
	}
	copy(out, sealMagic)
	out[4] = sealVersion
	binary.BigEndian.PutUint32(out[5:9], uint32(len(body)))
	binary.BigEndian.PutUint32(out[9:13], crc32.Checksum(body, castagnoli))
	return out, nil
}

// sealHeader is the length of a sealed record's header.
const sealHeader = 13

func unseal(b []byte, maxBody int, v any) error {
	if len(b) < 13 || !bytes.Equal(b[:4], sealMagic) {
		return fmt.Errorf("%w: no record header (%d bytes)", ErrCorruptRecord, len(b))
	}
	if b[4] != sealVersion {
		return fmt.Errorf("%w: record version %d, this build reads %d", ErrCorruptRecord, b[4], sealVersion)
	}
	n := binary.BigEndian.Uint32(b[5:9])
	if int64(n) > int64(maxBody) {
		return fmt.Errorf("%w: record body of %d bytes exceeds the bound %d", ErrCorruptRecord, n, maxBody)
	}
	body := b[13:]
	if uint32(len(body)) != n {
		return fmt.Errorf("%w: record body is %d bytes, header says %d", ErrCorruptRecord, len(body), n)
	}
	if crc32.Checksum(body, castagnoli) != binary.BigEndian.Uint32(b[9:13]) {
		return fmt.Errorf("%w: record checksum mismatch", ErrCorruptRecord)
	}
	if err := unmarshal(body, v); err != nil {
		return fmt.Errorf("%w: record body: %v", ErrCorruptRecord, err)
	}
	return nil
}
