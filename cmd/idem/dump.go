package main

import (
	"bufio"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/idemdb/idem/index"
	"github.com/idemdb/idem/wal"
)

var dumpCmd = &command{
	name:    "dump",
	args:    "[wal|index] <dir>",
	summary: "print every WAL record and every live index entry, readable or --json",
	help: `
Prints what an idem directory holds, without changing it (no lock is taken;
it works while an application has the directory open).

  idem dump wal <dir>     every WAL record, in LSN order: LSN, type, time,
                          scope, id or client/seq, acked ids, fingerprint,
                          lease, claim LSN, reply size, segment and offset
  idem dump index <dir>   every live index entry: scope, id or client, state
                          (in-flight / committed), sequence numbers, commit
                          time, reply size, fingerprints, lease, last LSN
  idem dump <dir>         both: the WAL, then the index

Ids are printed as text when they are printable ASCII, else as 0x<hex>.
Scopes written by an integration are printed in its words:
idemhttp(actor=alice) for the key space idemhttp gives actor alice,
idemgrpc(actor=bob,fields=[t1]) for an idemgrpc scope; --json keeps the raw
scope and adds those words as "integration". --scope takes either form.
Times are RFC 3339 in UTC. With --json every record and entry is one JSON
object per line, with "kind" set to "record" or "entry".

The index shown is the index files plus the WAL records they have not
applied yet, replayed onto a private copy by Open's own recovery code; --stored
shows the files as they are. The filters apply to both parts: records are
matched on their own time and LSN, entries on their commit (or claim) time
and on the LSN of their last change.`,
	examples: []string{
		"idem dump /var/lib/app/idem",
		"idem dump wal /var/lib/app/idem --scope payments --id req-42",
		"idem dump wal /var/lib/app/idem --since 1h --type commit,abort --json",
		"idem dump index /var/lib/app/idem --state in-flight",
		"idem dump index /var/lib/app/idem --client worker-7 --json | jq .seq",
	},
	setup: func(fs *flag.FlagSet) func(*cli, []string) error {
		o := &dumpOpts{}
		o.f.register(fs)
		fs.BoolVar(&o.json, "json", false, "one JSON object per line")
		fs.StringVar(&o.types, "type", "", "WAL: only these record `types`, comma-separated (claim,commit,abort,ack,forget,expire,commit-advance,advance)")
		fs.StringVar(&o.state, "state", "", "index: only entries in this `state` (in-flight or committed)")
		fs.BoolVar(&o.stored, "stored", false, "index: show the index files as they are, without replaying the WAL records they have not applied")
		return o.run
	},
}

type dumpOpts struct {
	f      filter
	json   bool
	types  string
	state  string
	stored bool

	typeSet map[byte]bool
}

func (o *dumpOpts) run(c *cli, pos []string) error {
	what := "all"
	if len(pos) > 0 && (pos[0] == "wal" || pos[0] == "index") {
		what, pos = pos[0], pos[1:]
	}
	dir, err := oneDir(pos)
	if err != nil {
		return err
	}
	if err := o.f.resolve(c.now()); err != nil {
		return err
	}
	if o.types != "" {
		o.typeSet = map[byte]bool{}
		for _, t := range strings.Split(o.types, ",") {
			typ, ok := opByName(strings.TrimSpace(t))
			if !ok {
				return usagef("unknown record type %q in --type (want claim, commit, abort, ack or forget)", t)
			}
			o.typeSet[typ] = true
		}
	}
	switch o.state {
	case "", "in-flight", "committed":
	default:
		return usagef("unknown --state %q (want in-flight or committed)", o.state)
	}
	noteWriter(c, dir)
	w := bufio.NewWriterSize(c.stdout, 64<<10)
	defer w.Flush()
	if what != "index" {
		if err := o.dumpWAL(c, w, dir); err != nil {
			return err
		}
	}
	if what != "wal" {
		if err := o.dumpIndex(c, w, dir); err != nil {
			return err
		}
	}
	return w.Flush()
}

func forgetReason(r byte) string {
	switch r {
	case wal.ForgetAdmin:
		return "admin"
	case wal.ForgetRetention:
		return "retention"
	case wal.ForgetCapacity:
		return "capacity"
	}
	return fmt.Sprintf("reason(%d)", r)
}

func opByName(s string) (byte, bool) {
	for t := wal.OpClaim; t <= wal.OpBatch; t++ {
		if wal.OpName(t) == s {
			return t, true
		}
	}
	return 0, false
}

