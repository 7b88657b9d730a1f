package main

import (
	"flag"
	"io"
	"slices"
	"strings"
	"testing"
)

// serve refuses, before it starts anything, a --grpc-addr that names no
// host unless --advertise-addr says what to publish (the node used to
// publish "[::]:7071", which no other host can dial), and a --raft-addr
// that names none; --advertise-addr goes to the node as the address it
// publishes.
func TestServeAdvertiseAddr(t *testing.T) {
	dir := t.TempDir()
	base := []string{"serve", "--node-id", "n1", "--dir", dir, "--peers", "n1=127.0.0.1:7000"}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--raft-addr", "127.0.0.1:7000", "--grpc-addr", ":7071"}, "--grpc-addr :7071 listens on every interface and names no host other nodes and clients can dial: give --advertise-addr HOST:PORT"},
		{[]string{"--raft-addr", "127.0.0.1:7000", "--grpc-addr", "0.0.0.0:7071"}, "--grpc-addr 0.0.0.0:7071 listens on every interface"},
		{[]string{"--raft-addr", "127.0.0.1:7000", "--grpc-addr", "[::]:7071"}, "--grpc-addr [::]:7071 listens on every interface"},
		{[]string{"--raft-addr", "127.0.0.1:7000", "--grpc-addr", ":7071", "--advertise-addr", ":7071"}, `--advertise-addr: ":7071" names no host`},
		{[]string{"--raft-addr", "127.0.0.1:7000", "--grpc-addr", ":7071", "--advertise-addr", "idem-1:0"}, "--advertise-addr: \"idem-1:0\": the port must be a number 1-65535"},
		{[]string{"--raft-addr", "127.0.0.1:7000", "--grpc-addr", ":7071", "--advertise-addr", "idem-1"}, `--advertise-addr: "idem-1" is not host:port`},
		{[]string{"--raft-addr", ":7000", "--grpc-addr", "127.0.0.1:7071"}, "--raft-addr :7000 names no host"},
	} {
		_, errs := wantCode(t, 2, append(base, c.args...)...)
		if !strings.Contains(errs, c.want) {
			t.Errorf("idem serve %v:\n%s\nwant %q", c.args, errs, c.want)
		}
	}

	for _, c := range []struct {
		args            []string
		grpc, advertise string
	}{
		{[]string{"--grpc-addr", ":7071", "--advertise-addr", "idem-1.internal:7071"}, ":7071", "idem-1.internal:7071"},
		{[]string{"--grpc-addr", "0.0.0.0:7071", "--advertise-addr", "10.0.0.1:7071"}, "0.0.0.0:7071", "10.0.0.1:7071"},
		{[]string{"--grpc-addr", "10.0.0.1:7071"}, "10.0.0.1:7071", ""}, // the node publishes its listener's address
		{[]string{"--grpc-addr", "10.0.0.1:7071", "--no-lease-reads"}, "10.0.0.1:7071", ""},
	} {
		o := &serveOpts{}
		fs := flag.NewFlagSet("serve", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		o.define(fs)
		if err := fs.Parse(append(base[1:], append([]string{"--raft-addr", "127.0.0.1:7000"}, c.args...)...)); err != nil {
			t.Fatal(err)
		}
		no, err := o.nodeOptions(nil)
		if err != nil {
			t.Fatalf("idem serve %v: %v", c.args, err)
		}
		if off := slices.Contains(c.args, "--no-lease-reads"); no.NoLeaseReads != off {
			t.Errorf("idem serve %v: NoLeaseReads %v", c.args, no.NoLeaseReads)
		}
		if no.GRPCAddr != c.grpc || no.AdvertiseAddr != c.advertise {
			t.Errorf("idem serve %v: GRPCAddr %q AdvertiseAddr %q, want %q %q", c.args, no.GRPCAddr, no.AdvertiseAddr, c.grpc, c.advertise)
		}
	}
}
