package fence_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
)

// The Hold tests run on a real SQLite lease table, with faults injected by
// wrapping the acquirer's leases.

func sqliteAcquirer(t *testing.T) *sqlfence.Acquirer {
	t.Helper()
	db, err := sqlfence.OpenSQLite(filepath.Join(t.TempDir(), "hold.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	a, err := sqlfence.NewAcquirer(sqlfence.SQLite(db), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.CreateTable(context.Background()); err != nil {
		t.Fatal(err)
	}
	return a
}

// faulty wraps an acquirer; its leases fail Renew with renewErr while failing is set.
type faulty struct {
	fence.Acquirer
	failing  atomic.Bool
	renewErr error
	renews   atomic.Int32
	releases atomic.Int32
}

type faultyLease struct {
	fence.Lease
	f *faulty
}

func (f *faulty) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	l, err := f.Acquirer.Acquire(ctx, name, ttl)
	if err != nil {
		return nil, err
	}
	return &faultyLease{l, f}, nil
}

func (l *faultyLease) Renew(ctx context.Context) error {
	l.f.renews.Add(1)
	if l.f.failing.Load() {
		return l.f.renewErr
	}
	return l.Lease.Renew(ctx)
}

func (l *faultyLease) Release(ctx context.Context) error {
	l.f.releases.Add(1)
	return l.Lease.Release(ctx)
}

const ttl = 150 * time.Millisecond

