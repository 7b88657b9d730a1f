package main

import (
	"context"
	"crypto/sha256"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/idemdb/idem"
)

var demoCmd = &command{
	name:    "demo",
	summary: "see exactly-once survive lost replies, retries and a crash (start here)",
	help: `
A small payment service runs on an idem engine in a real directory. Simulated
clients send requests, each with a random id; the server's side effect
appends the id to a ledger file (fsynced) before the reply goes out. On the
way back about 20% of replies are lost, and the client retries with the same
id; about 1% of requests are followed by a buggy retry that reuses the id
with a different payload, which idem refuses (ErrConflict). Clients write
every reply they receive into a journal file.

Half way through, the server process is killed with SIGKILL: the demo runs
the server and the clients in a child process (its own binary, started
again), which kills itself right after a side effect, before the engine has
recorded the reply. The demo then reopens the engine on the same directory,
as a restarted server would, and resolves the claims that were in flight:
if the ledger shows the side effect happened, the claim is committed with
the ledger's reply (recover-and-commit), otherwise aborted (recover-and-
abort). The clients then retry every request they have no reply for, with
the same id, and finish.

At the end the demo checks, and prints, that no request ran twice (the
ledger's ids are unique), that none was lost (every request got a reply),
and that every reply is the one recorded when the request ran. The exit
status is 1 if a check fails.

If the binary cannot be started again, the demo crashes an in-memory
filesystem instead (vfs.NewCrashableMem and CrashClone: only what was
fsynced survives) and says so.`,
	examples: []string{
		"idem demo",
		"go run ./cmd/idem demo",
		"idem demo --clients 32 --requests 5000",
		"idem demo --dir /tmp/idem-demo && idem dump /tmp/idem-demo/idem --id req- | head",
		"idem demo --seed 42   # the same plan again",
	},
	setup: func(fs *flag.FlagSet) func(*cli, []string) error {
		o := &demoOpts{}
		fs.StringVar(&o.dir, "dir", "", "keep the data in this `directory` (new or empty): the engine in <dir>/idem, ledger.jsonl, journal.jsonl (default: a temporary directory, removed)")
		fs.IntVar(&o.clients, "clients", 8, "simulated clients (`n` goroutines)")
		fs.IntVar(&o.requests, "requests", 1000, "requests in all (`n`, at least 2)")
		fs.Uint64Var(&o.seed, "seed", 0, "`seed` of the random plan: ids, payloads, lost replies (0: pick one and print it)")
		fs.BoolVar(&o.verbose, "verbose", false, "list every claim in doubt")
		fs.BoolVar(&o.child, "child", false, "(hidden) run as the server process that crashes")
		fs.BoolVar(&o.inProcess, "in-process", false, "(hidden) crash an in-memory filesystem instead of a child process")
		return o.run
	},
}

type demoOpts struct {
	dir       string
	clients   int
	requests  int
	seed      uint64
	verbose   bool
	child     bool
	inProcess bool
}

const (
	demoScope    = "payments"
	demoLostRate = 0.20
	demoBugRate  = 0.01
	// demoChildEnv is set for the child process, so that a test binary
	// standing in for idem knows to run the command (see TestMain).
	demoChildEnv = "IDEM_DEMO_CHILD"
	// demoSegmentSize keeps the WAL small: segments are preallocated, and
	// the demo writes a few hundred KiB.
	demoSegmentSize = 4 << 20
)

// demoRequest is one planned request.
type demoRequest struct {
	id      string
	client  int
	payload string
	fp      []byte // SHA-256 of payload, truncated
	buggy   bool   // after its reply, a buggy retry reuses id with another payload
	otherFP []byte
}

func fingerprint(s string) []byte {
	h := sha256.Sum256([]byte(s))
	return h[:16]
}

