package peers

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// embedded are the peers that need no server.
var embedded = []string{"idem", "pebble", "bbolt", "sqlite", "file"}

func openPeer(t *testing.T, name string, cfg Config) Peer {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if cfg.Dir == "" {
		cfg.Dir = t.TempDir()
	}
	p, err := Open(ctx, name, cfg)
	if err != nil {
		t.Fatalf("open %s: %v", name, err)
	}
	return p
}

// TestRunShort runs the harness on every embedded peer (and on Redis when
// redis-server is installed) for a fraction of a second: every phase
// completes requests without errors, and the duplicate phase finds every
// committed id with its reply (Run checks each reply).
func TestRunShort(t *testing.T) {
	names := append([]string(nil), embedded...)
	cfg := Config{Concurrency: 4}
	if addr, _, ok := startRedis(t); ok {
		names = append(names, "redis")
		cfg.RedisAddr = addr
	}
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			c := cfg
			c.Dir = t.TempDir()
			p := openPeer(t, name, c)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			rows, err := Run(ctx, p, RunConfig{Concurrency: 4, Fresh: 200 * time.Millisecond, Duplicate: 100 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			if err := p.Close(); err != nil {
				t.Fatalf("close: %v", err)
			}
			want := 2
			if name == "file" {
				want = 1 // no lookups: no duplicate phase
			}
			if len(rows) != want {
				t.Fatalf("%d phases, want %d: %+v", len(rows), want, rows)
			}
			for _, r := range rows {
				if r.Requests == 0 || r.Errors != 0 || r.PerSec <= 0 {
					t.Errorf("%s: %d requests, %d errors (first: %s), %.0f/s", r.Phase, r.Requests, r.Errors, r.FirstError, r.PerSec)
				}
				if !(r.P50us <= r.P99us && r.P99us <= r.P999us && r.P999us <= r.MaxUs) {
					t.Errorf("%s: percentiles out of order: %+v", r.Phase, r)
				}
				if r.ClientCPU <= 0 {
					t.Errorf("%s: no client CPU time measured", r.Phase)
				}
			}
		})
	}
}

// TestExactlyOneClaims: concurrent callers of one new id on each peer
// with lookups: exactly one runs it; every other one gets the committed
// reply or is told the id is in flight; afterwards everyone gets the reply.
func TestExactlyOneClaims(t *testing.T) {
	names := []string{"idem", "pebble", "bbolt", "sqlite"}
	cfg := Config{Concurrency: 16}
	if addr, _, ok := startRedis(t); ok {
		names = append(names, "redis")
		cfg.RedisAddr = addr
	}
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			c := cfg
			c.Dir = t.TempDir()
			p := openPeer(t, name, c)
			defer p.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			checkExactlyOne(ctx, t, p, "id-")
		})
	}
}

// checkExactlyOne races 16 callers on each of 5 new ids (prefix and a
// number): exactly one runs it; every other one gets the committed reply
// or is told the id is in flight; afterwards everyone gets the reply.
func checkExactlyOne(ctx context.Context, t *testing.T, p Peer, prefix string) {
	t.Helper()
	for round := range 5 {
		id := []byte(fmt.Sprintf("%s%015d", prefix, round))
		want := []byte("reply " + strconv.Itoa(round))
		var (
			mu             sync.Mutex
			ran, inflight  int
			wg             sync.WaitGroup
			start          = make(chan struct{})
			freshN, replyN int
		)
		for range 16 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				got, fresh, err := p.Do(ctx, id, func() []byte {
					mu.Lock()
					ran++
					mu.Unlock()
					time.Sleep(5 * time.Millisecond)
					return want
				})
				mu.Lock()
				defer mu.Unlock()
				switch {
				case errors.Is(err, ErrInFlight):
					inflight++
				case err != nil:
					t.Errorf("Do: %v", err)
				case !bytes.Equal(got, want):
					t.Errorf("reply %q, want %q", got, want)
				case fresh:
					freshN++
				default:
					replyN++
				}
			}()
		}
		close(start)
		wg.Wait()
		if ran != 1 || freshN != 1 || freshN+replyN+inflight != 16 {
			t.Fatalf("id %s: ran %d times, %d fresh, %d replies, %d in flight", id, ran, freshN, replyN, inflight)
		}
		got, fresh, err := p.Do(ctx, id, func() []byte { t.Error("ran again"); return nil })
		if err != nil || fresh || !bytes.Equal(got, want) {
			t.Fatalf("after: %q fresh=%v err=%v", got, fresh, err)
		}
	}
}

