package idemhttp_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemhttp"
)

// TestMain runs the server process of TestSIGKILLInFlight when
// IDEMHTTP_CHILD is set (the test binary re-executed).
func TestMain(m *testing.M) {
	if dir := os.Getenv("IDEMHTTP_CHILD"); dir != "" {
		os.Exit(killChild(dir))
	}
	os.Exit(m.Run())
}

// killChild serves the middleware on a loopback port: POST /fast answers at
// once, POST /slow prints "started <key>" and never answers. It prints
// "addr <host:port>" when it listens and runs until it is killed.
func killChild(dir string) int {
	e, err := idem.Open(dir, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 3
	}
	var calls int
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls++
		if r.URL.Path == "/slow" {
			fmt.Println("started", r.Header.Get(idemhttp.HeaderKey))
			select {}
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "made by pid %d, call %d", os.Getpid(), calls)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 3
	}
	mw, err := idemhttp.Middleware(e, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, "child:", err)
		return 3
	}
	fmt.Println("addr", ln.Addr())
	_ = http.Serve(ln, mw(h))
	return 0
}

type child struct {
	cmd  *exec.Cmd
	addr string
	out  *bufio.Scanner
}

func startChild(t *testing.T, dir string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "IDEMHTTP_CHILD="+dir)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{cmd: cmd, out: bufio.NewScanner(out)}
	t.Cleanup(func() { c.kill() })
	line := c.line(t)
	addr, ok := strings.CutPrefix(line, "addr ")
	if !ok {
		t.Fatalf("child said %q", line)
	}
	c.addr = "http://" + addr
	return c
}

func (c *child) line(t *testing.T) string {
	t.Helper()
	got := make(chan string, 1)
	go func() {
		if c.out.Scan() {
			got <- c.out.Text()
		}
		close(got)
	}()
	select {
	case l, ok := <-got:
		if !ok {
			t.Fatal("child exited")
		}
		return l
	case <-time.After(20 * time.Second):
		t.Fatal("child silent for 20s")
		return ""
	}
}

func (c *child) kill() {
	_ = c.cmd.Process.Signal(syscall.SIGKILL)
	_, _ = c.cmd.Process.Wait()
}

// A real server process is killed with SIGKILL while a request is being
// handled: after the restart the finished key is replayed from disk, and the
// killed one is in doubt (IDEMPOTENCY_KEY_PROCESSING), listed by InDoubt.
func TestSIGKILLInFlight(t *testing.T) {
	if testing.Short() {
		t.Skip("re-executes the test binary")
	}
	ctx := testCtx(t, 60*time.Second)
	dir := filepath.Join(t.TempDir(), "idem")
	c := startChild(t, dir)
	hc := &http.Client{Transport: &http.Transport{}}
	defer hc.CloseIdleConnections()
	first := do(t, ctx, hc, http.MethodPost, c.addr+"/fast", item1, idemhttp.HeaderKey, "done-before-kill")
	if first.status != http.StatusCreated {
		t.Fatalf("%d %s", first.status, first.body)
	}
	go func() {
		_, _ = tryDo(ctx, hc, http.MethodPost, c.addr+"/slow", item1, idemhttp.HeaderKey, "killed-in-flight")
	}()
	if l := c.line(t); l != "started killed-in-flight" {
		t.Fatalf("child said %q", l)
	}
	c.kill()

	c = startChild(t, dir)
	hc.CloseIdleConnections()
	sameResponse(t, first, do(t, ctx, hc, http.MethodPost, c.addr+"/fast", item1, idemhttp.HeaderKey, "done-before-kill"))
	r := do(t, ctx, hc, http.MethodPost, c.addr+"/slow", item1, idemhttp.HeaderKey, "killed-in-flight")
	wantError(t, r, http.StatusConflict, idemhttp.CodeProcessing, "killed-in-flight")
	c.kill()

	e, err := idem.Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	doubts, err := e.InDoubt(context.Background(), "")
	if err != nil || len(doubts) != 1 {
		t.Fatalf("in doubt: %v %v", doubts, err)
	}
	if k, ok := idemhttp.ParseKey(doubts[0].Scope, doubts[0].ID); !ok || k.Key != "killed-in-flight" {
		t.Fatalf("in doubt: %+v", k)
	}
}
