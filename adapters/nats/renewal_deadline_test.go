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

// TestRenewalRecognisedLaterCountsFromItsSend: a renewal lands but its reply
// is lost and it returns ErrUnknown; the next renewal, seconds later, finds
// that entry and returns nil. The server counts the entry's TTL from the
// first renewal, so the lease's local deadline must count from that
// renewal's send too: another acquirer is granted once the server expired the
// entry, and by then the holder's local deadline has passed.
func TestRenewalRecognisedLaterCountsFromItsSend(t *testing.T) {
	ctx := context.Background()
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.Options{RetryFor: 300 * time.Millisecond})
	other := newAcquirer(t, js(t), lockBucket, nil)
	name := fencetest.Name("renewlater")
	const ttl = 6 * time.Second
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(lockBucket.Bucket))
	p.Refuse(true) // no reconnection within RetryFor: the renewal cannot tell
	err = l.Renew(ctx)
	waitLost(t, p, before)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a renewal whose reply was lost, cut off for its RetryFor: %v, want ErrUnknown", err)
	}
	// The gap between the two renewals is the point of the case, not a wait
	// for an event.
	time.Sleep(2 * time.Second)
	p.Refuse(false)
	if err := l.Renew(ctx); err != nil {
		t.Fatalf("the next renewal, which finds the first one's entry: %v", err)
	}
	deadline := l.(interface{ LocalDeadline() time.Time }).LocalDeadline()
	var lb fence.Lease
	for giveUp := time.Now().Add(60 * time.Second); ; {
		lb, err = other.TryAcquire(ctx, name, ttl)
		if err == nil {
			break
		}
		if !errors.Is(err, fence.ErrHeld) || time.Now().After(giveUp) {
			t.Fatalf("another acquirer after the server expired the entry: %v", err)
		}
		time.Sleep(20 * time.Millisecond) // the pace of the tries
	}
	granted := time.Now()
	defer lb.Release(ctx)
	if deadline.After(granted) {
		t.Fatalf("two holders: B was granted while A's local deadline was still %v away (it counted from the later renewal's send)", deadline.Sub(granted))
	}
}
