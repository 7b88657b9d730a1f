package idem

import (
	"bytes"
	"context"
	"strings"
	"time"

	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
)

// InDoubtClaim is a claim found in flight when the engine opened: its
// owner crashed (or closed) between Begin and Commit, so whether the side
// effect happened is unknown to idem. Retries see InFlight until the lease
// runs out. Resolve it with Claim.Commit (recover-and-commit) or
// Claim.Abort (recover-and-abort), as a two-phase-commit sink recovers.
type InDoubtClaim struct {
	Scope       string
	ID          []byte // id mode
	Client      string // sequence mode
	Seq         uint64
	Fingerprint []byte // the caller's own copy, as ID
	ClaimedAt   time.Time
	LeaseUntil  time.Time
	Claim       *Claim
}

type inDoubtRef struct {
	key      []byte
	claimLSN wal.LSN
}

// InDoubt lists the claims that were in flight when the engine opened and
// are still unresolved, whose scope starts with scopePrefix ("" lists them
// all): an integration asks for its own scopes (idemhttp's, one sink's).
func (e *Engine) InDoubt(ctx context.Context, scopePrefix string) ([]InDoubtClaim, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if err := e.enter(); err != nil {
		return nil, err
	}
	defer e.leave()
	e.inDoubtMu.Lock()
	defer e.inDoubtMu.Unlock()
	var out []InDoubtClaim
	keep := e.inDoubt[:0]
	for _, r := range e.inDoubt {
		scope, mode, ident, err := index.ParseEntryKey(r.key)
		if err != nil {
			return nil, wrapCorrupt(err)
		}
		unlock := e.lockKeys(r.key)
		sl, err := e.slotLocked(r.key)
		if err != nil {
			unlock()
			return nil, err
		}
		cur := e.current(sl, mode) // a forget may have dropped the claim
		unlock()
		if cur == nil || !cur.InFlight || cur.ClaimLSN != r.claimLSN {
			continue // resolved, forgotten, or taken over by a new claim
		}
		keep = append(keep, r)
		if !strings.HasPrefix(scope, scopePrefix) {
			continue
		}
		// The claim's identifier is r.key's (ident aliases it: the
		// engine's own bytes); the caller gets a copy of its own, which
		// it may reuse while the claim keeps k (TestClaimIDNotCallers).
		k := reqKey{scope: scope, mode: mode, ident: ident, key: r.key}
		d := InDoubtClaim{Scope: scope, Fingerprint: bytes.Clone(cur.ClaimFP), ClaimedAt: time.Unix(0, cur.ClaimTime), LeaseUntil: time.Unix(0, cur.LeaseUntil)}
		if mode == index.ModeID {
			d.ID = bytes.Clone(ident)
		} else {
			d.Client, d.Seq, k.seq = string(k.ident), cur.ClaimSeq, cur.ClaimSeq
		}
		d.Claim = newEngineClaim(e, k, cur.ClaimLSN, d.LeaseUntil)
		out = append(out, d)
	}
	e.inDoubt = keep
	return out, nil
}
