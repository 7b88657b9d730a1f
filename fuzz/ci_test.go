package fuzz

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestCIFuzzDeadlineRace runs .ci/fuzz (CI's wrapper of go test -fuzz)
// against a fake go command printing recorded outputs: a run whose only
// failure is Go 1.26's bare "context deadline exceeded" at the end of
// -fuzztime (golang/go#75804; the first output is FuzzIndexEntry's, from a
// loaded machine) passes, with a notice; a real failure, or that message
// with a failing input written, fails.
func TestCIFuzzDeadlineRace(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	script, err := filepath.Abs("../.ci/fuzz")
	if err != nil {
		t.Fatal(err)
	}
	const race = "fuzz: elapsed: 6s, execs: 1129 (187/sec), new interesting: 6 (total: 25)\n" +
		"fuzz: elapsed: 11s, execs: 1129 (0/sec), new interesting: 6 (total: 25)\n" +
		"--- FAIL: FuzzIndexEntry (11.10s)\n" +
		"    context deadline exceeded\n" +
		"FAIL\nexit status 1\nFAIL\tgithub.com/idemdb/idem/fuzz\t11.311s\n"
	const crash = "fuzz: elapsed: 2s, execs: 100 (50/sec), new interesting: 0 (total: 4)\n" +
		"--- FAIL: FuzzIndexEntry (2.31s)\n" +
		"    --- FAIL: FuzzIndexEntry (0.00s)\n" +
		"        decode_test.go:420: DecodeEntry error x is not index.ErrBadEntry\n\n" +
		"    Failing input written to testdata/fuzz/FuzzIndexEntry/0123456789abcdef\n" +
		"    To re-run:\n    go test -run=FuzzIndexEntry/0123456789abcdef\n" +
		"FAIL\nexit status 1\nFAIL\tgithub.com/idemdb/idem/fuzz\t2.5s\n"
	const raceAndInput = "--- FAIL: FuzzIndexEntry (11.10s)\n" +
		"    context deadline exceeded\n" +
		"    Failing input written to testdata/fuzz/FuzzIndexEntry/0123456789abcdef\n" +
		"FAIL\nexit status 1\n"
	const pass = "fuzz: elapsed: 10s, execs: 42798 (4280/sec), new interesting: 3 (total: 22)\nPASS\nok  \tgithub.com/idemdb/idem/fuzz\t10.1s\n"
	for _, c := range []struct {
		name, out string
		goRC      int
		ok        bool
	}{
		{"deadline race only", race, 1, true},
		{"failing input", crash, 1, false},
		{"deadline race with a failing input", raceAndInput, 1, false},
		{"pass", pass, 0, true},
	} {
		dir := t.TempDir()
		outFile := filepath.Join(dir, "out")
		if err := os.WriteFile(outFile, []byte(c.out), 0o644); err != nil {
			t.Fatal(err)
		}
		fakeGo := "#!/bin/sh\ncat " + outFile + "\nexit " + string(rune('0'+c.goRC)) + "\n"
		if err := os.WriteFile(filepath.Join(dir, "go"), []byte(fakeGo), 0o755); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		cmd := exec.CommandContext(ctx, bash, script, "./fuzz/", "FuzzIndexEntry", "-fuzztime", "10s")
		cmd.Env = append(os.Environ(), "PATH="+dir+string(os.PathListSeparator)+os.Getenv("PATH"))
		out, err := cmd.CombinedOutput()
		cancel()
		if ok := err == nil; ok != c.ok {
			t.Errorf("%s: .ci/fuzz passed %v (%v), want %v; output:\n%s", c.name, ok, err, c.ok, out)
		}
		if notice := strings.Contains(string(out), "golang/go#75804"); notice != (c.name == "deadline race only") {
			t.Errorf("%s: notice of the deadline race printed: %v; output:\n%s", c.name, notice, out)
		}
	}
}
