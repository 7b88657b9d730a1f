package idem

import (
	"testing"
	"time"
)

// The documented defaults no behaviour test can reach in reasonable time:
// a claim's lease (1 hour, as the Idempotency-Key service's) and the
// period of the background cleanup (10 minutes), which runs on a real
// ticker, not on Options.Clock.
func TestDocumentedDefaults(t *testing.T) {
	o := (*Options)(nil).withDefaults()
	if o.Lease != time.Hour || o.CleanupInterval != 10*time.Minute {
		t.Fatalf("Lease %v, CleanupInterval %v; documented 1h and 10m", o.Lease, o.CleanupInterval)
	}
}
