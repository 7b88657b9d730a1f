package main

import (
	"cmp"
	"flag"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/idemdb/idem/index"
)

var statsCmd = &command{
	name:    "stats",
	args:    "<dir>",
	summary: "live entries by state, scope and age; WAL segments and bytes; index size; LSNs",
	help: `
Summarises an idem directory without changing it (no lock is taken; it works
while an application has the directory open):

  - live entries by state (in flight, committed, replies kept) and by scope
    (a scope written by idemhttp or idemgrpc in its words, such as
    idemhttp(actor=alice); --json adds them as "integration");
  - the age of the kept replies, by commit time;
  - WAL segments, their bytes, the first and last LSN, a torn tail if any;
  - the index's size on disk, the LSN it has applied, its forget mark.

The entry counts include the WAL records the index files have not applied
yet, replayed onto a private copy by Open's own recovery code (--stored:
the files only).`,
	examples: []string{
		"idem stats /var/lib/app/idem",
		"idem stats /var/lib/app/idem --json | jq .entries",
		"idem stats /var/lib/app/idem --top 50",
	},
	setup: func(fs *flag.FlagSet) func(*cli, []string) error {
		o := &statsOpts{}
		fs.BoolVar(&o.json, "json", false, "print one JSON object")
		fs.BoolVar(&o.stored, "stored", false, "count the index files as they are, without replaying the WAL records they have not applied")
		fs.IntVar(&o.top, "top", 20, "list at most `n` scopes in text output (--json lists all)")
		return o.run
	},
}

type statsOpts struct {
	json, stored bool
	top          int
}

type scopeStats struct {
	Scope       string `json:"scope"`
	Integration string `json:"integration,omitempty"` // the scope in its integration's words (scopeWords)
	Entries     int64  `json:"entries"`
	InFlight    int64  `json:"in_flight"`
	Committed   int64  `json:"committed"`
}

type ageBucket struct {
	Label string        `json:"bucket"`
	Under time.Duration `json:"-"`
	Count int64         `json:"count"`
}

type statsOut struct {
	Dir          string `json:"dir"`
	WriterActive bool   `json:"writer_active"`
	Entries      struct {
		Total       int64 `json:"total"`
		InFlight    int64 `json:"in_flight"`
		Committed   int64 `json:"committed"`
		RepliesKept int64 `json:"replies_kept"`
		IDs         int64 `json:"ids"`
		Clients     int64 `json:"clients"`
		ReplyBytes  int64 `json:"reply_bytes"`
	} `json:"entries"`
	ByScope []scopeStats `json:"by_scope"`
	Age     []ageBucket  `json:"reply_age"`
	WAL     struct {
		Segments  int    `json:"segments"`
		Bytes     int64  `json:"bytes"`
		FileBytes int64  `json:"file_bytes"`
		FirstLSN  uint64 `json:"first_lsn"`
		LastLSN   uint64 `json:"last_lsn"`
		TornTail  string `json:"torn_tail,omitempty"`
		TornFiles int    `json:"torn_files,omitempty"`
	} `json:"wal"`
	Index struct {
		Bytes         int64  `json:"bytes"`
		AppliedLSN    uint64 `json:"applied_lsn"`
		StoredEntries int64  `json:"stored_entries"`
		ForgetBefore  string `json:"forget_before,omitempty"`
		ForgetLSN     uint64 `json:"forget_lsn,omitempty"`
		Replayed      int    `json:"replayed_records"`
		// SeededFrom is the snapshot an empty index was loaded from before
		// the replay, as Open would.
		SeededFrom string `json:"seeded_from,omitempty"`
	} `json:"index"`
}

