package idem

import (
	"context"
	"errors"
	"time"
)

// Store is what the integrations (idemhttp, idemgrpc, idemstream,
// idemprom) need of an exactly-once store, and all they use: *Engine
// satisfies it in one process, a replicated cluster's client across a
// fleet, and a test double in a test.
//
// Every method has the meaning documented on Engine's method of the same
// name. A Store that talks to a server bounds its calls with ctx; where
// the answer is lost after the request may have taken effect, it returns
// an error matching ErrInDoubt, never one that says "not done".
type Store interface {
	Begin(ctx context.Context, req Request) (Result, error)
	Lookup(ctx context.Context, req Request) (Result, error)
	Wait(ctx context.Context, req Request) (Result, error)
	Ack(ctx context.Context, scope string, ids ...[]byte) error
	Advance(ctx context.Context, adv ...Advance) error
	ClientState(ctx context.Context, scope, client string) (uint64, error)
	InDoubt(ctx context.Context, scopePrefix string) ([]InDoubtClaim, error)
	// Now is the store's clock: code built on a Store uses it for every
	// time decision (a test with a fake clock sees one time everywhere).
	Now() time.Time
	Stats() Stats
}

var _ Store = (*Engine)(nil)

// ClaimBackend finishes the claims of a Store other than *Engine: it is
// the store's side of a Claim, as database/sql's driver.Tx is to sql.Tx.
// Claim (made by NewClaim) keeps the rules common to every store: one
// finish per claim (a second Commit or Abort is ErrLeaseLost without
// calling the backend), a nil reply stored as an empty one, and a claim
// that stays open when the backend wrote nothing (ErrInvalidRequest,
// ErrInFlight).
//
// Commit and Abort must write their record whatever ctx says once they
// are called; ctx may only bound how long they wait for the outcome, and
// a wait cut short returns an error matching ErrInDoubt. A backend may be
// called again after an ErrInDoubt (the caller retries the same finish),
// so both must be idempotent for their claim.
type ClaimBackend interface {
	// Commit stores reply as the claim's reply and raises the clients
	// adv in the same atomic step (adv is empty for a plain Commit).
	Commit(ctx context.Context, reply []byte, adv []Advance) error
	// Abort releases the claim's id.
	Abort(ctx context.Context) error
}

// NewClaim returns a Claim finished by b, whose lease runs until
// leaseUntil: what a Store other than *Engine hands out in Result.Claim
// and InDoubtClaim.Claim.
func NewClaim(b ClaimBackend, leaseUntil time.Time) *Claim {
	return &Claim{b: b, leaseUntil: leaseUntil}
}

// Do runs fn exactly once for req on s: a new request runs fn and commits
// its reply (or aborts on its error, so that a retry runs again); a
// committed request returns the stored reply; while another caller runs
// it, Do waits for it (bounded by ctx). If fn panics the claim is aborted
// and the panic goes on. Once fn has run, its Commit (or Abort) is written
// whatever ctx says (see Claim).
func Do(ctx context.Context, s Store, req Request, fn func(context.Context) ([]byte, error)) ([]byte, error) {
	for {
		res, err := s.Begin(ctx, req)
		if err != nil {
			return nil, err
		}
		switch res.Status {
		case Done:
			return res.Reply, nil
		case Fresh:
			return run(ctx, res.Claim, fn)
		case InFlight:
			if _, err := s.Wait(ctx, req); err != nil {
				return nil, err
			}
		}
	}
}

func run(ctx context.Context, c *Claim, fn func(context.Context) ([]byte, error)) (reply []byte, err error) {
	done := false
	defer func() {
		if !done {
			_ = c.Abort(ctx)
		}
	}()
	reply, err = fn(ctx)
	done = true
	if err != nil {
		if aerr := c.Abort(ctx); aerr != nil {
			return nil, errors.Join(err, aerr)
		}
		return nil, err
	}
	if err := c.Commit(ctx, reply); err != nil {
		return nil, err
	}
	return reply, nil
}

// Do is the package function Do on e.
func (e *Engine) Do(ctx context.Context, req Request, fn func(context.Context) ([]byte, error)) ([]byte, error) {
	return Do(ctx, e, req, fn)
}
