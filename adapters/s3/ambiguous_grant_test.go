package s3fence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestAcquireEndingAfterALostGrantReportsUnknown (HAZARDS 3): an Acquire's
// grant PUT lands, its answer is lost, and the caller's context ends then.
// The grant may be the caller's, so Acquire reports fence.ErrUnknown with the
// context's error, not fence.ErrHeld (held by another). The grant is given
// back in the background: another acquirer is granted the name well within
// its ttl.
func TestAcquireEndingAfterALostGrantReportsUnknown(t *testing.T) {
	faultServers(t, testAcquireEndingAfterALostGrant)
}

func testAcquireEndingAfterALostGrant(t *testing.T, e *s3env, f *faults) {
	a, b := newAcquirer(t, e), newAcquirer(t, e)
	ctx := context.Background()
	const ttl = 60 * time.Second
	name := fencetest.Name("unknown-acquire")
	// The lock object exists and is free: the next PUT is the grant's.
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}

	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	f.mu.Lock()
	f.afterDrop = cancel // the grant landed, its answer is lost, the wait ends
	f.mu.Unlock()
	defer func() { f.mu.Lock(); f.afterDrop = nil; f.mu.Unlock() }()
	f.inject("drop-response")
	got, err := a.Acquire(cctx, name, ttl)
	if err == nil {
		_ = got.Release(ctx)
		t.Fatalf("Acquire granted token %d with its context cancelled", got.Token())
	}
	if !errors.Is(err, fence.ErrUnknown) || !errors.Is(err, context.Canceled) {
		t.Errorf("Acquire whose grant's answer was lost as its context ended: %v; want fence.ErrUnknown and context.Canceled", err)
	}
	if errors.Is(err, fence.ErrHeld) {
		t.Errorf("Acquire whose grant may have landed reports the name held by another: %v", err)
	}

	wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
	defer wcancel()
	lb, err := b.Acquire(wctx, name, ttl)
	if err != nil {
		t.Fatalf("after the abandoned grant: %v (the ttl is %v)", err, ttl)
	}
	_ = lb.Release(ctx)
}