func (o *statsOpts) run(c *cli, pos []string) error {
	dir, err := oneDir(pos)
	if err != nil {
		return err
	}
	var s statsOut
	s.Dir = dir
	s.WriterActive = noteWriter(c, dir)
	ri, err := loadIndex(c, dir, o.stored, "reading the WAL")
	if err != nil {
		return err
	}
	defer ri.close()
	now := c.now()
	s.Age = []ageBucket{
		{Label: "<1m", Under: time.Minute}, {Label: "1m-1h", Under: time.Hour},
		{Label: "1h-1d", Under: 24 * time.Hour}, {Label: "1d-7d", Under: 7 * 24 * time.Hour},
		{Label: "7d-30d", Under: 30 * 24 * time.Hour}, {Label: ">=30d", Under: 1<<63 - 1},
	}
	scopes := map[string]*scopeStats{}
	err = ri.ix.Entries(nil, func(key []byte, e *index.Entry) error {
		scope, mode, _, err := index.ParseEntryKey(key)
		if err != nil {
			return fmt.Errorf("corrupt index: %w", err)
		}
		sc := scopes[scope]
		if sc == nil {
			sc = &scopeStats{Scope: scope, Integration: scopeWords(scope)}
			scopes[scope] = sc
		}
		s.Entries.Total++
		sc.Entries++
		if mode == index.ModeID {
			s.Entries.IDs++
		} else {
			s.Entries.Clients++
		}
		if e.InFlight {
			s.Entries.InFlight++
			sc.InFlight++
		}
		if e.Committed {
			s.Entries.Committed++
			sc.Committed++
		}
		if e.HasTimeKey() {
			s.Entries.RepliesKept++
			s.Entries.ReplyBytes += int64(len(e.Reply))
			age := now.Sub(time.Unix(0, e.CommitTime))
			for i := range s.Age {
				if age < s.Age[i].Under {
					s.Age[i].Count++
					break
				}
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, sc := range scopes {
		s.ByScope = append(s.ByScope, *sc)
	}
	slices.SortFunc(s.ByScope, func(a, b scopeStats) int {
		if c := cmp.Compare(b.Entries, a.Entries); c != 0 {
			return c
		}
		return cmp.Compare(a.Scope, b.Scope)
	})
	files, _, err := listWAL(dir)
	if err != nil {
		return err
	}
	for _, f := range files {
		s.WAL.FileBytes += f.size
		if strings.HasSuffix(f.name, ".torn") {
			s.WAL.TornFiles++
		}
	}
	for _, seg := range ri.scan.Segments {
		s.WAL.Segments++
		s.WAL.Bytes += seg.Size
	}
	if len(ri.scan.Segments) > 0 {
		s.WAL.FirstLSN = uint64(ri.scan.Segments[0].FirstLSN)
	}
	s.WAL.LastLSN = uint64(ri.scan.LastLSN)
	if t := ri.scan.TornTail; t != nil {
		s.WAL.TornTail = fmt.Sprintf("%d bytes at segment %s offset %d", t.Bytes, t.Segment, t.Offset)
	}
	st := ri.stored
	s.Index.Bytes, s.Index.AppliedLSN, s.Index.StoredEntries = st.bytes, uint64(st.applied), st.count
	if m := ri.ix.Mark(); m.LSN != 0 {
		s.Index.ForgetBefore, s.Index.ForgetLSN = fmtTime(m.Before), uint64(m.LSN)
	}
	s.Index.Replayed, s.Index.SeededFrom = ri.replayed, ri.seeded
	if o.json {
		return writeJSONLine(c.stdout, &s)
	}
	if n := ri.note(); n != "" {
		fmt.Fprintf(c.stderr, "idem: note: %s\n", n)
	}
	o.print(c.stdout, &s)
	return nil
}

func (o *statsOpts) print(w io.Writer, s *statsOut) {
	e := s.Entries
	fmt.Fprintf(w, "directory    %s", s.Dir)
	if s.WriterActive {
		fmt.Fprint(w, " (open by a running engine)")
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "entries      %d live: %d in flight, %d committed (%d replies kept, %s)\n",
		e.Total, e.InFlight, e.Committed, e.RepliesKept, humanBytes(e.ReplyBytes))
	fmt.Fprintf(w, "             %d ids, %d sequence-mode clients\n", e.IDs, e.Clients)
	if len(s.ByScope) > 0 {
		shown := s.ByScope
		if o.top >= 0 && o.top < len(shown) {
			shown = shown[:o.top]
		}
		names := make([]string, len(shown))
		width := 24 // the scope column: as wide as the longest shown, up to 64
		for i, sc := range shown {
			names[i] = showScope(sc.Scope)
			width = max(width, min(len(names[i]), 64))
		}
		fmt.Fprintf(w, "by scope     %-*s %10s %10s %10s\n", width, "scope", "entries", "in-flight", "committed")
		for i, sc := range shown {
			fmt.Fprintf(w, "             %-*s %10d %10d %10d\n", width, names[i], sc.Entries, sc.InFlight, sc.Committed)
		}
		if len(shown) < len(s.ByScope) {
			fmt.Fprintf(w, "             ... and %d more scopes (--top, --json)\n", len(s.ByScope)-len(shown))
		}
	}
	fmt.Fprintf(w, "reply age   ")
	for _, b := range s.Age {
		fmt.Fprintf(w, " %s: %d", b.Label, b.Count)
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "wal          %d segments, %s of records (%s on disk, preallocated space included), %s\n",
		s.WAL.Segments, humanBytes(s.WAL.Bytes), humanBytes(s.WAL.FileBytes), lsnRange(s.WAL.FirstLSN, s.WAL.LastLSN))
	if s.WAL.TornTail != "" {
		fmt.Fprintf(w, "             torn tail: %s (Open cuts it)\n", s.WAL.TornTail)
	}
	if s.WAL.TornFiles > 0 {
		fmt.Fprintf(w, "             %d other files (tails cut earlier, saved as *.torn)\n", s.WAL.TornFiles)
	}
	fmt.Fprintf(w, "index        %s on disk, applied LSN %d, %d entries stored\n", humanBytes(s.Index.Bytes), s.Index.AppliedLSN, s.Index.StoredEntries)
	if s.Index.ForgetLSN != 0 {
		fmt.Fprintf(w, "             forget mark: replies committed before %s (LSN %d)\n", s.Index.ForgetBefore, s.Index.ForgetLSN)
	}
	fmt.Fprintf(w, "lsn          applied %d, last %d (%d not yet in the index files)\n", s.Index.AppliedLSN, s.WAL.LastLSN, s.WAL.LastLSN-s.Index.AppliedLSN)
}
