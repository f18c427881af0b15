package gcsfence_test

import (
	"context"
	"errors"
	"io"
	"testing"

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
