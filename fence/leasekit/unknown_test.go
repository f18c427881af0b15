package leasekit_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
)

// TestAcquireReportsUnknownWhenTheWaitEndsInAnAmbiguousTry: the wait's
// deadline passes while a try's grant request is in flight, and the try
// cannot tell whether it landed. Acquire reports ErrUnknown with the
// deadline, never ErrHeld: the grant may be this caller's.
func TestAcquireReportsUnknownWhenTheWaitEndsInAnAmbiguousTry(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := leasekit.Acquire(ctx, fence.Backoff{}, nil, func(ctx context.Context) (fence.Lease, error) {
		<-ctx.Done() // the reply never came
		return nil, fmt.Errorf("grant sent, no reply: %w: %w", fence.ErrUnknown, ctx.Err())
	})
	if !errors.Is(err, fence.ErrUnknown) || !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, fence.ErrHeld) {
		t.Fatalf("Acquire = %v, want ErrUnknown and DeadlineExceeded, not ErrHeld", err)
	}
}

// TestAcquireKeepsAnEarlierUnknownOutcome: the first try's outcome is
// unknown (its error matches ErrHeld too, so the wait goes on), and every
// later try finds the lock held, which may be by that first grant. When the
// wait ends, Acquire reports ErrUnknown, not ErrHeld. A later grant settles
// it.
func TestAcquireKeepsAnEarlierUnknownOutcome(t *testing.T) {
	ambiguous := fmt.Errorf("grant reply lost, lock found held: %w", errors.Join(fence.ErrHeld, fence.ErrUnknown))
	b := fence.Backoff{Min: time.Millisecond, Max: 5 * time.Millisecond, MaxWait: 100 * time.Millisecond}
	tries := 0
	_, err := leasekit.Acquire(context.Background(), b, nil, func(context.Context) (fence.Lease, error) {
		tries++
		if tries == 1 {
			return nil, ambiguous
		}
		return nil, fence.ErrHeld
	})
	if tries < 2 {
		t.Fatalf("%d tries, want the wait to go on after the first", tries)
	}
	if !errors.Is(err, fence.ErrUnknown) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Acquire after an unknown try then refusals = %v, want ErrUnknown and DeadlineExceeded", err)
	}

	a := memAcquirer{&memBackend{locks: map[string]*memLock{}}}
	tries = 0
	l, err := leasekit.Acquire(context.Background(), b, nil, func(ctx context.Context) (fence.Lease, error) {
		tries++
		if tries == 1 {
			return nil, ambiguous
		}
		return a.TryAcquire(ctx, "n", time.Second)
	})
	if err != nil || l == nil {
		t.Errorf("Acquire granted after an unknown try = %v, %v; want the lease", l, err)
	}
}

// TestAcquireKeepsAnEarlierUnknownOutcomeWhenALaterTryFails: the first try's
// grant reply was lost (its error matches ErrUnknown, and ErrHeld, so the
// wait goes on); the next try fails outright (the connection refused). The
// first grant may still have landed and hold the lock for its ttl: Acquire's
// error must still match ErrUnknown, not only the last try's failure.
func TestAcquireKeepsAnEarlierUnknownOutcomeWhenALaterTryFails(t *testing.T) {
	ambiguous := fmt.Errorf("grant reply lost, lock found held: %w", errors.Join(fence.ErrHeld, fence.ErrUnknown))
	refused := errors.New("dial tcp 127.0.0.1:6379: connection refused")
	b := fence.Backoff{Min: time.Millisecond, Max: 5 * time.Millisecond, MaxWait: time.Minute}
	tries := 0
	_, err := leasekit.Acquire(context.Background(), b, nil, func(context.Context) (fence.Lease, error) {
		tries++
		if tries == 1 {
			return nil, ambiguous
		}
		return nil, refused
	})
	if tries != 2 {
		t.Fatalf("%d tries, want 2", tries)
	}
	if !errors.Is(err, refused) || !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("Acquire after an unknown try then a failed one = %v, want the failure and ErrUnknown", err)
	}
}

// TestAcquireWithADoneContextMakesNoTry: Acquire's documentation says a ctx
// already done gives up before the first call to try, with ErrHeld and the
// context's error.
func TestAcquireWithADoneContextMakesNoTry(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	tries := 0
	_, err := leasekit.Acquire(ctx, fence.Backoff{}, nil, func(context.Context) (fence.Lease, error) {
		tries++
		return nil, fence.ErrHeld
	})
	if tries != 0 {
		t.Errorf("%d calls to try with a ctx already done, want none", tries)
	}
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.Canceled) {
		t.Errorf("Acquire with a ctx already done = %v, want ErrHeld and context.Canceled", err)
	}
}
