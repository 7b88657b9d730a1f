// Package ledgersvc is the ledger example's service: accounts with balances
// per namespace (and vault), written with per-client sequences through
// idemgrpc. Balances live in a journal file (one fsynced msgpack record per
// write, torn tail cut on open); the idem engine keeps sequences and stored
// responses. After a crash, Open settles the calls left in doubt against the
// journal: a write that reached it is committed with its response, one that
// did not is aborted.
package ledgersvc

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/examples/ledger/ledgerpb"
	"github.com/idemdb/idem/idemgrpc"
	"github.com/vmihailenco/msgpack/v5"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// Full method names of the sequenced methods.
const (
	MethodWrite      = "/idem.examples.ledger.v1.Ledger/Write"
	MethodBatchWrite = "/idem.examples.ledger.v1.Ledger/BatchWrite"
)

// Scope returns the scope fields of a write: [namespace] for a
// namespace-level write, [namespace, vault] for a vault-level one. Each is
// a separate sequence stream.
func Scope(namespace, vault string) []string {
	if vault == "" {
		return []string{namespace}
	}
	return []string{namespace, vault}
}

type scoped interface {
	idemgrpc.SequencedMessage
	GetNamespaceId() string
	GetVaultId() string
}

// Identify is the ledger's IdentifyFunc: client_id and sequence from the
// request, scope from namespace_id and vault_id. The request's actor field
// is never read.
func Identify(_ context.Context, req proto.Message) (idemgrpc.Identity, error) {
	r, ok := req.(scoped)
	if !ok {
		return idemgrpc.Identity{}, fmt.Errorf("%T is not a ledger write", req)
	}
	if r.GetNamespaceId() == "" {
		return idemgrpc.Identity{}, errors.New("namespace_id is required")
	}
	return idemgrpc.Identity{Client: r.GetClientId(), Seq: r.GetSequence(), Scope: Scope(r.GetNamespaceId(), r.GetVaultId())}, nil
}

// Methods is the idemgrpc.Options.Methods of the ledger.
func Methods() map[string]idemgrpc.IdentifyFunc {
	return map[string]idemgrpc.IdentifyFunc{MethodWrite: Identify, MethodBatchWrite: Identify}
}

// TokenAuth is a unary server interceptor checking "authorization: Bearer
// <token>" metadata against tokens (token -> actor, for example
// "user:alice") and storing the actor with idemgrpc.WithActor. Calls with
// no or an unknown token are Unauthenticated.
func TokenAuth(tokens map[string]string) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		vals := metadata.ValueFromIncomingContext(ctx, "authorization")
		if len(vals) != 1 || !strings.HasPrefix(vals[0], "Bearer ") {
			return nil, status.Error(codes.Unauthenticated, "ledger: send one \"authorization: Bearer <token>\" header")
		}
		actor, ok := tokens[strings.TrimPrefix(vals[0], "Bearer ")]
		if !ok {
			return nil, status.Error(codes.Unauthenticated, "ledger: unknown token")
		}
		return handler(idemgrpc.WithActor(ctx, actor), req)
	}
}

// journal record: the balances a write set, and its response, so that
// replay rebuilds the balances and Open can settle calls left in doubt.
type record struct {
	Scope    string           `msgpack:"s"` // the engine scope of the call
	Client   string           `msgpack:"c"`
	Seq      uint64           `msgpack:"q"`
	Balances map[string]int64 `msgpack:"b"` // account key -> new balance
	Reply    []byte           `msgpack:"r"` // marshaled WriteSuccess
}

type applied struct {
	seq   uint64
	reply []byte
}

// Ledger implements ledgerpb.LedgerServer.
type Ledger struct {
	ledgerpb.UnimplementedLedgerServer
	idem *idemgrpc.Server
	eng  *idem.Engine

	mu       sync.Mutex
	f        *os.File
	balances map[string]int64
	last     map[string]applied // engine scope + client -> last applied write

	// BeforeApply, if set, is called before each write is applied (tests:
	// slow or failing handlers).
	BeforeApply func(ctx context.Context) error
	// AfterApply, if set, is called after a write reached the journal and
	// before its response is returned (tests: a crash in that window).
	AfterApply func(ctx context.Context)
	// Applies counts writes applied since Open.
	Applies int64
}

