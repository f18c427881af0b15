package gcsfence_test

import (
	"testing"
	"time"

	"cloud.google.com/go/storage"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestTokenAfterLockObjectRestoredFromOlderVersion: with object versioning,
// an operator restores an older generation of a lock object (a copy of the
// noncurrent generation over the live object), whose counter is below the
// tokens granted since. The next grant's token is still above every token
// handed out, so a paused holder of the last grant cannot beat the new
// holder at a fenced writer.
func TestTokenAfterLockObjectRestoredFromOlderVersion(t *testing.T) {
	servers(t, func(t *testing.T, e *gcsEnv) {
		ctx := ctxFor(t)
		if e.url != "" {
			if _, err := e.b().Update(ctx, storage.BucketAttrsToUpdate{VersioningEnabled: true}); err != nil {
				t.Fatalf("enabling object versioning: %v", err)
			}
		} else if ba, err := e.b().Attrs(ctx); err != nil || !ba.VersioningEnabled {
			t.Skipf("bucket %s has no object versioning (%v): the restore is not tested", e.bucket, err)
		}
		a, w := newAcquirer(t, e), newWriter(t, e, nil)
		name, key := fencetest.Name("restore"), fencetest.Name("data")
		obj := e.b().Object("fencekit-locks/" + name)
		l1, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if err := l1.Release(ctx); err != nil {
			t.Fatal(err)
		}
		old, err := obj.Attrs(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var last uint64
		for range 3 { // grants after the version that will be restored
			l, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if err := w.Write(ctx, key, []byte("v"), l.Token()); err != nil {
				t.Fatal(err)
			}
			last = uint64(l.Token())
			if err := l.Release(ctx); err != nil {
				t.Fatal(err)
			}
		}
		restored, err := obj.CopierFrom(obj.Generation(old.Generation)).Run(ctx)
		if err != nil {
			t.Fatalf("restoring generation %d of the lock object: %v", old.Generation, err)
		}
		t.Logf("restored generation %d (token %s) as generation %d", old.Generation, old.Metadata["fence-token"], restored.Generation)
		l, err := newAcquirer(t, e).TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Release(ctx)
		if uint64(l.Token()) <= last {
			t.Errorf("grant after the restore of an older version: token %d, want above the last token handed out, %d", l.Token(), last)
		}
		if err := w.Write(ctx, key, []byte("new"), l.Token()); err != nil {
			t.Errorf("the new holder's write with token %d: %v", l.Token(), err)
		}
	})
}
