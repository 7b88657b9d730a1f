// Command idem inspects, checks and exercises idem directories.
//
//	idem demo                      exactly-once through lost replies, retries and a crash
//	idem dump [wal|index] <dir>    every WAL record and every live index entry
//	idem stats <dir>               entries by state, scope and age; WAL and index sizes
//	idem verify <dir>              check every WAL frame and the index against a replay
//	idem forget <dir> --before T   append an administrator's forget record
//	idem compact <dir>             snapshot the index, remove WAL segments it no longer needs
//	idem snapshot <dir> -o F       write a snapshot (a backup) of the dedup set
//	idem restore F <dir>           build a new directory from a snapshot
//	idem bench                     fresh and duplicate throughput and latency
//	idem serve --node-id ...       run a node of an idem cluster
//	idem cluster status --addr A   a running cluster's members and leader (also remove, forget)
//
// dump, stats and verify are read-only: they never take the engine's lock
// and never write into the directory, so they work while an application has
// it open. They read the WAL with wal.Scan and a private copy of the index
// (see view.go).
//
// Exit status: 0 success, 1 failure (including failed checks), 2 usage error.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"sort"
	"strings"
	"time"
)

func main() {
	setArenaMax()
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// cli is what every command gets: where to write, and what it can show.
type cli struct {
	stdout, stderr io.Writer
	// progressOK says stderr is a terminal, so progress bars may be drawn.
	progressOK bool
	// stdoutTTY says stdout is a terminal (dump then draws no bar: it would
	// mix with the output).
	stdoutTTY bool
	now       func() time.Time
}

// command is one subcommand: its help text, its flags and what it runs.
type command struct {
	name     string
	args     string // positional arguments in the synopsis
	summary  string // one line for the command list
	help     string // what it does, for idem help <name>
	examples []string
	hidden   bool
	// setup registers the command's flags on fs and returns the function
	// that runs it with the positional arguments.
	setup func(fs *flag.FlagSet) func(c *cli, pos []string) error
}

// commands in the order idem --help lists them.
var commands []*command

func init() {
	commands = []*command{demoCmd, dumpCmd, statsCmd, verifyCmd, forgetCmd, compactCmd, snapshotCmd, restoreCmd, benchCmd, scaleCmd, serveCmd, clusterCmd}
}

func lookupCommand(name string) *command {
	for _, c := range commands {
		if c.name == name {
			return c
		}
	}
	return nil
}

// usageError is a mistake in the command line: exit status 2.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error {
	return &usageError{msg: fmt.Sprintf(format, args...)}
}

// errReported is returned by a command that has already printed why it
// failed (a check that did not pass): exit status 1, nothing more to say.
var errReported = errors.New("failure reported above")

// run is the whole program: it parses args, runs one command and returns
// the exit status.
func run(args []string, stdout, stderr io.Writer) (code int) {
	c := &cli{stdout: stdout, stderr: stderr, now: time.Now}
	if f, ok := stderr.(*os.File); ok {
		c.progressOK = isTerminal(f.Fd())
	}
	if f, ok := stdout.(*os.File); ok {
		c.stdoutTTY = isTerminal(f.Fd())
	}
	defer func() {
		// No input should get here; if something does, say so in one
		// line instead of a goroutine dump.
		if r := recover(); r != nil {
			fmt.Fprintf(stderr, "idem: failed: %s\n", oneLine(fmt.Sprint(r)))
			if os.Getenv("IDEM_DEBUG") != "" {
				fmt.Fprintf(stderr, "%s", debug.Stack())
			}
			code = 1
		}
	}()
	if len(args) == 0 {
		printUsage(stderr)
		return 2
	}
	name := args[0]
	switch name {
	case "-h", "-help", "--help":
		printUsage(stdout)
		return 0
	case "help":
		return runHelp(c, args[1:])
	}
	cmd := lookupCommand(name)
	if cmd == nil {
		fmt.Fprintf(stderr, "idem: unknown command %q (run 'idem --help' for the list)\n", name)
		return 2
	}
	fs := flag.NewFlagSet("idem "+cmd.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	exec := cmd.setup(fs)
	pos, err := parseInterspersed(fs, args[1:])
	if errors.Is(err, flag.ErrHelp) {
		printCommandHelp(stdout, cmd)
		return 0
	}
	if err == nil {
		err = exec(c, pos)
	}
	return exitCode(c, cmd, err)
}

func exitCode(c *cli, cmd *command, err error) int {
	var ue *usageError
	switch {
	case err == nil:
		return 0
	case errors.Is(err, errReported):
		return 1
	case errors.As(err, &ue):
		fmt.Fprintf(c.stderr, "idem %s: %s (run 'idem help %s')\n", cmd.name, oneLine(ue.msg), cmd.name)
		return 2
	default:
		msg := err.Error()
		if nd := (*notIdemDirError)(nil); errors.As(err, &nd) {
			msg = nd.message(cmd.name)
		}
		fmt.Fprintf(c.stderr, "idem %s: %s\n", cmd.name, oneLine(msg))
		return 1
	}
}

// oneLine keeps an error message on one line (Pebble's errors can span
// several).
func oneLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = strings.TrimSpace(s[:i]) + " ..."
	}
	return s
}

