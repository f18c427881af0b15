package s3fence_test

import (
	"context"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestTokensRiseWithinS3TimeOverQuickGrants: grants in quick succession,
// each right after the release of the one before, alternating between two
// acquirers, give rising tokens, none ahead of S3's time (bounded by the
// Date of a later answer plus its second and the default DateLag), and only
// a new lock object's first grant waits for S3's clock.
func TestTokensRiseWithinS3TimeOverQuickGrants(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		ctx := context.Background()
		acq := []fence.Acquirer{newAcquirer(t, e), newAcquirer(t, e)}
		lock := fencetest.Name("quick")
		var last fence.Token
		var slowest time.Duration
		for i := range 30 {
			start := time.Now()
			l, err := acq[i%2].TryAcquire(ctx, lock, time.Minute)
			took := time.Since(start)
			if err != nil {
				t.Fatalf("grant %d: %v", i, err)
			}
			if i > 0 {
				slowest = max(slowest, took)
			}
			bound := serverDate(t, e).Add(time.Second + 2*time.Second)
			if uint64(l.Token()) > uint64(bound.UnixMicro()) {
				t.Errorf("grant %d: token %d is ahead of S3's latest possible time %d µs", i, l.Token(), bound.UnixMicro())
			}
			if l.Token() <= last {
				t.Errorf("grant %d: token %d after %d", i, l.Token(), last)
			}
			last = l.Token()
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("slowest grant after the first %v", slowest)
		if slowest > 500*time.Millisecond {
			t.Errorf("a grant of a free, existing lock took %v", slowest)
		}
	})
}
