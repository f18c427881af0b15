package redislua_test

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
)

// TestGoroutinesEndAfterBusyStorm: many steps whose contexts end while
// Redis answers BUSY (tries, waits in line, renewals, releases, writes) leave
// work in the background (leaves and releases sent again). Once Redis is no
// longer busy, that work ends: the goroutine count comes back to where it
// was, and no name stays held.
func TestGoroutinesEndAfterBusyStorm(t *testing.T) {
	b := startBusyRedis(t)
	ctx := context.Background()
	a, err := redislua.NewAcquirer(b.c, nil)
	if err != nil {
		t.Fatal(err)
	}
	w, _ := redislua.NewWriter(b.c, nil)
	const n = 20
	names := make([]string, n)
	leases := make([]fence.Lease, n)
	for i := range names {
		names[i] = fencetest.Name("storm")
		if leases[i], err = a.TryAcquire(ctx, names[i], time.Minute); err != nil {
			t.Fatal(err)
		}
		if err := leases[i].Renew(ctx); err != nil { // every script loaded
			t.Fatal(err)
		}
	}
	if err := w.Write(ctx, "storm-key", []byte("v"), 1); err != nil {
		t.Fatal(err)
	}
	base := runtime.NumGoroutine()
	stop := b.busy(t)
	var wg sync.WaitGroup
	for i := range names {
		wg.Add(4)
		go func() { // a release, left to the background
			defer wg.Done()
			sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			defer cancel()
			// ErrUnknown when the context ended while a resend was in flight.
			if err := leases[i].Release(sctx); !errors.Is(err, redislua.ErrNotRun) && !errors.Is(err, fence.ErrUnknown) {
				t.Errorf("release while busy: %v, want ErrNotRun or ErrUnknown", err)
			}
		}()
		go func() { // a wait for a held name that ends
			defer wg.Done()
			sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			defer cancel()
			if l, err := a.Acquire(sctx, names[i], time.Minute); err == nil {
				t.Errorf("wait while busy granted %q", l.Name())
			}
		}()
		go func() { // a try for a new name
			defer wg.Done()
			sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			defer cancel()
			if l, err := a.TryAcquire(sctx, fencetest.Name("storm-try"), time.Minute); err == nil {
				t.Errorf("try while busy granted %q", l.Name())
			}
		}()
		go func() {
			defer wg.Done()
			sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			defer cancel()
			if err := w.Write(sctx, "storm-key", []byte("v2"), 2); !errors.Is(err, redislua.ErrNotRun) && !errors.Is(err, fence.ErrUnknown) {
				t.Errorf("write while busy: %v, want ErrNotRun or ErrUnknown", err)
			}
		}()
	}
	wg.Wait()
	during := runtime.NumGoroutine()
	stop()
	// The releases left to the background go through (paced: up to 2s apart).
	deadline := time.Now().Add(30 * time.Second)
	for _, name := range names {
		for b.admin.Exists(ctx, "fence:{"+name+"}:lock").Val() == 1 {
			if time.Now().After(deadline) {
				t.Fatalf("%q still held 30s after Redis stopped being busy", name)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	for runtime.NumGoroutine() > base+5 {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<16)
			t.Fatalf("goroutines: %d before the storm, %d right after, %d 30s after Redis stopped being busy:\n%s",
				base, during, runtime.NumGoroutine(), buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("goroutines: %d before, %d after the storm, %d at the end", base, during, runtime.NumGoroutine())
}

// TestRedlockWithOneNodeBusyForever: one of three Redlock nodes answers BUSY
// for the whole test. A try still gets a majority within its node timeout,
// the release frees the name on the other two (and returns nil), and the
// next try is granted a larger token.
func TestRedlockWithOneNodeBusyForever(t *testing.T) {
	b := startBusyRedis(t)
	n1, n2 := testenv.StartRedis(t), testenv.StartRedis(t)
	ctx := context.Background()
	r, err := redislua.NewRedlock([]redislua.Client{n1.Client(t), n2.Client(t), b.c}, nil)
	if err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("redlock-busy")
	warm, err := r.TryAcquire(ctx, fencetest.Name("warm"), time.Minute) // loads the scripts
	if err != nil {
		t.Fatal(err)
	}
	_ = warm.Release(ctx)
	b.busy(t)
	var last fence.Token
	for i := 0; i < 3; i++ {
		tctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		l, err := r.TryAcquire(tctx, name, 10*time.Second)
		cancel()
		if err != nil {
			t.Fatalf("try %d with one node busy: %v", i, err)
		}
		if l.Token() <= last {
			t.Errorf("token %d after %d", l.Token(), last)
		}
		last = l.Token()
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err = l.Release(rctx)
		cancel()
		if err != nil {
			t.Errorf("release %d with one node busy: %v", i, err)
		}
	}
}
