package etcdfence_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
)

// TestTryAcquireLookupPastLocalDeadline: a TryAcquire whose
// create transaction landed with its answer lost looks for its key, and that
// lookup is tried again while etcd cannot be reached (a partition of 1.5s
// from the moment the create was sent). When it finds the key, the lease's
// local deadline (ttl 1.2s) has passed, though etcd (which rounds the ttl up
// to 2s) still holds the key: TryAcquire must not return that lease with a
// nil error, and the name must not stay held by it.
func TestTryAcquireLookupPastLocalDeadline(t *testing.T) {
	a, _, b, p, name := faultSetup(t, "lookup")
	ctx := context.Background()
	if _, err := b.Inspect(ctx, name); err != nil { // connects b's client
		t.Fatal(err)
	}
	const ttl, partition = 1200 * time.Millisecond, 1500 * time.Millisecond
	pfx := []byte(linePrefix(name))
	sent := make(chan struct{}, 1)
	p.LoseReply(func(req []byte) bool {
		if !bytes.Contains(req, pfx) {
			return false
		}
		sent <- struct{}{}
		return true
	})
	type result struct {
		l   fence.Lease
		err error
	}
	res := make(chan result, 1)
	go func() {
		tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
		l, err := b.TryAcquire(tctx, name, ttl)
		res <- result{l, err}
	}()
	select {
	case <-sent:
	case <-time.After(10 * time.Second):
		t.Fatal("TryAcquire sent no create transaction")
	}
	p.Partition()
	time.Sleep(partition) // the fault's length, not a synchronisation
	p.Heal()
	r := <-res
	if p.Pending() != 0 {
		t.Fatal("the lost reply never fired")
	}
	if r.err == nil {
		t.Logf("TryAcquire returned token %d, lease context %v", r.l.Token(), context.Cause(r.l.Context()))
		if r.l.Context().Err() != nil {
			t.Errorf("TryAcquire returned a lease already past its local deadline with a nil error: %v", context.Cause(r.l.Context()))
		}
		_ = r.l.Release(ctx)
		return
	}
	t.Logf("TryAcquire: %v", r.err)
	// Not granted: nothing holds the name afterwards. (Here etcd's own
	// expiry of the 2s lease is only about 0.5s away, so this cannot tell
	// the revoke from it; it shows no other key was left behind.)
	actx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	l, err := a.Acquire(actx, name, 30*time.Second)
	if err != nil {
		t.Fatalf("the name after a TryAcquire that was not granted: %v, want it free", err)
	}
	_ = l.Release(ctx)
}

// TestWaiterKeepsItsPlaceAfterACut: the first waiter, whose
// connection is cut while it waits, keeps its place ahead of a second waiter
// that joined after it: after the holder's release the first is granted,
// and the second still waits until the first releases.
func TestWaiterKeepsItsPlaceAfterACut(t *testing.T) {
	a, cl, b, p, name := faultSetup(t, "fifo")
	ctx := context.Background()
	h, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	seen := holderRequests(t, cl, p, name)
	first := acquireAsync(b, name, 20*time.Second)
	waitLine(t, cl, name, 2)
	second := acquireAsync(a, name, 20*time.Second)
	waitLine(t, cl, name, 3)
	cutUntilBack(t, p, seen, false) // the first waiter is back
	waitLine(t, cl, name, 3)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-first
	if r.err != nil {
		t.Fatalf("the first waiter after a cut and the holder's release: %v", r.err)
	}
	waitLine(t, cl, name, 2) // the first's key (now the lock's) and the second's
	select {
	case r2 := <-second:
		t.Fatalf("the second waiter was answered while the first holds: %v, %v", r2.l, r2.err)
	default:
	}
	if err := r.l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r2 := <-second
	if r2.err != nil {
		t.Fatalf("the second waiter after the first's release: %v", r2.err)
	}
	if !(h.Token() < r.l.Token() && r.l.Token() < r2.l.Token()) {
		t.Errorf("tokens %d, %d, %d: want them in line order", h.Token(), r.l.Token(), r2.l.Token())
	}
	_ = r2.l.Release(ctx)
}
