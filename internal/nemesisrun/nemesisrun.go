// Package nemesisrun holds what the nemesis suites (fencetest's and
// idempotencytest's) share: the environment variables that replay a seed or
// lengthen a run, the seeds of a run, and the command that replays one.
package nemesisrun

import (
	crand "crypto/rand"
	"encoding/binary"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The environment variables: one seed to replay, each seed's length, how
// many seeds run.
const (
	SeedEnv     = "FENCETEST_NEMESIS_SEED"
	DurationEnv = "FENCETEST_NEMESIS_DURATION"
	SeedsEnv    = "FENCETEST_NEMESIS_SEEDS"
)

// Settings returns each seed's duration (DurationEnv, else d) and the seeds
// to run: the one SeedEnv names, else n (SeedsEnv, else n) random ones. A bad
// value fails t, its message prefixed with who ("fencetest").
func Settings(t *testing.T, who string, d time.Duration, n int) (time.Duration, []uint64) {
	t.Helper()
	if env := os.Getenv(DurationEnv); env != "" {
		v, err := time.ParseDuration(env)
		if err != nil || v <= 0 {
			t.Fatalf("%s: %s=%q: not a positive duration", who, DurationEnv, env)
		}
		d = v
	}
	if env := os.Getenv(SeedsEnv); env != "" {
		v, err := strconv.Atoi(env)
		if err != nil || v <= 0 {
			t.Fatalf("%s: %s=%q: not a positive number", who, SeedsEnv, env)
		}
		n = v
	}
	if env := os.Getenv(SeedEnv); env != "" {
		seed, err := strconv.ParseUint(env, 10, 64)
		if err != nil {
			t.Fatalf("%s: %s=%q: %v", who, SeedEnv, env, err)
		}
		return d, []uint64{seed}
	}
	seeds := make([]uint64, 0, n)
	for range n {
		var b [8]byte
		_, _ = crand.Read(b[:])
		seeds = append(seeds, binary.LittleEndian.Uint64(b[:])>>1)
	}
	return d, seeds
}

// TestPattern is a -run pattern for t's top-level test.
func TestPattern(t *testing.T) string {
	top, _, _ := strings.Cut(t.Name(), "/")
	return "^" + top + "$"
}

// Replay is the command line that replays seed for t's top-level test.
func Replay(t *testing.T, seed uint64, d time.Duration) string {
	return SeedEnv + "=" + strconv.FormatUint(seed, 10) + " " + DurationEnv + "=" + d.String() + " go test -run '" + TestPattern(t) + "'"
}
