package fencetest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// smallCounter is where the deleted-state case raises a counter that is still
// small (a backend that counts from 1) with Bump, so that a counter that
// restarts at a small number after the deletion shows.
const smallCounter fence.Token = 1 << 20

// deletedGrant is what a grant after the deletion of a name's state may do:
// carry a token above top, or be refused with ErrTokensExhausted (a backend
// that cannot tell which tokens it handed out refuses to grant; it must never
// hand out a smaller token). ErrHeld is a failure: DeleteState removed every
// piece of state of the name, its holder among it, so nobody holds it, and a
// backend that says it is held either refuses the name for good or was not
// reached by DeleteState (which then deleted nothing, and the case would
// test nothing). It returns the lease, or nil after a refusal, which it logs.
func deletedGrant(t *testing.T, op string, l fence.Lease, err error, top fence.Token, when string) fence.Lease {
	t.Helper()
	if err != nil {
		if l != nil {
			t.Errorf("%s %s returned a lease together with %v", op, when, err)
		}
		if errors.Is(err, fence.ErrTokensExhausted) {
			t.Logf("%s %s refused: %v", op, when, err)
			return nil
		}
		if errors.Is(err, fence.ErrHeld) {
			t.Fatalf("%s %s: %v, although DeleteState removed the name's holder: the backend refuses a free name (for good?), or DeleteState deleted nothing; want a token above %d, or ErrTokensExhausted", op, when, err, top)
		}
		t.Fatalf("%s %s: %v; want a token above %d, or ErrTokensExhausted", op, when, err, top)
	}
	t.Cleanup(func() { _ = l.Release(context.Background()) })
	if l.Token() <= top {
		t.Fatalf("%s %s granted token %d, not above %d, a token granted before: a paused holder's writes would beat the new holder's", op, when, l.Token(), top)
	}
	t.Logf("%s %s: token %d (largest before %d)", op, when, l.Token(), top)
	return l
}

// testDeletedState: the state a backend keeps for a name (its
// counter among it) is deleted behind the acquirers' backs, while A holds the
// name and pauses. A grant to another process after that must carry a token
// above every token granted before, by TryAcquire, by Acquire after a second
// deletion, and after a deletion while nobody holds the name; A's Release must
// not free the new holder's lease. A's Renew is only logged.
func (s AcquirerSuite) testDeletedState(t *testing.T) {
	if s.DeleteState == nil {
		t.Skip("fencetest: the harness has no DeleteState: tokens after the name's state is deleted are not tested")
	}
	a, b := s.New(t), s.NewOther(t)
	name := Name("deleted")
	var top fence.Token
	for i := 0; i < 3; i++ { // a few grants first, so the counter is past its start
		l := mustTry(t, a, name, longTTL)
		top = max(top, l.Token())
		release(t, l)
	}
	if bumper, ok := a.(fence.Bumper); ok && top < smallCounter {
		if err := bumper.Bump(ctxT(t), name, smallCounter); err != nil {
			t.Fatalf("Bump(%q, %d): %v", name, smallCounter, err)
		}
		top = smallCounter
	}
	la := mustTry(t, a, name, longTTL) // A: holds the name, then pauses
	defer func() { _ = la.Release(context.Background()) }()
	if la.Token() <= top {
		t.Fatalf("token %d after the counter was at %d", la.Token(), top)
	}
	top = la.Token()
	t.Logf("before the deletion: tokens up to %d, A holds %d", top, la.Token())

	s.DeleteState(t, name)
	l, err := b.TryAcquire(ctxT(t), name, longTTL)
	if lb := deletedGrant(t, "TryAcquire", l, err, top, "after the state was deleted under A's lease"); lb != nil {
		top = lb.Token()
		// Not asserted: the case is about tokens, and a backend may let the
		// paused holder renew a lease whose state is gone (etcd's Renew keeps
		// its etcd lease alive); the fence refuses its writes either way.
		t.Logf("A's Renew after the deletion and B's grant: %v", la.Renew(ctxT(t)))
	}

	s.DeleteState(t, name) // again, under A's (and maybe B's) lease
	ctx, cancel := context.WithTimeout(ctxT(t), 5*time.Second)
	l, err = b.Acquire(ctx, name, longTTL)
	cancel()
	if lc := deletedGrant(t, "Acquire", l, err, top, "after a second deletion"); lc != nil {
		top = lc.Token()
		_ = la.Release(context.Background()) // A wakes up and lets go: the result does not matter
		if l, err := a.TryAcquire(ctxT(t), name, longTTL); !errors.Is(err, fence.ErrHeld) {
			if err == nil {
				t.Errorf("TryAcquire after the paused holder's Release while the new holder (token %d) holds the name: granted token %d, want ErrHeld", lc.Token(), l.Token())
				_ = l.Release(context.Background())
			} else {
				t.Errorf("TryAcquire after the paused holder's Release while the new holder (token %d) holds the name: %v, want ErrHeld", lc.Token(), err)
			}
		}
		release(t, lc)
	}

	// Nobody holds the name now (A let go; B's leases were released or had
	// their state deleted): delete once more, then grant.
	_ = la.Release(context.Background())
	s.DeleteState(t, name)
	l, err = a.TryAcquire(ctxT(t), name, longTTL)
	deletedGrant(t, "TryAcquire", l, err, top, "after a deletion while nobody held the name")
}

// testRenewAfterDeletedState: A holds the name, its
// state is deleted behind the acquirers' backs, and B is granted it with a
// short lease. A's Renew must return ErrLost: the name is B's. A Renew that
// checks the lease's expiry but not its holder finds B's live lease, extends
// it by A's ttl and returns nil, and A goes on believing it holds the name.
// Nor may A's Renew extend B's lease: once B's lease has run out unrenewed,
// a third client is granted the name.
func (s AcquirerSuite) testRenewAfterDeletedState(t *testing.T) {
	if s.DeleteState == nil {
		t.Skip("fencetest: the harness has no DeleteState: a Renew after the name's state is deleted is not tested")
	}
	a, b := s.New(t), s.NewOther(t)
	name := Name("delrenew")
	la := mustTry(t, a, name, longTTL)
	defer func() { _ = la.Release(context.Background()) }()
	s.DeleteState(t, name)
	// B's lease is short, so that A's Renew extending it shows, but not so
	// short that a grant answered late on a loaded machine is already past
	// its local deadline.
	bTTL := max(s.ShortTTL, time.Second)
	l, err := b.TryAcquire(ctxT(t), name, bTTL)
	lb := deletedGrant(t, "TryAcquire", l, err, la.Token(), "after the state was deleted under A's lease")
	if lb == nil {
		return
	}
	granted := time.Now()
	if err := la.Renew(ctxT(t)); !errors.Is(err, fence.ErrLost) {
		t.Errorf("A's Renew (token %d) after its state was deleted and B was granted token %d: %v, want ErrLost", la.Token(), lb.Token(), err)
	}
	if err := la.Context().Err(); err == nil {
		t.Errorf("A's context is live after its state was deleted and B was granted the name")
	}
	// B does not renew: its lease ends on the backend by its ttl and half
	// again, plus the backend's ExpiryLag, unless A's Renew extended it to
	// A's much longer ttl.
	time.Sleep(time.Until(granted.Add(bTTL + bTTL/2 + s.ExpiryLag)))
	lc, err := s.NewOther(t).TryAcquire(ctxT(t), name, longTTL)
	if err != nil {
		t.Fatalf("%v after B was granted a %v lease that nobody renewed, a third client got %v, want a grant: A's Renew extended B's lease", time.Since(granted), bTTL, err)
	}
	release(t, lc)
}
