package gcsfence_test

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"cloud.google.com/go/storage"
	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestWriteRefusedAfterMetadataChanged: an object whose token metadata was
// removed or lowered after its upload (objects.patch by another tool; the
// body and generation unchanged) never lets a lower token through, and Read
// does not report the changed token.
func TestWriteRefusedAfterMetadataChanged(t *testing.T) {
	servers(t, func(t *testing.T, e *gcsEnv) {
		for _, c := range []struct{ name, token string }{{"removed", ""}, {"lowered", "1"}} {
			t.Run(c.name, func(t *testing.T) {
				ctx := context.Background()
				w := newWriter(t, e, nil)
				key := fencetest.Name("meta")
				if err := w.Write(ctx, key, []byte("ten"), 10); err != nil {
					t.Fatal(err)
				}
				// An empty value deletes the key on GCS (fake-gcs-server
				// keeps it, empty).
				if _, err := e.b().Object(key).Update(ctx, storage.ObjectAttrsToUpdate{Metadata: map[string]string{gcsfence.MetaToken: c.token}}); err != nil {
					t.Fatal(err)
				}
				err := w.Write(ctx, key, []byte("five"), 5)
				var se *fence.StaleError
				if err == nil || (!errors.As(err, &se) && !errors.Is(err, gcsfence.ErrMetadataChanged)) {
					t.Errorf("Write(token 5) after token 10 and the token metadata %s: %v, want a refusal (stale, or ErrMetadataChanged)", c.name, err)
				}
				r, err := e.b().Object(key).NewReader(ctx)
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(r)
				r.Close()
				if string(body) != "ten" {
					t.Errorf("the object holds %q after the refused write, want \"ten\"", body)
				}
				if v, tok, err := w.Read(ctx, key); err == nil && tok < 10 {
					t.Errorf("Read = %q token %d, want token 10 or an error", v, tok)
				}
			})
		}
	})
}

// TestObjectDeletedByHand records what the README says: an
// object deleted other than by Delete takes its token with it, and the next
// write of a lower token creates it again. (Delete's tombstone keeps it.)
func TestObjectDeletedByHand(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	w := newWriter(t, e, nil)
	key := fencetest.Name("byhand")
	if err := w.Write(ctx, key, []byte("new"), 9); err != nil {
		t.Fatal(err)
	}
	if err := w.Delete(ctx, key, 9); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, key, []byte("stale"), 3); !errors.Is(err, fence.ErrStale) {
		t.Fatalf("a lower token after Delete = %v, want ErrStale", err)
	}
	if err := e.b().Object(key).Delete(ctx); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, key, []byte("stale"), 3); err != nil {
		t.Fatalf("a lower token after the object was deleted by hand = %v; the README says it is accepted", err)
	}
}

// lockMetadataEdits are patches of a lock object's metadata in place
// (objects.patch by another tool: the generation and the body stay), made
// while the lease is held or after its release. A value "" removes the key.
var lockMetadataEdits = []struct {
	name  string
	held  bool
	patch map[string]string
}{
	{"holder removed while held", true, map[string]string{"fence-holder": "", "fence-ttl-ns": ""}},
	{"ttl shortened while held", true, map[string]string{"fence-ttl-ns": "1"}},
	{"everything removed while held", true, map[string]string{"fencekit": "", "fence-token": "", "fence-holder": "", "fence-ttl-ns": "", "fence-owner": "", "note": "by hand"}},
	{"token lowered while held", true, map[string]string{"fence-token": "1"}},
	{"token lowered after release", false, map[string]string{"fence-token": "1"}},
	{"token removed after release", false, map[string]string{"fence-token": "", "note": "by hand"}},
	{"holder set after release", false, map[string]string{"fence-holder": "someone", "fence-ttl-ns": "1"}},
}

// TestGrantAfterLockMetadataReplaced: a lock object whose metadata another
// tool patched in place never yields two holders (a live lease made to look
// free, or expired, is still held) nor a token at or below one already
// handed out: the next grant's token is above the last.
func TestGrantAfterLockMetadataReplaced(t *testing.T) {
	servers(t, func(t *testing.T, e *gcsEnv) {
		for _, edit := range lockMetadataEdits {
			t.Run(edit.name, func(t *testing.T) {
				ctx := ctxFor(t)
				a, other := newAcquirer(t, e), newAcquirer(t, e)
				name := fencetest.Name("meta")
				obj := e.b().Object("fencekit-locks/" + name)
				l0, err := a.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				if err := l0.Release(ctx); err != nil {
					t.Fatal(err)
				}
				l, err := a.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				if !edit.held {
					if err := l.Release(ctx); err != nil {
						t.Fatal(err)
					}
				}
				before, err := obj.Attrs(ctx)
				if err != nil {
					t.Fatal(err)
				}
				after, err := obj.Update(ctx, storage.ObjectAttrsToUpdate{Metadata: edit.patch})
				if err != nil {
					t.Fatalf("patching the lock object's metadata: %v", err)
				}
				if after.Generation != before.Generation {
					t.Fatalf("the patch made generation %d of %d: not an edit in place", after.Generation, before.Generation)
				}
				t.Logf("metadata %v -> %v (metageneration %d)", before.Metadata, after.Metadata, after.Metageneration)
				if edit.held {
					if l2, err := other.TryAcquire(ctx, name, time.Minute); !errors.Is(err, fence.ErrHeld) {
						if l2 != nil {
							t.Errorf("granted token %d while token %d is held: two holders", l2.Token(), l.Token())
							_ = l2.Release(ctx)
						}
						t.Fatalf("TryAcquire while held, after the metadata patch: %v, want ErrHeld", err)
					}
					if info, err := other.Inspect(ctx, name); err != nil || !info.Held || info.Token != l.Token() {
						t.Errorf("Inspect while held, after the metadata patch: %+v, %v; want held at token %d", info, err, l.Token())
					}
					if err := l.Release(ctx); err != nil {
						t.Fatalf("Release after the metadata patch: %v", err)
					}
				}
				l2, err := other.TryAcquire(ctx, name, time.Minute)
				if err != nil {
					t.Fatalf("TryAcquire after the release: %v", err)
				}
				defer l2.Release(ctx)
				if l2.Token() <= l.Token() {
					t.Errorf("grant after the metadata patch: token %d, want above the earlier grant's %d", l2.Token(), l.Token())
				}
			})
		}
	})
}
