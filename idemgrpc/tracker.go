package idemgrpc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/idemdb/idem/idemgrpc/idemgrpcpb"
	"google.golang.org/grpc"
)

// StateFunc asks the server for a client's last committed sequence number
// in a scope (GetClientState).
type StateFunc func(ctx context.Context, client string, scope []string) (uint64, error)

// ServiceState is a StateFunc calling the ClientState service on cc.
func ServiceState(cc grpc.ClientConnInterface) StateFunc {
	c := idemgrpcpb.NewClientStateClient(cc)
	return func(ctx context.Context, client string, scope []string) (uint64, error) {
		r, err := c.GetClientState(ctx, &idemgrpcpb.GetClientStateRequest{ClientId: client, Scope: scope})
		if err != nil {
			return 0, err
		}
		return r.GetLastCommittedSequence(), nil
	}
}

// Tracker hands out a client's sequence numbers, one stream per scope, as
// per-client sequences require of a client: the number of each new request
// is the last used + 1 and is saved durably before the request is sent;
// retries reuse it (the retry interceptor resends the same message); after
// a restart the client resumes from the saved number; when the saved state
// is lost (or the server reports SEQUENCE_GAP) it asks the server
// (GetClientState) and resumes at the last committed + 1.
//
// Per-client sequences admit one outstanding request per scope: Call holds
// the scope for the request's duration. Use several client ids for
// parallel requests.
type Tracker struct {
	client string
	store  SequenceStore
	state  StateFunc
	o      TrackerOptions

	mu     sync.Mutex
	scopes map[string]chan struct{}
}

// TrackerOptions configure a Tracker. nil or a zero field means its
// default.
type TrackerOptions struct {
	// MaxResyncs bounds how often one Call asks the server and sends again
	// after SEQUENCE_GAP or IDEMPOTENCY_CONFLICT (default 3).
	MaxResyncs int
	// Logger receives warnings (a corrupt saved state). Default: discard.
	Logger *slog.Logger
}

// maxClientID is the engine's bound on a client id (idem.Request.Client).
const maxClientID = 1024

