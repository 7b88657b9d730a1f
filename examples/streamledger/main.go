// Command streamledger moves payment events from a NATS JetStream stream
// into a ledger file exactly once, while the consumer process is killed
// with SIGKILL and restarted, then checks the ledger.
//
//	go run ./examples/streamledger               # 2000 events, 6 kills
//	go run ./examples/streamledger -events 5000 -kills 10 -keep
//
// The parent process starts an embedded NATS server with JetStream (no
// setup needed), publishes the events (some twice, as a producer retrying
// would), and runs the consumer as a child process (this same binary),
// killing it at random moments. The consumer uses idemstream's idempotent
// sink: each event is claimed in idem, its ledger row appended, its result
// (the running balance) committed with its stream position, and only then
// is the message acknowledged. After a kill, idem lists the events left in
// doubt and the sink asks the ledger whether their row was written. At the
// end the parent prints the check: every event in the ledger exactly once,
// nothing missing, the balance equal to the sum of the amounts.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemstream"
	idemjs "github.com/idemdb/idem/idemstream/jetstream"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

const (
	stream   = "PAYMENTS"
	consumer = "ledger"
)

func main() {
	if dir := os.Getenv("STREAMLEDGER_CHILD"); dir != "" {
		if err := child(dir, os.Getenv("STREAMLEDGER_NATS")); err != nil {
			fmt.Fprintln(os.Stderr, "consumer:", err)
			os.Exit(1)
		}
		return
	}
	events := flag.Int("events", 2000, "events to publish")
	kills := flag.Int("kills", 6, "how many times the consumer is killed with SIGKILL")
	keep := flag.Bool("keep", false, "keep the data directory")
	flag.Parse()
	if err := parent(*events, *kills, *keep); err != nil {
		fmt.Fprintln(os.Stderr, "streamledger:", err)
		os.Exit(1)
	}
}

func amount(i int) int64 { return int64(i%97 + 1) }

func parent(events, kills int, keep bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "streamledger-")
	if err != nil {
		return err
	}
	if keep {
		fmt.Println("data directory:", dir)
	} else {
		defer os.RemoveAll(dir)
	}
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true,
		StoreDir: filepath.Join(dir, "nats"), NoLog: true, NoSigs: true})
	if err != nil {
		return err
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		return errors.New("nats-server did not start")
	}
	defer ns.Shutdown()
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{"payments.>"}}); err != nil {
		return err
	}
	if _, err := js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{Durable: consumer,
		AckPolicy: jetstream.AckExplicitPolicy, AckWait: time.Second, MaxAckPending: 4096}); err != nil {
		return err
	}
	var want int64
	published := 0
	for i := 0; i < events; i++ {
		want += amount(i)
		copies := 1
		if i%10 == 0 {
			copies = 2 // the producer retried: same event id, published twice
		}
		for c := 0; c < copies; c++ {
			m := nats.NewMsg("payments.in")
			m.Header.Set("Event-Id", fmt.Sprintf("pay-%06d", i))
			m.Data = []byte(strconv.FormatInt(amount(i), 10))
			if _, err := js.PublishMsg(ctx, m); err != nil {
				return err
			}
			published++
		}
	}
	fmt.Printf("published %d messages (%d events, %d producer duplicates)\n", published, events, published-events)

	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 4))
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	run := func(killAfter time.Duration) (killed bool, err error) {
		cmd := exec.CommandContext(ctx, exe)
		cmd.Env = append(os.Environ(), "STREAMLEDGER_CHILD="+dir, "STREAMLEDGER_NATS="+ns.ClientURL())
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			return false, err
		}
		if err := cmd.Start(); err != nil {
			return false, err
		}
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			line := sc.Text()
			if strings.HasPrefix(line, "ready") && killAfter > 0 {
				time.AfterFunc(killAfter, func() { _ = cmd.Process.Signal(syscall.SIGKILL) })
			}
			fmt.Println("  consumer:", line)
		}
		err = cmd.Wait()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
				return true, nil
			}
		}
		return false, err
	}
	for k := 0; k < kills; k++ {
		after := time.Duration(100+rng.IntN(900)) * time.Millisecond
		killed, err := run(after)
		if err != nil {
			return err
		}
		if killed {
			fmt.Printf("run %d: consumer killed with SIGKILL %v after start\n", k+1, after)
		} else {
			fmt.Printf("run %d: consumer finished before its kill\n", k+1)
			break
		}
	}
	if _, err := run(0); err != nil {
		return err
	}

	// The check.
	rows, err := readLedger(dir)
	if err != nil {
		return err
	}
	seen := map[string]int{}
	var balance int64
	for _, r := range rows {
		seen[r.id]++
		balance += r.amount
	}
	dups, missing := 0, 0
	for i := 0; i < events; i++ {
		switch n := seen[fmt.Sprintf("pay-%06d", i)]; {
		case n == 0:
			missing++
		case n > 1:
			dups += n - 1
		}
	}
	ok := dups == 0 && missing == 0 && balance == want && len(rows) == events
	fmt.Printf("check: %d events, %d ledger rows, %d duplicates, %d missing, balance %d (expected %d): %s\n",
		events, len(rows), dups, missing, balance, want, map[bool]string{true: "OK", false: "FAILED"}[ok])
	if !ok {
		return errors.New("the ledger is not exactly once")
	}
	return nil
}

