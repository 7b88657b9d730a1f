// Command client is the ledger example's client: it numbers its writes with
// an idemgrpc.Tracker (the last used sequence saved in a file before each
// send, recovered through GetClientState when lost) and retries lost
// responses with the same sequence through idemgrpc's retry interceptor.
//
//	go run ./examples/ledger/client -token tok-alice -client laptop -ns acme write cash 100
//	go run ./examples/ledger/client -token tok-alice -client laptop -ns acme -vault eu batch cash:-30 fees:30
//	go run ./examples/ledger/client -token tok-alice -client laptop -ns acme state
//	go run ./examples/ledger/client -token tok-alice -ns acme balance cash
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/idemdb/idem/examples/ledger/ledgerpb"
	"github.com/idemdb/idem/examples/ledger/ledgersvc"
	"github.com/idemdb/idem/idemgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

func usage() {
	fmt.Fprintln(os.Stderr, `usage: client [flags] <command> [args]

commands:
  write <account> <amount>                  one write under the next sequence
  batch <account>:<amount>[=<expect>] ...    one batch, one sequence, all or nothing
                                            (=<expect>: apply only if the balance is <expect>)
  state                                     last committed sequence (GetClientState)
  balance <account>                         an account's balance

flags:`)
	flag.PrintDefaults()
}

func main() {
	addr := flag.String("addr", "127.0.0.1:7070", "server address")
	token := flag.String("token", "", "bearer token (the server maps it to your actor)")
	client := flag.String("client", "", "client id (write, batch, state)")
	ns := flag.String("ns", "", "namespace id")
	vault := flag.String("vault", "", "vault id (empty: namespace-level scope)")
	stateDir := flag.String("state", filepath.Join(os.TempDir(), "ledger-client"), "directory of the saved sequence numbers")
	drop := flag.Bool("drop-first-response", false, "simulate a lost response on the first attempt (shows the retry replay)")
	timeout := flag.Duration("timeout", 10*time.Second, "deadline of the whole command")
	flag.Usage = usage
	flag.Parse()
	if flag.NArg() < 1 || *token == "" || *ns == "" {
		usage()
		os.Exit(2)
	}
	if err := run(*addr, *token, *client, *ns, *vault, *stateDir, *drop, *timeout, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		if r, meta := idemgrpc.ErrorReason(err); r != "" {
			fmt.Fprintf(os.Stderr, "reason: %s %v\n", r, meta)
		}
		os.Exit(1)
	}
}

