package natsfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/nats-io/nats.go/jetstream"
)

// recreatedWithNewHolder grants A a lease on name in a fresh bucket made
// with cfg, deletes and re-creates the bucket, and grants B the same name in
// the new bucket. On a fresh bucket every first grant has the same revision
// (its marker, then its create), so B's entry sits at the revision A's lease
// last wrote in the bucket that is gone (HAZARDS 1: the revisions restart).
func recreatedWithNewHolder(t *testing.T, cfg jetstream.KeyValueConfig, name string) (a, b, c *natsfence.Acquirer, la, lb fence.Lease) {
	t.Helper()
	ctx := context.Background()
	j := js(t)
	_ = j.DeleteKeyValue(ctx, cfg.Bucket) // a fresh bucket: revisions from 1
	a = newAcquirer(t, j, cfg, nil)
	la, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := j.DeleteKeyValue(ctx, cfg.Bucket); err != nil {
		t.Fatal(err)
	}
	b = newAcquirer(t, js(t), cfg, nil)
	c = newAcquirer(t, js(t), cfg, nil)
	lb, err = b.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatalf("B in the re-created bucket: %v", err)
	}
	t.Cleanup(func() { _ = lb.Release(context.Background()) })
	if lb.Token() <= la.Token() {
		t.Fatalf("B's token %d in the new bucket is not above A's %d", lb.Token(), la.Token())
	}
	return a, b, c, la, lb
}

// TestReleaseAfterBucketRecreatedSparesNewHolder: A holds a lease from a
// bucket that was deleted and re-created; B was granted the name in the new
// bucket. A's Release must not purge B's entry (the key is another grant's:
// ErrLost), else C is granted while B's lease is live: two holders.
func TestReleaseAfterBucketRecreatedSparesNewHolder(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-recreated-release")
	name := fencetest.Name("recreated-release")
	_, _, c, la, lb := recreatedWithNewHolder(t, cfg, name)
	err := la.Release(ctx)
	if lc, cerr := c.TryAcquire(ctx, name, 30*time.Second); cerr == nil {
		defer lc.Release(ctx)
		t.Fatalf("two holders: A's release from the old bucket returned %v and purged B's entry; C was granted token %d while B's lease (token %d, context live: %v) holds", err, lc.Token(), lb.Token(), lb.Context().Err() == nil)
	} else if !errors.Is(cerr, fence.ErrHeld) {
		t.Fatalf("C while B holds: %v, want ErrHeld", cerr)
	}
	if !errors.Is(err, fence.ErrLost) {
		t.Fatalf("A's release from the old bucket: %v, want ErrLost", err)
	}
}

// TestRenewAfterBucketRecreatedSparesNewHolder: as above, A renews instead.
// The renewal must report ErrLost and leave B's entry alone; it must not
// take over B's entry and return nil (two holders: A's context renewed
// while B's is live).
func TestRenewAfterBucketRecreatedSparesNewHolder(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-recreated-renew")
	name := fencetest.Name("recreated-renew")
	_, _, _, la, lb := recreatedWithNewHolder(t, cfg, name)
	err := la.Renew(ctx)
	if err == nil {
		t.Fatalf("two holders: A's renewal from the old bucket (token %d) returned nil over B's entry in the new one (token %d, context live: %v)", la.Token(), lb.Token(), lb.Context().Err() == nil)
	}
	if !errors.Is(err, fence.ErrLost) {
		t.Fatalf("A's renewal from the old bucket: %v, want ErrLost", err)
	}
	if err := lb.Renew(ctx); err != nil {
		t.Fatalf("B's renewal after A's: %v, want nil (B holds)", err)
	}
}
