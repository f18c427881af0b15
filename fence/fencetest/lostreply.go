package fencetest

import (
	"context"
	"errors"
	"os"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
)

// LostReplyEnv names the environment variable that turns the suites'
// lost-reply cases off when it is "0". They run whenever the harness has a
// Faulty constructor; every built-in backend passes them.
const LostReplyEnv = "FENCEKIT_LOST_REPLY"

// lostTTL is the lease of the lost-reply cases: long enough that a name left
// blocked by an orphan grant is told apart from one that is free.
const lostTTL = 20 * time.Second

// lostWait is how long another acquirer may take to be granted a name that
// the lost-reply case left free: well before lostTTL.
const lostWait = lostTTL / 4

// lostReplyGate skips t unless the lost-reply cases are on and the harness
// can build a client behind a proxy.
func lostReplyGate(t *testing.T, haveFaulty bool) {
	t.Helper()
	if !haveFaulty {
		t.Skip("fencetest: the harness has no Faulty constructor: lost replies are not tested")
	}
	if os.Getenv(LostReplyEnv) == "0" {
		t.Skipf("fencetest: lost-reply cases are off (%s=0)", LostReplyEnv)
	}
}

// armLoseReply makes p lose the reply to the next request, and returns a
// check that the fault fired during the call in between.
func armLoseReply(t *testing.T, p *faultnet.Proxy) func() {
	t.Helper()
	before := p.Stats().LostReplies
	p.LoseReply(nil)
	return func() {
		t.Helper()
		if p.Pending() != 0 {
			t.Fatal("fencetest: the armed lost reply never fired: the call sent no request through the proxy")
		}
		// The proxy counts the lost reply once the server has answered; wait for it.
		giveUp := time.Now().Add(10 * time.Second)
		for p.Stats().LostReplies == before {
			if time.Now().After(giveUp) {
				t.Fatal("fencetest: the request was forwarded but its reply never came")
			}
			time.Sleep(time.Millisecond)
		}
	}
}

// lostReply wraps a lost-reply case with the gate.
func (s AcquirerSuite) lostReply(fn func(*testing.T, fence.Acquirer, *faultnet.Proxy)) func(*testing.T) {
	return func(t *testing.T) {
		lostReplyGate(t, s.Faulty != nil)
		a, p := s.Faulty(t)
		// Warm up: the client's connection is open before the fault is armed,
		// so the fault takes the case's request and not a handshake.
		l := mustTry(t, a, Name("warm"), longTTL)
		release(t, l)
		fn(t, a, p)
	}
}

// freeSoon checks that another acquirer is granted name well before lostTTL.
func (s AcquirerSuite) freeSoon(t *testing.T, name, after string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(ctxT(t), lostWait)
	defer cancel()
	start := time.Now()
	l, err := s.NewOther(t).Acquire(ctx, name, longTTL)
	if err != nil {
		t.Fatalf("after %s, another acquirer waited %v without a grant (%v): the name is blocked by an orphan lease for its ttl", after, time.Since(start), err)
	}
	release(t, l)
}

// testLostReplyGrant: a TryAcquire (or Acquire) whose reply was lost returns a
// valid lease that excludes others, or an error; after an error the name is
// not blocked for the ttl (another acquirer is granted well before it), unless
// the error is ErrUnknown.
func (s AcquirerSuite) testLostReplyGrant(wait bool) func(*testing.T, fence.Acquirer, *faultnet.Proxy) {
	return func(t *testing.T, a fence.Acquirer, p *faultnet.Proxy) {
		name := Name("lostgrant")
		fired := armLoseReply(t, p)
		ctx, cancel := context.WithTimeout(ctxT(t), lostWait)
		var (
			l   fence.Lease
			err error
		)
		if wait {
			l, err = a.Acquire(ctx, name, lostTTL)
		} else {
			l, err = a.TryAcquire(ctx, name, lostTTL)
		}
		cancel()
		fired()
		if err != nil {
			if l != nil {
				t.Errorf("a lease together with the error %v", err)
			}
			if errors.Is(err, fence.ErrUnknown) {
				t.Logf("grant with a lost reply: %v (ErrUnknown: the name may stay held for the ttl)", err)
				return
			}
			t.Logf("grant with a lost reply: %v", err)
			s.freeSoon(t, name, "a grant whose reply was lost returned "+err.Error())
			return
		}
		if !l.Token().Valid() || l.Name() != name || l.Context().Err() != nil {
			t.Fatalf("grant with a lost reply: lease %q token %d, context %v", l.Name(), l.Token(), l.Context().Err())
		}
		expectHeld(t, s.NewOther(t), name, "while the lease granted after a lost reply is held")
		release(t, l)
		s.freeSoon(t, name, "the lease granted after a lost reply was released")
	}
}

