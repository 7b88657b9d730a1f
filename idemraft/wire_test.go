package idemraft

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/idemdb/idem"
	"github.com/vmihailenco/msgpack/v5"
)

// TestWireErrors: every answer a Response can carry crosses HTTP and still
// matches its sentinel (errors.Is / errors.As) on the client.
func TestWireErrors(t *testing.T) {
	cases := []*Response{
		{Reply: []byte("ok")},
		{Reply: []byte("again"), Duplicate: true},
		{Err: &AppError{Message: "insufficient funds"}, Duplicate: true},
		{Err: &idem.SequenceGapError{Scope: "s", Client: "c", Seq: 5, Last: 2}},
		{Err: idem.ErrConflict},
		{Err: idem.ErrAlreadyCommitted},
		{Err: &idem.AlreadyCommittedError{Scope: "s", Client: "c", Seq: 1, Last: 4}},
		{Err: idem.ErrInvalidRequest},
		{Err: ErrReplyTooLarge},
		{Err: ErrUnsupportedResult},
		{Err: ErrInvalidCommand},
	}
	for _, want := range cases {
		b, err := msgpack.Marshal(toWire(want))
		if err != nil {
			t.Fatal(err)
		}
		var w wireResponse
		if err := unmarshalStrict(b, &w); err != nil {
			t.Fatal(err)
		}
		got := fromWire(w)
		if string(got.Reply) != string(want.Reply) || got.Duplicate != want.Duplicate {
			t.Fatalf("%+v came back as %+v", want, got)
		}
		switch e := want.Err.(type) {
		case nil:
			if got.Err != nil {
				t.Fatalf("nil error came back as %v", got.Err)
			}
		case *AppError:
			var ae *AppError
			if !errors.As(got.Err, &ae) || ae.Message != e.Message {
				t.Fatalf("%v came back as %v", want.Err, got.Err)
			}
		case *idem.SequenceGapError:
			var g *idem.SequenceGapError
			if !errors.As(got.Err, &g) || *g != *e || !errors.Is(got.Err, idem.ErrSequenceGap) {
				t.Fatalf("%v came back as %v", want.Err, got.Err)
			}
		case *idem.AlreadyCommittedError:
			var d *idem.AlreadyCommittedError
			if !errors.As(got.Err, &d) || *d != *e || !errors.Is(got.Err, idem.ErrAlreadyCommitted) || got.Err.Error() != e.Error() {
				t.Fatalf("%v came back as %v", want.Err, got.Err)
			}
		default:
			if !errors.Is(got.Err, want.Err) || got.Err.Error() != want.Err.Error() {
				t.Fatalf("%v came back as %v", want.Err, got.Err)
			}
		}
	}
}

// TestHTTPHandler runs Handler on a loopback server in front of a
// single-node cluster and checks the status codes and the Client's use of
// them (redirect by leader id, duplicate, invalid command).
func TestHTTPHandler(t *testing.T) {
	c := newCluster(t, 1, clusterOpts{wrap: true})
	nd := c.nodes[0]
	r, f, _, _ := nd.current()
	h, err := Handler(nd.id, r, f)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	// A node that is not the leader and names it: the client goes there.
	notLeader := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set(HeaderLeader, string(nd.id))
		http.Error(w, "not the leader", http.StatusMisdirectedRequest)
	}))
	t.Cleanup(notLeader.Close)
	cl := httpClient(t, map[raft.ServerID]string{"other": notLeader.URL, nd.id: srv.URL}, "other", nd.id)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req := idem.Request{ID: []byte("h1"), Fingerprint: []byte("f")}
	op := encodeOp(counterOp{ID: "h1", Key: "k", Delta: 4})
	r1, err := cl.Do(ctx, req, op)
	if err != nil || val(t, r1) != 4 || r1.Duplicate {
		t.Fatalf("first: %+v %v", r1, err)
	}
	r2, err := cl.Do(ctx, req, op)
	if err != nil || val(t, r2) != 4 || !r2.Duplicate {
		t.Fatalf("retry: %+v %v", r2, err)
	}
	r3, err := cl.Do(ctx, idem.Request{ID: []byte("h1"), Fingerprint: []byte("g")}, op)
	if err != nil || !errors.Is(r3.Err, idem.ErrConflict) {
		t.Fatalf("conflict: %+v %v", r3, err)
	}
	// Not a command: 400, not retried.
	res, err := http.Post(srv.URL, contentType, nil)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusBadRequest {
		t.Fatalf("empty body: %s", res.Status)
	}
	hn, err := HTTPNode(nd.id, srv.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := hn.Submit(ctx, []byte("junk")); !errors.Is(err, ErrInvalidCommand) {
		t.Fatalf("junk: %v", err)
	}
	res, err = http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusMethodNotAllowed {
		t.Fatalf("GET: %s", res.Status)
	}
	// A client with no reachable node gives up when its context ends.
	dead := httpClient(t, map[raft.ServerID]string{"gone": "http://127.0.0.1:1"}, "gone")
	dctx, dcancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer dcancel()
	if _, err := dead.Do(dctx, idem.Request{ID: []byte("x")}, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("dead cluster: %v", err)
	}
	if !errors.Is(&NotLeaderError{}, raft.ErrNotLeader) {
		t.Fatal("NotLeaderError does not match raft.ErrNotLeader")
	}
}

// httpClient is a Client of HTTPNodes (ids in order, urls by id).
func httpClient(t *testing.T, urls map[raft.ServerID]string, ids ...raft.ServerID) *Client {
	t.Helper()
	var nodes []Node
	for _, id := range ids {
		n, err := HTTPNode(id, urls[id], nil)
		if err != nil {
			t.Fatal(err)
		}
		nodes = append(nodes, n)
	}
	cl, err := NewClient(nodes, nil)
	if err != nil {
		t.Fatal(err)
	}
	return cl
}
