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

// TestRenewLostReplyThenDeadlinePassesGivesBack: a renewal sent halfway
// through the lease lands, but its reply is lost and the client cannot
// reconnect until the lease's local deadline has passed. Renew reports the
// lease lost. The renewal's entry would hold the name for a fresh ttl that
// nobody holds: it is given back once the client is connected again, so
// another acquirer is granted long before that ttl runs out.
func TestRenewLostReplyThenDeadlinePassesGivesBack(t *testing.T) {
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Timeout: 200 * time.Millisecond})
	other := newAcquirer(t, js(t), lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute})
	ctx := context.Background()
	name := fencetest.Name("renew-lost-reply-deadline")
	const ttl = 5 * time.Second
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	// Half a ttl before the renewal is the case: its entry outlives the
	// grant's by as much.
	time.Sleep(ttl / 2)
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(lockBucket.Bucket))
	p.Refuse(true)
	err = l.Renew(ctx)
	waitLost(t, p, before)
	if !errors.Is(err, fence.ErrLost) {
		t.Fatalf("a renewal whose reply was lost, cut off past the local deadline: %v, want ErrLost", err)
	}
	p.Refuse(false)
	// The renewal's entry, if left, holds the name until about 2.5s from
	// here.
	wctx, cancel := context.WithTimeout(ctx, 1200*time.Millisecond)
	defer cancel()
	l2, err := other.Acquire(wctx, name, ttl)
	if err != nil {
		info, _ := other.Inspect(ctx, name)
		t.Fatalf("the name after the holder learnt its lease was lost: %v; the renewal that landed unconfirmed holds it for a fresh ttl nobody holds (server time left %v)", err, info.TimeLeft.Round(time.Millisecond))
	}
	_ = l2.Release(ctx)
}

// TestRenewReadAnsweredPastDeadlineSendsNothing: a renewal's read is held
// by a partition until the lease's local deadline has passed. Once healed,
// the read finds the lease's entry (the server's TTL, rounded up to whole
// seconds, has not run out yet); Renew returns fence.ErrLost and publishes
// nothing to the bucket: no renewal, and nothing to give back.
func TestRenewReadAnsweredPastDeadlineSendsNothing(t *testing.T) {
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Timeout: 10 * time.Second})
	ctx := context.Background()
	name := fencetest.Name("renew-read-past-deadline")
	// 2.5s is 3s on the server: the read is answered between the two.
	l, err := a.TryAcquire(ctx, name, 2500*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	p.Partition()
	renewed := make(chan error, 1)
	go func() { renewed <- l.Renew(ctx) }()
	<-l.Context().Done()
	p.DropRequest(publishTo(lockBucket.Bucket))
	p.Heal()
	if err := <-renewed; !errors.Is(err, fence.ErrLost) {
		t.Fatalf("a renewal whose read answered after the local deadline: %v, want ErrLost", err)
	}
	if p.Pending() == 0 {
		t.Fatal("Renew published to the bucket after the local deadline had passed")
	}
}

// TestRenewGiveBackBoundedByCallerContext: as in
// TestRenewLostReplyThenDeadlinePassesGivesBack, a renewal lands with its
// reply lost and the client is cut off past the local deadline, here with
// a long Timeout and a caller's context that ends just after that deadline.
// Renew returns fence.ErrLost at the context's end, not a Timeout or two
// past it, and the give-back still happens once the client is connected
// again: another acquirer is granted long before the renewal's ttl runs out.
func TestRenewGiveBackBoundedByCallerContext(t *testing.T) {
	j, p := proxied(t)
	const timeout = 2 * time.Second
	a := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Timeout: timeout})
	other := newAcquirer(t, js(t), lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute})
	ctx := context.Background()
	name := fencetest.Name("renew-giveback-ctx")
	const ttl = 5 * time.Second
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	// Half a ttl before the renewal is the case: its entry outlives the
	// grant's by as much.
	time.Sleep(ttl / 2)
	rctx, cancel := context.WithDeadline(ctx, l.(interface{ LocalDeadline() time.Time }).LocalDeadline().Add(100*time.Millisecond))
	defer cancel()
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(lockBucket.Bucket))
	p.Refuse(true)
	err = l.Renew(rctx)
	returned := time.Now()
	waitLost(t, p, before)
	if !errors.Is(err, fence.ErrLost) {
		t.Fatalf("a renewal whose reply was lost, cut off past the local deadline: %v, want ErrLost", err)
	}
	dl, _ := rctx.Deadline()
	if late := returned.Sub(dl); late > timeout/2 {
		t.Fatalf("Renew returned %v after its context's deadline (Timeout %v)", late.Round(time.Millisecond), timeout)
	}
	p.Refuse(false)
	// The renewal's entry, if left, holds the name until about 2.5s from
	// here.
	wctx, wcancel := context.WithTimeout(ctx, 1200*time.Millisecond)
	defer wcancel()
	l2, err := other.Acquire(wctx, name, ttl)
	if err != nil {
		info, _ := other.Inspect(ctx, name)
		t.Fatalf("the name after the holder learnt its lease was lost: %v; the renewal that landed unconfirmed holds it for a fresh ttl nobody holds (server time left %v)", err, info.TimeLeft.Round(time.Millisecond))
	}
	_ = l2.Release(ctx)
}
