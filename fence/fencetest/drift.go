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
// error while the backend holds the name. The refusal must
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
	// mustTry asks again when the grant is given back as confirmed past its
	// one second of local life (ErrLost, seen on a loaded machine with
	// etcd and a 5s Drift); ErrHeld, the refusal leaving the name taken,
	// fails.
	l := mustTry(t, a, name, drift+time.Second)
	defer func() { _ = l.Release(ctx) }()
	if l.Context().Err() != nil {
		t.Fatalf("ttl %v under a %v Drift: granted with a context already done (%v)", drift+time.Second, drift, context.Cause(l.Context()))
	}
}
