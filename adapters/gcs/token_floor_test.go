package gcsfence_test

import (
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestTokensRiseWithinGCSTimeOverQuickGrants: grants in quick succession,
// each right after the release of the one before, alternating between two
// acquirers, give rising tokens, each at or below GCS's time when its grant
// landed (the grant's updated time, in microseconds, plus the timestamps'
// millisecond when GCS truncates them), and no grant waits for the clock
// much longer than the millisecond the floor needs.
func TestTokensRiseWithinGCSTimeOverQuickGrants(t *testing.T) {
	for _, ms := range []bool{false, true} {
		name := "micro-timestamps"
		if ms {
			name = "milli-timestamps"
		}
		t.Run(name, func(t *testing.T) {
			e := fakeGCS(t)
			e.f.msTimes.Store(ms)
			ctx := ctxFor(t)
			acq := []fence.Acquirer{newAcquirer(t, e), newAcquirer(t, e)}
			lock := fencetest.Name("quick")
			obj := e.b().Object("fencekit-locks/" + lock)
			var last fence.Token
			var slowest time.Duration
			for i := range 40 {
				start := time.Now()
				l, err := acq[i%2].TryAcquire(ctx, lock, time.Minute)
				took := time.Since(start)
				if err != nil {
					t.Fatalf("grant %d: %v", i, err)
				}
				slowest = max(slowest, took)
				attrs, err := obj.Attrs(ctx)
				if err != nil {
					t.Fatal(err)
				}
				landed := attrs.Updated
				if ms {
					landed = landed.Add(time.Millisecond)
				}
				if uint64(l.Token()) > uint64(landed.UnixMicro()) {
					t.Errorf("grant %d: token %d is ahead of GCS's time when it landed (updated %s, %d µs)", i, l.Token(), attrs.Updated.Format(time.RFC3339Nano), landed.UnixMicro())
				}
				if l.Token() <= last {
					t.Errorf("grant %d: token %d after %d", i, l.Token(), last)
				}
				last = l.Token()
				if err := l.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}
			t.Logf("slowest grant %v", slowest)
			if slowest > 500*time.Millisecond {
				t.Errorf("a grant of a free lock took %v", slowest)
			}
		})
	}
}