// lostOnLease takes a lease on a fresh name, then makes call on it with the
// reply of its first request lost.
func lostOnLease(t *testing.T, a fence.Acquirer, p *faultnet.Proxy, prefix string, call func(fence.Lease, context.Context) error) (fence.Lease, error) {
	t.Helper()
	l := mustTry(t, a, Name(prefix), lostTTL)
	fired := armLoseReply(t, p)
	err := call(l, ctxT(t))
	fired()
	return l, err
}

// testLostReplyRenew: a Renew whose reply was lost returns nil (the lease is
// still held and excludes others), ErrLost or ErrUnknown, never a bare
// transport error; after the Release the name is free.
func (s AcquirerSuite) testLostReplyRenew(t *testing.T, a fence.Acquirer, p *faultnet.Proxy) {
	l, err := lostOnLease(t, a, p, "lostrenew", fence.Lease.Renew)
	name := l.Name()
	switch {
	case err == nil:
		if l.Context().Err() != nil {
			t.Errorf("Renew returned nil but the lease's context is done: %v", context.Cause(l.Context()))
		}
		expectHeld(t, s.NewOther(t), name, "after a Renew with a lost reply returned nil")
	case errors.Is(err, fence.ErrLost), errors.Is(err, fence.ErrUnknown):
		t.Logf("Renew with a lost reply: %v", err)
	default:
		t.Errorf("Renew with a lost reply: err = %v, want nil, ErrLost or ErrUnknown (not a bare transport error)", err)
	}
	if err := l.Release(ctxT(t)); err != nil && !errors.Is(err, fence.ErrLost) {
		t.Errorf("Release after a Renew with a lost reply: %v", err)
	}
	s.freeSoon(t, name, "a Release after a Renew with a lost reply")
}

// testLostReplyRelease: a Release whose reply was lost returns nil, ErrLost
// or ErrUnknown, never a bare transport error; its context is done and the
// name is free at once, not after the ttl.
func (s AcquirerSuite) testLostReplyRelease(t *testing.T, a fence.Acquirer, p *faultnet.Proxy) {
	l, err := lostOnLease(t, a, p, "lostrelease", fence.Lease.Release)
	name := l.Name()
	if err != nil && !errors.Is(err, fence.ErrLost) && !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("Release with a lost reply: err = %v, want nil, ErrLost or ErrUnknown (not a bare transport error)", err)
	}
	if l.Context().Err() == nil {
		t.Error("the lease's context is live after Release returned")
	}
	s.freeSoon(t, name, "a Release whose reply was lost (err "+errString(err)+")")
}

// expectHeld checks that a's TryAcquire of name gets ErrHeld, when what.
func expectHeld(t *testing.T, a fence.Acquirer, name, when string) {
	t.Helper()
	if l, err := a.TryAcquire(ctxT(t), name, longTTL); !errors.Is(err, fence.ErrHeld) {
		if l != nil {
			_ = l.Release(context.Background())
		}
		t.Errorf("%s, another acquirer got %v, want ErrHeld", when, err)
	}
}

func errString(err error) string {
	if err == nil {
		return "nil"
	}
	return err.Error()
}

// lostReply wraps a writer's lost-reply case with the gate.
func (s WriterSuite) lostReply(fn func(*testing.T, fence.FencedWriter, *faultnet.Proxy)) func(*testing.T) {
	return func(t *testing.T) {
		lostReplyGate(t, s.Faulty != nil)
		w, p := s.Faulty(t)
		mustWrite(t, w, Name("warm"), []byte("warm"), 1)
		fn(t, w, p)
	}
}

// testLostReplyWrite: a Write whose reply was lost returns nil with the value
// stored, or an error matching ErrUnknown, never a bare transport error; the
// same write sent again after ErrUnknown succeeds and the key holds it.
func (s WriterSuite) testLostReplyWrite(t *testing.T, w fence.FencedWriter, p *faultnet.Proxy) {
	key := Name("lostwrite")
	mustWrite(t, w, key, []byte("v1"), 5)
	fired := armLoseReply(t, p)
	err := w.Write(ctxT(t), key, []byte("v2"), 6)
	fired()
	check := s.New(t) // reads through a client of its own, not through the proxy
	switch {
	case err == nil:
	case errors.Is(err, fence.ErrUnknown):
		t.Logf("Write with a lost reply: %v", err)
		if err := w.Write(ctxT(t), key, []byte("v2"), 6); err != nil {
			t.Fatalf("the same Write again after ErrUnknown: %v", err)
		}
	default:
		t.Fatalf("Write with a lost reply: err = %v, want nil or ErrUnknown (not a bare transport error)", err)
	}
	expect(t, check, key, []byte("v2"), 6)
	// The write is settled: a lower token is refused, naming it.
	expectStale(t, check.Write(ctxT(t), key, []byte("v1"), 5), key, 5, 6)
}

