// Command server runs the ledger example: Write, BatchWrite, GetClientState
// and GetBalance, exactly once per (actor, scope, client_id, sequence)
// through idemgrpc, with bearer tokens mapped to actors.
//
//	go run ./examples/ledger/server -dir /tmp/ledger -token tok-alice=user:alice -token tok-bob=user:bob
package main

import (
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/idemdb/idem/examples/ledger/ledgersvc"
)

type tokenFlag map[string]string

func (t tokenFlag) String() string { return fmt.Sprint(map[string]string(t)) }
func (t tokenFlag) Set(v string) error {
	tok, actor, ok := strings.Cut(v, "=")
	if !ok || tok == "" || actor == "" {
		return fmt.Errorf("want token=actor, for example tok-alice=user:alice")
	}
	t[tok] = actor
	return nil
}

func main() {
	addr := flag.String("addr", "127.0.0.1:7070", "listen address")
	dir := flag.String("dir", "", "data directory (engine in <dir>/idem, journal in <dir>/ledger); required")
	ttl := flag.Duration("ttl", 0, "how long stored responses are kept for retries (0: until the client's next sequence)")
	tokens := tokenFlag{}
	flag.Var(tokens, "token", "bearer token and the actor it authenticates, token=actor (repeatable)")
	flag.Parse()
	if *dir == "" || len(tokens) == 0 {
		fmt.Fprintln(os.Stderr, "usage: server -dir <dir> -token <token>=<actor> [-token ...] [-addr host:port] [-ttl 5m]")
		os.Exit(2)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	lis, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Error("listen", "err", err)
		os.Exit(1)
	}
	srv, err := ledgersvc.Start(*dir, lis, &ledgersvc.Options{Tokens: tokens, TTL: *ttl, Logger: log})
	if err != nil {
		log.Error("start", "err", err)
		os.Exit(1)
	}
	log.Info("ledger serving", "addr", lis.Addr().String(), "dir", *dir, "actors", len(tokens))
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	<-sig
	log.Info("stopping")
	if err := srv.Stop(); err != nil {
		log.Error("stop", "err", err)
		os.Exit(1)
	}
}
