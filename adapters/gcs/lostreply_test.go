package gcsfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestReleaseLandedThenGranted: a release that landed but whose
// answer was lost, after which another grant took the lock before the
// releaser read it again, is not reported as ErrLost (the lease was never
// lost): nil or fence.ErrUnknown.
func TestReleaseLandedThenGranted(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	a, other := newAcquirer(t, e), newAcquirer(t, e)
	name := fencetest.Name("rel")
	l, err := a.TryAcquire(ctx, name, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var l2 fence.Lease
	var err2 error
	e.f.mu.Lock()
	e.f.afterApply = func() {
		e.f.mu.Lock()
		e.f.afterApply = nil
		e.f.mu.Unlock()
		l2, err2 = other.TryAcquire(ctx, name, 5*time.Second)
	}
	e.f.mu.Unlock()
	e.f.inject("drop-response")
	err = l.Release(ctx)
	if err2 != nil {
		t.Fatalf("the other grant after the release landed: %v", err2)
	}
	defer l2.Release(ctx)
	if errors.Is(err, fence.ErrLost) || (err != nil && !errors.Is(err, fence.ErrUnknown)) {
		t.Fatalf("Release whose upload landed (answer lost) = %v, want nil or ErrUnknown", err)
	}
}

// TestRenewUnconfirmed: a Renew whose every upload got a 5xx
// (each may have landed) returns an error matching fence.ErrUnknown, as its
// doc promises.
func TestRenewUnconfirmed(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	a, err := gcsfence.NewAcquirer(e.b(), &gcsfence.AcquirerOptions{MaxAttempts: 3})
	if err != nil {
		t.Fatal(err)
	}
	l, err := a.TryAcquire(ctx, fencetest.Name("renew"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	e.f.inject("apply-503", "apply-503", "apply-503")
	if err := l.Renew(ctx); !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("Renew through three 503s after applying = %v, want ErrUnknown", err)
	}
}

// TestAbandonedGrantFreed: a TryAcquire whose grant landed but
// whose answer was lost, and whose context ended right then, returns an error
// and frees the lock in the background: another contender gets it well
// before the ttl.
func TestAbandonedGrantFreed(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	a, other := newAcquirer(t, e), newAcquirer(t, e)
	name := fencetest.Name("aband")
	l, err := a.TryAcquire(ctx, name, time.Second) // creates the object
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	const ttl = 20 * time.Second
	gctx, cancel := context.WithCancel(ctx)
	e.f.mu.Lock()
	e.f.afterApply = func() { cancel() }
	e.f.mu.Unlock()
	e.f.inject("drop-response")
	if l, err := a.TryAcquire(gctx, name, ttl); err == nil {
		t.Fatalf("TryAcquire whose context ended after its upload landed returned lease %d", l.Token())
	}
	e.f.mu.Lock()
	e.f.afterApply = nil
	e.f.mu.Unlock()
	start := time.Now()
	actx, acancel := context.WithTimeout(ctx, 5*time.Second)
	defer acancel()
	l2, err := other.Acquire(actx, name, time.Second)
	if err != nil {
		t.Fatalf("Acquire after an abandoned grant: %v after %v (ttl %v)", err, time.Since(start), ttl)
	}
	t.Logf("granted %v after the abandoned grant", time.Since(start))
	_ = l2.Release(ctx)
}
