package idemgrpc

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
)

// Defaults of RetryOptions.
const (
	// DefaultPerAttemptTimeout bounds each attempt when
	// RetryOptions.PerAttemptTimeout is zero.
	DefaultPerAttemptTimeout = 10 * time.Second
	// DefaultKeepaliveTime and DefaultKeepaliveTimeout are the keepalive
	// pings DialOptions sets when RetryOptions.Keepalive is zero: after
	// DefaultKeepaliveTime without activity while calls are outstanding
	// the client pings, and closes the connection if no answer comes within
	// DefaultKeepaliveTimeout.
	DefaultKeepaliveTime    = 30 * time.Second
	DefaultKeepaliveTimeout = 10 * time.Second
)

// RetryOptions configure UnaryClientInterceptor and DialOptions. nil or a
// zero field means its default.
type RetryOptions struct {
	// MaxAttempts is the number of attempts of one call, the first
	// included (default 8). Negative: no limit but the call's context.
	MaxAttempts int
	// InitialBackoff is the delay before the first retry (default 50ms);
	// each further retry multiplies it by Multiplier (default 2, at least
	// 1) up to MaxBackoff (default 5s, at least InitialBackoff). Every
	// delay is jittered by ±Jitter (default 0.2, i.e. ±20%, at most 1) so
	// that clients that failed together do not retry together. A server's
	// RetryInfo advice, when longer, wins.
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	Multiplier     float64
	Jitter         float64
	// PerAttemptTimeout bounds each attempt (default
	// DefaultPerAttemptTimeout, 10s; it cannot be turned off: an attempt
	// on a connection whose peer vanished would otherwise wait for the
	// call's whole deadline, or forever). An attempt that runs out is
	// retried while the call's context lives; with DialOptions the retry
	// goes out on a new connection (see there). Set it above the slowest
	// handler's time and above the time to open a connection: the server
	// stores what a handler that ran returns, even after the attempt gave
	// up, and the retry gets it, but an attempt that always runs out never
	// succeeds.
	PerAttemptTimeout time.Duration
	// Keepalive is what DialOptions sets with grpc.WithKeepaliveParams
	// (zero: Time DefaultKeepaliveTime, Timeout DefaultKeepaliveTimeout,
	// no pings without calls; a zero Timeout alone: the default). A
	// negative Time sets no keepalive. The server must allow pings this
	// often (grpc.KeepaliveEnforcementPolicy with MinTime at most Time;
	// grpc-go's default of 5 minutes answers more frequent pings with
	// GOAWAY too_many_pings, which closes the connection).
	Keepalive keepalive.ClientParameters
	// Dial opens DialOptions' connections (default: TCP with
	// net.Dialer). DialOptions wraps it to know its connections; a
	// grpc.WithContextDialer given after DialOptions' options replaces it
	// and disables the reconnection after a timeout.
	Dial func(ctx context.Context, addr string) (net.Conn, error)
	// Methods selects the methods that are retried (nil: every method the
	// interceptor sees). Retrying is only safe for methods the server runs
	// exactly once (or that are idempotent anyway).
	Methods func(fullMethod string) bool
	// OnRetry, if set, is called before each retry (for metrics or logs).
	OnRetry func(fullMethod string, attempt int, err error, delay time.Duration)

	// now and sleep replace the clock in tests (export_test.go).
	now   func() time.Time
	sleep func(ctx context.Context, d time.Duration) error
}