// recordOut is one WAL record as dump prints it.
type recordOut struct {
	Kind        string   `json:"kind"`
	LSN         uint64   `json:"lsn"`
	Type        string   `json:"type"`
	Time        string   `json:"time"`
	Scope       string   `json:"scope"`
	Integration string   `json:"integration,omitempty"` // the scope in its integration's words (scopeWords)
	ID          string   `json:"id,omitempty"`
	Client      string   `json:"client,omitempty"`
	Seq         uint64   `json:"seq,omitempty"`
	Acked       []string `json:"acked,omitempty"`
	Fingerprint string   `json:"fingerprint,omitempty"`
	LeaseUntil  string   `json:"lease_until,omitempty"`
	ExpiresAt   string   `json:"expires_at,omitempty"`
	Expired     []string `json:"expired,omitempty"`
	Advanced    []string `json:"advanced,omitempty"`
	New         bool     `json:"new,omitempty"`
	ClaimLSN    uint64   `json:"claim_lsn,omitempty"`
	ReplySize   *int     `json:"reply_size,omitempty"`
	Before      string   `json:"before,omitempty"`
	Reason      string   `json:"reason,omitempty"`
	Segment     string   `json:"segment"`
	Offset      int64    `json:"offset"`
	Error       string   `json:"error,omitempty"`
}

func (o *dumpOpts) dumpWAL(c *cli, w *bufio.Writer, dir string) error {
	label := ""
	if !c.stdoutTTY {
		label = "dump wal"
	}
	after := wal.LSN(0)
	if o.f.fromLSN > 0 {
		after = wal.LSN(o.f.fromLSN - 1)
	}
	bad := 0
	res, err := scanWAL(c, dir, after, label, func(r wal.Record) error {
		if !o.f.lsnOK(r.LSN) || (o.typeSet != nil && !o.typeSet[r.Type]) {
			return nil
		}
		op, derr := wal.DecodeOp(r.Type, r.Payload)
		out := recordOut{Kind: "record", LSN: uint64(r.LSN), Type: wal.OpName(r.Type), Segment: r.Segment, Offset: r.Offset}
		if derr != nil {
			bad++
			out.Error = derr.Error()
			return writeRecord(w, o.json, &out)
		}
		if op.Type == wal.OpBatch {
			// One line per operation, in order: "batch:claim", ...
			for i := range op.Ops {
				sub := out
				sub.Type = "batch:" + wal.OpName(op.Ops[i].Type)
				if err := o.writeOp(w, &op.Ops[i], &sub); err != nil {
					return err
				}
			}
			return nil
		}
		return o.writeOp(w, op, &out)
	})
	if err != nil {
		return walError(err)
	}
	if t := res.TornTail; t != nil {
		fmt.Fprintf(c.stderr, "idem: note: segment %s ends with %d bytes of torn tail at offset %d (a write cut by a crash; Open cuts them)\n", t.Segment, t.Bytes, t.Offset)
	}
	if bad > 0 {
		w.Flush()
		return fmt.Errorf("%d records could not be decoded (shown with their error)", bad)
	}
	return nil
}

// writeOp writes the operation op (a record, or one operation of a batch
// record) as out, when it passes the filters.
func (o *dumpOpts) writeOp(w *bufio.Writer, op *wal.Op, out *recordOut) error {
	ids := append([][]byte{op.ID}, op.Acked...)
	if !o.f.keyOK(op.Scope, op.Type != wal.OpForget && op.Type != wal.OpExpire && op.Type != wal.OpAdvance, ids, op.Client) || !o.f.timeOK(op.Time) {
		return nil
	}
	out.Time, out.Scope, out.Client, out.Seq = fmtTime(op.Time), op.Scope, op.Client, op.Seq
	if o.json { // text output shows it in place of the scope
		out.Integration = scopeWords(op.Scope)
	}
	if len(op.ID) > 0 {
		out.ID = readable(op.ID)
	}
	for _, a := range op.Acked {
		out.Acked = append(out.Acked, readable(a))
	}
	for _, a := range op.Advances { // commit-advance, advance
		out.Advanced = append(out.Advanced, fmt.Sprintf("scope %s client %s to %d", showScope(a.Scope), readableText([]byte(a.Client)), a.Seq))
	}
	switch op.Type {
	case wal.OpClaim:
		out.Fingerprint = hex.EncodeToString(op.Fingerprint)
		out.LeaseUntil = fmtTime(op.LeaseUntil)
		out.New = op.Flags&wal.ClaimFlagNew != 0
		if op.ExpiresAt != 0 {
			out.ExpiresAt = fmtTime(op.ExpiresAt)
		}
	case wal.OpExpire:
		for _, k := range op.Keys {
			out.Expired = append(out.Expired, describeKey(k))
		}
	case wal.OpCommit, wal.OpCommitAdvance:
		n := len(op.Reply)
		out.ClaimLSN, out.ReplySize = uint64(op.ClaimLSN), &n
	case wal.OpAbort:
		out.ClaimLSN = uint64(op.ClaimLSN)
	case wal.OpForget:
		out.Before, out.Reason = fmtTime(op.Before), forgetReason(op.Reason)
	}
	return writeRecord(w, o.json, out)
}

