package ledgersvc_test

import (
	"context"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/idemdb/idem/examples/ledger/ledgerpb"
	"github.com/idemdb/idem/examples/ledger/ledgersvc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	rpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
)

// TestReflection: what a tool in another language sees through server
// reflection alone (no .proto files, nothing of this binary's registry):
// the services, and the descriptor of google.rpc.ErrorInfo, with which it
// decodes a SEQUENCE_GAP's details.
func TestReflection(t *testing.T) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := ledgersvc.Start(t.TempDir(), lis, &ledgersvc.Options{Tokens: map[string]string{"tok": "user:alice"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Kill() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	stream, err := rpb.NewServerReflectionClient(cc).ServerReflectionInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ask := func(req *rpb.ServerReflectionRequest) *rpb.ServerReflectionResponse {
		t.Helper()
		serr := stream.Send(req) // io.EOF when the server ended the stream: Recv says why
		resp, err := stream.Recv()
		if err != nil || serr != nil {
			t.Fatalf("reflection: %v (send: %v)", err, serr)
		}
		if e := resp.GetErrorResponse(); e != nil {
			t.Fatalf("reflection error for %v: %v", req, e)
		}
		return resp
	}

	var services []string
	for _, s := range ask(&rpb.ServerReflectionRequest{MessageRequest: &rpb.ServerReflectionRequest_ListServices{}}).GetListServicesResponse().GetService() {
		services = append(services, s.GetName())
	}
	for _, want := range []string{"idem.examples.ledger.v1.Ledger", "idem.grpc.v1.ClientState", "grpc.reflection.v1.ServerReflection"} {
		if !slices.Contains(services, want) {
			t.Fatalf("services %v lack %s", services, want)
		}
	}

	// The descriptors, as a tool builds its registry: the file holding
	// ErrorInfo and the files it imports.
	fds := &descriptorpb.FileDescriptorSet{}
	resp := ask(&rpb.ServerReflectionRequest{MessageRequest: &rpb.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: "google.rpc.ErrorInfo"}})
	for _, b := range resp.GetFileDescriptorResponse().GetFileDescriptorProto() {
		fd := &descriptorpb.FileDescriptorProto{}
		if err := proto.Unmarshal(b, fd); err != nil {
			t.Fatal(err)
		}
		fds.File = append(fds.File, fd)
	}
	files, err := protodesc.NewFiles(fds)
	if err != nil {
		t.Fatalf("descriptors served for google.rpc.ErrorInfo: %v", err)
	}
	if _, err := files.FindFileByPath("google/rpc/error_details.proto"); err != nil {
		t.Fatal(err)
	}
	types := dynamicpb.NewTypes(files)

	// A SEQUENCE_GAP, decoded with those descriptors only.
	_, err = ledgerpb.NewLedgerClient(cc).Write(metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer tok"),
		&ledgerpb.WriteRequest{ClientId: "c", Sequence: 5, NamespaceId: "ns", Operation: &ledgerpb.Operation{Account: "a", Amount: 1}})
	st := status.Convert(err)
	if st.Code() != codes.FailedPrecondition || len(st.Proto().GetDetails()) == 0 {
		t.Fatalf("got %v, want FailedPrecondition with details", err)
	}
	a := st.Proto().GetDetails()[0]
	mt, err := types.FindMessageByURL(a.GetTypeUrl())
	if err != nil {
		t.Fatalf("detail %s: %v", a.GetTypeUrl(), err)
	}
	m := mt.New().Interface()
	if err := proto.Unmarshal(a.GetValue(), m); err != nil {
		t.Fatal(err)
	}
	fields := m.ProtoReflect().Descriptor().Fields()
	reason := m.ProtoReflect().Get(fields.ByName("reason")).String()
	meta := m.ProtoReflect().Get(fields.ByName("metadata")).Map()
	last := meta.Get(protoreflect.ValueOfString("last_committed_sequence").MapKey())
	if mt.Descriptor().FullName() != "google.rpc.ErrorInfo" || reason != "SEQUENCE_GAP" || last.String() != "0" {
		t.Fatalf("decoded %s: reason %q, last_committed_sequence %q", mt.Descriptor().FullName(), reason, last.String())
	}
}