func accountKey(ns, vault, account string) string {
	return idemgrpc.EncodeScope("acct", ns, vault, account)
}

// Open opens the journal in dir (creating it), replays it, and settles the
// server's calls left in doubt. srv is the idemgrpc server the ledger runs
// behind (its engine holds the sequences).
func Open(dir string, srv *idemgrpc.Server, eng *idem.Engine) (*Ledger, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	p := filepath.Join(dir, "ledger.journal")
	f, err := os.OpenFile(p, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, err
	}
	l := &Ledger{idem: srv, eng: eng, f: f, balances: map[string]int64{}, last: map[string]applied{}}
	if err := l.replay(); err != nil {
		f.Close()
		return nil, fmt.Errorf("ledger: journal %s: %w", p, err)
	}
	if d, err := os.Open(dir); err == nil {
		err = d.Sync()
		d.Close()
		if err != nil {
			f.Close()
			return nil, err
		}
	}
	_, _, err = srv.ResolveInDoubt(context.Background(), func(d idemgrpc.InDoubt) (proto.Message, bool, error) {
		a, ok := l.last[d.EngineScope+"\x00"+d.Client]
		if !ok || a.seq != d.Seq {
			return nil, false, nil
		}
		m, err := idemgrpc.DecodeReply(a.reply)
		return m, err == nil, err
	})
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("ledger: settling calls in doubt: %w", err)
	}
	return l, nil
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// replay reads every frame (len u32, crc32c u32, msgpack record); a torn
// tail is cut.
func (l *Ledger) replay() error {
	data, err := io.ReadAll(l.f)
	if err != nil {
		return err
	}
	off := 0
	for off+8 <= len(data) {
		n := int(binary.BigEndian.Uint32(data[off:]))
		sum := binary.BigEndian.Uint32(data[off+4:])
		if off+8+n > len(data) || crc32.Checksum(data[off+8:off+8+n], castagnoli) != sum {
			break
		}
		var r record
		if err := msgpack.Unmarshal(data[off+8:off+8+n], &r); err != nil {
			return fmt.Errorf("record at offset %d: %w", off, err)
		}
		l.apply(&r)
		off += 8 + n
	}
	if off != len(data) {
		if err := l.f.Truncate(int64(off)); err != nil {
			return err
		}
		if err := l.f.Sync(); err != nil {
			return err
		}
	}
	_, err = l.f.Seek(int64(off), io.SeekStart)
	return err
}

func (l *Ledger) apply(r *record) {
	for k, v := range r.Balances {
		l.balances[k] = v
	}
	l.last[r.Scope+"\x00"+r.Client] = applied{seq: r.Seq, reply: r.Reply}
}

// Close closes the journal.
func (l *Ledger) Close() error { return l.f.Close() }

// Write implements ledgerpb.LedgerServer.
func (l *Ledger) Write(ctx context.Context, req *ledgerpb.WriteRequest) (*ledgerpb.WriteSuccess, error) {
	if req.GetOperation() == nil {
		return nil, status.Error(codes.InvalidArgument, "ledger: operation is required")
	}
	return l.write(ctx, req.GetNamespaceId(), req.GetVaultId(), []*ledgerpb.Operation{req.GetOperation()})
}

// BatchWrite implements ledgerpb.LedgerServer: all operations or none, one
// sequence.
func (l *Ledger) BatchWrite(ctx context.Context, req *ledgerpb.BatchWriteRequest) (*ledgerpb.WriteSuccess, error) {
	if len(req.GetOperations()) == 0 {
		return nil, status.Error(codes.InvalidArgument, "ledger: a batch needs at least one operation")
	}
	return l.write(ctx, req.GetNamespaceId(), req.GetVaultId(), req.GetOperations())
}