// testLostReplyDelete: a Delete whose reply was lost returns nil with the key
// deleted, or an error matching ErrUnknown, never a bare transport error; the
// same Delete again after ErrUnknown succeeds; the tombstone keeps the fence.
func (s WriterSuite) testLostReplyDelete(t *testing.T, w fence.FencedWriter, p *faultnet.Proxy) {
	d, ok := w.(fence.Deleter)
	if !ok {
		t.Skipf("fencetest: the Faulty writer %T has no Delete", w)
	}
	key := Name("lostdelete")
	mustWrite(t, w, key, []byte("v"), 5)
	fired := armLoseReply(t, p)
	err := d.Delete(ctxT(t), key, 6)
	fired()
	check := s.New(t)
	switch {
	case err == nil:
	case errors.Is(err, fence.ErrUnknown):
		t.Logf("Delete with a lost reply: %v", err)
		if err := d.Delete(ctxT(t), key, 6); err != nil {
			t.Fatalf("the same Delete again after ErrUnknown: %v", err)
		}
	default:
		t.Fatalf("Delete with a lost reply: err = %v, want nil or ErrUnknown (not a bare transport error)", err)
	}
	if r, ok := check.(fence.Reader); ok {
		if v, tok, err := r.Read(ctxT(t), key); !errors.Is(err, fence.ErrNotFound) {
			t.Fatalf("Read after the Delete = %q token %d, %v; want ErrNotFound", trim(v), tok, err)
		}
	}
	expectStale(t, check.Write(ctxT(t), key, []byte("zombie"), 5), key, 5, 6)
}

// testLostReplyRenewThenRenew: a Renew's reply is lost (and the
// backend unreachable for the rest of that call), the holder waits half a ttl
// and renews again. Whatever the second Renew
// returns, the lease's context must end no later than the backend's expiry
// counted from the earliest send that may have renewed it (the first Renew's,
// when the second only recognises the first one's effect): another acquirer,
// polling from the second Renew on, is never granted the name while the
// lease's context is live. A backend that counts the local deadline from the
// second Renew's send lets the two overlap for up to half a ttl.
func (s AcquirerSuite) testLostReplyRenewThenRenew(t *testing.T, a fence.Acquirer, p *faultnet.Proxy) {
	ttl := s.renewTTL()
	name := Name("lostrenew2")
	l := mustTry(t, a, name, ttl)
	defer func() { _ = l.Release(context.Background()) }()
	// The reply is lost and the connection cut; new connections are refused
	// for a quarter of the ttl, so that a client that sends the Renew again
	// on its own cannot settle it within this call.
	fired := armLoseReply(t, p)
	p.Refuse(true)
	sent := time.Now()
	ctx, cancel := context.WithTimeout(ctxT(t), ttl/4)
	err := l.Renew(ctx)
	cancel()
	fired()
	p.Refuse(false)
	switch {
	case err == nil, errors.Is(err, fence.ErrUnknown):
		t.Logf("Renew with a lost reply: %v", err)
	case errors.Is(err, fence.ErrLost):
		t.Logf("Renew with a lost reply: %v: nothing more to check", err)
		return
	default:
		t.Fatalf("Renew with a lost reply: err = %v, want nil, ErrLost or ErrUnknown (not a bare transport error)", err)
	}
	// A good part of the ttl, so that a deadline counted from the next
	// send rather than this one outlasts the backend's expiry by as much.
	time.Sleep(time.Until(sent.Add(ttl / 2)))
	sent2 := time.Now()
	err = l.Renew(ctxT(t))
	t.Logf("the next Renew, %v after the lost one: %v", sent2.Sub(sent), err)
	if err != nil && !errors.Is(err, fence.ErrLost) && !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("the next Renew: err = %v, want nil, ErrLost or ErrUnknown (not a bare transport error)", err)
	}
	b := s.NewOther(t)
	giveUp := sent2.Add(ttl + 10*time.Second + s.ExpiryLag)
	for l.Context().Err() == nil {
		if time.Now().After(giveUp) {
			t.Fatalf("the context of a %v lease is not done %v after its last Renew was sent", ttl, time.Since(sent2))
		}
		lb, err := b.TryAcquire(ctxT(t), name, longTTL)
		// ErrLost: a grant confirmed after its own local deadline and
		// given back; still a grant, made no later than now.
		if late := errors.Is(err, fence.ErrLost); err == nil || late {
			// The lease's Context().Err() reads the clock: live now means
			// its holder still believes it holds the name.
			live := l.Context().Err() == nil
			if !late {
				_ = lb.Release(context.Background())
			}
			if live {
				t.Fatalf("another acquirer was granted %q (%s) %v after the lost Renew was sent and %v after the next one, while the holder's context was live: the local deadline counts from a later send than the one that renewed the lease on the backend", name, grantOf(lb, err), time.Since(sent), time.Since(sent2))
			}
			return
		}
		if !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("TryAcquire while the lease is held: %v, want ErrHeld", err)
		}
		time.Sleep(max(2*time.Millisecond, ttl/200)) // paces the polling; not a synchronisation
	}
}
