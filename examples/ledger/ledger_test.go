package ledger_test

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestCommands builds the example's server and client and runs the
// README's session: writes, a lost response retried, batches (one failing
// its compare-and-set), GetClientState at both levels, a graceful restart,
// a SIGKILL, a client that lost its saved state, and another actor.
func TestCommands(t *testing.T) {
	if testing.Short() {
		t.Skip("builds two binaries")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	bin := t.TempDir()
	t0 := time.Now()
	// One build of both commands (without -race: the dependencies compiled
	// by go vet are reused).
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", bin+string(filepath.Separator), "./server", "./client").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	t.Logf("built the commands in %v", time.Since(t0).Round(time.Millisecond))
	data, state := t.TempDir(), t.TempDir()

	var addr string
	var srv *exec.Cmd
	start := func() {
		srv = exec.CommandContext(ctx, filepath.Join(bin, "server"), "-addr", "127.0.0.1:0", "-dir", data,
			"-token", "tok-alice=user:alice", "-token", "tok-bob=user:bob")
		stderr, err := srv.StderrPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := srv.Start(); err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(stderr)
		re := regexp.MustCompile(`addr=(127\.0\.0\.1:\d+)`)
		for sc.Scan() {
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				addr = m[1]
				break
			}
		}
		if addr == "" {
			t.Fatal("server did not report its address")
		}
		go func() {
			for sc.Scan() {
			}
		}()
	}
	stop := func(sig syscall.Signal) {
		_ = srv.Process.Signal(sig)
		_ = srv.Wait()
	}
	start()
	t.Cleanup(func() { stop(syscall.SIGKILL) })

	run := func(token string, args ...string) (map[string]any, string, error) {
		all := append([]string{"-addr", addr, "-token", token, "-client", "laptop", "-ns", "acme", "-state", state}, args...)
		cmd := exec.CommandContext(ctx, filepath.Join(bin, "client"), all...)
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		var m map[string]any
		if err == nil {
			if jerr := json.Unmarshal(out, &m); jerr != nil {
				t.Fatalf("client %v: output %q: %v", args, out, jerr)
			}
		}
		return m, stderr.String(), err
	}
	must := func(token string, args ...string) (map[string]any, string) {
		t.Helper()
		m, stderr, err := run(token, args...)
		if err != nil {
			t.Fatalf("client %v: %v\n%s", args, err, stderr)
		}
		return m, stderr
	}
	want := func(m map[string]any, key, val string) {
		t.Helper()
		if got, _ := m[key].(string); got != val {
			t.Fatalf("%s = %v, want %s (%v)", key, m[key], val, m)
		}
	}

	m, _ := must("tok-alice", "write", "cash", "100")
	want(m, "sequence", "1")
	want(m, "actor", "user:alice")

	m, stderr := must("tok-alice", "-drop-first-response", "write", "cash", "-20")
	want(m, "sequence", "2")
	if !strings.Contains(stderr, "response lost") || !strings.Contains(stderr, "retrying") || !strings.Contains(stderr, m["txId"].(string)) {
		t.Fatalf("the retry did not replay the lost response:\n%s\n%v", stderr, m)
	}

	m, _ = must("tok-alice", "-vault", "eu", "batch", "cash:50", "fees:5")
	want(m, "sequence", "1")
	if _, stderr, err := run("tok-alice", "-vault", "eu", "batch", "cash:-10=999", "fees:10"); err == nil || !strings.Contains(stderr, "FailedPrecondition") {
		t.Fatalf("failing batch: %v\n%s", err, stderr)
	}
	m, _ = must("tok-alice", "-vault", "eu", "state")
	want(m, "lastCommittedSequence", "1")
	m, _ = must("tok-alice", "state")
	want(m, "lastCommittedSequence", "2")

	stop(syscall.SIGTERM)
	start()
	m, _ = must("tok-alice", "balance", "cash")
	want(m, "balance", "80")
	m, _ = must("tok-alice", "write", "cash", "1")
	want(m, "sequence", "3")

	stop(syscall.SIGKILL)
	start()
	if err := os.RemoveAll(state); err != nil { // the client loses its saved sequences
		t.Fatal(err)
	}
	m, _ = must("tok-alice", "write", "cash", "1")
	want(m, "sequence", "4")
	m, _ = must("tok-alice", "balance", "cash")
	want(m, "balance", "82")
	m, _ = must("tok-bob", "state")
	want(m, "lastCommittedSequence", "0")
}