func TestHoldKeepsLeaseAndReleases(t *testing.T) {
	f := &faulty{Acquirer: sqliteAcquirer(t)}
	err := fence.Hold(context.Background(), f, "job", ttl, func(ctx context.Context, l fence.Lease) error {
		select {
		case <-time.After(4 * ttl):
			return nil
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	})
	if err != nil {
		t.Fatalf("Hold: %v", err)
	}
	if n := f.renews.Load(); n < 3 {
		t.Errorf("%d renewals over 4 ttl, want at least 3 (every ttl/3)", n)
	}
	if n := f.releases.Load(); n != 1 {
		t.Errorf("%d releases, want 1", n)
	}
}

func TestHoldCancelsWorkWhenLeaseLost(t *testing.T) {
	a := sqliteAcquirer(t)
	f := &faulty{Acquirer: a}
	var cause error
	start := time.Now()
	err := fence.Hold(context.Background(), f, "job", ttl, func(ctx context.Context, l fence.Lease) error {
		// Someone takes the lease over: expire it by waiting with renewals
		// failing transiently, then let the next renewal reach the server.
		f.renewErr = errors.New("injected: connection reset")
		f.failing.Store(true)
		<-ctx.Done()
		cause = context.Cause(ctx)
		return errors.New("work stopped")
	})
	if !errors.Is(cause, fence.ErrLost) {
		t.Errorf("work context cause = %v, want ErrLost", cause)
	}
	if !errors.Is(err, fence.ErrLost) {
		t.Errorf("Hold returned %v, want an error matching ErrLost", err)
	}
	if err == nil || !containsText(err, "work stopped") {
		t.Errorf("Hold returned %v, want the work's error too", err)
	}
	// Transient errors were retried until the local deadline passed.
	if n := f.renews.Load(); n < 2 {
		t.Errorf("%d renewal attempts before giving up, want retries", n)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("work was cancelled only after %v", d)
	}
	// The lease is free for the next holder, with a larger token.
	l, err := a.TryAcquire(context.Background(), "job", ttl)
	if err != nil {
		t.Fatalf("after the loss: %v", err)
	}
	_ = l.Release(context.Background())
}

func TestHoldStopsOnErrLost(t *testing.T) {
	f := &faulty{Acquirer: sqliteAcquirer(t), renewErr: fence.ErrLost}
	f.failing.Store(true)
	renewsAtCancel := int32(-1)
	err := fence.Hold(context.Background(), f, "job", 3*time.Second, func(ctx context.Context, l fence.Lease) error {
		<-ctx.Done()
		renewsAtCancel = f.renews.Load()
		return nil
	})
	if !errors.Is(err, fence.ErrLost) {
		t.Fatalf("Hold = %v, want ErrLost", err)
	}
	if renewsAtCancel != 1 {
		t.Errorf("work cancelled after %d renewals, want right after the first one returned ErrLost", renewsAtCancel)
	}
}

func TestHoldReturnsWorkError(t *testing.T) {
	f := &faulty{Acquirer: sqliteAcquirer(t)}
	boom := errors.New("boom")
	err := fence.Hold(context.Background(), f, "job", time.Second, func(context.Context, fence.Lease) error { return boom })
	if !errors.Is(err, boom) || errors.Is(err, fence.ErrLost) {
		t.Fatalf("Hold = %v, want boom alone", err)
	}
	if f.releases.Load() != 1 {
		t.Error("lease not released after the work failed")
	}
}

func TestHoldReleasesOnPanic(t *testing.T) {
	a := sqliteAcquirer(t)
	func() {
		defer func() {
			if recover() == nil {
				t.Error("panic swallowed")
			}
		}()
		_ = fence.Hold(context.Background(), a, "job", 30*time.Second, func(context.Context, fence.Lease) error { panic("work panicked") })
	}()
	l, err := a.TryAcquire(context.Background(), "job", time.Second)
	if err != nil {
		t.Fatalf("lease still held after the work panicked: %v", err)
	}
	_ = l.Release(context.Background())
}

func TestHoldAcquireError(t *testing.T) {
	a := sqliteAcquirer(t)
	l, err := a.TryAcquire(context.Background(), "job", 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	ran := false
	err = fence.Hold(ctx, a, "job", time.Second, func(context.Context, fence.Lease) error { ran = true; return nil })
	if ran || !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Hold on a held lease: ran=%v err=%v", ran, err)
	}
}

func TestHoldParentCancel(t *testing.T) {
	f := &faulty{Acquirer: sqliteAcquirer(t)}
	ctx, cancel := context.WithCancel(context.Background())
	err := fence.Hold(ctx, f, "job", time.Second, func(ctx context.Context, l fence.Lease) error {
		cancel()
		<-ctx.Done()
		return ctx.Err()
	})
	if !errors.Is(err, context.Canceled) || errors.Is(err, fence.ErrLost) {
		t.Fatalf("Hold after parent cancel = %v, want context.Canceled alone", err)
	}
	if f.releases.Load() != 1 {
		t.Error("lease not released after the parent context was cancelled")
	}
}

func containsText(err error, s string) bool {
	return err != nil && strings.Contains(err.Error(), s)
}

func TestBackoffDelay(t *testing.T) {
	b := fence.Backoff{Min: time.Millisecond, Max: 8 * time.Millisecond}
	for attempt := 0; attempt < 40; attempt++ {
		ceil := time.Millisecond << min(attempt, 3)
		for i := 0; i < 200; i++ {
			if d := b.Delay(attempt); d < 0 || d > ceil {
				t.Fatalf("Delay(%d) = %v, want within [0, %v]", attempt, d, ceil)
			}
		}
	}
	// Full jitter: delays spread over the range instead of sitting at the cap.
	var low int
	for i := 0; i < 1000; i++ {
		if b.Delay(10) < 4*time.Millisecond {
			low++
		}
	}
	if low < 300 || low > 700 {
		t.Errorf("%d of 1000 delays below half the cap; want about half (full jitter)", low)
	}
}

func TestBackoffGivesUpAtMaxWait(t *testing.T) {
	b := fence.Backoff{MaxWait: 50 * time.Millisecond}
	var calls atomic.Int32
	_, err := b.Acquire(context.Background(), nil, func(context.Context) (fence.Lease, error) {
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

func TestBackoffWakesOnNotification(t *testing.T) {
	b := fence.Backoff{Min: 10 * time.Second, Max: 10 * time.Second}
	wake := make(chan struct{}, 1)
	var mu sync.Mutex
	free := false
	go func() {
		time.Sleep(20 * time.Millisecond)
		mu.Lock()
		free = true
		mu.Unlock()
		wake <- struct{}{}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	attempts := 0
	_, err := b.Acquire(ctx, wake, func(context.Context) (fence.Lease, error) {
		attempts++
		mu.Lock()
		defer mu.Unlock()
		if free {
			return nil, nil
		}
		return nil, fence.ErrHeld
	})
	// A 10s backoff would outlast ctx: only the wake-up can make this succeed.
	if err != nil {
		t.Fatalf("Acquire with a wake-up: %v after %d attempts", err, attempts)
	}
}

func TestBackoffPassesOtherErrors(t *testing.T) {
	boom := errors.New("boom")
	_, err := fence.Backoff{}.Acquire(context.Background(), nil, func(context.Context) (fence.Lease, error) { return nil, boom })
	if !errors.Is(err, boom) || errors.Is(err, fence.ErrHeld) {
		t.Fatalf("err = %v, want boom", err)
	}
}
