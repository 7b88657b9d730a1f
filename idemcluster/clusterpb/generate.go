// Package clusterpb holds the generated code of the idem cluster's client
// protocol (cluster.proto): the gRPC services Idem (the store) and Cluster
// (membership), for clients in any language.
package clusterpb

// Regenerate with protoc (Debian: protobuf-compiler, and libprotobuf-dev for
// the well-known types) and the plugins
//
//	go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
//	go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2
//	go install github.com/planetscale/vtprotobuf/cmd/protoc-gen-go-vtproto@v0.6.0
//
// cluster_vtproto.pb.go (vtprotobuf: generated MarshalVT, UnmarshalVT and
// SizeVT, which the client's and the nodes' gRPC codec use instead of the
// protobuf runtime's reflection; the same bytes on the wire) needs its
// runtime, github.com/planetscale/vtprotobuf, at the version gRPC already
// requires (go.mod).
//
//go:generate protoc --go_out=. --go_opt=paths=source_relative --go-grpc_out=. --go-grpc_opt=paths=source_relative --go-vtproto_out=. --go-vtproto_opt=paths=source_relative,features=marshal+unmarshal+size cluster.proto