func writeRecord(w io.Writer, asJSON bool, r *recordOut) error {
	if asJSON {
		return writeJSONLine(w, r)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "lsn=%d type=%s", r.LSN, r.Type)
	if r.Error != "" {
		fmt.Fprintf(&b, " error=%q", r.Error)
	} else {
		fmt.Fprintf(&b, " time=%s", r.Time)
		if base := strings.TrimPrefix(r.Type, "batch:"); base != "forget" && base != "expire" && base != "advance" {
			fmt.Fprintf(&b, " scope=%s", showScope(r.Scope))
		}
		if r.ID != "" {
			fmt.Fprintf(&b, " id=%s", readableText([]byte(r.ID)))
		}
		if r.Client != "" {
			fmt.Fprintf(&b, " client=%s seq=%d", readableText([]byte(r.Client)), r.Seq)
		}
		if len(r.Acked) > 0 {
			q := make([]string, len(r.Acked))
			for i, a := range r.Acked {
				q[i] = readableText([]byte(a))
			}
			fmt.Fprintf(&b, " acked=[%s]", strings.Join(q, ","))
		}
		if r.Fingerprint != "" {
			fmt.Fprintf(&b, " fp=%s", r.Fingerprint)
		}
		if r.LeaseUntil != "" {
			fmt.Fprintf(&b, " lease_until=%s", r.LeaseUntil)
		}
		if r.ExpiresAt != "" {
			fmt.Fprintf(&b, " expires_at=%s", r.ExpiresAt)
		}
		if r.New {
			b.WriteString(" new")
		}
		if len(r.Expired) > 0 {
			fmt.Fprintf(&b, " expired=[%s]", strings.Join(r.Expired, "; "))
		}
		if len(r.Advanced) > 0 {
			fmt.Fprintf(&b, " advanced=[%s]", strings.Join(r.Advanced, "; "))
		}
		if r.ClaimLSN != 0 {
			fmt.Fprintf(&b, " claim_lsn=%d", r.ClaimLSN)
		}
		if r.ReplySize != nil {
			fmt.Fprintf(&b, " reply_size=%d", *r.ReplySize)
		}
		if r.Before != "" {
			fmt.Fprintf(&b, " before=%s reason=%s", r.Before, r.Reason)
		}
	}
	fmt.Fprintf(&b, " segment=%s offset=%d\n", r.Segment, r.Offset)
	_, err := io.WriteString(w, b.String())
	return err
}

// writeJSONLine writes v as one line of JSON (without escaping <, > and &:
// the output is for people and jq, not for HTML).
func writeJSONLine(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}

// entryOut is one index entry as dump prints it.
type entryOut struct {
	Kind             string `json:"kind"`
	Scope            string `json:"scope"`
	Integration      string `json:"integration,omitempty"` // the scope in its integration's words (scopeWords)
	ID               string `json:"id,omitempty"`
	Client           string `json:"client,omitempty"`
	State            string `json:"state"`
	Seq              uint64 `json:"seq,omitempty"`
	CommitTime       string `json:"commit_time,omitempty"`
	CommitLSN        uint64 `json:"commit_lsn,omitempty"`
	ReplyKept        *bool  `json:"reply_kept,omitempty"`
	ReplySize        *int   `json:"reply_size,omitempty"`
	Fingerprint      string `json:"fingerprint,omitempty"`
	ExpiresAt        string `json:"expires_at,omitempty"`
	ClaimLSN         uint64 `json:"claim_lsn,omitempty"`
	ClaimSeq         uint64 `json:"claim_seq,omitempty"`
	ClaimTime        string `json:"claim_time,omitempty"`
	LeaseUntil       string `json:"lease_until,omitempty"`
	ClaimFingerprint string `json:"claim_fingerprint,omitempty"`
	LSN              uint64 `json:"lsn"`
}

func entryState(e *index.Entry) string {
	switch {
	case e.Committed && e.InFlight:
		return "committed+in-flight"
	case e.InFlight:
		return "in-flight"
	case e.Committed:
		return "committed"
	}
	return "empty"
}