func (l *Ledger) write(ctx context.Context, ns, vault string, ops []*ledgerpb.Operation) (*ledgerpb.WriteSuccess, error) {
	call, ok := idemgrpc.CallFromContext(ctx)
	if !ok {
		return nil, status.Error(codes.Internal, "ledger: writes must run behind the idemgrpc interceptor")
	}
	if l.BeforeApply != nil {
		if err := l.BeforeApply(ctx); err != nil {
			return nil, err
		}
	}
	l.mu.Lock()
	resp, err := l.writeLocked(call, ns, vault, ops)
	l.mu.Unlock()
	if err == nil && l.AfterApply != nil {
		l.AfterApply(ctx)
	}
	return resp, err
}

func (l *Ledger) writeLocked(call *idemgrpc.Call, ns, vault string, ops []*ledgerpb.Operation) (*ledgerpb.WriteSuccess, error) {
	next := map[string]int64{}
	var order []string
	for i, op := range ops {
		if op.GetAccount() == "" {
			return nil, status.Errorf(codes.InvalidArgument, "ledger: operation %d has no account", i)
		}
		k := accountKey(ns, vault, op.GetAccount())
		cur, seen := next[k]
		if !seen {
			cur = l.balances[k]
			order = append(order, op.GetAccount())
		}
		if op.ExpectBalance != nil && op.GetExpectBalance() != cur {
			return nil, status.Errorf(codes.FailedPrecondition, "ledger: operation %d: account %q has balance %d, expected %d; nothing was written",
				i, op.GetAccount(), cur, op.GetExpectBalance())
		}
		next[k] = cur + op.GetAmount()
	}
	var id [8]byte
	_, _ = rand.Read(id[:])
	resp := &ledgerpb.WriteSuccess{
		TxId: hex.EncodeToString(id[:]), Sequence: call.Identity.Seq, Actor: call.Actor,
		TimestampUnixNano: l.eng.Now().UnixNano(),
	}
	for _, a := range order {
		resp.Balances = append(resp.Balances, &ledgerpb.Balance{Account: a, Balance: next[accountKey(ns, vault, a)]})
	}
	reply, err := idemgrpc.EncodeReply(resp)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "ledger: %v", err)
	}
	rec := &record{Scope: call.Scope, Client: call.Identity.Client, Seq: call.Identity.Seq, Balances: next, Reply: reply}
	b, err := msgpack.Marshal(rec)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "ledger: %v", err)
	}
	frame := make([]byte, 8+len(b))
	binary.BigEndian.PutUint32(frame, uint32(len(b)))
	binary.BigEndian.PutUint32(frame[4:], crc32.Checksum(b, castagnoli))
	copy(frame[8:], b)
	if _, err := l.f.Write(frame); err != nil {
		return nil, status.Errorf(codes.Internal, "ledger: journal write: %v", err)
	}
	if err := l.f.Sync(); err != nil {
		return nil, status.Errorf(codes.Internal, "ledger: journal fsync: %v", err)
	}
	l.apply(rec)
	l.Applies++
	return resp, nil
}

// GetClientState implements ledgerpb.LedgerServer for both scope levels.
func (l *Ledger) GetClientState(ctx context.Context, req *ledgerpb.GetClientStateRequest) (*ledgerpb.GetClientStateResponse, error) {
	if req.GetNamespaceId() == "" {
		return nil, status.Error(codes.InvalidArgument, "ledger: namespace_id is required")
	}
	last, err := l.idem.ClientState(ctx, req.GetClientId(), Scope(req.GetNamespaceId(), req.GetVaultId())...)
	if err != nil {
		return nil, err
	}
	return &ledgerpb.GetClientStateResponse{LastCommittedSequence: last}, nil
}

// GetBalance implements ledgerpb.LedgerServer.
func (l *Ledger) GetBalance(_ context.Context, req *ledgerpb.GetBalanceRequest) (*ledgerpb.GetBalanceResponse, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return &ledgerpb.GetBalanceResponse{Balance: l.balances[accountKey(req.GetNamespaceId(), req.GetVaultId(), req.GetAccount())]}, nil
}

// ApplyCount returns how many writes were applied since Open.
func (l *Ledger) ApplyCount() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.Applies
}
