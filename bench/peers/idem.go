package peers

import (
	"context"
	"time"

	"github.com/idemdb/idem"
)

// idemPeer is idem with its defaults: SyncAlways (claim and reply both
// fsynced before Do goes on, shared by concurrent callers through group
// commit).
type idemPeer struct{ e *idem.Engine }

func openIdem(cfg Config) (Peer, error) {
	e, err := idem.Open(cfg.Dir, nil)
	if err != nil {
		return nil, err
	}
	return &idemPeer{e: e}, nil
}

func (p *idemPeer) Do(ctx context.Context, id []byte, fn func() []byte) ([]byte, bool, error) {
	fresh := false
	reply, err := p.e.Do(ctx, idem.Request{ID: id}, func(context.Context) ([]byte, error) {
		fresh = true
		return fn(), nil
	})
	return reply, fresh, err
}

// Settle waits (at most 10 s) until the index has applied every durable
// record, as `idem bench` does before its duplicate phase, so that the
// duplicates measure lookups rather than the tail of the fresh writes.
func (p *idemPeer) Settle(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		if st := p.e.Stats(); st.AppliedLSN >= st.DurableLSN {
			return
		}
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func (p *idemPeer) Close() error { return p.e.Close() }
