package idemgrpc_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"math/big"
	"net"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/examples/ledger/ledgerpb"
	"github.com/idemdb/idem/examples/ledger/ledgersvc"
	"github.com/idemdb/idem/idemgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
)

type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pool *x509.CertPool
}

func newCA(t *testing.T) *testCA {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &testCA{cert: cert, key: key, pool: pool}
}

var serial atomic.Int64

func (ca *testCA) issue(t *testing.T, cn string, uri string, server bool) tls.Certificate {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial.Add(1) + 1), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), KeyUsage: x509.KeyUsageDigitalSignature}
	if server {
		tmpl.IPAddresses = []net.IP{net.ParseIP("127.0.0.1")}
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	} else {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	}
	if uri != "" {
		u, _ := url.Parse(uri)
		tmpl.URIs = []*url.URL{u}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// TestTLSActor: with mutual TLS the actor is the verified client
// certificate's URI SAN or common name: "cert:<name>" (TLSActor) or
// "client:<name>" (ClientActor(TLSName)).
func TestTLSActor(t *testing.T) {
	ca := newCA(t)
	for _, af := range []struct {
		name   string
		actor  idemgrpc.ActorFunc
		prefix string
	}{{"TLSActor", idemgrpc.TLSActor, "cert:"}, {"ClientActor", idemgrpc.ClientActor(idemgrpc.TLSName), "client:"}} {
		t.Run(af.name, func(t *testing.T) {
			eng, err := idem.Open(t.TempDir(), nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { eng.Close() })
			isrv, err := idemgrpc.NewServer(eng, &idemgrpc.Options{Actor: af.actor, Methods: ledgersvc.Methods()})
			if err != nil {
				t.Fatal(err)
			}
			l := &fnLedger{}
			creds := credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{ca.issue(t, "server", "", true)},
				ClientCAs: ca.pool, ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS13})
			gs := grpc.NewServer(grpc.Creds(creds), grpc.UnaryInterceptor(isrv.UnaryServerInterceptor()))
			ledgerpb.RegisterLedgerServer(gs, l)
			addr := serve(t, isrv, gs)
			ctx := testCtx(t)
			for _, tc := range []struct{ cn, uri, want string }{
				{"alice", "", af.prefix + "alice"},
				{"bob", "spiffe://example.org/bob", af.prefix + "spiffe://example.org/bob"},
			} {
				cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
					Certificates: []tls.Certificate{ca.issue(t, tc.cn, tc.uri, false)}, RootCAs: ca.pool, MinVersion: tls.VersionTLS13})))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { cc.Close() })
				req := write("c", "ns", "", 1, "a", 1)
				req.Actor = "user:root" // ignored
				r, err := ledgerpb.NewLedgerClient(cc).Write(ctx, req)
				if err != nil || r.GetActor() != tc.want {
					t.Fatalf("%s: %v, %v; want actor %q", tc.cn, r, err, tc.want)
				}
			}
			// alice's and bob's sequence 1 are separate identities: both ran.
			if l.runs.Load() != 2 {
				t.Fatalf("runs %d", l.runs.Load())
			}
			// without TLS the actor function refuses.
			_, err = af.actor(ctx)
			wantStatus(t, err, codes.Unauthenticated, "")
		})
	}
}

type subjectKey struct{}

// subject is an IDFunc reading what a test auth layer stored.
func subject(ctx context.Context) (string, error) {
	s, ok := ctx.Value(subjectKey{}).(string)
	if !ok {
		return "", errors.New("no verified subject")
	}
	return s, nil
}

// TestKindActors: UserActor, ClientActor and SystemActor form the ledger's
// "user:<id>", "client:<id>", "system:<name>" from the authenticated
// context; a missing or malformed id is Unauthenticated, a status from the
// IDFunc passes through.
func TestKindActors(t *testing.T) {
	with := func(s string) context.Context { return context.WithValue(context.Background(), subjectKey{}, s) }
	denied := func(context.Context) (string, error) {
		return "", status.Error(codes.PermissionDenied, "test: revoked")
	}
	for _, tc := range []struct {
		actor idemgrpc.ActorFunc
		ctx   context.Context
		want  string
		code  codes.Code
	}{
		{idemgrpc.UserActor(subject), with("alice"), "user:alice", codes.OK},
		{idemgrpc.ClientActor(subject), with("billing-svc"), "client:billing-svc", codes.OK},
		{idemgrpc.SystemActor(subject), with("reconciler"), "system:reconciler", codes.OK},
		{idemgrpc.UserActor(subject), context.Background(), "", codes.Unauthenticated},
		{idemgrpc.UserActor(subject), with(""), "", codes.Unauthenticated},
		{idemgrpc.UserActor(subject), with("a b"), "", codes.Unauthenticated},
		{idemgrpc.UserActor(subject), with("a\x00"), "", codes.Unauthenticated},
		{idemgrpc.UserActor(subject), with("\xff"), "", codes.Unauthenticated},
		{idemgrpc.UserActor(subject), with(strings.Repeat("a", 513)), "", codes.Unauthenticated},
		{idemgrpc.UserActor(nil), with("alice"), "", codes.Unauthenticated},
		{idemgrpc.SystemActor(denied), with("x"), "", codes.PermissionDenied},
	} {
		got, err := tc.actor(tc.ctx)
		if got != tc.want || status.Code(err) != tc.code {
			t.Errorf("got %q, %v; want %q, code %v", got, err, tc.want, tc.code)
		}
	}
}
