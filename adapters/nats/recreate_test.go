package natsfence_test

import (
	"bytes"
	"context"
	"errors"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestBucketRecreatedDuringGrant: the lock bucket is deleted and re-created
// after A's create landed in the old bucket and before A reads the bucket's
// creation time for its token. A must not come back with a lease the new
// bucket does not hold, nor with a token that mixes the new creation time
// with the old bucket's revision: B, granted later in the new bucket, would
// hold a smaller token than A's, and A's writes would fence B out.
func TestBucketRecreatedDuringGrant(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-recreated-grant")
	direct := js(t)
	bucket(t, direct, cfg)
	j, p := proxied(t)
	a := newAcquirer(t, j, cfg, nil)
	for i := 0; i < 20; i++ { // move the old bucket's revisions past the new one's first
		l, err := a.TryAcquire(ctx, "warm", 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	name := fencetest.Name("recreated")
	// The read of the creation time after the grant never reaches the
	// server, and the client is kept away until the bucket is re-created.
	p.DropRequest(func(b []byte) bool { return bytes.Contains(b, []byte("STREAM.INFO.KV_"+cfg.Bucket)) })
	p.Refuse(true)
	type result struct {
		l   fence.Lease
		err error
	}
	done := make(chan result, 1)
	go func() {
		l, err := a.TryAcquire(ctx, name, 20*time.Second)
		done <- result{l, err}
	}()
	for giveUp := time.Now().Add(30 * time.Second); p.Pending() != 0; {
		if time.Now().After(giveUp) {
			t.Fatal("the grant never read the bucket's creation time")
		}
		time.Sleep(time.Millisecond)
	}
	if err := direct.DeleteKeyValue(ctx, cfg.Bucket); err != nil {
		t.Fatal(err)
	}
	bucket(t, direct, cfg)
	p.Refuse(false)
	r := <-done
	b := newAcquirer(t, js(t), cfg, nil)
	lb, err := b.TryAcquire(ctx, name, 20*time.Second)
	if r.err != nil {
		t.Logf("A's grant across the re-creation: %v", r.err)
		if err != nil {
			t.Fatalf("A got no lease, and B is refused: %v", err)
		}
		_ = lb.Release(ctx)
		return
	}
	if err == nil {
		t.Fatalf("two holders: A (token %d) came back with a lease across the re-creation, and B was granted after it (token %d)", r.l.Token(), lb.Token())
	}
	if !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("B while A holds: %v, want ErrHeld", err)
	}
	if err := r.l.Release(ctx); err != nil {
		t.Fatalf("A's release: %v", err)
	}
	lb, err = b.TryAcquire(ctx, name, 20*time.Second)
	if err != nil {
		t.Fatalf("B after A released: %v", err)
	}
	defer lb.Release(ctx)
	if lb.Token() <= r.l.Token() {
		t.Fatalf("B, granted after A, holds token %d, not above A's %d", lb.Token(), r.l.Token())
	}
}
