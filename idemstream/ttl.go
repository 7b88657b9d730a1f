package idemstream

import (
	"time"

	"github.com/idemdb/idem"
)

// setTTL and expiresAt isolate the engine's per-request TTL.
func setTTL(r *idem.Request, ttl time.Duration) {}

func expiresAt(r idem.Result) time.Time { return time.Time{} }

func engineNow(e *idem.Engine) time.Time { return time.Now() }
