package idemgrpc

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// monoBase anchors mono.
var monoBase = time.Now()

// mono is a monotonic clock reading in nanoseconds (always positive): it
// only orders events (an attempt's start, a connection's last read).
func mono() int64 { return int64(time.Since(monoBase)) + 1 }

// connTracker is a dialer that knows the connections it opened and when
// each last received something, so that the retry interceptor can close
// the ones that went silent (DialOptions).
type connTracker struct {
	dialFn func(ctx context.Context, addr string) (net.Conn, error)
	mu     sync.Mutex
	conns  map[*trackedConn]struct{}
}

func newConnTracker(dial func(ctx context.Context, addr string) (net.Conn, error)) *connTracker {
	return &connTracker{dialFn: dial, conns: map[*trackedConn]struct{}{}}
}

func (t *connTracker) dial(ctx context.Context, addr string) (net.Conn, error) {
	c, err := t.dialFn(ctx, addr)
	if err != nil {
		return nil, err
	}
	tc := &trackedConn{Conn: c, t: t, opened: mono()}
	t.mu.Lock()
	t.conns[tc] = struct{}{}
	t.mu.Unlock()
	return tc, nil
}

// closeSilent closes the connections opened before began (a mono reading)
// that received nothing since, and returns how many. A connection opened
// during the attempt is left its chance: a slow handshake is not a dead
// peer, and the next attempt that times out closes it if it stays silent.
func (t *connTracker) closeSilent(began int64) int {
	t.mu.Lock()
	var silent []*trackedConn
	for c := range t.conns {
		if c.opened < began && c.lastRead.Load() < began {
			silent = append(silent, c)
		}
	}
	t.mu.Unlock()
	for _, c := range silent {
		_ = c.Close()
	}
	return len(silent)
}

// trackedConn records its last read and leaves the tracker on Close.
type trackedConn struct {
	net.Conn
	t        *connTracker
	opened   int64        // mono of the dial
	lastRead atomic.Int64 // mono of the last read that returned data; 0: none
}

func (c *trackedConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		c.lastRead.Store(mono())
	}
	return n, err
}

func (c *trackedConn) Close() error {
	c.t.mu.Lock()
	delete(c.t.conns, c)
	c.t.mu.Unlock()
	return c.Conn.Close()
}
