package idem

import (
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
)

// TestCallerBuffersNotKept: a caller may reuse the buffers of a Request
// (its id, fingerprint and acked ids) once the call returns, as it may
// the reply given to Commit. The engine keeps its own copies, so a retry
// with the original bytes in new buffers is answered as the first call's
// record says, by every path that claims: Begin, a batch's Begin and
// Put, LookupHint's Put; in memory, after a reopen, and after scribbling
// over what InDoubt returned. (The entries once
// kept the caller's fingerprint slice: reusing it made the retry of a
// committed request ErrConflict.)
func TestCallerBuffersNotKept(t *testing.T) {
	fs := vfs.NewMem()
	e := openMem(t, fs, nil)
	const fpA, fpB = "fingerprint-A-0123456789abcdef", "fingerprint-B-0123456789abcdef"
	scribble := func(bufs ...[]byte) {
		for _, b := range bufs {
			copy(b, fpB)
		}
	}
	req := func(id string) Request { return Request{ID: []byte(id), Fingerprint: []byte(fpA)} }

	// Begin, Commit.
	r1 := req("single")
	res := mustBegin(t, e, r1, Fresh)
	if err := res.Claim.Commit(bg, []byte("reply")); err != nil {
		t.Fatal(err)
	}
	scribble(r1.ID, r1.Fingerprint)
	// Begin left in flight.
	r2 := req("inflight")
	mustBegin(t, e, r2, Fresh)
	scribble(r2.ID, r2.Fingerprint)
	// A batch's Put, and its Begin then Commit.
	r3, r4 := req("batch-put"), req("batch-begin")
	b := e.NewBatch()
	b.Put(r3, []byte("reply"))
	b.Begin(r4)
	rs, err := b.Run(bg)
	if err != nil || rs[0].Err != nil || rs[1].Err != nil || rs[1].Result.Status != Fresh {
		t.Fatalf("batch: %v %+v", err, rs)
	}
	scribble(r3.ID, r3.Fingerprint, r4.ID, r4.Fingerprint)
	b = e.NewBatch()
	b.Commit(rs[1].Result.Claim, []byte("reply"))
	if rs, err := b.Run(bg); err != nil || rs[0].Err != nil {
		t.Fatalf("batch commit: %v %+v", err, rs)
	}
	// LookupHint, then its Put.
	r5 := req("hinted")
	var h PutHint
	if res, err := e.LookupHint(bg, r5, &h); err != nil || res.Status != Absent {
		t.Fatalf("LookupHint: %v %v", res.Status, err)
	}
	b = e.NewBatch()
	h.Put(b, []byte("reply"))
	if rs, err := b.Run(bg); err != nil || rs[0].Err != nil {
		t.Fatalf("hinted put: %v %+v", err, rs)
	}
	scribble(r5.ID, r5.Fingerprint)

	check := func(when string) {
		t.Helper()
		for _, id := range []string{"single", "batch-put", "batch-begin", "hinted"} {
			res, err := e.Begin(bg, req(id))
			if err != nil || res.Status != Done || string(res.Reply) != "reply" {
				t.Fatalf("%s: retry of %q with its own fingerprint: %v %q %v", when, id, res.Status, res.Reply, err)
			}
		}
		if res, err := e.Begin(bg, req("inflight")); err != nil || res.Status != InFlight {
			t.Fatalf("%s: retry of the claim in flight with its own fingerprint: %v %v", when, res.Status, err)
		}
	}
	check("in memory")
	if err := e.Close(); err != nil {
		t.Fatal(err)
	}
	e = openMem(t, fs, nil)
	defer e.Close()
	check("after a reopen")
	// What InDoubt hands out is the caller's too.
	ds, err := e.InDoubt(bg, "")
	if err != nil || len(ds) != 1 {
		t.Fatalf("InDoubt: %d claims, %v; want the one in flight", len(ds), err)
	}
	scribble(ds[0].ID, ds[0].Fingerprint)
	check("after scribbling over InDoubt's claim")
}