type row struct {
	id     string
	amount int64
}

func readLedger(dir string) ([]row, error) {
	data, err := os.ReadFile(filepath.Join(dir, "ledger.log"))
	if err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	var rows []row
	for _, line := range strings.Split(string(data), "\n") {
		id, a, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		n, err := strconv.ParseInt(a, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("ledger row %q: %v", line, err)
		}
		rows = append(rows, row{id, n})
	}
	return rows, nil
}

// child is the consumer process: it runs until the stream is drained.
func child(dir, url string) error {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e, err := idem.Open(filepath.Join(dir, "idem"), nil)
	if err != nil {
		return err
	}
	defer e.Close()
	// The ledger: one row per event, appended and fsynced by the effect.
	rows, err := readLedger(dir)
	if err != nil {
		return err
	}
	var mu sync.Mutex
	inLedger := map[string]bool{}
	var balance int64
	for _, r := range rows {
		inLedger[r.id] = true
		balance += r.amount
	}
	f, err := os.OpenFile(filepath.Join(dir, "ledger.log"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer f.Close()
	post := func(ctx context.Context, ev idemstream.Event) (idemstream.Effect, error) {
		n, err := strconv.ParseInt(string(ev.Payload), 10, 64)
		if err != nil {
			return idemstream.Effect{}, fmt.Errorf("bad amount %q", ev.Payload)
		}
		mu.Lock()
		defer mu.Unlock()
		if _, err := fmt.Fprintf(f, "%s %d\n", ev.ID, n); err != nil {
			return idemstream.Effect{}, err
		}
		if err := f.Sync(); err != nil {
			return idemstream.Effect{}, err
		}
		inLedger[string(ev.ID)] = true
		balance += n
		return idemstream.Effect{Result: []byte(strconv.FormatInt(balance, 10))}, nil
	}
	sink, err := idemstream.NewSink(ctx, e, "ledger", &idemstream.SinkOptions{
		TTL: 24 * time.Hour,
		// An event left in doubt by the kill: did its row reach the ledger?
		Recover: func(ctx context.Context, d idemstream.InDoubtEvent) (idemstream.Resolution, error) {
			mu.Lock()
			defer mu.Unlock()
			return idemstream.Resolution{Applied: inLedger[string(d.ID)]}, nil
		},
	})
	if err != nil {
		return err
	}
	st := sink.Stats()
	front, _, _ := sink.Frontier(stream)
	fmt.Printf("ready: %d ledger rows, frontier %d, in-doubt events committed %d, released %d\n",
		len(rows), front, st.RecoveredCommitted, st.RecoveredAborted)
	nc, err := nats.Connect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	cons, err := js.Consumer(ctx, stream, consumer)
	if err != nil {
		return err
	}
	src, err := idemjs.NewSource(cons, &idemjs.Options{FetchWait: 200 * time.Millisecond, IDHeader: "Event-Id"})
	if err != nil {
		return err
	}
	// Stop once JetStream has nothing left for the consumer.
	go func() {
		for ctx.Err() == nil {
			if info, err := cons.Info(ctx); err == nil && info.NumPending == 0 && info.NumAckPending == 0 {
				cancel()
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	err = idemstream.Consume(ctx, src, sink, post, &idemstream.ConsumeOptions{BatchSize: 64})
	if err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	st = sink.Stats()
	front, _, _ = sink.Frontier(stream)
	fmt.Printf("done: applied %d, replayed %d, frontier %d\n", st.Applied, st.Replayed, front)
	return nil
}