// Retryable reports whether a failed call may be sent again with the same
// identity, as UnaryClientInterceptor decides: Unavailable, DeadlineExceeded
// (while ctx, the call's own context, lives), and the interceptor's
// IN_FLIGHT and LEASE_LOST (Aborted). Every other status is final for that
// identity: SEQUENCE_GAP, ALREADY_COMMITTED, IDEMPOTENCY_CONFLICT and
// INVALID_IDENTITY would fail again, and a handler's own error is the
// answer. A handler that itself returns Unavailable or DeadlineExceeded is
// retried once: its outcome is unknown, so the server stored it and the
// retry gets it again with FAILURE_REPLAYED, which is final.
func Retryable(ctx context.Context, err error) bool {
	if err == nil || ctx.Err() != nil {
		return false
	}
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded:
		// A replayed handler failure is final whatever its code.
		r, _ := ErrorReason(err)
		return r != ReasonFailureReplayed
	case codes.Aborted:
		r, _ := ErrorReason(err)
		return r == ReasonInFlight || r == ReasonLeaseLost
	}
	return false
}

// withDefaults checks o and fills in its defaults.
func (o *RetryOptions) withDefaults() (RetryOptions, error) {
	var r RetryOptions
	if o != nil {
		r = *o
	}
	bad := func(field string, v any, why string) (RetryOptions, error) {
		return RetryOptions{}, fmt.Errorf("idemgrpc: RetryOptions.%s: %v: %s", field, v, why)
	}
	switch {
	case r.InitialBackoff < 0:
		return bad("InitialBackoff", r.InitialBackoff, "negative")
	case r.MaxBackoff < 0:
		return bad("MaxBackoff", r.MaxBackoff, "negative")
	case r.Multiplier != 0 && !(r.Multiplier >= 1) || math.IsInf(r.Multiplier, 0):
		return bad("Multiplier", r.Multiplier, "want 1 or more")
	case r.Jitter < 0 || r.Jitter > 1 || math.IsNaN(r.Jitter):
		return bad("Jitter", r.Jitter, "want 0 to 1")
	case r.PerAttemptTimeout < 0:
		return bad("PerAttemptTimeout", r.PerAttemptTimeout, "negative (every attempt has a timeout; 0 is the default)")
	case r.Keepalive.Timeout < 0:
		return bad("Keepalive.Timeout", r.Keepalive.Timeout, "negative")
	}
	if r.MaxAttempts == 0 {
		r.MaxAttempts = 8
	}
	if r.InitialBackoff == 0 {
		r.InitialBackoff = 50 * time.Millisecond
	}
	if r.MaxBackoff == 0 {
		r.MaxBackoff = max(5*time.Second, r.InitialBackoff)
	}
	if r.MaxBackoff < r.InitialBackoff {
		return bad("MaxBackoff", r.MaxBackoff, fmt.Sprintf("less than InitialBackoff %v", r.InitialBackoff))
	}
	if r.Multiplier == 0 {
		r.Multiplier = 2
	}
	if r.Jitter == 0 {
		r.Jitter = 0.2
	}
	if r.PerAttemptTimeout == 0 {
		r.PerAttemptTimeout = DefaultPerAttemptTimeout
	}
	if r.Keepalive.Time == 0 {
		r.Keepalive.Time = DefaultKeepaliveTime
	}
	if r.Keepalive.Timeout == 0 {
		r.Keepalive.Timeout = DefaultKeepaliveTimeout
	}
	if r.Dial == nil {
		var d net.Dialer
		r.Dial = func(ctx context.Context, addr string) (net.Conn, error) { return d.DialContext(ctx, "tcp", addr) }
	}
	if r.now == nil {
		r.now = time.Now
	}
	if r.sleep == nil {
		r.sleep = sleepCtx
	}
	return r, nil
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// backoff is the jittered delay before retry number n (1 for the first).
func (o *RetryOptions) backoff(n int) time.Duration {
	d := float64(o.InitialBackoff) * math.Pow(o.Multiplier, float64(n-1))
	if d > float64(o.MaxBackoff) {
		d = float64(o.MaxBackoff)
	}
	d *= 1 + o.Jitter*(2*rand.Float64()-1)
	return time.Duration(d)
}

// UnaryClientInterceptor retries calls that failed in a way that is safe to
// retry (see Retryable), sending the same request, and so the same
// identity (client_id and sequence, or the idempotency-key metadata, which
// stays in the context), with exponential backoff and jitter. Each attempt
// is bounded by PerAttemptTimeout. It stops at MaxAttempts, or when the next
// delay would end after the call's deadline (it never sleeps past it), and
// returns the last error.
//
// After an attempt that timed out, the retry should not go out on the same
// connection (its peer may be gone without a word: a zombie connection).
// Only the connections of a ClientConn built with DialOptions can be closed
// for that; with this interceptor alone, the retry reuses the connection
// until keepalive (if set) finds it dead. Prefer DialOptions.
func UnaryClientInterceptor(opts *RetryOptions) (grpc.UnaryClientInterceptor, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	return o.interceptor(nil), nil
}

// DialOptions returns the options of a retrying client connection, to pass
// to grpc.NewClient with the transport credentials:
//
//   - the retry interceptor (UnaryClientInterceptor);
//   - a dialer (RetryOptions.Dial) whose connections the interceptor can
//     close: after an attempt runs out of time, every connection of this
//     ClientConn that was open when the attempt began and received nothing
//     since (its peer is gone, or it never completed its handshake) is
//     closed, and the ClientConn is asked to reconnect at once
//     (ResetConnectBackoff, Connect), so that the retry goes out on a new
//     connection (a connection opened during the attempt gets one more
//     attempt's time);
//   - keepalive (RetryOptions.Keepalive), which finds dead connections
//     between calls as well.
//
// Each call of DialOptions is for one ClientConn.
func DialOptions(opts *RetryOptions) ([]grpc.DialOption, error) {
	o, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	t := newConnTracker(o.Dial)
	dos := []grpc.DialOption{grpc.WithChainUnaryInterceptor(o.interceptor(t)), grpc.WithContextDialer(t.dial)}
	if o.Keepalive.Time > 0 {
		dos = append(dos, grpc.WithKeepaliveParams(o.Keepalive))
	}
	return dos, nil
}

func (o *RetryOptions) interceptor(t *connTracker) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
		if o.Methods != nil && !o.Methods(method) {
			return invoker(ctx, method, req, reply, cc, callOpts...)
		}
		for attempt := 1; ; attempt++ {
			began := mono()
			actx, cancel := context.WithTimeout(ctx, o.PerAttemptTimeout)
			err := invoker(actx, method, req, reply, cc, callOpts...)
			timedOut := errors.Is(actx.Err(), context.DeadlineExceeded) && ctx.Err() == nil
			cancel()
			if err == nil || !Retryable(ctx, err) || (o.MaxAttempts > 0 && attempt >= o.MaxAttempts) {
				return err
			}
			if timedOut {
				o.reconnect(ctx, cc, t, began)
			}
			delay := o.backoff(attempt)
			if advice := retryDelay(err); advice > delay {
				delay = advice
			}
			if dl, ok := ctx.Deadline(); ok && dl.Sub(o.now()) <= delay {
				return err
			}
			if o.OnRetry != nil {
				o.OnRetry(method, attempt, err, delay)
			}
			if o.sleep(ctx, delay) != nil {
				return err
			}
		}
	}
}

// reconnect closes the connections that were silent since began (with a
// tracker) and has cc reconnect at once.
func (o *RetryOptions) reconnect(ctx context.Context, cc *grpc.ClientConn, t *connTracker, began int64) {
	if t == nil || cc == nil {
		return
	}
	if t.closeSilent(began) == 0 {
		return
	}
	// A connection closed during its handshake puts its subchannel in
	// TRANSIENT_FAILURE with a backoff (a second or more): wait for that
	// state (briefly), then cancel the backoff.
	if cc.GetState() == connectivity.Connecting {
		wctx, cancel := context.WithTimeout(ctx, o.PerAttemptTimeout)
		cc.WaitForStateChange(wctx, connectivity.Connecting)
		cancel()
	}
	cc.ResetConnectBackoff()
	cc.Connect()
}
