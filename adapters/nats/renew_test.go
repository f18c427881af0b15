package natsfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/nats-io/nats.go/jetstream"
)

// proxiedHold is a lease held by an acquirer that reaches the server through
// a faultnet proxy, and another acquirer on a direct connection.
type proxiedHold struct {
	j     jetstream.JetStream
	p     *faultnet.Proxy
	other *natsfence.Acquirer
	l     fence.Lease
}

// holdProxied grants name for ttl to an acquirer with opts behind a new
// proxy; other has otherOpts.
func holdProxied(t *testing.T, opts, otherOpts *natsfence.AcquirerOptions, name string, ttl time.Duration) proxiedHold {
	t.Helper()
	j, p := proxied(t)
	a := newAcquirer(t, j, lockBucket, opts)
	other := newAcquirer(t, js(t), lockBucket, otherOpts)
	l, err := a.TryAcquire(context.Background(), name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	return proxiedHold{j: j, p: p, other: other, l: l}
}

// localDeadline is the lease's local deadline.
func localDeadline(l fence.Lease) time.Time {
	return l.(interface{ LocalDeadline() time.Time }).LocalDeadline()
}

// renewLosingReply renews h's lease with the publish's reply lost and no
// reconnection allowed (the proxy refuses connections until Refuse(false)),
// so the renewal lands and cannot tell. It returns when Renew returned and
// its error, once the reply has been thrown away.
func renewLosingReply(ctx context.Context, t *testing.T, h proxiedHold) (time.Time, error) {
	t.Helper()
	before := h.p.Stats().LostReplies
	h.p.LoseReply(publishTo(lockBucket.Bucket))
	h.p.Refuse(true)
	err := h.l.Renew(ctx)
	returned := time.Now()
	waitLost(t, h.p, before)
	return returned, err
}

// renewAcrossDeadline renews h's lease through a partition held until the
// lease's local deadline has passed; atDeadline runs then, before the heal.
// It returns Renew's error.
func renewAcrossDeadline(ctx context.Context, h proxiedHold, atDeadline func()) error {
	h.p.Partition()
	renewed := make(chan error, 1)
	go func() { renewed <- h.l.Renew(ctx) }()
	<-h.l.Context().Done()
	atDeadline()
	h.p.Heal()
	return <-renewed
}

// freeWithin has h's other acquirer wait at most within for name and
// returns the token it was granted (the lease released); it fails t with
// why, and the server's time left on the name, when the wait ends first.
func freeWithin(ctx context.Context, t *testing.T, h proxiedHold, name string, within time.Duration, why string) fence.Token {
	t.Helper()
	wctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	l2, err := h.other.Acquire(wctx, name, 5*time.Second)
	if err != nil {
		info, _ := h.other.Inspect(ctx, name)
		t.Fatalf("the name after the holder learnt its lease was lost: %v; %s (server time left %v)", err, why, info.TimeLeft.Round(time.Millisecond))
	}
	_ = l2.Release(ctx)
	return l2.Token()
}

// TestRenewalUnknownCountsFromTheSendThatLanded: a renewal lands but its
// reply is lost and it returns ErrUnknown; a later renewal finds that entry.
// The server counts the entry's TTL from the renewal that wrote it, so the
// lease's local deadline must count from that renewal's send too: another
// acquirer is granted once the server expired the entry, and by then the
// holder's local deadline has passed. The rows differ in what happens
// between the first renewal and the one the deadline is read after.
func TestRenewalUnknownCountsFromTheSendThatLanded(t *testing.T) {
	cases := []struct {
		name  string
		label string
		opts  *natsfence.AcquirerOptions
		// then runs the renewals after the first, which returned
		// ErrUnknown with the client still cut off.
		then func(ctx context.Context, t *testing.T, h proxiedHold)
		// counted names the send a wrong deadline counted from.
		counted string
	}{{
		// The next renewal, seconds later, finds the first one's entry
		// and returns nil.
		name:  "RecognisedLaterCountsFromItsSend",
		label: "renewlater",
		opts:  &natsfence.AcquirerOptions{RetryFor: 300 * time.Millisecond},
		then: func(ctx context.Context, t *testing.T, h proxiedHold) {
			// The gap between the two renewals is the point of the
			// case, not a wait for an event.
			time.Sleep(2 * time.Second)
			h.p.Refuse(false)
			if err := h.l.Renew(ctx); err != nil {
				t.Fatalf("the next renewal, which finds the first one's entry: %v", err)
			}
		},
		counted: " (it counted from the later renewal's send)",
	}, {
		// The next renewal, sent while the client is still cut off,
		// cannot tell either (ErrUnknown); a third finds the first one's
		// entry. The deadline counts from the first send, the one that
		// wrote the entry the server expires, not from the second's.
		name:  "LostTwiceCountsFromTheFirstSend",
		label: "renewtwice",
		opts:  &natsfence.AcquirerOptions{RetryFor: 300 * time.Millisecond, Timeout: 500 * time.Millisecond},
		then: func(ctx context.Context, t *testing.T, h proxiedHold) {
			// The gaps between the renewals are the case, not waits
			// for events.
			time.Sleep(time.Second)
			if err := h.l.Renew(ctx); !errors.Is(err, fence.ErrUnknown) {
				t.Fatalf("the second renewal, still cut off: %v, want ErrUnknown", err)
			}
			time.Sleep(time.Second)
			h.p.Refuse(false)
			if err := h.l.Renew(ctx); err != nil {
				t.Fatalf("the third renewal, which finds the first one's entry: %v", err)
			}
		},
	}, {
		// The next renewal finds that entry and sends one of its own,
		// which never reaches the server, and the client is cut off for
		// its RetryFor (ErrUnknown). The entry the server holds is the
		// first renewal's.
		name:  "RecognisedThenUnconfirmedCountsFromTheFirstSend",
		label: "renewrecognised",
		opts:  &natsfence.AcquirerOptions{RetryFor: 300 * time.Millisecond, Timeout: 500 * time.Millisecond},
		then: func(ctx context.Context, t *testing.T, h proxiedHold) {
			// The gap between the renewals is the case, not a wait for
			// an event.
			time.Sleep(2 * time.Second)
			h.p.Refuse(false)
			for giveUp := time.Now().Add(10 * time.Second); !h.j.Conn().IsConnected(); {
				if time.Now().After(giveUp) {
					t.Fatal("the client did not reconnect")
				}
				time.Sleep(time.Millisecond) // the pace of the polls
			}
			// The second renewal reads the first one's entry on this
			// connection; its own publish is dropped with the
			// connection, and no other is made within its RetryFor.
			h.p.Refuse(true)
			h.p.DropRequest(publishTo(lockBucket.Bucket))
			if err := h.l.Renew(ctx); !errors.Is(err, fence.ErrUnknown) {
				t.Fatalf("the second renewal, its publish dropped: %v, want ErrUnknown", err)
			}
			if n := h.p.Pending(); n != 0 {
				t.Fatalf("the second renewal sent no publish (%d faults still armed)", n)
			}
		},
		counted: " (it counted from the second renewal's send)",
	}}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ctx := context.Background()
			name := fencetest.Name(c.label)
			const ttl = 6 * time.Second
			h := holdProxied(t, c.opts, nil, name, ttl)
			if _, err := renewLosingReply(ctx, t, h); !errors.Is(err, fence.ErrUnknown) {
				t.Fatalf("the first renewal, its reply lost, cut off for its RetryFor: %v, want ErrUnknown", err)
			}
			c.then(ctx, t, h)
			deadline := localDeadline(h.l)
			var lb fence.Lease
			var err error
			for giveUp := time.Now().Add(60 * time.Second); ; {
				lb, err = h.other.TryAcquire(ctx, name, ttl)
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
				t.Fatalf("two holders: B was granted while A's local deadline was still %v away%s", deadline.Sub(granted), c.counted)
			}
		})
	}
}

