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

// TestRenewSentPastDeadlineWithLostReplyDoesNotBlockName: a renewal's read
// is held by a partition until the lease's local deadline has passed. Once
// healed, the read finds the lease's entry (the server's TTL, rounded up to
// whole seconds, has not run out yet). Renew must not send a renewal now
// ("the local deadline has passed: nothing is sent"), and a renewal that
// lands after the local deadline is undone. Here the renewal is sent and
// lands, and its reply is lost: Renew reports the lease lost, and the name
// must still be free by the original grant's server expiry, not held for a
// fresh ttl by an entry nobody holds.
func TestRenewSentPastDeadlineWithLostReplyDoesNotBlockName(t *testing.T) {
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Timeout: 10 * time.Second})
	other := newAcquirer(t, js(t), lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute})
	ctx := context.Background()
	name := fencetest.Name("late-renew-lost-reply")
	// 2.5s is 3s on the server: the renewal is sent between the two.
	l, err := a.TryAcquire(ctx, name, 2500*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	p.Partition()
	renewed := make(chan error, 1)
	go func() { renewed <- l.Renew(ctx) }()
	<-l.Context().Done()
	deadlinePassed := time.Now()
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(lockBucket.Bucket))
	p.Heal()
	err = <-renewed
	t.Logf("Renew %v after the local deadline: %v", time.Since(deadlinePassed).Round(time.Millisecond), err)
	if !errors.Is(err, fence.ErrLost) && !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a renewal whose read answered after the local deadline: %v, want ErrLost", err)
	}
	sent := p.Pending() == 0 && p.Stats().LostReplies > before
	info, ierr := other.Inspect(ctx, name)
	t.Logf("renewal sent after the local deadline: %v; the server's lock after Renew returned: held %v, time left %v, %v", sent, info.Held, info.TimeLeft.Round(time.Millisecond), ierr)
	// The original grant expires on the server within about 0.5s of the
	// local deadline; a renewal sent after it, if left, ~3s after its send.
	wctx, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	defer cancel()
	l2, err := other.Acquire(wctx, name, 5*time.Second)
	if err != nil {
		t.Fatalf("the name after the holder learnt its lease was lost: %v; a renewal sent past the local deadline, whose reply was lost, holds it for a fresh ttl that nobody holds (server time left %v after Renew returned)", err, info.TimeLeft.Round(time.Millisecond))
	}
	_ = l2.Release(ctx)
}