func makeEntryOut(scope string, mode byte, ident []byte, e *index.Entry) *entryOut {
	out := &entryOut{Kind: "entry", Scope: scope, Integration: scopeWords(scope), State: entryState(e), LSN: uint64(e.LSN)}
	if mode == index.ModeID {
		out.ID = readable(ident)
	} else {
		out.Client = readable(ident)
	}
	if e.Committed {
		kept, n := e.ReplyKept, len(e.Reply)
		out.Seq, out.CommitTime, out.CommitLSN = e.Seq, fmtTime(e.CommitTime), uint64(e.CommitLSN)
		out.ReplyKept, out.ReplySize = &kept, &n
		out.Fingerprint = hex.EncodeToString(e.Fingerprint)
		if e.ExpiresAt != 0 && e.ReplyKept {
			out.ExpiresAt = fmtTime(e.ExpiresAt)
		}
	}
	if e.InFlight {
		out.ClaimLSN, out.ClaimSeq = uint64(e.ClaimLSN), e.ClaimSeq
		out.ClaimTime, out.LeaseUntil = fmtTime(e.ClaimTime), fmtTime(e.LeaseUntil)
		out.ClaimFingerprint = hex.EncodeToString(e.ClaimFP)
	}
	return out
}

// entryTime is the time filters match an entry on: its commit time, or its
// claim time when it holds only a claim.
func entryTime(e *index.Entry) int64 {
	if e.Committed {
		return e.CommitTime
	}
	return e.ClaimTime
}

func (o *dumpOpts) entryOK(scope string, mode byte, ident []byte, e *index.Entry) bool {
	var ids [][]byte
	client := ""
	if mode == index.ModeID {
		ids = [][]byte{ident}
	} else {
		client = string(ident)
	}
	if !o.f.keyOK(scope, true, ids, client) || !o.f.lsnOK(e.LSN) || !o.f.timeOK(entryTime(e)) {
		return false
	}
	switch o.state {
	case "in-flight":
		return e.InFlight
	case "committed":
		return e.Committed
	}
	return true
}

func (o *dumpOpts) dumpIndex(c *cli, w *bufio.Writer, dir string) error {
	label := ""
	if !c.stdoutTTY {
		label = "reading the WAL"
	}
	ri, err := loadIndex(c, dir, o.stored, label)
	if err != nil {
		return err
	}
	defer ri.close()
	if n := ri.note(); n != "" {
		fmt.Fprintf(c.stderr, "idem: note: %s\n", n)
	}
	return ri.ix.Entries(nil, func(key []byte, e *index.Entry) error {
		scope, mode, ident, err := index.ParseEntryKey(key)
		if err != nil {
			return fmt.Errorf("corrupt index: %w", err)
		}
		if !o.entryOK(scope, mode, ident, e) {
			return nil
		}
		return writeEntry(w, o.json, makeEntryOut(scope, mode, ident, e))
	})
}

func writeEntry(w io.Writer, asJSON bool, e *entryOut) error {
	if asJSON {
		return writeJSONLine(w, e)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "entry scope=%s", showScope(e.Scope))
	if e.Client != "" {
		fmt.Fprintf(&b, " client=%s", readableText([]byte(e.Client)))
	} else {
		fmt.Fprintf(&b, " id=%s", readableText([]byte(e.ID)))
	}
	fmt.Fprintf(&b, " state=%s", e.State)
	if e.CommitTime != "" {
		if e.Client != "" {
			fmt.Fprintf(&b, " seq=%d", e.Seq)
		}
		fmt.Fprintf(&b, " committed=%s commit_lsn=%d", e.CommitTime, e.CommitLSN)
		if *e.ReplyKept {
			fmt.Fprintf(&b, " reply_size=%d", *e.ReplySize)
		} else {
			b.WriteString(" reply=dropped")
		}
		if e.Fingerprint != "" {
			fmt.Fprintf(&b, " fp=%s", e.Fingerprint)
		}
		if e.ExpiresAt != "" {
			fmt.Fprintf(&b, " expires_at=%s", e.ExpiresAt)
		}
	}
	if e.ClaimTime != "" {
		if e.Client != "" {
			fmt.Fprintf(&b, " claim_seq=%d", e.ClaimSeq)
		}
		fmt.Fprintf(&b, " claimed=%s claim_lsn=%d lease_until=%s", e.ClaimTime, e.ClaimLSN, e.LeaseUntil)
		if e.ClaimFingerprint != "" {
			fmt.Fprintf(&b, " claim_fp=%s", e.ClaimFingerprint)
		}
	}
	fmt.Fprintf(&b, " lsn=%d\n", e.LSN)
	_, err := io.WriteString(w, b.String())
	return err
}
