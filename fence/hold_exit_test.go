package fence_test

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// TestHoldReleasesWhenWorkExitsItsGoroutine: work ends its goroutine with
// runtime.Goexit, as t.FailNow (t.Fatal, require.NoError) does inside a
// work function. Hold's deferred calls run, so the lease must be released
// as after a return or a panic: a lease left behind keeps the lock from
// every other process for a whole ttl (30s here).
func TestHoldReleasesWhenWorkExitsItsGoroutine(t *testing.T) {
	a := sqliteAcquirer(t)
	f := &faulty{Acquirer: a}
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		_ = fence.Hold(context.Background(), f, "job", 30*time.Second, func(ctx context.Context, l fence.Lease) error {
			runtime.Goexit()
			return nil
		})
	}()
	select {
	case <-exited:
	case <-time.After(hangGuard):
		t.Fatal("Hold's goroutine never ended after work called runtime.Goexit")
	}
	if n := f.releases.Load(); n != 1 {
		t.Errorf("lease released %d times after work called runtime.Goexit, want 1", n)
	}
	l, err := a.TryAcquire(context.Background(), "job", time.Second)
	if err != nil {
		t.Fatalf("lock still held after Hold's work called runtime.Goexit: %v", err)
	}
	_ = l.Release(context.Background())
}

// TestHoldReportsLossSeenByWorkAtItsLastStep: the lease's renewals fail
// (transient errors) until its local deadline passes; work notices the
// lease's context is done and returns nil at once. The backend still holds
// the row (its expiry is later than the holder's local deadline), so
// Release succeeds. The lease ended while work ran: Hold's result must match
// ErrLost, whatever the order in which Hold's own goroutines saw the end.
func TestHoldReportsLossSeenByWorkAtItsLastStep(t *testing.T) {
	a := sqliteAcquirer(t)
	const rounds = 20
	missed := 0
	for i := range rounds {
		f := &faulty{Acquirer: a, renewErr: errors.New("renewal timed out")}
		f.failing.Store(true)
		err := fence.Hold(context.Background(), f, "job", ttl, func(ctx context.Context, l fence.Lease) error {
			select {
			case <-l.Context().Done():
			case <-time.After(hangGuard):
				return errors.New("lease never ended")
			}
			return nil // the last step saw the lease end and stopped
		})
		if !errors.Is(err, fence.ErrLost) {
			missed++
			t.Logf("round %d: Hold = %v after its lease ended while work ran", i, err)
		}
	}
	if missed > 0 {
		t.Errorf("%d of %d Holds returned without ErrLost although the lease's local deadline passed while work ran", missed, rounds)
	}
}