// demoPlan is the whole workload, derived from the seed alone, so that the
// child and the parent agree on it.
func demoPlan(seed uint64, clients, requests int) []demoRequest {
	rng := rand.New(rand.NewPCG(seed, 0x1de4))
	plan := make([]demoRequest, requests)
	bugs := 0
	for i := range plan {
		r := &plan[i]
		r.id = fmt.Sprintf("req-%016x", rng.Uint64())
		r.client = i % clients
		r.payload = fmt.Sprintf("pay %d.%02d EUR to account %d", rng.IntN(500), rng.IntN(100), rng.IntN(1e6))
		r.fp = fingerprint(r.payload)
		if rng.Float64() < demoBugRate {
			r.buggy = true
			bugs++
		}
		r.otherFP = fingerprint(r.payload + " (edited by a buggy retry)")
	}
	if bugs == 0 {
		plan[len(plan)/4].buggy = true // always show one conflict
	}
	return plan
}

// demoClients runs the simulated clients against one engine.
type demoClients struct {
	eng     *idem.Engine
	store   demoStore
	plan    []demoRequest
	clients int
	phase   string
	seed    uint64
	replied map[string]bool // requests already answered (read-only while running)
	refused map[string]bool // buggy retries already refused (read-only while running)
}

func (d *demoClients) run(ctx context.Context) error {
	errs := make([]error, d.clients)
	var wg sync.WaitGroup
	for cl := 0; cl < d.clients; cl++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[cl] = d.client(ctx, cl)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// client sends its requests in order. A lost reply is retried with the
// same id until one arrives; the journal records what arrived.
func (d *demoClients) client(ctx context.Context, cl int) error {
	stream := uint64(cl) << 1
	if d.phase != "before crash" {
		stream |= 1
	}
	rng := rand.New(rand.NewPCG(d.seed, stream))
	for i := cl; i < len(d.plan); i += d.clients {
		r := &d.plan[i]
		req := idem.Request{Scope: demoScope, ID: []byte(r.id), Fingerprint: r.fp}
		for !d.replied[r.id] {
			ran := false
			reply, err := d.eng.Do(ctx, req, func(context.Context) ([]byte, error) {
				ran = true
				time.Sleep(time.Duration(rng.IntN(400)) * time.Microsecond) // the work
				rep, err := d.store.execute(r.id)
				return []byte(rep), err
			})
			if err != nil {
				return fmt.Errorf("request %s: %w", r.id, err)
			}
			if rng.Float64() < demoLostRate {
				if err := d.store.record(journalEvent{Kind: "lost", ID: r.id, Replay: !ran, Phase: d.phase}); err != nil {
					return err
				}
				continue // the client never saw it: retry, same id
			}
			if err := d.store.record(journalEvent{Kind: "reply", ID: r.id, Reply: string(reply), Replay: !ran, Phase: d.phase}); err != nil {
				return err
			}
			break
		}
		if r.buggy && !d.refused[r.id] {
			bad := idem.Request{Scope: demoScope, ID: []byte(r.id), Fingerprint: r.otherFP}
			_, err := d.eng.Do(ctx, bad, func(context.Context) ([]byte, error) {
				return nil, errors.New("a buggy retry was executed")
			})
			ev := journalEvent{Kind: "conflict", ID: r.id, Phase: d.phase}
			if !errors.Is(err, idem.ErrConflict) {
				ev.Kind, ev.Reply = "accepted", fmt.Sprint(err)
			}
			if err := d.store.record(ev); err != nil {
				return err
			}
		}
	}
	return nil
}

func (o *demoOpts) run(c *cli, pos []string) error {
	if len(pos) > 0 {
		return usagef("demo takes no arguments (use --dir to keep the data)")
	}
	if o.requests < 2 {
		return usagef("--requests must be at least 2")
	}
	if o.clients < 1 || o.clients > 4096 {
		return usagef("--clients must be between 1 and 4096")
	}
	o.clients = min(o.clients, o.requests)
	if o.child {
		return o.runChild(c)
	}
	if o.seed == 0 {
		o.seed = uint64(time.Now().UnixNano())%1_000_000 + 1
	}
	w := c.stdout
	fmt.Fprintf(w, "idem demo: %d clients send %d requests to a payment service running on idem.\n", o.clients, o.requests)
	fmt.Fprintf(w, "  ~%.0f%% of replies are lost on the way back (the client retries with the same id),\n", demoLostRate*100)
	fmt.Fprintf(w, "  ~%.0f%% of requests get a buggy retry (same id, different payload), and the server is killed half way.\n", demoBugRate*100)
	fmt.Fprintf(w, "seed      %d (--seed %d replays the same plan)\n", o.seed, o.seed)
	plan := demoPlan(o.seed, o.clients, o.requests)

	if !o.inProcess {
		root, cleanup, err := o.dataDir()
		if err != nil {
			return err
		}
		defer cleanup()
		if o.dir != "" {
			fmt.Fprintf(w, "data      %s (engine in %s, ledger.jsonl, journal.jsonl; kept)\n", root, filepath.Join(root, "idem"))
		} else {
			fmt.Fprintf(w, "data      %s (removed at the end; keep it with --dir)\n", root)
		}
		exe, err := os.Executable()
		if err == nil {
			var started bool
			started, err = o.runChildProcess(c, exe, root)
			if started {
				if err != nil {
					return err
				}
				return o.recoverOnDisk(c, root, plan)
			}
		}
		fmt.Fprintf(w, "note      cannot start a child process (%v): crashing an in-memory filesystem instead\n", err)
	}
	return o.runInProcess(c, plan)
}

// dataDir returns the directory for the demo's data and what removes it.
func (o *demoOpts) dataDir() (string, func(), error) {
	if o.dir == "" {
		d, err := os.MkdirTemp("", "idem-demo-")
		if err != nil {
			return "", nil, err
		}
		return d, func() { os.RemoveAll(d) }, nil
	}
	if err := os.MkdirAll(o.dir, 0o755); err != nil {
		return "", nil, err
	}
	ents, err := os.ReadDir(o.dir)
	if err != nil {
		return "", nil, err
	}
	if len(ents) > 0 {
		return "", nil, fmt.Errorf("--dir %s is not empty: the demo needs a new or empty directory", o.dir)
	}
	return o.dir, func() {}, nil
}

// runChildProcess runs phase 1 in a child process and waits for it to die.
// started is false when the child could not be started at all.
func (o *demoOpts) runChildProcess(c *cli, exe, root string) (started bool, err error) {
	cmd := exec.Command(exe, "demo", "--child", "--dir", root,
		"--clients", strconv.Itoa(o.clients), "--requests", strconv.Itoa(o.requests),
		"--seed", strconv.FormatUint(o.seed, 10))
	cmd.Env = append(os.Environ(), demoChildEnv+"=1")
	cmd.Stdout, cmd.Stderr = c.stdout, c.stderr
	if err := cmd.Start(); err != nil {
		return false, err
	}
	err = cmd.Wait()
	st := cmd.ProcessState
	switch {
	case st == nil:
		return true, fmt.Errorf("the child process: %v", err)
	case st.Exited() && st.ExitCode() == 0:
		fmt.Fprintf(c.stdout, "phase 1   the child finished without crashing (unexpected); going on\n")
	case st.Exited():
		return true, fmt.Errorf("the child process failed (exit status %d); see its message above", st.ExitCode())
	default:
		fmt.Fprintf(c.stdout, "phase 1   the child process is dead (%s): no Close, no flush\n", st)
	}
	return true, nil
}

// runChild is the server process of phase 1: engine, side effects and
// clients, until it kills itself half way.
func (o *demoOpts) runChild(c *cli) error {
	if o.dir == "" {
		return usagef("--child needs --dir")
	}
	store, _, err := openFileStore(o.dir)
	if err != nil {
		return err
	}
	defer store.close()
	eng, err := idem.Open(filepath.Join(o.dir, "idem"), &idem.Options{SegmentSize: demoSegmentSize})
	if err != nil {
		return err
	}
	defer eng.Close()
	store.crashAt = o.requests / 2
	store.onCrash = func() {
		fmt.Fprintf(c.stdout, "phase 1   child: %d requests executed; the last one is in the ledger but not yet committed in idem: SIGKILL now\n", store.executed)
		killSelf()
	}
	fmt.Fprintf(c.stdout, "phase 1   child process %d opened the engine; %d clients start sending\n", os.Getpid(), o.clients)
	d := &demoClients{eng: eng, store: store, plan: demoPlan(o.seed, o.clients, o.requests), clients: o.clients,
		phase: "before crash", seed: o.seed, replied: map[string]bool{}, refused: map[string]bool{}}
	return d.run(context.Background())
}

// recoverOnDisk is phase 2 after a real child crash: reopen the directory,
// resolve the claims in doubt, finish, check.
func (o *demoOpts) recoverOnDisk(c *cli, root string, plan []demoRequest) error {
	w := c.stdout
	engDir := filepath.Join(root, "idem")
	store, notes, err := openFileStore(root)
	if err != nil {
		return err
	}
	defer store.close()
	for _, n := range notes {
		fmt.Fprintf(w, "reopen    %s\n", n)
	}
	// What the crash left, seen by the read-only tools of this command.
	if ri, err := loadIndex(c, engDir, true, ""); err == nil {
		fmt.Fprintf(w, "reopen    the index files had applied LSN %d; the WAL holds records through LSN %d: Open replays %d\n",
			ri.stored.applied, ri.scan.LastLSN, ri.scan.LastLSN-ri.stored.applied)
		if t := ri.scan.TornTail; t != nil {
			fmt.Fprintf(w, "reopen    the last WAL segment ends with %d bytes of torn tail: Open cuts them\n", t.Bytes)
		}
		ri.close()
	}
	eng, err := idem.Open(engDir, &idem.Options{SegmentSize: demoSegmentSize})
	if err != nil {
		return fmt.Errorf("reopening after the crash: %w", err)
	}
	defer eng.Close()
	return o.finish(c, eng, store, plan)
}

// runInProcess is the fallback: the same two phases in this process, the
// crash being a CrashClone of an in-memory filesystem.
func (o *demoOpts) runInProcess(c *cli, plan []demoRequest) error {
	w := c.stdout
	fmt.Fprintf(w, "data      in memory (vfs.NewCrashableMem: a crash keeps only what was fsynced)\n")
	mem := vfs.NewCrashableMem()
	const engDir = "idem"
	eng, err := idem.Open(engDir, &idem.Options{FS: mem, SegmentSize: demoSegmentSize})
	if err != nil {
		return err
	}
	store := &memStore{crashAt: o.requests / 2}
	var crashed *vfs.MemFS
	store.onCrash = func() {
		crashed = mem.CrashClone(vfs.CrashCloneCfg{}) // only what was fsynced
		fmt.Fprintf(w, "phase 1   %d requests executed; the last one is in the ledger but not yet committed in idem: crash now\n", store.executed)
	}
	fmt.Fprintf(w, "phase 1   in-process server on an in-memory filesystem; %d clients start sending\n", o.clients)
	d := &demoClients{eng: eng, store: store, plan: plan, clients: o.clients,
		phase: "before crash", seed: o.seed, replied: map[string]bool{}, refused: map[string]bool{}}
	err = d.run(context.Background())
	_ = eng.Close() // the crashed "process": its later writes are not in the clone
	if err != nil && !errors.Is(err, errCrashed) {
		return err
	}
	if crashed == nil {
		return errors.New("the simulated crash did not happen")
	}
	store.restart()
	fmt.Fprintf(w, "phase 1   the filesystem was cut back to what was fsynced\n")
	eng, err = idem.Open(engDir, &idem.Options{FS: crashed, SegmentSize: demoSegmentSize})
	if err != nil {
		return fmt.Errorf("reopening after the crash: %w", err)
	}
	defer eng.Close()
	return o.finish(c, eng, store, plan)
}

// finish resolves the claims in doubt, lets the clients retry and finish,
// then checks and prints the summary.
func (o *demoOpts) finish(c *cli, eng *idem.Engine, store demoStore, plan []demoRequest) error {
	w := c.stdout
	ctx := context.Background()
	st := eng.Stats()
	if st.TornTailsCut > 0 {
		fmt.Fprintf(w, "reopen    Open cut %d torn WAL tail(s)\n", st.TornTailsCut)
	}
	ledger, err := store.ledger()
	if err != nil {
		return err
	}
	executed := map[string]string{}
	for _, l := range ledger {
		executed[l.ID] = l.Reply
	}
	doubts, err := eng.InDoubt(ctx, "") // every scope: the demo uses one
	if err != nil {
		return err
	}
	var committed, aborted int
	for i, dc := range doubts {
		id := string(dc.ID)
		var what string
		if reply, ok := executed[id]; ok {
			err = dc.Claim.Commit(ctx, []byte(reply))
			committed++
			what = "the ledger shows it ran: recover-and-commit with the ledger's reply"
		} else {
			err = dc.Claim.Abort(ctx)
			aborted++
			what = "not in the ledger, so it never ran: recover-and-abort"
		}
		if i < 10 || o.verbose {
			fmt.Fprintf(w, "reopen    in doubt: %s, claimed %s; %s\n", id, dc.ClaimedAt.UTC().Format(time.RFC3339Nano), what)
		} else if i == 10 {
			fmt.Fprintf(w, "reopen    ... %d more claims in doubt (--verbose lists them)\n", len(doubts)-10)
		}
		if err != nil {
			return fmt.Errorf("resolving %s: %w", id, err)
		}
	}
	if len(doubts) == 0 {
		fmt.Fprintf(w, "reopen    no claim in doubt\n")
	}
	events, err := store.journal()
	if err != nil {
		return err
	}
	replied, refused := map[string]bool{}, map[string]bool{}
	for _, ev := range events {
		switch ev.Kind {
		case "reply":
			replied[ev.ID] = true
		case "conflict":
			refused[ev.ID] = true
		}
	}
	fmt.Fprintf(w, "phase 2   %d of %d requests have a reply in the client journal; the clients retry the others with the same ids\n", len(replied), len(plan))
	d := &demoClients{eng: eng, store: store, plan: plan, clients: o.clients,
		phase: "after crash", seed: o.seed, replied: replied, refused: refused}
	if err := d.run(ctx); err != nil {
		return err
	}
	return o.check(c, eng, store, plan, committed, aborted)
}

// check verifies exactly-once from the ledger, the journal and the engine,
// and prints the summary.
func (o *demoOpts) check(c *cli, eng *idem.Engine, store demoStore, plan []demoRequest, committed, aborted int) error {
	w := c.stdout
	ledger, err := store.ledger()
	if err != nil {
		return err
	}
	events, err := store.journal()
	if err != nil {
		return err
	}
	planned := map[string]*demoRequest{}
	bugs := 0
	for i := range plan {
		planned[plan[i].id] = &plan[i]
		if plan[i].buggy {
			bugs++
		}
	}
	executed := map[string]string{}
	var twice, phantom []string
	for _, l := range ledger {
		if _, ok := executed[l.ID]; ok {
			twice = append(twice, l.ID)
		}
		executed[l.ID] = l.Reply
		if planned[l.ID] == nil {
			phantom = append(phantom, l.ID)
		}
	}
	var lost, wrong, accepted []string
	got := map[string]string{}
	var replies, replays, lostReplies, calls int
	refused := map[string]bool{}
	for _, ev := range events {
		switch ev.Kind {
		case "reply":
			replies++
			calls++
			if ev.Replay {
				replays++
			}
			if prev, ok := got[ev.ID]; ok && prev != ev.Reply {
				wrong = append(wrong, fmt.Sprintf("%s: replies %q and %q", ev.ID, prev, ev.Reply))
			}
			got[ev.ID] = ev.Reply
			if r, ok := executed[ev.ID]; !ok || r != ev.Reply {
				wrong = append(wrong, fmt.Sprintf("%s: reply %q, executed as %q", ev.ID, ev.Reply, r))
			}
		case "lost":
			lostReplies++
			calls++
			if ev.Replay {
				replays++
			}
		case "conflict":
			refused[ev.ID] = true
		case "accepted":
			accepted = append(accepted, ev.ID+" ("+ev.Reply+")")
		}
	}
	var stored []string
	ctx := context.Background()
	for i := range plan {
		id := plan[i].id
		if _, ok := got[id]; !ok {
			lost = append(lost, id)
		}
		res, err := eng.Lookup(ctx, idem.Request{Scope: demoScope, ID: []byte(id)})
		if err != nil {
			return err
		}
		if res.Status != idem.Done || string(res.Reply) != executed[id] {
			stored = append(stored, fmt.Sprintf("%s: engine says %v %q, ledger %q", id, res.Status, res.Reply, executed[id]))
		}
		if plan[i].buggy && !refused[id] {
			accepted = append(accepted, id+" (no ErrConflict recorded)")
		}
	}
	fmt.Fprintf(w, "summary\n")
	fmt.Fprintf(w, "  requests            %d from %d clients\n", len(plan), o.clients)
	fmt.Fprintf(w, "  executions          %d (ledger lines)\n", len(ledger))
	fmt.Fprintf(w, "  Do calls answered   %d (%d replies received, %d lost on the way back and retried)\n", calls, replies, lostReplies)
	fmt.Fprintf(w, "  replays             %d (duplicate hits: the stored reply came back, nothing ran)\n", replays)
	fmt.Fprintf(w, "  conflicts           %d of %d buggy retries refused with ErrConflict\n", len(refused), bugs)
	fmt.Fprintf(w, "  in-doubt resolved   %d (%d recover-and-commit, %d recover-and-abort)\n", committed+aborted, committed, aborted)
	checks := []struct {
		name string
		bad  []string
	}{
		{"no request executed twice (ledger ids unique)", twice},
		{"no execution outside the plan", phantom},
		{"no request lost (every request has a reply)", lost},
		{"every reply equals the reply recorded at execution", wrong},
		{"the engine holds the executed reply for every id", stored},
		{"every buggy retry was refused with ErrConflict", accepted},
	}
	failed := 0
	for _, ch := range checks {
		if len(ch.bad) == 0 {
			fmt.Fprintf(w, "CHECK %-52s ok\n", ch.name)
			continue
		}
		failed++
		fmt.Fprintf(w, "CHECK %-52s FAILED (%d)\n", ch.name, len(ch.bad))
		for i, b := range ch.bad {
			if i == 5 {
				fmt.Fprintf(w, "        ... and %d more\n", len(ch.bad)-5)
				break
			}
			fmt.Fprintf(w, "        %s\n", b)
		}
	}
	if failed > 0 {
		fmt.Fprintf(w, "exactly-once: FAILED (%d checks)\n", failed)
		return errReported
	}
	fmt.Fprintf(w, "exactly-once: ok\n")
	if o.dir != "" && !o.inProcess {
		fmt.Fprintf(w, "next      idem dump %s | less;  idem verify %s\n", filepath.Join(o.dir, "idem"), filepath.Join(o.dir, "idem"))
	}
	return nil
}
