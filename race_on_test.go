//go:build race

package idem

// raceEnabled says whether the tests run under the race detector.
const raceEnabled = true
