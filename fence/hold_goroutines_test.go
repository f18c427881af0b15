package fence_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// TestHoldLeavesNoGoroutineBehind: after Hold ends by every path (work
// returns nil or an error, panics with a value, with nil or with an error
// matching ErrLost, calls runtime.Goexit, its lease is lost, its parent ctx
// is cancelled), no goroutine it started is left (renewal loop, loss
// watcher), and the lock is free again at once. Real SQLite leases.
func TestHoldLeavesNoGoroutineBehind(t *testing.T) {
	a := sqliteAcquirer(t)
	// Warm the pool up: the database's own goroutines are not Hold's.
	if err := fence.Hold(context.Background(), a, "warm", time.Second, func(context.Context, fence.Lease) error { return nil }); err != nil {
		t.Fatal(err)
	}
	lostErr := fmt.Errorf("work gave up: %w", fence.ErrLost)
	paths := []struct {
		name  string
		f     func(f *faulty, ctx context.Context, cancel context.CancelFunc, l fence.Lease) error
		panic bool
	}{
		{name: "returns nil", f: func(*faulty, context.Context, context.CancelFunc, fence.Lease) error { return nil }},
		{name: "returns an error", f: func(*faulty, context.Context, context.CancelFunc, fence.Lease) error {
			return errors.New("work failed")
		}},
		{name: "panics", panic: true, f: func(*faulty, context.Context, context.CancelFunc, fence.Lease) error { panic("boom") }},
		{name: "panics with nil", panic: true, f: func(*faulty, context.Context, context.CancelFunc, fence.Lease) error { panic(nil) }},
		{name: "panics with ErrLost", panic: true, f: func(*faulty, context.Context, context.CancelFunc, fence.Lease) error { panic(lostErr) }},
		{name: "panics during a renewal", panic: true, f: func(f *faulty, ctx context.Context, _ context.CancelFunc, _ fence.Lease) error {
			waitFor(func() bool { return f.renews.Load() >= 1 })
			panic("boom while renewing")
		}},
		{name: "calls Goexit", f: func(*faulty, context.Context, context.CancelFunc, fence.Lease) error { runtime.Goexit(); return nil }},
		{name: "lease lost", f: func(f *faulty, ctx context.Context, _ context.CancelFunc, _ fence.Lease) error {
			f.failing.Store(true)
			return awaitCancel(ctx)
		}},
		{name: "parent cancelled", f: func(_ *faulty, ctx context.Context, cancel context.CancelFunc, _ fence.Lease) error {
			cancel()
			return awaitCancel(ctx)
		}},
	}
	for _, p := range paths {
		before := runtime.NumGoroutine()
		f := &faulty{Acquirer: a, renewErr: fence.ErrLost}
		ctx, cancel := context.WithCancel(context.Background())
		ended := make(chan bool) // whether Hold panicked
		go func() {
			panicked := false
			defer func() { ended <- panicked }()
			defer func() {
				if r := recover(); r != nil {
					panicked = true
				}
			}()
			_ = fence.Hold(ctx, f, "job", 300*time.Millisecond, func(ctx context.Context, l fence.Lease) error {
				return p.f(f, ctx, cancel, l)
			})
		}()
		var got bool
		select {
		case got = <-ended:
		case <-time.After(hangGuard):
			t.Fatalf("%s: Hold never ended", p.name)
		}
		cancel()
		if got != p.panic {
			t.Errorf("%s: Hold panicked: %v, want %v", p.name, got, p.panic)
		}
		if !waitFor(func() bool { return runtime.NumGoroutine() <= before }) {
			buf := make([]byte, 1<<16)
			t.Errorf("%s: %d goroutines after Hold ended, %d before:\n%s", p.name, runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
		}
		l, err := a.TryAcquire(context.Background(), "job", time.Second)
		if err != nil {
			t.Errorf("%s: lock still held after Hold ended: %v", p.name, err)
			continue
		}
		_ = l.Release(context.Background())
	}
}
