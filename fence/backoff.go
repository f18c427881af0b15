package fence

import (
	"context"
	"errors"
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

// Check returns an *InvalidError, for op, when a field of b is negative.
func (b Backoff) Check(op string) error {
	for _, f := range []struct {
		name string
		d    time.Duration
	}{{"Backoff.Min", b.Min}, {"Backoff.Max", b.Max}, {"Backoff.MaxWait", b.MaxWait}} {
		if f.d < 0 {
			return &InvalidError{Op: op, Arg: f.name, Reason: fmt.Sprintf("%v is negative", f.d)}
		}
	}
	return nil
}

// DefaultMaxWait is the wait limit of a zero Backoff.
const DefaultMaxWait = 30 * time.Second

// WithDefaults returns b as Delay, Sleep and Acquire read it: an unset Min is
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

// Acquire is the waiting loop that acquirers share. It calls try until try returns
// a lease or an error that does not match ErrHeld. Between calls it sleeps for
// Delay(attempt), or less when wake receives (a release notification; wake may be
// nil). It gives up at ctx's deadline, or after MaxWait when ctx has none, with an
// error matching ErrHeld and the context error.
func (b Backoff) Acquire(ctx context.Context, wake <-chan struct{}, try func(context.Context) (Lease, error)) (Lease, error) {
	return b.loop(ctx, wake, try, true)
}

// Retry is Acquire for a caller that has just tried and found the lease held:
// it waits (for Delay(0) or a wake-up) before its first call to try.
func (b Backoff) Retry(ctx context.Context, wake <-chan struct{}, try func(context.Context) (Lease, error)) (Lease, error) {
	return b.loop(ctx, wake, try, false)
}

func (b Backoff) loop(ctx context.Context, wake <-chan struct{}, try func(context.Context) (Lease, error), tryFirst bool) (Lease, error) {
	b = b.WithDefaults()
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, b.MaxWait,
			fmt.Errorf("fence: gave up after the maximum wait %v: %w", b.MaxWait, context.DeadlineExceeded))
		defer cancel()
	}
	// Since Go 1.23 a timer channel holds no stale value after Stop or Reset,
	// so one timer serves every attempt without draining.
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for attempt := 0; ; attempt++ {
		if tryFirst || attempt > 0 {
			l, err := try(ctx)
			if err == nil {
				return l, nil
			}
			if !errors.Is(err, ErrHeld) {
				if ctx.Err() != nil {
					return nil, errors.Join(ErrHeld, context.Cause(ctx))
				}
				return nil, err
			}
		}
		timer.Reset(b.Delay(attempt))
		select {
		case <-ctx.Done():
			return nil, errors.Join(ErrHeld, context.Cause(ctx))
		case <-wake:
			timer.Stop()
		case <-timer.C:
		}
	}
}
