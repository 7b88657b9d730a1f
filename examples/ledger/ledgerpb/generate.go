// Package ledgerpb holds the generated code of the ledger example's service
// (ledger.proto).
package ledgerpb

// Regenerate with protoc (Debian: protobuf-compiler) and the plugins
//
//	go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
//	go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2
//
//go:generate protoc --go_out=. --go_opt=paths=source_relative --go-grpc_out=. --go-grpc_opt=paths=source_relative ledger.proto
