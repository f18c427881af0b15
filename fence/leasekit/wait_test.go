package leasekit_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
)

func TestBackoffGivesUpAtMaxWait(t *testing.T) {
	b := fence.Backoff{MaxWait: 50 * time.Millisecond}
	var calls atomic.Int32
	_, err := leasekit.Acquire(context.Background(), b, nil, func(context.Context) (fence.Lease, error) {
		calls.Add(1)
		return nil, fence.ErrHeld
	})
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want ErrHeld and DeadlineExceeded", err)
	}
	if calls.Load() < 2 {
		t.Errorf("%d attempts, want retries", calls.Load())
	}
}

// TestBackoffWakesOnNotification: the lease frees itself after the first
// attempt was refused, and a notification says so. The backoff's delay is
// uniform in [0, 24h]: it ends within ctx's 5s once in 17280, so only the
// wake-up can make the second attempt in time.
func TestBackoffWakesOnNotification(t *testing.T) {
	b := fence.Backoff{Min: 24 * time.Hour, Max: 24 * time.Hour}
	wake := make(chan struct{}, 1)
	refused := make(chan struct{})
	var free atomic.Bool
	go func() {
		<-refused
		free.Store(true)
		wake <- struct{}{}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	attempts := 0
	_, err := leasekit.Acquire(ctx, b, wake, func(context.Context) (fence.Lease, error) {
		attempts++
		if free.Load() {
			return nil, nil
		}
		if attempts == 1 {
			close(refused)
		}
		return nil, fence.ErrHeld
	})
	if err != nil || attempts != 2 {
		t.Fatalf("Acquire with a wake-up: %v after %d attempts, want granted at the second", err, attempts)
	}
}

func TestBackoffPassesOtherErrors(t *testing.T) {
	boom := errors.New("boom")
	_, err := leasekit.Acquire(context.Background(), fence.Backoff{}, nil, func(context.Context) (fence.Lease, error) { return nil, boom })
	if !errors.Is(err, boom) || errors.Is(err, fence.ErrHeld) {
		t.Fatalf("err = %v, want boom", err)
	}
}
