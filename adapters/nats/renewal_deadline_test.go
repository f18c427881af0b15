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
	a := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{RetryFor: 300 * time.Millisecond})
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

// TestRenewalLostTwiceCountsFromTheFirstSend: a renewal lands but its reply
// is lost (ErrUnknown); the next renewal, sent while the client is still cut
// off, cannot tell either (ErrUnknown); a third finds the first one's entry.
// The local deadline counts from the first renewal's send, the one that
// wrote the entry the server expires, not from the second's.
func TestRenewalLostTwiceCountsFromTheFirstSend(t *testing.T) {
	ctx := context.Background()
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{RetryFor: 300 * time.Millisecond, Timeout: 500 * time.Millisecond})
	other := newAcquirer(t, js(t), lockBucket, nil)
	name := fencetest.Name("renewtwice")
	const ttl = 6 * time.Second
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(lockBucket.Bucket))
	p.Refuse(true)
	err = l.Renew(ctx)
	waitLost(t, p, before)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("the first renewal, its reply lost: %v, want ErrUnknown", err)
	}
	// The gaps between the renewals are the case, not waits for events.
	time.Sleep(time.Second)
	if err := l.Renew(ctx); !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("the second renewal, still cut off: %v, want ErrUnknown", err)
	}
	time.Sleep(time.Second)
	p.Refuse(false)
	if err := l.Renew(ctx); err != nil {
		t.Fatalf("the third renewal, which finds the first one's entry: %v", err)
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
		t.Fatalf("two holders: B was granted while A's local deadline was still %v away", deadline.Sub(granted))
	}
}

// TestRenewalRecognisedThenUnconfirmedCountsFromTheFirstSend: a renewal
// lands but its reply is lost (ErrUnknown). The next renewal finds that
// entry and sends one of its own, which never reaches the server, and the
// client is cut off for its RetryFor (ErrUnknown). The entry the server
// holds is the first renewal's: the local deadline counts from that
// renewal's send, not from the second call's, and has passed by the time
// another acquirer is granted.
func TestRenewalRecognisedThenUnconfirmedCountsFromTheFirstSend(t *testing.T) {
	ctx := context.Background()
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{RetryFor: 300 * time.Millisecond, Timeout: 500 * time.Millisecond})
	other := newAcquirer(t, js(t), lockBucket, nil)
	name := fencetest.Name("renewrecognised")
	const ttl = 6 * time.Second
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(lockBucket.Bucket))
	p.Refuse(true)
	err = l.Renew(ctx)
	waitLost(t, p, before)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("the first renewal, its reply lost: %v, want ErrUnknown", err)
	}
	// The gap between the renewals is the case, not a wait for an event.
	time.Sleep(2 * time.Second)
	p.Refuse(false)
	for giveUp := time.Now().Add(10 * time.Second); !j.Conn().IsConnected(); {
		if time.Now().After(giveUp) {
			t.Fatal("the client did not reconnect")
		}
		time.Sleep(time.Millisecond) // the pace of the polls
	}
	// The second renewal reads the first one's entry on this connection;
	// its own publish is dropped with the connection, and no other is
	// made within its RetryFor.
	p.Refuse(true)
	p.DropRequest(publishTo(lockBucket.Bucket))
	if err := l.Renew(ctx); !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("the second renewal, its publish dropped: %v, want ErrUnknown", err)
	}
	if n := p.Pending(); n != 0 {
		t.Fatalf("the second renewal sent no publish (%d faults still armed)", n)
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
		t.Fatalf("two holders: B was granted while A's local deadline was still %v away (it counted from the second renewal's send)", deadline.Sub(granted))
	}
}

// TestReleaseAfterLostRenewalFreesTheName: a renewal lands but its reply is
// lost (ErrUnknown); the Release that follows finds the renewal's entry,
// removes it and returns nil, and another acquirer is granted at once, not
// a ttl later.
func TestReleaseAfterLostRenewalFreesTheName(t *testing.T) {
	ctx := context.Background()
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{RetryFor: 300 * time.Millisecond})
	other := newAcquirer(t, js(t), lockBucket, nil)
	name := fencetest.Name("renewrelease")
	const ttl = 30 * time.Second
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	before := p.Stats().LostReplies
	p.LoseReply(publishTo(lockBucket.Bucket))
	p.Refuse(true)
	err = l.Renew(ctx)
	waitLost(t, p, before)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a renewal whose reply was lost: %v, want ErrUnknown", err)
	}
	p.Refuse(false)
	if err := l.Release(ctx); err != nil {
		t.Fatalf("the release after it: %v, want nil", err)
	}
	if l.Context().Err() == nil {
		t.Fatal("the lease's context is live after its release")
	}
	lb, err := other.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("another acquirer right after the release: %v, want a grant", err)
	}
	_ = lb.Release(ctx)
}

// TestLateRenewalDoesNotBlockName: a renewal sent before the lease's local
// deadline lands after it (held by a partition until the holder's context is
// done). The server then holds the key for a fresh ttl that nobody holds:
// Renew reports the lease lost, and the name must not stay blocked past the
// original grant's server expiry for that fresh ttl.
func TestLateRenewalDoesNotBlockName(t *testing.T) {
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, &natsfence.AcquirerOptions{Timeout: 10 * time.Second})
	other := newAcquirer(t, js(t), lockBucket, &natsfence.AcquirerOptions{Recheck: time.Minute})
	ctx := context.Background()
	name := fencetest.Name("laterenew")
	// 2.5s is 3s on the server: the renewal lands between the two, and
	// would hold the name until about 5.5s after the grant.
	l, err := a.TryAcquire(ctx, name, 2500*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	p.Partition()
	renewed := make(chan error, 1)
	go func() { renewed <- l.Renew(ctx) }()
	<-l.Context().Done()
	p.Heal()
	if err := <-renewed; !errors.Is(err, fence.ErrLost) {
		t.Fatalf("a renewal that landed after the local deadline: %v, want ErrLost", err)
	}
	// The original grant expires on the server within about 0.5s from
	// here; the late renewal, if left, about 3s from here.
	wctx, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	defer cancel()
	l2, err := other.Acquire(wctx, name, 5*time.Second)
	if err != nil {
		t.Fatalf("the name after the holder learnt its lease was lost: %v, want it free by the original expiry (the late renewal undone)", err)
	}
	if l2.Token() <= l.Token() {
		t.Errorf("token %d not above %d", l2.Token(), l.Token())
	}
	_ = l2.Release(ctx)
}
