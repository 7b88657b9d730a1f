package idemstream

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemdb/idem"
)

// eventRequest is the claim request of ev in scope: the event id, the
// payload's fingerprint (unless noFingerprint) and the TTL.
func eventRequest(scope string, ev *Event, noFingerprint bool, ttl time.Duration) idem.Request {
	return eventRequestFP(scope, ev, noFingerprint, ttl, nil)
}

// eventRequestFP is eventRequest with the fingerprint from fps (a
// batch's), or its own allocation when fps is nil.
func eventRequestFP(scope string, ev *Event, noFingerprint bool, ttl time.Duration, fps *fingerprints) idem.Request {
	req := idem.Request{Scope: scope, ID: ev.ID, TTL: ttl}
	switch {
	case noFingerprint:
	case fps != nil:
		req.Fingerprint = fps.of(ev.Payload)
	default:
		req.Fingerprint = fingerprint(ev.Payload)
	}
	return req
}

// claimEvent claims ev and classifies the store's answer, the same way for
// Sink.Apply and for each event of TwoPhase.Checkpoint. Exactly one of:
//   - a Fresh claim: the event is to be run (out has only ExpiresAt);
//   - out.Status Replayed: the event was committed before (a redelivery);
//     out carries its stored record;
//   - out.Status Busy: another delivery holds the claim;
//   - err: ErrConflict (the id was committed with another payload),
//     ErrCorruptRecord (its record does not decode), or the store's error.
//
// who names the component in errors ("sink \"ledger\"").
func claimEvent(ctx context.Context, st idem.Store, req idem.Request, who string, ev *Event) (*idem.Claim, Outcome, error) {
	res, err := st.Begin(ctx, req)
	return classifyEvent(res, err, req.Scope, who, ev)
}

// classifyEvent is claimEvent's classification of a Begin's (or a batch
// item's, or a Lookup's: Absent is then the event to run, with no claim)
// answer for ev in scope.
func classifyEvent(res idem.Result, err error, scope, who string, ev *Event) (*idem.Claim, Outcome, error) {
	if err != nil {
		if errors.Is(err, idem.ErrConflict) {
			return nil, Outcome{}, fmt.Errorf("%w: %s, event %q (partition %q, offset %d)", ErrConflict, who, ev.ID, ev.Partition, ev.Offset)
		}
		return nil, Outcome{}, fmt.Errorf("idemstream: %s: claiming event %q: %w", who, ev.ID, err)
	}
	switch res.Status {
	case idem.Fresh, idem.Absent:
		return res.Claim, Outcome{ExpiresAt: res.ExpiresAt}, nil
	case idem.Done:
		rec, err := decodeEventRecord(scope, ev.ID, res.Reply)
		if err != nil {
			return nil, Outcome{}, err
		}
		return nil, Outcome{Status: Replayed, Result: rec.Result, Partition: rec.Partition, Offset: rec.Offset, Checkpoint: rec.Checkpoint,
			ExpiresAt: res.ExpiresAt, outbox: rec.Outbox}, nil
	case idem.InFlight:
		return nil, Outcome{Status: Busy, BusyUntil: res.LeaseUntil, Partition: ev.Partition, Offset: ev.Offset}, nil
	}
	return nil, Outcome{}, fmt.Errorf("idemstream: %s: event %q: unexpected status %v", who, ev.ID, res.Status)
}
