package fencetest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// DriftRefusesShortTTL checks an acquirer made with the drift margin drift
// (an adapter option, so not a suite case): a ttl not longer than drift leaves
// no local validity, so TryAcquire and Acquire must refuse it with ErrInvalid
// naming arg, and not grant a lease whose context is already done with a nil
// error while the backend holds the name (HAZARDS 6, 8). The refusal must
// leave the name free: a ttl of drift plus a second is then granted at once,
// with a live context. drift must be at least the backend's smallest ttl.
func DriftRefusesShortTTL(t *testing.T, a fence.Acquirer, drift time.Duration, arg string) {
	t.Helper()
	ctx := context.Background()
	name := Name("drift")
	for _, acquire := range []struct {
		op string
		f  func(context.Context, string, time.Duration) (fence.Lease, error)
	}{{"TryAcquire", a.TryAcquire}, {"Acquire", a.Acquire}} {
		l, err := acquire.f(ctx, name, drift)
		var ie *fence.InvalidError
		if !errors.As(err, &ie) || ie.Arg != arg {
			if err == nil {
				_ = l.Release(ctx)
			}
			t.Errorf("%s with ttl %v under a %v Drift: %v, %v; want ErrInvalid naming %s", acquire.op, drift, drift, l, err, arg)
		}
	}
	l, err := a.TryAcquire(ctx, name, drift+time.Second)
	for try := 1; errors.Is(err, fence.ErrLost) && try < 3; try++ {
		// Confirmed past its one second of local life and given back, as
		// fence.Acquirer allows (never for a held name: the name was
		// free). A loaded machine (L6 on 7706196: etcd, 5s Drift): again.
		t.Logf("TryAcquire with ttl %v under a %v Drift: %v; again", drift+time.Second, drift, err)
		l, err = a.TryAcquire(ctx, name, drift+time.Second)
	}
	if err != nil {
		t.Fatalf("TryAcquire with ttl %v under a %v Drift, after the refusals: %v", drift+time.Second, drift, err)
	}
	defer func() { _ = l.Release(ctx) }()
	if l.Context().Err() != nil {
		t.Fatalf("ttl %v under a %v Drift: granted with a context already done (%v)", drift+time.Second, drift, context.Cause(l.Context()))
	}
}