func run(addr, token, client, ns, vault, stateDir string, drop bool, timeout time.Duration, args []string) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	// The retrying client: each attempt bounded (PerAttemptTimeout), a
	// new connection after an attempt that timed out, keepalive.
	dialOpts, err := idemgrpc.DialOptions(&idemgrpc.RetryOptions{
		OnRetry: func(method string, attempt int, err error, delay time.Duration) {
			fmt.Fprintf(os.Stderr, "attempt %d of %s failed (%v); retrying in %v with the same sequence\n", attempt, method, status.Code(err), delay.Round(time.Millisecond))
		},
	})
	if err != nil {
		return err
	}
	dialOpts = append(dialOpts, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if drop {
		dialOpts = append(dialOpts, grpc.WithChainUnaryInterceptor(dropFirst())) // inside the retries
	}
	cc, err := grpc.NewClient(addr, dialOpts...)
	if err != nil {
		return err
	}
	defer cc.Close()
	c := ledgerpb.NewLedgerClient(cc)
	scope := ledgersvc.Scope(ns, vault)
	tracker := func() (*idemgrpc.Tracker, func(), error) {
		if client == "" {
			return nil, nil, fmt.Errorf("-client is required")
		}
		fs, err := idemgrpc.OpenFileStore(stateDir)
		if err != nil {
			return nil, nil, err
		}
		tr, err := idemgrpc.NewTracker(client, fs, idemgrpc.ServiceState(cc), nil)
		if err != nil {
			fs.Close()
			return nil, nil, err
		}
		return tr, func() { fs.Close() }, nil
	}
	switch cmd := args[0]; cmd {
	case "write", "batch":
		var ops []*ledgerpb.Operation
		if cmd == "write" {
			if len(args) != 3 {
				return fmt.Errorf("write <account> <amount>")
			}
			amt, err := strconv.ParseInt(args[2], 10, 64)
			if err != nil {
				return fmt.Errorf("amount %q: %v", args[2], err)
			}
			ops = append(ops, &ledgerpb.Operation{Account: args[1], Amount: amt})
		} else {
			for _, a := range args[1:] {
				op, err := parseOp(a)
				if err != nil {
					return err
				}
				ops = append(ops, op)
			}
		}
		tr, closeStore, err := tracker()
		if err != nil {
			return err
		}
		defer closeStore()
		var resp *ledgerpb.WriteSuccess
		err = tr.Call(ctx, scope, func(ctx context.Context, seq uint64) error {
			fmt.Fprintf(os.Stderr, "sending sequence %d\n", seq)
			var err error
			if cmd == "write" {
				resp, err = c.Write(ctx, &ledgerpb.WriteRequest{ClientId: client, Sequence: seq, NamespaceId: ns, VaultId: vault, Operation: ops[0]})
			} else {
				resp, err = c.BatchWrite(ctx, &ledgerpb.BatchWriteRequest{ClientId: client, Sequence: seq, NamespaceId: ns, VaultId: vault, Operations: ops})
			}
			if idemgrpc.IsSequenceGap(err) {
				fmt.Fprintln(os.Stderr, "SEQUENCE_GAP: recovering through GetClientState")
			}
			return err
		})
		if err != nil {
			return err
		}
		return print(resp)
	case "state":
		if client == "" {
			return fmt.Errorf("-client is required")
		}
		r, err := c.GetClientState(ctx, &ledgerpb.GetClientStateRequest{NamespaceId: ns, VaultId: vault, ClientId: client})
		if err != nil {
			return err
		}
		return print(r)
	case "balance":
		if len(args) != 2 {
			return fmt.Errorf("balance <account>")
		}
		r, err := c.GetBalance(ctx, &ledgerpb.GetBalanceRequest{NamespaceId: ns, VaultId: vault, Account: args[1]})
		if err != nil {
			return err
		}
		return print(r)
	default:
		return fmt.Errorf("unknown command %q", cmd)
	}
}

func parseOp(s string) (*ledgerpb.Operation, error) {
	acct, rest, ok := strings.Cut(s, ":")
	if !ok || acct == "" {
		return nil, fmt.Errorf("operation %q: want <account>:<amount>[=<expect>]", s)
	}
	amtS, expS, hasExp := strings.Cut(rest, "=")
	amt, err := strconv.ParseInt(amtS, 10, 64)
	if err != nil {
		return nil, fmt.Errorf("operation %q: amount: %v", s, err)
	}
	op := &ledgerpb.Operation{Account: acct, Amount: amt}
	if hasExp {
		exp, err := strconv.ParseInt(expS, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("operation %q: expected balance: %v", s, err)
		}
		op.ExpectBalance = &exp
	}
	return op, nil
}

func print(m proto.Message) error {
	b, err := protojson.MarshalOptions{EmitUnpopulated: true}.Marshal(m)
	if err != nil {
		return err
	}
	fmt.Println(string(b))
	return nil
}

// dropFirst delivers the first write but reports its response lost, as a
// network failure would after the server committed.
func dropFirst() grpc.UnaryClientInterceptor {
	dropped := false
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		if !dropped && err == nil && (method == ledgersvc.MethodWrite || method == ledgersvc.MethodBatchWrite) {
			dropped = true
			b, _ := protojson.Marshal(reply.(proto.Message))
			fmt.Fprintf(os.Stderr, "(simulated) response lost: %s\n", b)
			return status.Error(codes.Unavailable, "simulated: response lost")
		}
		return err
	}
}
