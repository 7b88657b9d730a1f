package idemstream

import (
	"context"
	"encoding/binary"
	"maps"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
)

// frontierReq is the claim of frontier update seq to offset (a crash test
// leaves it in doubt).
func frontierReq(s *Sink, partition string, seq, offset uint64) idem.Request {
	var enc [8]byte
	binary.BigEndian.PutUint64(enc[:], offset)
	return idem.Request{Scope: s.fscope, Client: frontierClient(partition), Seq: seq, Fingerprint: enc[:]}
}

// What the external tests (package idemstream_test: the broker scenarios,
// which import the source packages) use of the internal test harness.

type Window = window

const (
	WindowAfterEffect     = windowAfterEffect
	WindowAfterCommit     = windowAfterCommit
	WindowAfterPreCommit  = windowAfterPreCommit
	WindowAfterCheckpoint = windowAfterCheckpoint
	WindowBeforeAck       = windowBeforeAck
)

type World = world

func NewWorld() *World                                  { return newWorld() }
func (w *world) Crash() error                           { return w.crash() }
func (w *world) Restart()                               { w.restart() }
func (w *world) Do(fn func() error) error               { return w.do(fn) }
func (w *world) Dead() chan struct{}                    { return w.deadCh() }
func (w *world) FS() vfs.FS                             { w.mu.RLock(); defer w.mu.RUnlock(); return w.mem }
func (w *world) Crashed() bool                          { w.mu.RLock(); defer w.mu.RUnlock(); return w.crashed }
func SetSinkHook(s *Sink, h func(Window, *Event) error) { s.hook = h }

func OpenEngine(t testing.TB, fs vfs.FS, clock func() time.Time) *idem.Engine {
	return openEngine(t, fs, clock)
}

type Ledger = ledger

func NewLedger(w *World) *Ledger { return newLedger(w) }
func (l *ledger) Handler(ctx context.Context, ev Event) (Effect, error) {
	return l.handler(ctx, ev)
}
func (l *ledger) Recover(ctx context.Context, d InDoubtEvent) (Resolution, error) {
	return l.recoverFn(ctx, d)
}

// Applied returns how many times each event's effect was applied.
func (l *ledger) Applied() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return maps.Clone(l.applied)
}

type TxnLedger = txnLedger

func NewTxnLedger(w *World) *TxnLedger  { return newTxnLedger(w) }
func (l *txnLedger) Check(t *testing.T) { l.check(t) }

// Committed returns how many times each event was made visible.
func (l *txnLedger) Committed() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return maps.Clone(l.committed)
}

// FailInvoke makes every Invoke of event id fail.
func (l *txnLedger) FailInvoke(id string) { l.mu.Lock(); l.failInvoke = id; l.mu.Unlock() }

// Invokes returns how many times event id was invoked.
func (l *txnLedger) Invokes(id string) int { l.mu.Lock(); defer l.mu.Unlock(); return l.invokes[id] }

func NewTwoPhaseWithHook(t *testing.T, ctx context.Context, w *World, l *TxnLedger, hook func(Window, uint64) error) (*TwoPhase[*ledgerTxn], RecoveryReport, error) {
	return newTwoPhaseWithHook(t, ctx, w, l, hook)
}
