// Package fuzz holds idem's crash-recovery fuzzing and fault-injection
// evidence. It has no API: everything lives in its tests, which use only the
// exported API of idem (and of the wal, index and snapshot packages for the
// decoder targets), and compare the engine with a small reference model of
// what callers were told (model_test.go).
//
//   - FuzzCrashRecovery: the fuzzer's bytes are a program of idem calls run
//     against the model on a crashable in-memory filesystem; at points the
//     program chooses, the filesystem is crashed (between steps or inside an
//     fsync, with or without unsynced data kept), the engine reopened and its
//     whole observable state compared with the model. Programs whose
//     configuration byte is 0x40 (bit 6 without bit 7) run batches
//     (Batch.Run of Begins, Puts, Commits, Aborts and Acks, which the model
//     applies in order, atomically).
//   - TestCrashAtEverySyncPoint: fixed programs with a crash image taken at
//     every fsync, each image recovered and checked.
//   - TestMaxEntriesEvictionCrash: capacity eviction under crashes.
//   - TestFaultSweep (and TestFaultSweepIndex for the index's files, one
//     child process per fault point, run with IDEM_FUZZ_INDEX_FAULTS: every
//     point, or every N-th in CI): EIO and ENOSPC injected with
//     vfs/errorfs at the 1st, 2nd, ... write, sync, create, rename and
//     remove until a run completes.
//   - TestWALByteFlipsAndTruncations: every single-byte flip and every
//     truncation of a small WAL.
//   - TestSIGKILL: a child process killed with SIGKILL at random moments.
//   - FuzzWALDecode, FuzzWALScan, FuzzIndexEntry, FuzzSnapshotDecode,
//     FuzzRestore: every decoder of bytes read from disk, fed arbitrary
//     input.
//   - found_test.go: the bugs these tests found.
//
// See README.md for what was run and how to run it for longer.
package fuzz