// parseInterspersed parses flags that may come before, between or after the
// positional arguments ("idem forget <dir> --before 720h"). Everything after
// "--" is positional.
func parseInterspersed(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err
			}
			return nil, usagef("%v", err)
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		// fs.Parse consumed a "--" if it stopped there: then everything
		// left is positional.
		if n := len(args) - len(rest); n > 0 && args[n-1] == "--" {
			return append(pos, rest...), nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

func runHelp(c *cli, args []string) int {
	if len(args) == 0 {
		printUsage(c.stdout)
		return 0
	}
	cmd := lookupCommand(args[0])
	if cmd == nil {
		fmt.Fprintf(c.stderr, "idem help: unknown command %q (run 'idem --help' for the list)\n", args[0])
		return 2
	}
	printCommandHelp(c.stdout, cmd)
	return 0
}

func printUsage(w io.Writer) {
	fmt.Fprint(w, `idem: inspect, check and exercise idem directories (exactly-once request handling).

Usage:
  idem <command> [arguments] [flags]

Commands:
`)
	for _, cmd := range commands {
		if cmd.hidden {
			continue
		}
		fmt.Fprintf(w, "  %-8s %s\n", cmd.name, cmd.summary)
	}
	fmt.Fprint(w, `
New here? Run 'idem demo': simulated clients lose replies, retry and even see
the server crash, and every request still runs exactly once.

dump, stats and verify only read: they take no lock and write nothing, so they
work while an application has the directory open (what they show may then be
slightly behind it).

Run 'idem help <command>' or 'idem <command> --help' for its flags and examples.
Exit status: 0 success, 1 failure or failed check, 2 usage error.
`)
}

// flagSpelling is how help and examples write a flag: -o for a one-letter
// name, --json for a longer one (the flag package accepts both forms).
func flagSpelling(name string) string {
	if len(name) == 1 {
		return "-" + name
	}
	return "--" + name
}

func printCommandHelp(w io.Writer, cmd *command) {
	fmt.Fprintf(w, "Usage: idem %s", cmd.name)
	if cmd.args != "" {
		fmt.Fprintf(w, " %s", cmd.args)
	}
	fmt.Fprintf(w, " [flags]\n\n%s\n", strings.TrimSpace(cmd.help))
	fs := flag.NewFlagSet(cmd.name, flag.ContinueOnError)
	cmd.setup(fs)
	var names []string
	fs.VisitAll(func(f *flag.Flag) {
		if !strings.HasPrefix(f.Usage, "(hidden)") {
			names = append(names, f.Name)
		}
	})
	if len(names) > 0 {
		fmt.Fprintf(w, "\nFlags:\n")
		sort.Strings(names)
		for _, n := range names {
			f := fs.Lookup(n)
			arg, usage := flag.UnquoteUsage(f)
			head := "  " + flagSpelling(f.Name)
			if arg != "" {
				head += " " + arg
			}
			fmt.Fprintf(w, "%s\n", head)
			fmt.Fprintf(w, "        %s", usage)
			if f.DefValue != "" && f.DefValue != "false" && f.DefValue != "0" && f.DefValue != "0s" {
				fmt.Fprintf(w, " (default %s)", f.DefValue)
			}
			fmt.Fprintln(w)
		}
	}
	if len(cmd.examples) > 0 {
		fmt.Fprintf(w, "\nExamples:\n")
		for _, ex := range cmd.examples {
			fmt.Fprintf(w, "  %s\n", ex)
		}
	}
}
