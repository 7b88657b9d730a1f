// Package brokertest starts the real brokers the tests of idemstream and
// its source packages run against: NATS JetStream embedded in the test
// process, and a redis-server process on a loopback port. Each stops what
// it started when the test ends.
package brokertest

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/redis/go-redis/v9"
)

// StartNATS starts an embedded NATS server with JetStream on a free
// loopback port, its store in a temp dir.
func StartNATS(t testing.TB) *server.Server {
	t.Helper()
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not start")
	}
	t.Cleanup(func() { ns.Shutdown(); ns.WaitForShutdown() })
	return ns
}

// RequireRedisEnv, set to 1, turns a missing redis-server into a test
// failure (CI sets it: .ci/run installs redis-server).
const RequireRedisEnv = "IDEM_REQUIRE_REDIS"

// RedisServer returns the path of the redis-server binary. Without it the
// test is skipped with one line saying what and how to install it, or
// fails when IDEM_REQUIRE_REDIS=1. Every Redis test goes through it.
func RedisServer(t testing.TB) string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err == nil {
		return bin
	}
	if os.Getenv(RequireRedisEnv) == "1" {
		t.Fatalf("redis-server is not on PATH and %s=1: install it (apt-get install redis-server)", RequireRedisEnv)
	}
	t.Skipf("skipped %s: it runs a real redis-server, which is not on PATH (install: apt-get install redis-server)", t.Name())
	return ""
}

// StartRedis starts a real redis-server on a free loopback port, with no
// persistence, in a temp dir, and stops it by its pid at cleanup.
func StartRedis(t testing.TB) *redis.Client {
	t.Helper()
	bin := RedisServer(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	dir := t.TempDir()
	cmd := exec.Command(bin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", dir, "--logfile", filepath.Join(dir, "redis.log"))
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting redis-server: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Kill)
		_ = cmd.Wait()
	})
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(port)})
	t.Cleanup(func() { rdb.Close() })
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := rdb.Ping(ctx).Err()
		cancel()
		if err == nil {
			return rdb
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(dir, "redis.log"))
			t.Fatalf("redis-server on port %d not answering: %v\n%s", port, err, log)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
