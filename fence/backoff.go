package fence

import (
	"context"
	"math/rand/v2"
	"time"
)

// Backoff configures how an acquirer waits for a held lease: exponential backoff
// with full jitter, capped, and a limit on the whole wait. Its zero value means
// the defaults.
type Backoff struct {
	// Min is the first retry's upper bound. Default: 1ms.
	Min time.Duration
	// Max caps every retry's upper bound. Default: 100ms.
	Max time.Duration
	// MaxWait bounds the whole wait when ctx has no deadline. Default: 30s.
	MaxWait time.Duration
}

// DefaultMaxWait is the wait limit of a zero Backoff.
const DefaultMaxWait = 30 * time.Second

// WithDefaults returns b as Delay, Sleep and leasekit.Acquire read it: an unset Min is
// 1ms, an unset Max 100ms (and never below Min), an unset MaxWait
// DefaultMaxWait.
func (b Backoff) WithDefaults() Backoff {
	if b.Min <= 0 {
		b.Min = time.Millisecond
	}
	if b.Max <= 0 {
		b.Max = 100 * time.Millisecond
	}
	if b.Max < b.Min {
		b.Max = b.Min
	}
	if b.MaxWait <= 0 {
		b.MaxWait = DefaultMaxWait
	}
	return b
}

// Delay returns the pause before retry number attempt (0-based): a uniformly random
// duration in [0, min(Max, Min*2^attempt)] ("full jitter").
func (b Backoff) Delay(attempt int) time.Duration {
	b = b.WithDefaults()
	ceil := b.Max
	if attempt < 30 {
		if d := b.Min << attempt; d > 0 && d < ceil {
			ceil = d
		}
	}
	return rand.N(ceil + 1)
}

// Sleep waits Delay(attempt), or until ctx is done: then it returns ctx's
// cause. It paces a retry loop of the caller's own.
func (b Backoff) Sleep(ctx context.Context, attempt int) error {
	t := time.NewTimer(b.Delay(attempt))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-t.C:
		return nil
	}
}
