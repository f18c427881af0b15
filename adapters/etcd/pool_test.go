package etcdfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	etcdfence "github.com/fencekit/fencekit/adapters/etcd"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/etcdtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// pooledAfterRelease grants name for ttl and releases it, and returns the
// etcd lease the pool then holds for ttl and its send time; it fails the
// test when the release pooled nothing (a release late in its lease's
// window pools it after a keep-alive: this waits up to a second for it).
func pooledAfterRelease(t *testing.T, a *etcdfence.Acquirer, name string, ttl time.Duration) (int64, time.Time) {
	t.Helper()
	ctx := context.Background()
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	id, sent, ok := etcdfence.PooledLease(a, ttl)
	for deadline := time.Now().Add(time.Second); !ok; id, sent, ok = etcdfence.PooledLease(a, ttl) {
		if time.Now().After(deadline) {
			t.Fatal("the release pooled no lease")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if id != etcdfence.LeaseID(l) {
		t.Fatalf("the pool holds lease %x, the released grant had %x", id, etcdfence.LeaseID(l))
	}
	return id, sent
}

// leaseAlive reports whether etcd still has lease id.
func leaseAlive(t *testing.T, cl *clientv3.Client, id int64) bool {
	t.Helper()
	resp, err := cl.TimeToLive(context.Background(), clientv3.LeaseID(id))
	if err != nil {
		t.Fatal(err)
	}
	return resp.TTL > 0
}

// waitLeases waits until etcd has at most n leases, as the cluster tells
// it, and fails the test after within.
func waitLeases(t *testing.T, cl *clientv3.Client, n int, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		resp, err := cl.Leases(context.Background())
		if err == nil && len(resp.Leases) <= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("etcd has %d leases after %v (%v), want at most %d", len(resp.Leases), within, err, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestPooledLeaseRevokedBehindThePool (HAZARDS 6): the etcd lease in the
// pool is revoked by someone else (an operator); the next grant must not
// fail for it, nor hand out a lease etcd no longer has: it is granted on a
// live etcd lease of its own, holds the name, and renews.
func TestPooledLeaseRevokedBehindThePool(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	a, _ := etcdfence.New(cl, nil)
	ctx := context.Background()
	name := fencetest.Name("pool-revoked")
	const ttl = 30 * time.Second
	id, _ := pooledAfterRelease(t, a, name, ttl)
	if _, err := cl.Revoke(ctx, clientv3.LeaseID(id)); err != nil {
		t.Fatal(err)
	}
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("TryAcquire after the pooled lease was revoked: %v, want a grant on a lease of its own", err)
	}
	defer l.Release(ctx)
	if got := etcdfence.LeaseID(l); got == id || !leaseAlive(t, cl, got) {
		t.Fatalf("granted on etcd lease %x (the revoked one: %x), alive %v", got, id, got != id && leaseAlive(t, cl, got))
	}
	if err := l.Renew(ctx); err != nil {
		t.Fatalf("Renew: %v", err)
	}
	if _, err := a.TryAcquire(ctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("while it holds: %v, want ErrHeld", err)
	}
}

// TestPooledLeaseDeadlineCountsFromItsSend (HAZARDS 2): a grant on a pooled
// lease gets the local deadline of that lease's etcd clock, which started
// when its grant was sent, not when the pool handed it out: its context has
// ended by that send time plus the ttl less the drift margin, before etcd
// can expire the lease and grant the name to anyone else.
func TestPooledLeaseDeadlineCountsFromItsSend(t *testing.T) {
	c := etcdtest.Start(t, 1)
	a, _ := etcdfence.New(c.Client(t), nil)
	// A pooled lease is handed out within a tenth of its ttl; here within
	// three quarters, so that a loaded machine's pause between the release
	// and the grant below (up to 2.5s) does not make the grant take a
	// lease of its own.
	etcdfence.SetPoolWindow(a, func(ttl time.Duration) time.Duration { return ttl * 3 / 4 })
	ctx := context.Background()
	name := fencetest.Name("pool-deadline")
	const ttl = 4 * time.Second
	id, sent := pooledAfterRelease(t, a, name, ttl)
	// Age the pooled lease by 500ms: the point of the test (its hand-out
	// comes that much after its send), not a synchronisation.
	time.Sleep(time.Until(sent.Add(500 * time.Millisecond)))
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	if etcdfence.LeaseID(l) != id {
		t.Fatalf("the pooled lease was not used (%v after its send, within its 3s window): lease %x, pooled %x", time.Since(sent), etcdfence.LeaseID(l), id)
	}
	deadline := sent.Add(ttl - leasekitDrift(ttl))
	time.Sleep(time.Until(deadline) + time.Millisecond)
	if err := l.Context().Err(); err == nil {
		t.Fatalf("the lease's context is live %v after its etcd lease's grant was sent plus the ttl less the drift: its local deadline counts from the hand-out", time.Since(sent))
	}
}

// leasekitDrift is the default drift margin (leasekit.DefaultDrift).
func leasekitDrift(ttl time.Duration) time.Duration { return ttl/100 + 2*time.Millisecond }

// TestPooledLeaseUnusedIsRevoked: a pooled lease that no grant takes within
// a tenth of its ttl is revoked, long before its ttl, and the next grant
// takes a lease of its own.
func TestPooledLeaseUnusedIsRevoked(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	a, _ := etcdfence.New(cl, nil)
	ctx := context.Background()
	name := fencetest.Name("pool-stale")
	const ttl = 10 * time.Second
	id, _ := pooledAfterRelease(t, a, name, ttl)
	deadline := time.Now().Add(ttl / 2)
	for leaseAlive(t, cl, id) {
		if time.Now().After(deadline) {
			t.Fatalf("the pooled lease, unused, still lives %v after its release (window %v)", ttl/2, ttl/10)
		}
		time.Sleep(20 * time.Millisecond)
	}
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if etcdfence.LeaseID(l) == id || !leaseAlive(t, cl, etcdfence.LeaseID(l)) {
		t.Fatalf("granted on lease %x (stale: %x)", etcdfence.LeaseID(l), id)
	}
	_ = l.Release(ctx)
}

// TestPooledLeaseNotTouchedByTheOldGrant: a grant whose release pooled its
// etcd lease may be released and renewed again (ErrLost), and that must not
// touch the lease the next grant now holds: the next grant's key and lease
// stay, and the name stays held.
func TestPooledLeaseNotTouchedByTheOldGrant(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	a, _ := etcdfence.New(cl, nil)
	other, _ := etcdfence.New(c.Client(t), nil)
	ctx := context.Background()
	name := fencetest.Name("pool-old")
	const ttl = 30 * time.Second
	l1, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if err := l1.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l2, err := a.TryAcquire(ctx, name+"-2", ttl)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Release(ctx)
	if etcdfence.LeaseID(l2) != etcdfence.LeaseID(l1) {
		t.Fatalf("the second grant did not take the pooled lease (%x, first %x)", etcdfence.LeaseID(l2), etcdfence.LeaseID(l1))
	}
	if err := l1.Release(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("second Release: %v, want ErrLost", err)
	}
	if err := l1.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("Renew after Release: %v, want ErrLost", err)
	}
	if !leaseAlive(t, cl, etcdfence.LeaseID(l2)) {
		t.Fatal("the old grant's second Release revoked the etcd lease the next grant holds")
	}
	if _, err := other.TryAcquire(ctx, name+"-2", ttl); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("while the second grant holds: %v, want ErrHeld", err)
	}
	if err := l2.Renew(ctx); err != nil {
		t.Errorf("the second grant's Renew: %v", err)
	}
}

// TestUnconfirmedRenewalNotPooled (HAZARDS 3): a lease whose renewal was
// not confirmed (its keep-alive held by a partition: it may land later) is
// revoked at its release, never pooled, so a late keep-alive cannot extend
// the next holder's etcd lease.
func TestUnconfirmedRenewalNotPooled(t *testing.T) {
	_, cl, b, p, name := faultSetup(t, "pool-unconfirmed")
	ctx := context.Background()
	const ttl = 30 * time.Second
	l, err := b.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	p.Partition()
	rctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	err = l.Renew(rctx)
	cancel()
	p.Heal()
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("renew under a partition: %v, want ErrUnknown", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatalf("release: %v", err)
	}
	if id, _, ok := etcdfence.PooledLease(b, ttl); ok {
		t.Fatalf("the pool holds lease %x after a renewal that was not confirmed", id)
	}
	if leaseAlive(t, cl, etcdfence.LeaseID(l)) {
		t.Fatal("the release left the etcd lease alive")
	}
}

// TestPoolLeaksNoLease: grants and releases of one ttl, in sequence and two
// at a time, and TryAcquires that lose leave at most the one pooled etcd
// lease behind, and none once the acquirer is closed (a grant after Close
// pools nothing).
func TestPoolLeaksNoLease(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	a, _ := etcdfence.New(cl, nil)
	ctx := context.Background()
	name := fencetest.Name("pool-leak")
	const ttl = 30 * time.Second // longer than the test: a leaked lease stays
	for i := 0; i < 5; i++ {
		l, err := a.TryAcquire(ctx, name, ttl)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := a.TryAcquire(ctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("a second TryAcquire: %v, want ErrHeld", err)
		}
		l2, err := a.TryAcquire(ctx, name+"-b", ttl)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if err := l2.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	waitLeases(t, cl, 1, 5*time.Second)
	if err := a.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("TryAcquire after Close: %v", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	waitLeases(t, cl, 0, 5*time.Second)
	if err := a.Close(ctx); err != nil {
		t.Fatalf("a second Close: %v", err)
	}
}

// TestPooledWaiterLeaseRevokedBehindThePool (HAZARDS 6): a waiter's lease,
// pooled once the waiter's key moved onto the lock's lease, is revoked by
// someone else; the next waiter must not fail for it: it waits in line on a
// lease of its own and is granted after the holder's release.
func TestPooledWaiterLeaseRevokedBehindThePool(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	a, _ := etcdfence.New(cl, nil)
	ctx := context.Background()
	name := fencetest.Name("pool-waiter")
	const ttl = 30 * time.Second
	// One waiter's turn: its waiter lease goes to the pool.
	h, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	res := acquireAsync(a, name, 20*time.Second)
	waitLine(t, cl, name, 2)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-res
	if r.err != nil {
		t.Fatal(r.err)
	}
	var w int64
	for deadline, ok := time.Now().Add(time.Second), false; !ok; {
		if w, _, ok = etcdfence.PooledLease(a, etcdfence.WaiterTTL); !ok && time.Now().After(deadline) {
			t.Fatal("the waiter's lease was not pooled after its key moved")
		} else if !ok {
			time.Sleep(5 * time.Millisecond)
		}
	}
	if _, err := cl.Revoke(ctx, clientv3.LeaseID(w)); err != nil {
		t.Fatal(err)
	}
	// The next waiter would take that lease.
	res = acquireAsync(a, name, 20*time.Second)
	for deadline := time.Now().Add(20 * time.Second); ; {
		select {
		case r2 := <-res:
			t.Fatalf("a waiter after the pooled waiter lease was revoked, while the name is held: %v, %v; want it in line", r2.l, r2.err)
		default:
		}
		resp, err := cl.Get(ctx, linePrefix(name), clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err == nil && resp.Count == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the waiter did not join the line: %v, %v", resp, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := r.l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r2 := <-res
	if r2.err != nil {
		t.Fatalf("a waiter after the pooled waiter lease was revoked: %v, want a grant", r2.err)
	}
	if r2.l.Token() <= r.l.Token() || r2.l.Context().Err() != nil {
		t.Fatalf("token %d after %d, context %v", r2.l.Token(), r.l.Token(), r2.l.Context().Err())
	}
	other, _ := etcdfence.New(c.Client(t), nil)
	heldThenFree(t, other, r2.l, name)
}

// TestPooledLeaseAcrossLeaderLoss: a lease pooled before the leader of a
// 3-member cluster stops is used (or, past its window, replaced) after the
// new leader takes over: the grant holds the name on a live etcd lease with
// a larger token, and the pooled lease's end stays under the pool's control.
func TestPooledLeaseAcrossLeaderLoss(t *testing.T) {
	c := etcdtest.Start(t, 3)
	cl := c.Client(t)
	a, _ := etcdfence.New(cl, nil)
	ctx := context.Background()
	name := fencetest.Name("pool-leader")
	const ttl = 30 * time.Second // window 3s: longer than an election here
	l0, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if err := l0.Release(ctx); err != nil {
		t.Fatal(err)
	}
	leader := c.Leader()
	if leader < 0 {
		t.Fatal("no leader")
	}
	c.StopNode(leader)
	tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	l, err := a.Acquire(tctx, name, ttl)
	if err != nil {
		t.Fatalf("after the leader stopped: %v", err)
	}
	defer l.Release(ctx)
	t.Logf("granted on lease %x (pooled: %v)", etcdfence.LeaseID(l), etcdfence.LeaseID(l) == etcdfence.LeaseID(l0))
	if l.Token() <= l0.Token() || l.Context().Err() != nil {
		t.Fatalf("token %d after %d, context %v", l.Token(), l0.Token(), l.Context().Err())
	}
	if !leaseAlive(t, cl, etcdfence.LeaseID(l)) {
		t.Fatal("granted on an etcd lease the cluster does not have")
	}
	other, _ := etcdfence.New(c.Client(t), nil)
	if _, err := other.TryAcquire(tctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("while it holds: %v, want ErrHeld", err)
	}
}