// TestClusterPeers starts each cluster peer (three idem cluster nodes,
// three etcd members, in this process on loopback), runs the harness on
// it for a fraction of a second, races callers on new ids in both orders
// of operations (claim first, read first), closes it, and checks that
// nothing it started still listens.
func TestClusterPeers(t *testing.T) {
	for _, name := range []string{"idemcluster", "etcd"} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			p := openPeer(t, name, Config{Concurrency: 16, Dir: t.TempDir()})
			closed := false
			defer func() {
				if !closed {
					p.Close()
				}
			}()
			addrs := p.(interface{ listening() []string }).listening()
			if len(addrs) != 2*ClusterMembers {
				t.Fatalf("listening on %v, want %d addresses (peer and client per member)", addrs, 2*ClusterMembers)
			}
			rows, err := Run(ctx, p, RunConfig{Concurrency: 4, Fresh: 300 * time.Millisecond, Duplicate: 200 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			if len(rows) != 2 {
				t.Fatalf("%d phases, want 2: %+v", len(rows), rows)
			}
			for _, r := range rows {
				if r.Requests == 0 || r.Errors != 0 {
					t.Errorf("%s: %d requests, %d errors (first: %s)", r.Phase, r.Requests, r.Errors, r.FirstError)
				}
			}
			// Both orders of operations, each on new ids.
			for _, fresh := range []bool{true, false} {
				p.(Phased).Phase(fresh)
				checkExactlyOne(ctx, t, p, fmt.Sprintf("claim-first=%v/", fresh))
			}
			closed = true
			if err := p.Close(); err != nil {
				t.Fatalf("close: %v", err)
			}
			for _, a := range addrs {
				if c, err := net.DialTimeout("tcp", a, time.Second); err == nil {
					c.Close()
					t.Errorf("%s still accepts connections after Close", a)
				}
			}
		})
	}
}