// TestClaimKeepsNoCallerBuffer: a claim in flight does not keep the
// caller's request buffers reachable (the engine works on its own copies,
// see TestCallerBuffersNotKept): a caller's fingerprint buffer, dropped
// after Begin (or a batch's Begin) returned the claim, is collected while
// the claim is still held.
func TestClaimKeepsNoCallerBuffer(t *testing.T) {
	e := openMem(t, vfs.NewMem(), nil)
	for _, path := range []string{"Begin", "batch Begin"} {
		t.Run(path, func(t *testing.T) {
			var freed atomic.Bool
			fp := make([]byte, 64)
			copy(fp, "fingerprint-"+path)
			runtime.AddCleanup(&fp[0], func(f *atomic.Bool) { f.Store(true) }, &freed)
			req := Request{ID: []byte("claim-" + path), Fingerprint: fp}
			var c *Claim
			if path == "Begin" {
				c = mustBegin(t, e, req, Fresh).Claim
			} else {
				b := e.NewBatch()
				b.Begin(req)
				rs, err := b.Run(bg)
				if err != nil || rs[0].Err != nil || rs[0].Result.Status != Fresh {
					t.Fatalf("batch Begin: %+v %v", rs, err)
				}
				c = rs[0].Result.Claim
			}
			fp, req = nil, Request{}
			for i := 0; i < 50 && !freed.Load(); i++ {
				runtime.GC()
				time.Sleep(time.Millisecond)
			}
			if !freed.Load() {
				t.Errorf("%s: the caller's fingerprint buffer is still reachable while its claim is held", path)
			}
			if err := c.Commit(bg, []byte("reply")); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestClaimIDNotCallers: a claim's finish writes its record with the
// engine's copy of the id, not the caller's buffer: the caller may reuse
// the Request's ID (or InDoubtClaim's ID) as soon as Begin (or InDoubt)
// returned, and the commit or abort written later must still name the
// claimed id. Checked the way it matters, after a crash: the log replays
// and the id's state is the finish's. (The claim kept the caller's id
// slice and encoded it at the finish: the commit named another id, the
// engine answered from memory as if nothing was wrong, and the next Open
// refused the log: "commit at LSN 2 names claim 1".)
func TestClaimIDNotCallers(t *testing.T) {
	for _, path := range []string{"Begin", "batch Begin", "InDoubt"} {
		for _, abort := range []bool{false, true} {
			name := path + "/commit"
			if abort {
				name = path + "/abort"
			}
			t.Run(name, func(t *testing.T) {
				fs := vfs.NewCrashableMem()
				e := openMem(t, fs, nil)
				idb := []byte("claimed-id")
				var c *Claim
				switch path {
				case "Begin":
					c = mustBegin(t, e, Request{ID: idb}, Fresh).Claim
				case "batch Begin":
					b := e.NewBatch()
					b.Begin(Request{ID: idb})
					rs, err := b.Run(bg)
					if err != nil || rs[0].Err != nil || rs[0].Result.Status != Fresh {
						t.Fatalf("batch Begin: %+v %v", rs, err)
					}
					c = rs[0].Result.Claim
				case "InDoubt":
					mustBegin(t, e, Request{ID: idb}, Fresh)
					if err := e.Close(); err != nil {
						t.Fatal(err)
					}
					e = openMem(t, fs, nil)
					ds, err := e.InDoubt(bg, "")
					if err != nil || len(ds) != 1 {
						t.Fatalf("InDoubt: %d claims, %v", len(ds), err)
					}
					idb, c = ds[0].ID, ds[0].Claim
				}
				defer e.Close()
				copy(idb, "another-id") // the caller's buffer, reused
				var err error
				if abort {
					err = c.Abort(bg)
				} else {
					err = c.Commit(bg, []byte("reply"))
				}
				if err != nil {
					t.Fatal(err)
				}
				e2, err := Open("db", &Options{FS: fs.CrashClone(vfs.CrashCloneCfg{})})
				if err != nil {
					t.Fatalf("open after a crash: %v", err)
				}
				defer e2.Close()
				want := Done
				if abort {
					want = Fresh // released: runs again
				}
				if res := mustBegin(t, e2, Request{ID: []byte("claimed-id")}, want); !abort && string(res.Reply) != "reply" {
					t.Fatalf("reply %q after a crash, want %q", res.Reply, "reply")
				}
				mustBegin(t, e2, Request{ID: []byte("another-id")}, Fresh)
			})
		}
	}
}

// TestPutHintIDNotCallers: LookupHint's hint keeps the request's key for
// the Put that follows, and that Put's record names the id from the
// engine's bytes: a caller reusing its id buffer between LookupHint and
// the batch's Run still stores the id it looked up, after a crash too.
// (The hint kept the caller's id slice: the record named another id, and
// the next Open refused the log.)
func TestPutHintIDNotCallers(t *testing.T) {
	fs := vfs.NewCrashableMem()
	e := openMem(t, fs, nil)
	defer e.Close()
	idb := []byte("hinted-id")
	var h PutHint
	if res, err := e.LookupHint(bg, Request{ID: idb}, &h); err != nil || res.Status != Absent {
		t.Fatalf("LookupHint: %v %v", res.Status, err)
	}
	copy(idb, "another-i") // the caller's buffer, reused
	b := e.NewBatch()
	h.Put(b, []byte("reply"))
	if rs, err := b.Run(bg); err != nil || rs[0].Err != nil {
		t.Fatalf("hinted Put: %v %+v", err, rs)
	}
	e2, err := Open("db", &Options{FS: fs.CrashClone(vfs.CrashCloneCfg{})})
	if err != nil {
		t.Fatalf("open after a crash: %v", err)
	}
	defer e2.Close()
	if res := mustBegin(t, e2, Request{ID: []byte("hinted-id")}, Done); string(res.Reply) != "reply" {
		t.Fatalf("reply %q after a crash, want %q", res.Reply, "reply")
	}
	mustBegin(t, e2, Request{ID: []byte("another-i")}, Fresh)
}
