package idemraft_test

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
	"github.com/idemdb/idem/idemraft"
)

// account is an application FSM: a balance that deposits add to. Adding
// is not idempotent, so a retried deposit must not run twice.
type account struct {
	mu      sync.Mutex
	balance int
}

func (a *account) Apply(l *raft.Log) any {
	n, err := strconv.Atoi(string(l.Data))
	if err != nil {
		return err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.balance += n
	return []byte(strconv.Itoa(a.balance))
}

func (a *account) Snapshot() (raft.FSMSnapshot, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return balanceSnap(a.balance), nil
}

func (a *account) Restore(rc io.ReadCloser) error {
	b, err := io.ReadAll(rc)
	if err != nil {
		return err
	}
	n, err := strconv.Atoi(string(b))
	if err != nil {
		return err
	}
	a.mu.Lock()
	a.balance = n
	a.mu.Unlock()
	return nil
}

type balanceSnap int

func (s balanceSnap) Persist(sink raft.SnapshotSink) error {
	if _, err := sink.Write([]byte(strconv.Itoa(int(s)))); err != nil {
		sink.Cancel()
		return err
	}
	return sink.Close()
}
func (balanceSnap) Release() {}

// A single-node cluster: the same deposit sent three times (a client
// retrying after lost replies) is applied once.
func Example() {
	dir, _ := os.MkdirTemp("", "idemraft-example")
	defer os.RemoveAll(dir)

	fsm, err := idemraft.Wrap(&account{}, &idemraft.Options{Dir: dir})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer fsm.Close()

	conf := raft.DefaultConfig()
	conf.LocalID = "node1"
	conf.Logger = hclog.NewNullLogger()
	store := raft.NewInmemStore()
	snaps := raft.NewInmemSnapshotStore()
	addr, trans := raft.NewInmemTransport("")
	boot := raft.Configuration{Servers: []raft.Server{{ID: conf.LocalID, Address: addr}}}
	if err := raft.BootstrapCluster(conf, store, store, snaps, trans, boot); err != nil {
		fmt.Println(err)
		return
	}
	r, err := raft.NewRaft(conf, fsm, store, store, snaps, trans)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer r.Shutdown()

	node, err := idemraft.LocalNode(conf.LocalID, r, fsm)
	if err != nil {
		fmt.Println(err)
		return
	}
	client, err := idemraft.NewClient([]idemraft.Node{node}, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := idem.Request{Scope: "deposits", ID: []byte("deposit-7f3a")}
	for i := 0; i < 3; i++ {
		resp, err := client.Do(ctx, req, []byte("100"))
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Printf("balance %s (duplicate: %v)\n", resp.Reply, resp.Duplicate)
	}
	// Output:
	// balance 100 (duplicate: false)
	// balance 100 (duplicate: true)
	// balance 100 (duplicate: true)
}
