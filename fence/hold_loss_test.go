package fence_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// TestHoldReleaseInsideWorkIsNotALoss: work finishes early and gives the
// lease back itself with l.Release, which succeeds (the lease was held, the
// row is deleted). Nothing was lost: the lease's context ended because its
// holder released it (cause context.Canceled), not because it expired or a
// renewal found it gone. Hold must not report ErrLost, neither through its
// loss hook (the lease's context ended while work ran) nor through its own
// Release afterwards (which finds the lease already released).
func TestHoldReleaseInsideWorkIsNotALoss(t *testing.T) {
	a := sqliteAcquirer(t)
	var relErr, cause error
	err := fence.Hold(context.Background(), a, "job", 30*time.Second, func(ctx context.Context, l fence.Lease) error {
		relErr = l.Release(ctx)
		cause = context.Cause(l.Context())
		return relErr
	})
	if relErr != nil {
		t.Fatalf("work's own Release = %v, want nil (the lease was held)", relErr)
	}
	if errors.Is(cause, fence.ErrLost) {
		t.Fatalf("lease context cause after a successful Release = %v; want context.Canceled", cause)
	}
	if errors.Is(err, fence.ErrLost) {
		t.Errorf("Hold = %v after work released its lease itself (Release returned nil): a loss that did not happen", err)
	}
	if l, err := a.TryAcquire(context.Background(), "job", time.Second); err != nil {
		t.Errorf("lock held after work released it and Hold returned: %v", err)
	} else {
		_ = l.Release(context.Background())
	}
}

// TestHoldReleaseInsideWorkDoesNotCancelWorkAsLost: after work released
// the lease itself, the work's context (the one Hold passed) must not end
// with cause ErrLost: the work may go on with steps that need no lease, and
// a cause ErrLost tells it that another holder may have the name because its
// own lease expired.
func TestHoldReleaseInsideWorkDoesNotCancelWorkAsLost(t *testing.T) {
	a := sqliteAcquirer(t)
	var workCause error
	_ = fence.Hold(context.Background(), a, "job", 30*time.Second, func(ctx context.Context, l fence.Lease) error {
		if err := l.Release(ctx); err != nil {
			return err
		}
		// Give Hold's loss hook time to run if it is going to.
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
		workCause = context.Cause(ctx)
		return nil
	})
	if errors.Is(workCause, fence.ErrLost) {
		t.Errorf("work's context cause after work released its own lease = %v; want no ErrLost (nothing was lost)", workCause)
	}
}

// hangRenew wraps an acquirer: once hanging is set, its leases' Renew
// calls stall until their context ends (a link that went silent), then
// return the context's error, a transient failure. entered counts the Renew
// calls made while hanging.
type hangRenew struct {
	fence.Acquirer
	hanging atomic.Bool
	entered atomic.Int32
}

type hangLease struct {
	fence.Lease
	h *hangRenew
}

func (h *hangRenew) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	l, err := h.Acquirer.Acquire(ctx, name, ttl)
	if err != nil {
		return nil, err
	}
	return &hangLease{l, h}, nil
}

func (l *hangLease) LocalDeadline() time.Time {
	return l.Lease.(interface{ LocalDeadline() time.Time }).LocalDeadline()
}

func (l *hangLease) Renew(ctx context.Context) error {
	if !l.h.hanging.Load() {
		return l.Lease.Renew(ctx)
	}
	l.h.entered.Add(1)
	<-ctx.Done()
	return ctx.Err()
}

// TestHoldWorkDoneInTimeIsNotALossWhileARenewalHangs: the link goes silent,
// so Hold's renewals stall until their own timeout (ttl/3). Work finishes
// while the lease is still well inside its local deadline (more than 250ms
// left of 1.5s) and returns nil while a renewal is stalled. The lease was held
// for all of the work: Hold must report no loss, and must release promptly
// rather than wait out the stalled renewal (waiting lets the local deadline,
// and then the backend's expiry, pass after the work was done, and then
// reports ErrLost for a lease that was held all the time work ran).
func TestHoldWorkDoneInTimeIsNotALossWhileARenewalHangs(t *testing.T) {
	const ttl = 1500 * time.Millisecond // renewals every 500ms, each bounded by 500ms
	h := &hangRenew{Acquirer: sqliteAcquirer(t)}
	var left time.Duration
	var returned time.Time
	err := fence.Hold(context.Background(), h, "job", ttl, func(ctx context.Context, l fence.Lease) error {
		h.hanging.Store(true)
		// Wait for the second stalled renewal (the retry after the first
		// timed out): it is in flight until about 1.6s, past the local
		// deadline (about 1.48s).
		if !waitFor(func() bool { return h.entered.Load() >= 2 }) {
			return errors.New("no second renewal")
		}
		left = time.Until(l.(interface{ LocalDeadline() time.Time }).LocalDeadline())
		if ctx.Err() != nil {
			return errors.New("work cancelled before it returned")
		}
		returned = time.Now()
		return nil
	})
	took := time.Since(returned)
	if left < 250*time.Millisecond {
		t.Skipf("work returned only %v before the local deadline: the machine is too slow for this test", left)
	}
	t.Logf("work returned %v before the lease's local deadline; Hold returned %v after work", left, took)
	if errors.Is(err, fence.ErrLost) {
		t.Errorf("Hold = %v, though work returned %v before the lease's local deadline: the loss came from Hold waiting %v for a stalled renewal after work was done", err, left, took)
	}
	if took > left {
		t.Errorf("Hold returned %v after work returned, past the lease's local deadline (%v after): it waited for a stalled renewal before releasing", took, left)
	}
}
