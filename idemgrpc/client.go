package idemgrpc

import (
	"context"
	"math"
	"math/rand/v2"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// RetryOptions configure UnaryClientInterceptor. The zero value is usable.
type RetryOptions struct {
	// MaxAttempts is the number of attempts of one call, the first
	// included (default 8). Negative: no limit but the call's context.
	MaxAttempts int
	// InitialBackoff is the delay before the first retry (default 50ms);
	// each further retry multiplies it by Multiplier (default 2) up to
	// MaxBackoff (default 5s). Every delay is jittered by ±Jitter (default
	// 0.2, i.e. ±20%) so that clients that failed together do not retry
	// together. A server's RetryInfo advice, when longer, wins.
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	Multiplier     float64
	Jitter         float64
	// PerAttemptTimeout bounds each attempt (0: only the call's context).
	// An attempt that runs out is retried while the call's context lives.
	PerAttemptTimeout time.Duration
	// Methods selects the methods that are retried (nil: every method the
	// interceptor sees). Retrying is only safe for methods the server runs
	// exactly once (or that are idempotent anyway).
	Methods func(fullMethod string) bool
	// OnRetry, if set, is called before each retry (for metrics or logs).
	OnRetry func(fullMethod string, attempt int, err error, delay time.Duration)
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

func (o RetryOptions) withDefaults() RetryOptions {
	if o.MaxAttempts == 0 {
		o.MaxAttempts = 8
	}
	if o.InitialBackoff <= 0 {
		o.InitialBackoff = 50 * time.Millisecond
	}
	if o.MaxBackoff <= 0 {
		o.MaxBackoff = 5 * time.Second
	}
	if o.MaxBackoff < o.InitialBackoff {
		o.MaxBackoff = o.InitialBackoff
	}
	if o.Multiplier < 1 {
		o.Multiplier = 2
	}
	if o.Jitter <= 0 || o.Jitter > 1 {
		o.Jitter = 0.2
	}
	return o
}

// backoff is the jittered delay before retry number n (1 for the first).
func (o RetryOptions) backoff(n int) time.Duration {
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
// stays in the context), with exponential backoff and jitter. It stops at
// MaxAttempts, or when the next delay would end after the call's deadline,
// and returns the last error.
func UnaryClientInterceptor(opts RetryOptions) grpc.UnaryClientInterceptor {
	o := opts.withDefaults()
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, callOpts ...grpc.CallOption) error {
		if o.Methods != nil && !o.Methods(method) {
			return invoker(ctx, method, req, reply, cc, callOpts...)
		}
		for attempt := 1; ; attempt++ {
			actx, cancel := ctx, context.CancelFunc(func() {})
			if o.PerAttemptTimeout > 0 {
				actx, cancel = context.WithTimeout(ctx, o.PerAttemptTimeout)
			}
			err := invoker(actx, method, req, reply, cc, callOpts...)
			cancel()
			if err == nil || !Retryable(ctx, err) || (o.MaxAttempts > 0 && attempt >= o.MaxAttempts) {
				return err
			}
			delay := o.backoff(attempt)
			if advice := retryDelay(err); advice > delay {
				delay = advice
			}
			if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= delay {
				return err
			}
			if o.OnRetry != nil {
				o.OnRetry(method, attempt, err, delay)
			}
			t := time.NewTimer(delay)
			select {
			case <-ctx.Done():
				t.Stop()
				return err
			case <-t.C:
			}
		}
	}
}
