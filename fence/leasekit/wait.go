package leasekit

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// CheckBackoff returns b.Validate's *fence.InvalidError, for op, naming the
// field of b that is not valid. Call it in every constructor whose options
// hold a fence.Backoff.
func CheckBackoff(op string, b fence.Backoff) error {
	err := b.Validate()
	var ie *fence.InvalidError
	if errors.As(err, &ie) {
		return &fence.InvalidError{Op: op, Arg: ie.Arg, Reason: ie.Reason}
	}
	return err
}

// Acquire is the waiting loop that acquirers share, paced by b. It calls try
// until try returns a lease or an error that does not match fence.ErrHeld.
// Between calls it sleeps for b.Delay(attempt), or less when wake receives (a
// release notification; wake may be nil). It gives up at ctx's deadline, or
// after b.MaxWait when ctx has none, with an error matching fence.ErrHeld and
// the context error; or, when a try's error matched fence.ErrUnknown (a grant
// that may have landed), with that error joined with the context error. A try
// that fails with an error other than fence.ErrHeld ends the wait with that
// error, which also matches fence.ErrUnknown when an earlier try's did. A ctx already done gives up before the first call, so
// check the name and ttl before calling Acquire: bad input must be
// fence.ErrInvalid whatever the context (the suite's BadInput case checks).
func Acquire(ctx context.Context, b fence.Backoff, wake <-chan struct{}, try func(context.Context) (fence.Lease, error)) (fence.Lease, error) {
	return loop(ctx, b, wake, try, true)
}

// Retry is Acquire for a caller that has just tried and found the lease held:
// it waits (for b.Delay(0) or a wake-up) before its first call to try.
func Retry(ctx context.Context, b fence.Backoff, wake <-chan struct{}, try func(context.Context) (fence.Lease, error)) (fence.Lease, error) {
	return loop(ctx, b, wake, try, false)
}

// WithMaxWait returns ctx bounded by b.MaxWait (DefaultMaxWait when unset)
// when ctx has no deadline, with a cause that names the maximum wait; a ctx
// with a deadline is returned as it is. The waiting loop of an acquirer that
// does not use Acquire or Retry starts with it, so that it gives up as they
// do.
func WithMaxWait(ctx context.Context, b fence.Backoff) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	b = b.WithDefaults()
	return context.WithTimeoutCause(ctx, b.MaxWait,
		fmt.Errorf("fence: gave up after the maximum wait %v: %w", b.MaxWait, context.DeadlineExceeded))
}

func loop(ctx context.Context, b fence.Backoff, wake <-chan struct{}, try func(context.Context) (fence.Lease, error), tryFirst bool) (fence.Lease, error) {
	b = b.WithDefaults()
	ctx, cancel := WithMaxWait(ctx, b)
	defer cancel()
	// Since Go 1.23 a timer channel holds no stale value after Stop or Reset,
	// so one timer serves every attempt without draining.
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	// unknown is the first try's error that matched fence.ErrUnknown: that
	// grant may have landed, and no later refusal tells that it did not.
	var unknown error
	gaveUp := func() error {
		if unknown != nil {
			return errors.Join(unknown, context.Cause(ctx))
		}
		return errors.Join(fence.ErrHeld, context.Cause(ctx))
	}
	if ctx.Err() != nil {
		return nil, gaveUp()
	}
	for attempt := 0; ; attempt++ {
		if tryFirst || attempt > 0 {
			l, err := try(ctx)
			if err == nil {
				return l, nil
			}
			if unknown == nil && errors.Is(err, fence.ErrUnknown) {
				unknown = err
			}
			if !errors.Is(err, fence.ErrHeld) {
				if ctx.Err() != nil {
					return nil, gaveUp()
				}
				if unknown != nil && !errors.Is(err, fence.ErrUnknown) {
					// This try failed, but an earlier one may have been granted.
					return nil, fmt.Errorf("%w (an earlier try's outcome is unknown: %w)", err, unknown)
				}
				return nil, err
			}
		}
		timer.Reset(b.Delay(attempt))
		select {
		case <-ctx.Done():
			return nil, gaveUp()
		case <-wake:
			timer.Stop()
		case <-timer.C:
		}
	}
}
