package leasekit_test

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
)

// TestSentWithoutMonotonicReading: a send time stripped of its
// monotonic reading is re-anchored, so the context still ends at the local
// deadline; one that the wall clock puts after now (as after the wall clock
// stepped back an hour since the send) ends the lease at once, instead of an
// hour late.
func TestSentWithoutMonotonicReading(t *testing.T) {
	const ttl = 300 * time.Millisecond
	start := time.Now()
	b := leasekit.New("n", 1, ttl, 0, start.Round(0))
	if b.Context().Err() != nil {
		t.Fatalf("a stripped send time just now ended the lease at once: %v", context.Cause(b.Context()))
	}
	select {
	case <-b.Context().Done():
	case <-time.After(ttl + 10*time.Second):
		t.Fatal("a lease granted with a stripped send time did not end")
	}
	if got := time.Since(start); got < ttl-leasekit.DefaultDrift(ttl) {
		t.Errorf("ended after %v, before its local deadline", got)
	}
	if !errors.Is(context.Cause(b.Context()), fence.ErrLost) {
		t.Errorf("cause %v, want ErrLost", context.Cause(b.Context()))
	}

	// The wall clock read an hour ahead at the send, then stepped back.
	stepped := leasekit.New("n", 2, time.Minute, 0, time.Now().Round(0).Add(time.Hour))
	select {
	case <-stepped.Context().Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a send time an hour ahead on the wall clock kept the lease alive")
	}
	if !errors.Is(context.Cause(stepped.Context()), fence.ErrLost) {
		t.Errorf("cause %v, want ErrLost", context.Cause(stepped.Context()))
	}
	if stepped.Extend(time.Now()) {
		t.Error("Extend revived a lease that had ended")
	}
	stepped.End(context.Canceled) // no effect, no panic
}

// TestErrDoesNotWaitForTheTimer: a holder that checks its lease context's Err
// after the local deadline is told the lease is lost even when the timer that
// closes Done has not run yet (a loaded machine runs timers late). The lease
// below was sent a second ago for 100ms, so its deadline has passed when New
// returns; with one P and no scheduling point between New and Err, the timer's
// goroutine cannot have run.
func TestErrDoesNotWaitForTheTimer(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	for i := 0; i < 100; i++ {
		b := leasekit.New("n", 1, 100*time.Millisecond, 0, time.Now().Add(-time.Second))
		ctx := b.Context()
		if err := ctx.Err(); err == nil {
			t.Fatalf("round %d: Err() = nil a second after the grant of a 100ms lease", i)
		}
		if cause := context.Cause(ctx); !errors.Is(cause, fence.ErrLost) {
			t.Fatalf("round %d: cause %v, want fence.ErrLost", i, cause)
		}
		select {
		case <-ctx.Done():
		default:
			t.Fatalf("round %d: Err reported the loss but Done is open", i)
		}
	}
}

// TestSentInTheFuture: a send time after now cannot be the time a
// request was sent, with or without its monotonic reading (a time.Now() plus
// a duration, a time computed from another clock). Taking it as given puts
// the local deadline after the backend's expiry, by as much as it is ahead:
// the holder's context would outlive its lease. New ends such a lease at once
// and Extend leaves the deadline where it was, as for a stripped send time.
func TestSentInTheFuture(t *testing.T) {
	const ttl = 300 * time.Millisecond
	b := leasekit.New("n", 1, ttl, 0, time.Now().Add(time.Hour))
	select {
	case <-b.Context().Done():
	case <-time.After(10 * time.Second):
		t.Fatal("a send time an hour ahead (with its monotonic reading) kept a 300ms lease alive for 10s")
	}
	if !errors.Is(context.Cause(b.Context()), fence.ErrLost) {
		t.Errorf("cause %v, want ErrLost", context.Cause(b.Context()))
	}

	start := time.Now()
	e := leasekit.New("n", 2, ttl, 0, start)
	if !e.Extend(time.Now().Add(time.Hour)) {
		t.Fatal("Extend of a live lease returned false")
	}
	select {
	case <-e.Context().Done():
	case <-time.After(10 * time.Second):
		t.Fatal("an Extend with a send time an hour ahead kept a 300ms lease alive for 10s")
	}
}
