package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/idemdb/idem"
	"github.com/idemdb/idem/index"
)

var forgetCmd = &command{
	name:    "forget",
	args:    "<dir>",
	summary: "append a forget record: drop every reply committed before a time",
	help: `
Opens the engine (this takes the directory's lock: it fails if an application
has the directory open) and appends the administrator's forget record: every
reply committed before --before is dropped. Forgotten ids run again as new if
they are retried; sequence-mode clients keep their last sequence number. A
forget never moves backwards: a time before an earlier forget changes
nothing. The record is fsynced before the command returns.

--before takes an RFC 3339 time, a date (midnight UTC), or a duration before
now (720h, 30d).`,
	examples: []string{
		"idem forget /var/lib/app/idem --before 720h",
		"idem forget /var/lib/app/idem --before 2026-01-01T00:00:00Z",
		"idem forget /var/lib/app/idem --before 30d --dry-run",
	},
	setup: func(fs *flag.FlagSet) func(*cli, []string) error {
		o := &forgetOpts{}
		fs.StringVar(&o.before, "before", "", "forget replies committed before `t` (RFC 3339 time, date, or duration before now such as 720h); required")
		fs.BoolVar(&o.dryRun, "dry-run", false, "only count what would be forgotten (read-only, takes no lock)")
		return o.run
	},
}

type forgetOpts struct {
	before string
	dryRun bool
}

func (o *forgetOpts) run(c *cli, pos []string) error {
	if o.before == "" {
		return usagef("--before is required (for example --before 720h)")
	}
	now := c.now()
	before, err := parseTimeArg(o.before, now)
	if err != nil {
		return err
	}
	dir, err := oneDir(pos)
	if err != nil {
		return err
	}
	if before.After(now) {
		fmt.Fprintf(c.stderr, "idem: note: --before %s is in the future: every reply committed so far is forgotten\n", before.UTC().Format(time.RFC3339Nano))
	}
	if o.dryRun {
		return o.count(c, dir, before)
	}
	e, err := idem.Open(dir, nil)
	if errors.Is(err, idem.ErrLocked) {
		return fmt.Errorf("%s is locked by another engine (ErrLocked): close the application that has it open, or use --dry-run", dir)
	}
	if err != nil {
		return err
	}
	st0 := e.Stats()
	ferr := e.Forget(context.Background(), before)
	cerr := e.Close() // applies the forget to the index and flushes it
	if ferr != nil {
		return ferr
	}
	if cerr != nil {
		return cerr
	}
	st := e.Stats()
	fmt.Fprintf(c.stdout, "forget appended at LSN %d: replies committed before %s are forgotten\n", st.LastLSN, before.UTC().Format(time.RFC3339Nano))
	fmt.Fprintf(c.stdout, "live entries: %d before, %d after (%d replies dropped)\n", st0.LiveEntries, st.LiveEntries, st.Cleanups)
	return nil
}

// count reports what a forget would drop, from a read-only view.
func (o *forgetOpts) count(c *cli, dir string, before time.Time) error {
	noteWriter(c, dir)
	ri, err := loadIndex(c, dir, false, "reading the WAL")
	if err != nil {
		return err
	}
	defer ri.close()
	mark := ri.ix.Mark()
	b := max(before.UnixNano(), mark.Before)
	n, total := 0, 0
	err = ri.ix.Entries(nil, func(_ []byte, en *index.Entry) error {
		total++
		if en.HasTimeKey() && en.CommitTime < b {
			n++
		}
		return nil
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(c.stdout, "dry run: a forget before %s would drop %d of %d live entries' replies (nothing was written)\n", time.Unix(0, b).UTC().Format(time.RFC3339Nano), n, total)
	return nil
}
