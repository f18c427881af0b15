package natsfence_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	natsfence "github.com/fencekit/fencekit/adapters/nats"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/nats-io/nats.go/jetstream"
)

// interfereBeforeCreate runs f once, just before the first create of a grant
// on key is sent (after the grant read the key and wrote or chose its
// marker).
func interfereBeforeCreate(t *testing.T, key string, f func()) *atomic.Int32 {
	t.Helper()
	var n atomic.Int32
	natsfence.SetCreateHook(func(k string) {
		if k == key && n.Add(1) == 1 {
			f()
		}
	})
	t.Cleanup(func() { natsfence.SetCreateHook(nil) })
	return &n
}

// TestOperatorDeleteBetweenMarkerAndCreate: an operator's `kv del` or `kv
// purge` (a marker that never ages out) lands between a grant's marker and
// its create. The grant goes on to one lease (its create refused, it looks
// again and reserves anew), and the name then has one holder: another
// acquirer is refused.
func TestOperatorDeleteBetweenMarkerAndCreate(t *testing.T) {
	ctx := context.Background()
	j := js(t)
	kv := bucket(t, j, lockBucket)
	a := newAcquirer(t, j, lockBucket, nil)
	b := newAcquirer(t, js(t), lockBucket, nil)
	for _, op := range []struct {
		what string
		do   func(key string) error
	}{
		{"kv del", func(key string) error { return kv.Delete(ctx, key) }},
		{"kv purge", func(key string) error { return kv.Purge(ctx, key) }},
	} {
		name := fencetest.Name("opdel")
		key := natsfence.EncodeKey(name)
		n := interfereBeforeCreate(t, key, func() {
			if err := op.do(key); err != nil {
				t.Errorf("%s: %v", op.what, err)
			}
		})
		l, err := a.TryAcquire(ctx, name, 10*time.Second)
		if err != nil {
			t.Fatalf("a grant with an operator's %s before its create: %v", op.what, err)
		}
		if n.Load() < 2 {
			t.Errorf("%s: the grant's first create was not refused (%d creates)", op.what, n.Load())
		}
		if lb, err := b.TryAcquire(ctx, name, 10*time.Second); err == nil {
			t.Fatalf("two holders after an operator's %s: A token %d, B token %d", op.what, l.Token(), lb.Token())
		}
		if err := l.Release(ctx); err != nil {
			t.Fatalf("release: %v", err)
		}
		natsfence.SetCreateHook(nil)
	}
}

// TestBucketRecreatedBetweenMarkerAndCreate: the bucket is
// deleted and re-created after a grant wrote its marker and before its
// create. The grant ends in one lease of the new bucket, with a token above
// every token of the old one, and another acquirer is refused while it
// holds.
func TestBucketRecreatedBetweenMarkerAndCreate(t *testing.T) {
	ctx := context.Background()
	cfg := natsfence.LockBucket("locks-recreated-marker")
	j := js(t)
	a := newAcquirer(t, j, cfg, nil)
	var last fence.Token
	for i := 0; i < 10; i++ {
		l, err := a.TryAcquire(ctx, "warm", 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		last = l.Token()
		_ = l.Release(ctx)
	}
	name := fencetest.Name("recreated-marker")
	key := natsfence.EncodeKey(name)
	var b *natsfence.Acquirer
	var lb fence.Lease
	interfereBeforeCreate(t, key, func() {
		old, err := j.Stream(ctx, "KV_"+cfg.Bucket)
		if err != nil {
			t.Error(err)
			return
		}
		marker := old.CachedInfo().State.LastSeq // the revision A's create expects
		if err := j.DeleteKeyValue(ctx, cfg.Bucket); err != nil {
			t.Error(err)
			return
		}
		if _, err := j.CreateOrUpdateKeyValue(ctx, cfg); err != nil {
			t.Error(err)
			return
		}
		// Another client of the new bucket reserves the key, so the
		// marker it writes has the revision A's create expects.
		bj := js(t)
		b, err = natsfence.NewAcquirer(ctx, bj, cfg.Bucket, nil)
		if err != nil {
			t.Error(err)
			return
		}
		kv, err := bj.KeyValue(ctx, cfg.Bucket)
		if err != nil {
			t.Error(err)
			return
		}
		for i := uint64(1); i < marker; i++ {
			if _, err := kv.Put(ctx, "pad", nil); err != nil {
				t.Error(err)
				return
			}
		}
		if err := kv.Purge(ctx, key, jetstream.PurgeTTL(time.Second)); err != nil {
			t.Error(err)
		}
		if m, err := kv.Get(ctx, "pad"); err != nil || m.Revision() != marker-1 {
			t.Errorf("padding: %v, %v", m, err)
		}
	})
	l, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatalf("a grant across the re-creation: %v", err)
	}
	defer l.Release(ctx)
	if l.Token() <= last {
		t.Fatalf("the grant across the re-creation: token %d, not above the old bucket's %d", l.Token(), last)
	}
	if b == nil {
		t.FailNow()
	}
	if lb, err = b.TryAcquire(ctx, name, 10*time.Second); err == nil {
		t.Fatalf("two holders: A token %d, B token %d", l.Token(), lb.Token())
	}
	li, err := b.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if !li.Held || li.Token != l.Token() {
		t.Fatalf("the new bucket holds %+v, want A's lease, token %d", li, l.Token())
	}
}