// NewTracker returns a tracker for client (1 to 1024 bytes), saving to
// store and recovering through state (usually ServiceState(conn)).
func NewTracker(client string, store SequenceStore, state StateFunc, opts *TrackerOptions) (*Tracker, error) {
	var o TrackerOptions
	if opts != nil {
		o = *opts
	}
	switch {
	case client == "" || len(client) > maxClientID:
		return nil, fmt.Errorf("idemgrpc: NewTracker: client id of %d bytes; want 1 to %d", len(client), maxClientID)
	case store == nil:
		return nil, errors.New("idemgrpc: NewTracker: the SequenceStore is nil")
	case state == nil:
		return nil, errors.New("idemgrpc: NewTracker: the StateFunc is nil (it recovers a lost state: ServiceState(conn))")
	case o.MaxResyncs < 0:
		return nil, fmt.Errorf("idemgrpc: TrackerOptions.MaxResyncs: %d: negative", o.MaxResyncs)
	}
	if o.MaxResyncs == 0 {
		o.MaxResyncs = 3
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return &Tracker{client: client, store: store, state: state, o: o, scopes: map[string]chan struct{}{}}, nil
}

// Client returns the tracker's client id.
func (t *Tracker) Client() string { return t.client }

// storeKey is the SequenceStore key of client in the scope fields.
func storeKey(client string, scope ...string) string {
	return EncodeScope("seq", client, scope...)
}

func (t *Tracker) logger() *slog.Logger { return t.o.Logger }

// lock takes the scope's turn (bounded by ctx).
func (t *Tracker) lock(ctx context.Context, key string) (func(), error) {
	t.mu.Lock()
	ch := t.scopes[key]
	if ch == nil {
		ch = make(chan struct{}, 1)
		t.scopes[key] = ch
	}
	t.mu.Unlock()
	select {
	case ch <- struct{}{}:
		return func() { <-ch }, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// next reserves last used + 1 and saves it before returning it.
func (t *Tracker) next(ctx context.Context, key string, scope []string) (uint64, error) {
	last, ok, err := t.store.Load(key)
	if errors.Is(err, ErrStateCorrupt) {
		t.logger().Warn("idemgrpc: saved sequence state is corrupt; recovering it from the server", "client", t.client, "scope", scope, "err", err)
		ok, err = false, nil
	}
	if err != nil {
		return 0, err
	}
	if !ok {
		if last, err = t.resync(ctx, key, scope); err != nil {
			return 0, err
		}
	}
	seq := last + 1
	if seq == 0 {
		return 0, fmt.Errorf("idemgrpc: client %q exhausted its sequence numbers in scope %q; use a new client id", t.client, scope)
	}
	if err := t.store.Save(key, seq); err != nil {
		return 0, fmt.Errorf("idemgrpc: saving sequence %d before sending: %w", seq, err)
	}
	return seq, nil
}

// resync asks the server and saves its last committed number as last used.
func (t *Tracker) resync(ctx context.Context, key string, scope []string) (uint64, error) {
	last, err := t.state(ctx, t.client, scope)
	if err != nil {
		return 0, fmt.Errorf("idemgrpc: GetClientState of client %q: %w", t.client, err)
	}
	if err := t.store.Save(key, last); err != nil {
		return 0, err
	}
	return last, nil
}

// Next reserves the next sequence number of the scope for a new request
// and saves it before returning it; send the request with it, and resend
// it (only) to retry that request. Prefer Call, which also handles the
// outcome.
func (t *Tracker) Next(ctx context.Context, scope ...string) (uint64, error) {
	key := storeKey(t.client, scope...)
	unlock, err := t.lock(ctx, key)
	if err != nil {
		return 0, err
	}
	defer unlock()
	return t.next(ctx, key, scope)
}

// Resync asks the server for the client's last committed number in the
// scope and saves it as the last used one: the next request gets it + 1.
func (t *Tracker) Resync(ctx context.Context, scope ...string) (uint64, error) {
	key := storeKey(t.client, scope...)
	unlock, err := t.lock(ctx, key)
	if err != nil {
		return 0, err
	}
	defer unlock()
	return t.resync(ctx, key, scope)
}

// Call runs one new request in the scope: it takes the next sequence number
// (saved before sending), calls send with it, and handles the outcome:
//
//   - success: the number is used.
//   - SEQUENCE_GAP or IDEMPOTENCY_CONFLICT (the number is not the next one
//     or another request holds it; nothing ran): it asks the server
//     (GetClientState), saves its last committed number, and sends again
//     with that + 1, up to MaxResyncs times.
//   - ALREADY_COMMITTED: the number ran before and its reply is gone (the
//     saved state was behind the server, or a retry came after the reply
//     expired). It resyncs for the next request and returns the error:
//     only the caller knows whether this request is the one that ran.
//   - an error the server certifies consumed nothing (a handler's error
//     that DefaultNoEffect accepts, INVALID_IDENTITY, an auth failure): the
//     number is given back (saved as number - 1) so that the next request
//     uses it.
//   - an unknown outcome (Unavailable, DeadlineExceeded, Canceled, Unknown,
//     Internal, IN_FLIGHT, a non-status error) or a consumed one
//     (FAILURE_REPLAYED, RESPONSE_NOT_STORED): the number stays used; if
//     the request never ran, the next one gets SEQUENCE_GAP and recovers.
//
// send must send the same request each time it is called with the same
// number (the retry interceptor inside it resends it as is).
func (t *Tracker) Call(ctx context.Context, scope []string, send func(ctx context.Context, seq uint64) error) error {
	key := storeKey(t.client, scope...)
	unlock, err := t.lock(ctx, key)
	if err != nil {
		return err
	}
	defer unlock()
	seq, err := t.next(ctx, key, scope)
	if err != nil {
		return err
	}
	for resyncs := 0; ; resyncs++ {
		err := send(ctx, seq)
		if err == nil {
			return nil
		}
		reason, _ := ErrorReason(err)
		switch {
		case (reason == ReasonSequenceGap || reason == ReasonConflict) && resyncs < t.o.MaxResyncs:
			if _, rerr := t.resync(ctx, key, scope); rerr != nil {
				return errors.Join(err, rerr)
			}
			var rerr error
			if seq, rerr = t.next(ctx, key, scope); rerr != nil {
				return errors.Join(err, rerr)
			}
			continue
		case reason == ReasonAlreadyCommitted:
			if _, rerr := t.resync(ctx, key, scope); rerr != nil {
				return errors.Join(err, rerr)
			}
		case consumedNothing(err, reason):
			if serr := t.store.Save(key, seq-1); serr != nil {
				return errors.Join(err, serr)
			}
		}
		return err
	}
}

// consumedNothing: the status certifies the request did not commit its
// sequence number: the interceptor's INVALID_IDENTITY, or a handler error
// that DefaultNoEffect accepts (the server aborted its claim). A server with
// another Options.NoEffect heals either way: a number given back that was
// consumed meets IDEMPOTENCY_CONFLICT, one kept that was not meets
// SEQUENCE_GAP, and Call resyncs on both.
func consumedNothing(err error, reason string) bool {
	switch reason {
	case "":
		return DefaultNoEffect(err)
	case ReasonInvalidIdentity:
		return true
	}
	return false
}
