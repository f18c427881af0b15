package natsfence_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestHugeTimeoutRefusedOrWorks: a Timeout New accepts must
// work: it sets how long a grant's marker lives, and must neither overflow
// nor make every grant fail. Either New refuses it with ErrInvalid naming
// Timeout, or a grant on a free name succeeds.
func TestHugeTimeoutRefusedOrWorks(t *testing.T) {
	ctx := context.Background()
	j := js(t)
	bucket(t, j, lockBucket)
	for _, timeout := range []time.Duration{math.MaxInt64, natsfence.MaxTTL, 200 * 365 * 24 * time.Hour} {
		a, err := natsfence.NewAcquirer(ctx, j, lockBucket.Bucket, &natsfence.AcquirerOptions{Timeout: timeout})
		if err != nil {
			var ie *fence.InvalidError
			if !errors.As(err, &ie) || ie.Arg != "Timeout" {
				t.Errorf("New with Timeout %v: %v, want nil or ErrInvalid naming Timeout", timeout, err)
			}
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		l, err := a.TryAcquire(cctx, fencetest.Name("hugetimeout"), 5*time.Second)
		cancel()
		if err != nil {
			t.Errorf("New accepted Timeout %v, then a grant on a free name: %v", timeout, err)
			continue
		}
		_ = l.Release(ctx)
	}
}
