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

// TestRenewLostAfterKeyDeletedAndRegrantedFromThePool: A
// holds the name; an operator deletes A's key and B, granted by the same
// acquirer on an etcd lease from its pool, takes the name. A's next Renew
// returns ErrLost and ends A's context; the revoke of A's etcd lease must
// not touch B's: B renews, still holds the name, and A's Release neither
// frees B's name nor reports success.
func TestRenewLostAfterKeyDeletedAndRegrantedFromThePool(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	a, _ := etcdfence.NewAcquirer(cl, nil)
	ctx := context.Background()
	name := fencetest.Name("key-deleted-pool")
	const ttl = 30 * time.Second
	// One lease of this ttl in the pool, for B.
	pooled, _ := pooledAfterRelease(t, a, fencetest.Name("key-deleted-other"), ttl)

	la, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if etcdfence.LeaseID(la) == pooled {
		// A took the pooled lease; pool another for B.
		pooled, _ = pooledAfterRelease(t, a, fencetest.Name("key-deleted-other2"), ttl)
	}
	if _, err := cl.Delete(ctx, "/fencekit/locks/", clientv3.WithPrefix()); err != nil {
		t.Fatal(err)
	}
	lb, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("TryAcquire after the key was deleted: %v", err)
	}
	defer lb.Release(ctx)
	if etcdfence.LeaseID(lb) != pooled {
		t.Logf("B on lease %x, pooled was %x", etcdfence.LeaseID(lb), pooled)
	}
	if lb.Token() <= la.Token() {
		t.Fatalf("B's token %d not above A's %d", lb.Token(), la.Token())
	}
	if err := la.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("A's Renew after its key was deleted and B granted: %v, want ErrLost", err)
	}
	if la.Context().Err() == nil {
		t.Fatal("A's context is live after its Renew returned ErrLost, while B holds the name")
	}
	if err := la.Release(ctx); err == nil {
		t.Fatal("A's Release after its key was deleted: nil, want an error (ErrLost)")
	}
	waitLeaseGone(t, cl, etcdfence.LeaseID(la), 10*time.Second)
	if !leaseAlive(t, cl, etcdfence.LeaseID(lb)) {
		t.Fatal("B's etcd lease is gone after A's lost Renew")
	}
	if err := lb.Renew(ctx); err != nil {
		t.Fatalf("B's Renew after A's lost Renew and Release: %v", err)
	}
	if lb.Context().Err() != nil {
		t.Fatal("B's context ended")
	}
	if _, err := a.TryAcquire(ctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("a third grant while B holds: %v, want ErrHeld", err)
	}
}

// TestRenewLostAfterOperatorRevokedTheLease: an operator revokes
// A's etcd lease (etcdctl lease revoke) while A holds the name. The name is
// free at once (B is granted); A's next Renew returns ErrLost and ends its
// context, and B keeps the name through A's Release.
func TestRenewLostAfterOperatorRevokedTheLease(t *testing.T) {
	c := etcdtest.Start(t, 1)
	cl := c.Client(t)
	a, _ := etcdfence.NewAcquirer(cl, nil)
	b, _ := etcdfence.NewAcquirer(c.Client(t), nil)
	ctx := context.Background()
	name := fencetest.Name("operator-revoke")
	const ttl = 30 * time.Second
	la, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Revoke(ctx, clientv3.LeaseID(etcdfence.LeaseID(la))); err != nil {
		t.Fatal(err)
	}
	lb, err := b.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatalf("TryAcquire after A's lease was revoked: %v", err)
	}
	defer lb.Release(ctx)
	if err := la.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("A's Renew after its etcd lease was revoked: %v, want ErrLost", err)
	}
	if la.Context().Err() == nil {
		t.Fatal("A's context is live after its Renew returned ErrLost")
	}
	if err := la.Release(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("A's Release: %v, want ErrLost", err)
	}
	if err := lb.Renew(ctx); err != nil {
		t.Fatalf("B's Renew: %v", err)
	}
	if _, err := a.TryAcquire(ctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("a third grant while B holds: %v, want ErrHeld", err)
	}
}

// waitLeaseGone waits until etcd no longer has lease id.
func waitLeaseGone(t *testing.T, cl *clientv3.Client, id int64, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for leaseAlive(t, cl, id) {
		if time.Now().After(deadline) {
			t.Fatalf("etcd lease %x still alive after %v", id, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
