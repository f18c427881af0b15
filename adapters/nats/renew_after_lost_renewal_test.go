package natsfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestRenewAfterLostRenewalExtendsByTTL: a renewal lands but its reply is
// lost, and the holder is cut off for its RetryFor (ErrUnknown). Most of a
// ttl later, connected again, the holder renews and Renew returns nil. The
// Lease contract is that Renew extends the lease by its ttl on the backend's
// clock: the server must hold the name for about a ttl from that renewal,
// and the holder's context must stay live as long. A Renew that only
// recognises the earlier renewal's entry (nothing sent) and returns nil
// leaves the lease the few moments that earlier entry had left: the holder,
// connected and renewing, loses its lease right after a successful Renew,
// and another acquirer is granted.
func TestRenewAfterLostRenewalExtendsByTTL(t *testing.T) {
	ctx := context.Background()
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{RetryFor: 300 * time.Millisecond})
	other := newAcquirer(t, js(t), lockBucket, nil)
	name := fencetest.Name("renew-after-lost-renewal")
	const ttl = 6 * time.Second
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(lockBucket.Bucket))
	p.Refuse(true) // no reconnection within RetryFor: the renewal cannot tell
	err = l.Renew(ctx)
	waitLost(t, p, before)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a renewal whose reply was lost, cut off for its RetryFor: %v, want ErrUnknown", err)
	}
	// Most of a ttl between the two renewals is the case, not a wait for
	// an event.
	time.Sleep(4 * time.Second)
	p.Refuse(false)
	if err := l.Renew(ctx); err != nil {
		t.Fatalf("the renewal once connected again: %v", err)
	}
	renewed := time.Now()
	info, err := other.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	left := time.Until(l.(interface{ LocalDeadline() time.Time }).LocalDeadline())
	t.Logf("after a Renew that returned nil: server time left %v, local deadline in %v (ttl %v)", info.TimeLeft, left, ttl)
	// Half a ttl is far below what a renewal gives (a ttl less the drift)
	// and far above any scheduling delay.
	want := ttl / 2
	for time.Since(renewed) < want {
		lb, err := other.TryAcquire(ctx, name, ttl)
		if err == nil {
			_ = lb.Release(ctx)
			t.Fatalf("Renew returned nil, and %v later another acquirer was granted the name (the holder's context: %v); the server had left %v of the ttl %v after that renewal",
				time.Since(renewed).Round(time.Millisecond), context.Cause(l.Context()), info.TimeLeft.Round(time.Millisecond), ttl)
		}
		if !errors.Is(err, fence.ErrHeld) {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond) // the pace of the tries
	}
	if err := l.Context().Err(); err != nil {
		t.Fatalf("the holder's context ended %v after a Renew that returned nil (ttl %v): %v", time.Since(renewed).Round(time.Millisecond), ttl, context.Cause(l.Context()))
	}
}