// TestReleaseAfterLostRenewalFreesTheName: a renewal lands but its reply is
// lost (ErrUnknown); the Release that follows finds the renewal's entry,
// removes it and returns nil, and another acquirer is granted at once, not
// a ttl later.
func TestReleaseAfterLostRenewalFreesTheName(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("renewrelease")
	const ttl = 30 * time.Second
	h := holdProxied(t, &natsfence.AcquirerOptions{RetryFor: 300 * time.Millisecond}, nil, name, ttl)
	if _, err := renewLosingReply(ctx, t, h); !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a renewal whose reply was lost: %v, want ErrUnknown", err)
	}
	h.p.Refuse(false)
	if err := h.l.Release(ctx); err != nil {
		t.Fatalf("the release after it: %v, want nil", err)
	}
	if h.l.Context().Err() == nil {
		t.Fatal("the lease's context is live after its release")
	}
	lb, err := h.other.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("another acquirer right after the release: %v, want a grant", err)
	}
	_ = lb.Release(ctx)
}

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
	name := fencetest.Name("renew-after-lost-renewal")
	const ttl = 6 * time.Second
	h := holdProxied(t, &natsfence.AcquirerOptions{RetryFor: 300 * time.Millisecond}, nil, name, ttl)
	l, other := h.l, h.other
	defer l.Release(ctx)
	if _, err := renewLosingReply(ctx, t, h); !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a renewal whose reply was lost, cut off for its RetryFor: %v, want ErrUnknown", err)
	}
	// Most of a ttl between the two renewals is the case, not a wait for
	// an event.
	time.Sleep(4 * time.Second)
	h.p.Refuse(false)
	if err := l.Renew(ctx); err != nil {
		t.Fatalf("the renewal once connected again: %v", err)
	}
	renewed := time.Now()
	info, err := other.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	left := time.Until(localDeadline(l))
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

