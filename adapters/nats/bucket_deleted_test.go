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

// TestRenewAndReleaseAfterBucketDeletedNotRecreated (HAZARDS 1 and 6): the
// lock bucket is deleted while A holds a lease and is not re-created. A's
// Renew reports ErrLost at once (not ErrUnknown after retrying, not a stall)
// and ends A's context; A's Release reports ErrLost too.
func TestRenewAndReleaseAfterBucketDeletedNotRecreated(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-deleted-gone")
	name := fencetest.Name("deleted-gone")
	j := js(t)
	_ = j.DeleteKeyValue(ctx, cfg.Bucket)
	a := newAcquirer(t, j, cfg, nil)
	la, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := j.DeleteKeyValue(ctx, cfg.Bucket); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	err = la.Renew(rctx)
	if !errors.Is(err, fence.ErrLost) {
		t.Fatalf("Renew after the bucket was deleted: %v (after %v), want ErrLost", err, time.Since(start))
	}
	if errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("Renew after the bucket was deleted matches ErrUnknown too: %v", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("Renew took %v to find the bucket gone", d)
	}
	if la.Context().Err() == nil {
		t.Fatal("A's context is live after its Renew returned ErrLost")
	}
	if err := la.Release(rctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("Release after the bucket was deleted: %v, want ErrLost", err)
	}
}
