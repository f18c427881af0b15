package azfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/container"
	"github.com/Azure/azure-sdk-for-go/sdk/storage/azblob/lease"
	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// lateDelay delays every chunk each way through the proxy: a 1s grant
// (AcquireLease, then the token's write, two round trips) is confirmed at
// least 1.6s after it was sent, past its local deadline.
const lateDelay = 400 * time.Millisecond

// leased reports whether Azure holds a lease on name's lock blob, read
// through c (not through the test's proxy).
func leased(t *testing.T, c *container.Client, name string) bool {
	t.Helper()
	p, err := c.NewBlobClient("fencekit-locks/"+name).GetProperties(context.Background(), nil)
	if err != nil {
		t.Fatalf("reading %q's lock blob: %v", name, err)
	}
	return p.LeaseState != nil && *p.LeaseState == lease.StateTypeLeased
}

// waitLeased polls name's lock blob through c until its lease state is want,
// or fails the test after bound.
func waitLeased(t *testing.T, c *container.Client, name string, want bool, bound time.Duration, what string) {
	t.Helper()
	for end := time.Now().Add(bound); leased(t, c, name) != want; {
		if time.Now().After(end) {
			t.Fatalf("%s: the lock blob's lease state did not become leased=%v within %v", what, want, bound)
		}
		time.Sleep(20 * time.Millisecond) // polling Azure, not synchronisation
	}
}

// grantAndRelease makes name's lock blob and its first token through c, so
// that a later grant is one AcquireLease and one token write.
func grantAndRelease(t *testing.T, c *container.Client, name string) fence.Token {
	t.Helper()
	// A lease of 10s, not the shortest: on a loaded machine a lease of
	// MinAcquirerTTL can pass its local deadline before its Release.
	l, err := newAcquirer(t, c).TryAcquire(context.Background(), name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	return l.Token()
}

// TestLateGrantsAcquireGivesUpAsAWait: through a proxy that delays every
// chunk 400ms each way, every grant of a 1s lease is confirmed past its local
// deadline. TryAcquire gives the grant back and answers ErrLost; a waiting
// Acquire keeps trying and, at its deadline, gives up as any wait does:
// ErrHeld joined with DeadlineExceeded, never ErrLost (fence.Acquirer's
// contract). With the delay gone the name is free well within Azure's 15s
// lease: the late grants were given back.
func TestLateGrantsAcquireGivesUpAsAWait(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	localOnly(t, e, "needs the fault proxy in front of the Azurite this test run started")
	c, p := e.proxied(t)
	a := newAcquirer(t, c)
	ctx := context.Background()
	name := fencetest.Name("late-wait")
	grantAndRelease(t, e.c, name)
	p.Latency(lateDelay, lateDelay)

	if l, err := a.TryAcquire(ctx, name, azfence.MinAcquirerTTL); !errors.Is(err, fence.ErrLost) || errors.Is(err, fence.ErrHeld) {
		if err == nil {
			t.Fatalf("TryAcquire with every grant late granted token %d (its context: %v)", l.Token(), context.Cause(l.Context()))
		}
		t.Fatalf("TryAcquire of a free name, every grant late: %v, want ErrLost (and not ErrHeld)", err)
	}
	deadline := time.Now().Add(8 * time.Second)
	actx, cancel := context.WithDeadline(ctx, deadline)
	l, err := a.Acquire(actx, name, azfence.MinAcquirerTTL)
	cancel()
	if err == nil {
		t.Fatalf("Acquire with every grant late granted token %d (its context: %v)", l.Token(), context.Cause(l.Context()))
	}
	t.Logf("Acquire: %v (%v after its deadline)", err, time.Since(deadline))
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, fence.ErrLost) {
		t.Errorf("Acquire with every grant late: %v, want ErrHeld joined with DeadlineExceeded (and not ErrLost)", err)
	}

	p.Latency(0, 0)
	b := newAcquirer(t, e.other(t))
	for end := time.Now().Add(5 * time.Second); ; {
		l, err := b.TryAcquire(ctx, name, 15*time.Second)
		if err == nil {
			_ = l.Release(ctx)
			break
		}
		if !errors.Is(err, fence.ErrHeld) {
			t.Fatal(err)
		}
		if time.Now().After(end) {
			t.Fatalf("the name is still held 5s after the late grants (Azure's lease is 15s): they were not given back")
		}
		time.Sleep(50 * time.Millisecond) // polling Azure, not synchronisation
	}
}

// TestLateGrantThenAcquireGranted: a waiting Acquire whose grant comes back
// late (every chunk delayed 400ms each way) gives it back and tries again;
// once the network is fast again it is granted, within its context, a live
// lease with a larger token. The test sees the late grant happen on Azure
// (the blob leased, then released by the give-back) before it removes the
// delay, so an Acquire that answered the late grant's ErrLost would already
// have returned.
func TestLateGrantThenAcquireGranted(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	localOnly(t, e, "needs the fault proxy in front of the Azurite this test run started")
	c, p := e.proxied(t)
	a := newAcquirer(t, c)
	ctx := context.Background()
	name := fencetest.Name("late-then-granted")
	first := grantAndRelease(t, e.c, name)
	p.Latency(lateDelay, lateDelay)

	type result struct {
		l   fence.Lease
		err error
	}
	done := make(chan result, 1)
	actx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	go func() {
		l, err := a.Acquire(actx, name, azfence.MinAcquirerTTL)
		done <- result{l, err}
	}()
	waitLeased(t, e.c, name, true, 10*time.Second, "the late grant")
	waitLeased(t, e.c, name, false, 10*time.Second, "the late grant's give-back")
	p.Latency(0, 0)

	r := <-done
	if r.err != nil {
		t.Fatalf("Acquire after a late grant, with the network fast again: %v, want a grant", r.err)
	}
	defer r.l.Release(ctx)
	if err := r.l.Context().Err(); err != nil {
		t.Fatalf("Acquire returned a lease whose context is done: %v", context.Cause(r.l.Context()))
	}
	if r.l.Token() <= first {
		t.Fatalf("token %d after a late grant, not above the earlier grant's %d", r.l.Token(), first)
	}
	expectHeldBy(t, newAcquirer(t, e.other(t)), name)
}