// TestLateRenewalDoesNotBlockName: a renewal sent before the lease's local
// deadline lands after it (held by a partition until the holder's context is
// done). The server then holds the key for a fresh ttl that nobody holds:
// Renew reports the lease lost, and the name must not stay blocked past the
// original grant's server expiry for that fresh ttl.
func TestLateRenewalDoesNotBlockName(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("laterenew")
	// 2.5s is 3s on the server: the renewal lands between the two, and
	// would hold the name until about 5.5s after the grant.
	h := holdProxied(t, &natsfence.AcquirerOptions{Timeout: 10 * time.Second}, &natsfence.AcquirerOptions{Recheck: time.Minute}, name, 2500*time.Millisecond)
	if err := renewAcrossDeadline(ctx, h, func() {}); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("a renewal that landed after the local deadline: %v, want ErrLost", err)
	}
	// The original grant expires on the server within about 0.5s from
	// here; the late renewal, if left, about 3s from here.
	tok := freeWithin(ctx, t, h, name, 1500*time.Millisecond, "want it free by the original expiry (the late renewal undone)")
	if tok <= h.l.Token() {
		t.Errorf("token %d not above %d", tok, h.l.Token())
	}
}

// TestRenewReadAnsweredPastDeadlineSendsNothing: a renewal's read is held
// by a partition until the lease's local deadline has passed. Once healed,
// the read finds the lease's entry (the server's TTL, rounded up to whole
// seconds, has not run out yet); Renew returns fence.ErrLost and publishes
// nothing to the bucket: no renewal, and nothing to give back.
func TestRenewReadAnsweredPastDeadlineSendsNothing(t *testing.T) {
	// 2.5s is 3s on the server: the read is answered between the two.
	h := holdProxied(t, &natsfence.AcquirerOptions{Timeout: 10 * time.Second}, nil, fencetest.Name("renew-read-past-deadline"), 2500*time.Millisecond)
	err := renewAcrossDeadline(context.Background(), h, func() { h.p.DropRequest(publishTo(lockBucket.Bucket)) })
	if !errors.Is(err, fence.ErrLost) {
		t.Fatalf("a renewal whose read answered after the local deadline: %v, want ErrLost", err)
	}
	if h.p.Pending() == 0 {
		t.Fatal("Renew published to the bucket after the local deadline had passed")
	}
}

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
	ctx := context.Background()
	name := fencetest.Name("late-renew-lost-reply")
	// 2.5s is 3s on the server: the renewal is sent between the two.
	h := holdProxied(t, &natsfence.AcquirerOptions{Timeout: 10 * time.Second}, &natsfence.AcquirerOptions{Recheck: time.Minute}, name, 2500*time.Millisecond)
	var deadlinePassed time.Time
	var before int64
	err := renewAcrossDeadline(ctx, h, func() {
		deadlinePassed = time.Now()
		before = h.p.Stats().LostReplies
		h.p.LoseReply(publishTo(lockBucket.Bucket))
	})
	t.Logf("Renew %v after the local deadline: %v", time.Since(deadlinePassed).Round(time.Millisecond), err)
	if !errors.Is(err, fence.ErrLost) && !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("a renewal whose read answered after the local deadline: %v, want ErrLost", err)
	}
	sent := h.p.Pending() == 0 && h.p.Stats().LostReplies > before
	info, ierr := h.other.Inspect(ctx, name)
	t.Logf("renewal sent after the local deadline: %v; the server's lock after Renew returned: held %v, time left %v, %v", sent, info.Held, info.TimeLeft.Round(time.Millisecond), ierr)
	// The original grant expires on the server within about 0.5s of the
	// local deadline; a renewal sent after it, if left, ~3s after its send.
	freeWithin(ctx, t, h, name, 1500*time.Millisecond, "a renewal sent past the local deadline, whose reply was lost, holds it for a fresh ttl that nobody holds")
}

