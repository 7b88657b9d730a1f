package idemhttp

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemdb/idem"
)

// InDoubt is a request whose claim a crash (or Close) left in flight: the
// handler may or may not have made its side effect.
type InDoubt struct {
	// Actor is the actor the key belongs to (Options.Actor; empty for the
	// shared space). When ActorHashed is set it is the hex SHA-256 of an
	// actor longer than MaxVerbatimActor bytes.
	Actor       string
	ActorHashed bool
	// Key is the Idempotency-Key.
	Key string
	// ClaimedAt is when the request claimed the key (the store's clock).
	ClaimedAt time.Time
	// Scope is the store scope (ScopeFor(Options.ScopePrefix, Actor)).
	Scope string
}

// ResolveInDoubt settles the keys of a middleware built with opts (the same
// Options.ScopePrefix) that a crash left in doubt; keys of other prefixes
// and entries written by anything else are left alone. decide looks in the
// service's own state (which should keep the key with the records its
// handler writes): if the request's effect happened it returns the
// response a retry must get and true (the claim is committed with it, so
// retries replay it); if not, false (the claim is aborted and a retry runs
// the handler). Call it after opening the store, before serving. An error
// from decide, or from the store, stops it; what was settled stays
// settled.
func ResolveInDoubt(ctx context.Context, store idem.Store, opts *Options, decide func(InDoubt) (*StoredResponse, bool, error)) (committed, aborted int, err error) {
	if store == nil {
		return 0, 0, errors.New("idemhttp: ResolveInDoubt needs a store (got nil)")
	}
	if decide == nil {
		return 0, 0, errors.New("idemhttp: ResolveInDoubt needs a decide function (got nil)")
	}
	c, err := newConfig(opts)
	if err != nil {
		return 0, 0, err
	}
	claims, err := store.InDoubt(ctx, scopePrefixOf(c.prefix).String())
	if err != nil {
		return 0, 0, fmt.Errorf("idemhttp: listing the keys in doubt: %w", err)
	}
	for _, cl := range claims {
		k, ok := ParseKey(cl.Scope, cl.ID)
		if !ok || k.Prefix != c.prefix {
			continue
		}
		d := InDoubt{Actor: k.Actor, ActorHashed: k.ActorHashed, Key: k.Key, ClaimedAt: cl.ClaimedAt, Scope: cl.Scope}
		resp, ran, err := decide(d)
		if err != nil {
			return committed, aborted, err
		}
		if !ran {
			if err := cl.Claim.Abort(ctx); err != nil {
				return committed, aborted, fmt.Errorf("idemhttp: aborting key %q in doubt: %w", d.Key, err)
			}
			aborted++
			continue
		}
		if resp == nil {
			return committed, aborted, fmt.Errorf("idemhttp: ResolveInDoubt: decide says key %q ran but gives no response", d.Key)
		}
		reply, err := resp.Encode()
		if err != nil {
			return committed, aborted, fmt.Errorf("idemhttp: key %q in doubt: %w", d.Key, err)
		}
		if err := cl.Claim.Commit(ctx, reply); err != nil {
			return committed, aborted, fmt.Errorf("idemhttp: committing key %q in doubt: %w", d.Key, err)
		}
		committed++
	}
	return committed, aborted, nil
}
