package fence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// waitFor waits until cond holds, checking every few milliseconds; false
// after hangGuard.
func waitFor(cond func() bool) bool {
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	limit := time.After(hangGuard)
	for !cond() {
		select {
		case <-tick.C:
		case <-limit:
			return false
		}
	}
	return true
}

// TestHoldStopsRenewingWhenWorkPanics: work panics after Hold has renewed
// its lease, and the release fails. Once Hold has re-raised the panic, no
// renewal is sent: the lease is left to expire on the backend, not kept
// alive for a work that is gone.
func TestHoldStopsRenewingWhenWorkPanics(t *testing.T) {
	const ttl = 300 * time.Millisecond // renewals every 100ms
	f := &faulty{Acquirer: sqliteAcquirer(t), releaseErr: errors.New("release failed")}
	func() {
		defer func() {
			if recover() == nil {
				t.Error("panic swallowed")
			}
		}()
		_ = fence.Hold(context.Background(), f, "job", ttl, func(ctx context.Context, l fence.Lease) error {
			if !waitFor(func() bool { return f.renewed.Load() >= 1 }) {
				t.Error("the lease was never renewed")
			}
			panic("work panicked")
		})
	}()
	after := f.renews.Load()
	// A window of two ttls: six renewals would be due in it.
	<-time.After(2 * ttl)
	if n := f.renews.Load() - after; n != 0 {
		t.Errorf("%d renewals after Hold re-raised the work's panic, want none", n)
	}
}

// TestNestedHoldReportsItsOwnLease: a Hold runs inside another Hold's work,
// and the outer lease is lost while the inner work runs. The inner work's
// context ends with the outer loss as its cause, but the inner lease was
// healthy and released: the inner Hold returns nil, not ErrLost.
func TestNestedHoldReportsItsOwnLease(t *testing.T) {
	a := sqliteAcquirer(t)
	outer := &faulty{Acquirer: a, renewErr: fence.ErrLost}
	inner := &faulty{Acquirer: a}
	var innerErr, innerCause error
	outerErr := fence.Hold(context.Background(), outer, "outer", 600*time.Millisecond, func(ctx context.Context, _ fence.Lease) error {
		innerErr = fence.Hold(ctx, inner, "inner", 30*time.Second, func(ctx context.Context, _ fence.Lease) error {
			outer.failing.Store(true) // the outer lease's next renewal finds it lost
			if err := awaitCancel(ctx); err != nil {
				return err
			}
			innerCause = context.Cause(ctx)
			return nil
		})
		return nil
	})
	if !errors.Is(outerErr, fence.ErrLost) {
		t.Errorf("outer Hold = %v, want ErrLost", outerErr)
	}
	if !errors.Is(innerCause, fence.ErrLost) {
		t.Errorf("inner work's context cause = %v, want the outer lease's ErrLost", innerCause)
	}
	if innerErr != nil {
		t.Errorf("inner Hold = %v, want nil: its own lease was kept and released", innerErr)
	}
	if inner.releases.Load() != 1 {
		t.Errorf("inner lease released %d times, want 1", inner.releases.Load())
	}
	if l, err := a.TryAcquire(context.Background(), "inner", time.Second); err != nil {
		t.Errorf("inner lease still held after its Hold returned: %v", err)
	} else {
		_ = l.Release(context.Background())
	}
}
