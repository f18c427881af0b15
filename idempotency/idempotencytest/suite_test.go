package idempotencytest_test

import (
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idempotencytest"
)

// mutants maps each bug switch of memStore to the suite case that must catch it.
var mutants = []struct{ bug, kill string }{
	{bugFenceOnlyOnStateChange, "StaleOwnerCannotTouchTakenOverArmed"},
	{bugPurgeWithinRetention, "PurgeKeepsLiveRecords"},
	{bugPurgeExpiredLeases, "PurgeKeepsLiveRecords"},
	{bugPurgeUnknown, "PurgeKeepsLiveRecords"},
	{bugRenewKeepsLease, "RenewalKeepsKeyPastLease"},
	{bugTakeoverDropsFingerprint, "TakeoverKeepsFingerprint"},
	{bugGetByPrefix, "GetMatchesWholeKey"},
	{bugKeyCollation, "GetMatchesWholeKey"},
	{bugBeginIgnoresRetention, "BeginAfterRetentionWithoutPurge"},
	{bugRestartIgnored, "TakeoverRestartsInProgress"},
	{bugAliasStoredResult, "ResultNotAliased"},
	{bugAliasReadResult, "ResultNotAliased"},
}

// TestMemoryStore runs the suite on the correct in-memory store, or, in a child
// process started by TestMutantsKilled, on the mutant that mutantEnv names.
func TestMemoryStore(t *testing.T) {
	bug, err := mutantFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	st := newMemStore(bug)
	idempotencytest.Suite{New: func(*testing.T) idempotency.Store { return st }}.Run(t)
}

// TestMutantsKilled runs, for each mutant, the case meant to catch it in a
// child process (this test binary, with mutantEnv set), and asserts that this
// very case failed.
func TestMutantsKilled(t *testing.T) {
	if os.Getenv(mutantEnv) != "" {
		t.Skip("inside a mutant's child process")
	}
	for _, m := range mutants {
		t.Run(m.bug, func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command(os.Args[0], "-test.run=^TestMemoryStore$/^"+m.kill+"$", "-test.count=1", "-test.timeout=2m")
			cmd.Env = append(os.Environ(), mutantEnv+"="+m.bug)
			out, err := cmd.CombinedOutput()
			var exit *exec.ExitError
			if !errors.As(err, &exit) {
				t.Fatalf("the suite's %s passed on mutant %s (err %v):\n%s", m.kill, m.bug, err, out)
			}
			if !strings.Contains(string(out), "--- FAIL: TestMemoryStore/"+m.kill+" ") {
				t.Fatalf("mutant %s: the child failed, but not in %s:\n%s", m.bug, m.kill, out)
			}
			t.Logf("killed by %s", m.kill)
		})
	}
}
