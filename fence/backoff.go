package fence

import (
	"context"
	"fmt"
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

// Validate returns an *InvalidError (matching ErrInvalid) naming the first
// negative field of b. Every other Backoff, up to math.MaxInt64 in each
// field, is valid: Delay and Sleep cannot overflow.
func (b Backoff) Validate() error {
	for _, f := range []struct {
		name string
		d    time.Duration
	}{{"Backoff.Min", b.Min}, {"Backoff.Max", b.Max}, {"Backoff.MaxWait", b.MaxWait}} {
		if f.d < 0 {
			return &InvalidError{Op: "backoff", Arg: f.name, Reason: fmt.Sprintf("%v is negative", f.d)}
		}
	}
	return nil
}

// Delay returns the pause before retry number attempt (0-based; a negative
// attempt counts as 0): a uniformly random duration in
// [0, min(Max, Min*2^attempt)] ("full jitter"), without overflow for any
// field up to math.MaxInt64.
func (b Backoff) Delay(attempt int) time.Duration {
	b = b.WithDefaults()
	ceil := b.Max
	attempt = max(attempt, 0)
	// Min<<attempt <= ceil exactly when Min <= ceil>>attempt: shifting ceil
	// down cannot overflow, shifting Min up can.
	if attempt < 63 && b.Min <= ceil>>attempt {
		ceil = b.Min << attempt
	}
	// ceil+1 overflows for math.MaxInt64; as a uint64 it does not.
	return time.Duration(rand.Uint64N(uint64(ceil) + 1))
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