// TestRenewLostReplyThenDeadlinePassesGivesBack: a renewal sent halfway
// through the lease lands, but its reply is lost and the client cannot
// reconnect until the lease's local deadline has passed. Renew reports the
// lease lost. The renewal's entry would hold the name for a fresh ttl that
// nobody holds: it is given back once the client is connected again, so
// another acquirer is granted long before that ttl runs out.
func TestRenewLostReplyThenDeadlinePassesGivesBack(t *testing.T) {
	renewGivesBack(t, "renew-lost-reply-deadline", 200*time.Millisecond, false)
}

// TestRenewGiveBackBoundedByCallerContext: as in
// TestRenewLostReplyThenDeadlinePassesGivesBack, a renewal lands with its
// reply lost and the client is cut off past the local deadline, here with
// a long Timeout and a caller's context that ends just after that deadline.
// Renew returns fence.ErrLost at the context's end, not a Timeout or two
// past it, and the give-back still happens once the client is connected
// again: another acquirer is granted long before the renewal's ttl runs out.
func TestRenewGiveBackBoundedByCallerContext(t *testing.T) {
	renewGivesBack(t, "renew-giveback-ctx", 2*time.Second, true)
}

// renewGivesBack runs the give-back cases: a 5s lease renewed halfway
// through by an acquirer with timeout, its reply lost and the client cut
// off past the local deadline; with callerCtx the renewal's context ends
// 100ms after that deadline and Renew must return within timeout/2 of it.
func renewGivesBack(t *testing.T, label string, timeout time.Duration, callerCtx bool) {
	t.Helper()
	ctx := context.Background()
	name := fencetest.Name(label)
	const ttl = 5 * time.Second
	h := holdProxied(t, &natsfence.AcquirerOptions{Timeout: timeout}, &natsfence.AcquirerOptions{Recheck: time.Minute}, name, ttl)
	// Half a ttl before the renewal is the case: its entry outlives the
	// grant's by as much.
	time.Sleep(ttl / 2)
	rctx := ctx
	if callerCtx {
		var cancel context.CancelFunc
		rctx, cancel = context.WithDeadline(ctx, localDeadline(h.l).Add(100*time.Millisecond))
		defer cancel()
	}
	returned, err := renewLosingReply(rctx, t, h)
	if !errors.Is(err, fence.ErrLost) {
		t.Fatalf("a renewal whose reply was lost, cut off past the local deadline: %v, want ErrLost", err)
	}
	if dl, ok := rctx.Deadline(); ok {
		if late := returned.Sub(dl); late > timeout/2 {
			t.Fatalf("Renew returned %v after its context's deadline (Timeout %v)", late.Round(time.Millisecond), timeout)
		}
	}
	h.p.Refuse(false)
	// The renewal's entry, if left, holds the name until about 2.5s from
	// here.
	freeWithin(ctx, t, h, name, 1200*time.Millisecond, "the renewal that landed unconfirmed holds it for a fresh ttl nobody holds")
}
