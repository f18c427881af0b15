// Package linetest checks, against a real backend, how one acquirer grants
// the Acquire calls waiting in its line (internal/wakeup.Line): their order
// (Order), and the cases the object-store adapters share (cases.go).
package linetest

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// Order holds a fresh name with a's TryAcquire, queues 5 Acquire calls of a
// in a known order (waiting, with lineLen, until each is in the line before
// the next starts), then releases and at once asks again, as a worker's
// loop does. The grants must come in arrival order, the releasing holder
// last: without the line its first attempt takes the lock back before the
// waiters, which sleep in their backoff. ttl is each lease's.
func Order(t *testing.T, a fence.Acquirer, lineLen func(name string) int, ttl time.Duration) {
	t.Helper()
	ctx := context.Background()
	name := fencetest.Name("line")
	const workers, holder = 5, -1
	var (
		mu    sync.Mutex
		order []int
		wg    sync.WaitGroup
		errs  = make(chan error, workers+1)
	)
	granted := func(w int, l fence.Lease) {
		mu.Lock()
		order = append(order, w)
		mu.Unlock()
		if err := l.Release(ctx); err != nil {
			errs <- err
		}
	}
	first, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l, err := a.Acquire(ctx, name, ttl)
			if err != nil {
				errs <- err
				return
			}
			granted(w, l)
		}()
		Wait(t, lineLen, name, w+1) // worker w is in line before w+1 starts
	}
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	again, err := a.Acquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	granted(holder, again)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if want := []int{0, 1, 2, 3, 4, holder}; !slices.Equal(order, want) {
		t.Fatalf("grant order %v, want %v (arrival order; -1 is the holder that released and asked again)", order, want)
	}
	if n := lineLen(name); n != 0 {
		t.Fatalf("line has %d waiters after every Acquire returned", n)
	}
}

// Wait waits up to 20s until n Acquire calls wait in name's line.
func Wait(t *testing.T, lineLen func(name string) int, name string, n int) {
	t.Helper()
	waitLen(t, 20*time.Second, lineLen, name, n)
}

// waitLen waits up to d until n Acquire calls wait in name's line.
func waitLen(t *testing.T, d time.Duration, lineLen func(name string) int, name string, n int) {
	t.Helper()
	deadline := time.Now().Add(d)
	for lineLen(name) != n {
		if time.Now().After(deadline) {
			t.Fatalf("line of %q has %d waiters, want %d", name, lineLen(name), n)
		}
		time.Sleep(time.Millisecond)
	}
}