// TestFileSegments: the file-append limit rotates into the next
// preallocated segment when one is full, and every record is in the files.
func TestFileSegments(t *testing.T) {
	old := fileSegmentSize
	fileSegmentSize = 1 << 20
	t.Cleanup(func() { fileSegmentSize = old })
	dir := t.TempDir()
	p := openPeer(t, "file", Config{Dir: dir, Concurrency: 8})
	reply := bytes.Repeat([]byte{7}, 4096)
	n := int(fileSegmentSize / 4096 * 5 / 4) // 1.25 segments of replies
	var wg sync.WaitGroup
	errc := make(chan error, 8)
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += 8 {
				id := []byte(fmt.Sprintf("%016d", i))
				if _, fresh, err := p.Do(context.Background(), id, func() []byte { return reply }); err != nil || !fresh {
					errc <- fmt.Errorf("request %d: fresh=%v err=%v", i, fresh, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errc)
	for err := range errc {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	segs, _ := filepath.Glob(filepath.Join(dir, "*.log"))
	if len(segs) != 2 {
		t.Fatalf("segments %v, want 2", segs)
	}
	// Count the records: each frame is len(4) crc(4) payload(len).
	records := 0
	for _, s := range segs {
		b, err := os.ReadFile(s)
		if err != nil {
			t.Fatal(err)
		}
		if int64(len(b)) != fileSegmentSize {
			t.Errorf("%s: %d bytes, want the preallocated %d", s, len(b), fileSegmentSize)
		}
		for off := 0; off+8 <= len(b); {
			l := int(b[off]) | int(b[off+1])<<8 | int(b[off+2])<<16 | int(b[off+3])<<24
			if l == 0 {
				break // the zero-filled rest
			}
			off += 8 + l
			records++
		}
	}
	if records != 2*n {
		t.Fatalf("%d records in the segments, want %d (a claim and a reply per request)", records, 2*n)
	}
}

// TestSummary: ratios are taken against the base peer in the same round,
// concurrency and phase; the CSV round trip keeps them (in a column named
// for the base) and medians take them over the rounds.
func TestSummary(t *testing.T) {
	var rows []Result
	for round := 1; round <= 3; round++ {
		for _, peer := range []string{"idem", "pebble"} {
			v := float64(1000 * round)
			if peer == "pebble" {
				v /= 2
			}
			rows = append(rows, Result{Round: round, Peer: peer, Concurrency: 64, Phase: "fresh", Requests: 10, PerSec: v, P50us: float64(round)})
		}
	}
	SetRatios(rows, "pebble")
	var buf bytes.Buffer
	if err := WriteCSV(&buf, rows, true, "pebble"); err != nil {
		t.Fatal(err)
	}
	if h, _, _ := strings.Cut(buf.String(), "\n"); !strings.Contains(h, ",ratio_to_pebble,") {
		t.Fatalf("header %q has no ratio_to_pebble column", h)
	}
	back, err := ReadCSV(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if back[0].Peer != "idem" || back[0].Ratio != 2 || back[1].Ratio != 1 {
		t.Fatalf("ratios to pebble read back: %+v", back[:2])
	}
	SetRatios(back, "idem")
	ms := Medians(back)
	if len(ms) != 2 || ms[0].Peer != "idem" || ms[1].Peer != "pebble" {
		t.Fatalf("medians %+v", ms)
	}
	if ms[1].PerSec != 1000 || ms[1].Ratio != 0.5 || ms[1].BaseOver != 2 || ms[1].MinPerSec != 500 || ms[1].MaxPerSec != 1500 || ms[1].P50us != 2 {
		t.Fatalf("pebble medians %+v", ms[1])
	}
	if _, err := ReadCSV(bytes.NewBufferString("a,b\n1,2\n")); err == nil {
		t.Fatal("a CSV without the columns was read")
	}
}

// TestServerCPU: the CPU time of a process tree is read from /proc,
// including a child that burns CPU.
func TestServerCPU(t *testing.T) {
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no /proc")
	}
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("no sh")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	// A parent shell whose child counts to 300,000 (a few hundred ms of
	// CPU), then both sleep.
	cmd := exec.CommandContext(ctx, sh, "-c", `sh -c 'i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done; sleep 30' & sleep 30`)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cancel(); _ = cmd.Wait() })
	before := serverCPU([]int{cmd.Process.Pid})
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		if d := serverCPU([]int{cmd.Process.Pid}) - before; d >= 50*time.Millisecond {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("child's CPU not counted: %v", serverCPU([]int{cmd.Process.Pid})-before)
}

// startRedis starts a real redis-server on a free loopback port with
// appendfsync always, if one is installed.
func startRedis(t *testing.T) (addr string, pid int, ok bool) {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Log("redis-server not installed: Redis peer not tested")
		return "", 0, false
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	dir := t.TempDir()
	cmd := exec.Command(bin, "--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--dir", dir,
		"--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(end) {
			t.Fatalf("redis-server not listening on %s: %v", addr, err)
		}
	}
	return addr, cmd.Process.Pid, true
}

// countingPeer is a store in memory that counts the requests it handles
// and remembers the ids it committed.
type countingPeer struct {
	mu        sync.Mutex
	committed map[string][]byte
	fresh     int
}

func (p *countingPeer) Do(_ context.Context, id []byte, fn func() []byte) ([]byte, bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r, ok := p.committed[string(id)]; ok {
		return r, false, nil
	}
	r := fn()
	p.committed[string(id)] = r
	p.fresh++
	return r, true, nil
}

func (p *countingPeer) Close() error { return nil }

// TestRunWarmup: a warm-up runs fresh requests before the fresh phase
// without a row of its own, and the measured phases count only their own
// requests (the fresh phase's are all the fresh requests the store
// handled but the warm-up's), so the rows describe the store after its
// start. Without Warmup the fresh phase counts every fresh request.
func TestRunWarmup(t *testing.T) {
	for _, warmup := range []time.Duration{0, 150 * time.Millisecond} {
		p := &countingPeer{committed: map[string][]byte{}}
		rows, err := Run(context.Background(), p, RunConfig{Concurrency: 4, Warmup: warmup, Fresh: 50 * time.Millisecond, Duplicate: 20 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		if len(rows) != 2 || rows[0].Phase != "fresh" || rows[1].Phase != "duplicate" {
			t.Fatalf("warm-up %v: phases %+v, want fresh then duplicate", warmup, rows)
		}
		fresh := int(rows[0].Requests)
		switch {
		case warmup == 0 && fresh != p.fresh:
			t.Errorf("no warm-up: the fresh phase counts %d requests, the store ran %d", fresh, p.fresh)
		case warmup > 0 && (fresh == 0 || fresh >= p.fresh):
			t.Errorf("warm-up %v: the fresh phase counts %d requests of the %d the store ran: want its own only, some", warmup, fresh, p.fresh)
		}
	}
}
