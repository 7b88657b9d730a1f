package idemcluster

import (
	"context"
	"testing"
	"time"

	"github.com/idemdb/idem/idemcluster/clusterpb"
	"google.golang.org/grpc"
)

// answerEach is a node's Idem service whose Batch RPCs each wait for a
// value on release and answer every item with it as its reply.
type answerEach struct {
	clusterpb.IdemClient // nil: only Batch is called
	sent                 chan struct{}
	release              chan string
}

func (a *answerEach) Batch(ctx context.Context, in *clusterpb.BatchRequest, _ ...grpc.CallOption) (*clusterpb.BatchResponse, error) {
	a.sent <- struct{}{}
	reply := <-a.release
	out := &clusterpb.BatchResponse{}
	for range in.Items {
		out.Results = append(out.Results, &clusterpb.BatchResult{Result: &clusterpb.Result{Reply: []byte(reply)}})
	}
	return out, nil
}

// A call's attempt that stops waiting while its batch is on the wire
// leaves its record (callSlot) to that batch, which still writes its
// answer there: the call's next attempt (a claim's finish goes on after
// its caller left) must get a record of its own, or the first batch's
// late answer is taken for the second attempt's, and its signal lands on
// a channel the second attempt already gave back.
func TestRetryAfterLeftAttemptGetsItsOwnRecord(t *testing.T) {
	node := &answerEach{sent: make(chan struct{}, 2), release: make(chan string)}
	b := &batcher{idem: node}
	var slot callSlot
	item := &clusterpb.BatchItem{Call: &clusterpb.BatchItem_Lookup{Lookup: &clusterpb.LookupRequest{Request: &clusterpb.Request{Id: []byte("x")}}}}
	deadline := time.Now().Add(time.Minute)

	ctx, cancel := context.WithCancel(context.Background())
	left := make(chan error, 1)
	go func() {
		_, err := b.do(ctx, nil, deadline, item, &slot)
		left <- err
	}()
	<-node.sent // the first attempt's batch is on the wire
	cancel()
	if err := <-left; err == nil {
		t.Fatal("the attempt whose ctx ended got an answer")
	}
	second := make(chan string, 1)
	go func() {
		res, err := b.do(context.Background(), nil, deadline, item, &slot)
		if err != nil {
			second <- "error: " + err.Error()
			return
		}
		second <- string(res.GetReply())
	}()
	// The second attempt waits behind the batch on the wire (one in
	// flight), then goes in the next one.
	for {
		b.mu.Lock()
		n := len(b.queue)
		b.mu.Unlock()
		if n == 1 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	node.release <- "first attempt's"
	<-node.sent
	node.release <- "second attempt's"
	if got := <-second; got != "second attempt's" {
		t.Fatalf("the second attempt got %q, want its own batch's answer", got)
	}
}
