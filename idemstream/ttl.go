package idemstream

import (
	"time"

	"github.com/idemdb/idem"
)

func setTTL(r *idem.Request, ttl time.Duration) { r.TTL = ttl }

func expiresAt(r idem.Result) time.Time { return r.ExpiresAt }

func engineNow(e *idem.Engine) time.Time { return e.Now() }
