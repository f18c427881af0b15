package gcsfence_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
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

// putOldFormatLock writes name's lock object as older versions of gcsfence
// did: an empty body, the whole state in the custom metadata.
func putOldFormatLock(t *testing.T, e *gcsEnv, name string, meta map[string]string) *storage.ObjectAttrs {
	t.Helper()
	wr := e.b().Object("fencekit-locks/" + name).NewWriter(context.Background())
	wr.Metadata = meta
	wr.ContentType = "application/octet-stream"
	if err := wr.Close(); err != nil {
		t.Fatalf("writing an old-format lock object: %v", err)
	}
	return wr.Attrs()
}

// TestOldFormatLockObjectHeldStaysHeld: a lock object written by an older
// gcsfence (empty body, state only in its metadata) that records a live
// holder is still held for the new acquirer, and Inspect reports that holder.
func TestOldFormatLockObjectHeldStaysHeld(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	name := fencetest.Name("old-held")
	putOldFormatLock(t, e, name, map[string]string{"fencekit": "lock-v1", "fence-token": "7", "fence-owner": "old",
		"fence-holder": "oldnonce", "fence-ttl-ns": strconv.FormatInt(int64(time.Minute), 10)})
	a := newAcquirer(t, e)
	if l, err := a.TryAcquire(ctx, name, time.Minute); !errors.Is(err, fence.ErrHeld) {
		if l != nil {
			t.Errorf("granted token %d while the old-format holder of token 7 is live: two holders", l.Token())
		}
		t.Fatalf("TryAcquire on an old-format lock held for a minute: %v, want ErrHeld", err)
	}
	info, err := a.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != 7 || info.Owner != "old" {
		t.Errorf("Inspect of an old-format held lock = %+v, %v; want held by \"old\" at token 7", info, err)
	}
}

// TestOldFormatLockObjectNextTokenAboveItsCounter: a released or expired
// lock object of the older format gives a token above its counter, and a
// fenced write of that counter's token (made before the upgrade) is refused
// once the new holder wrote.
func TestOldFormatLockObjectNextTokenAboveItsCounter(t *testing.T) {
	e := fakeGCS(t)
	for _, c := range []struct {
		name string
		meta map[string]string
	}{
		{"released", map[string]string{"fencekit": "lock-v1", "fence-token": "1000", "fence-owner": "old"}},
		{"expired", map[string]string{"fencekit": "lock-v1", "fence-token": "1000", "fence-owner": "old", "fence-holder": "oldnonce", "fence-ttl-ns": strconv.FormatInt(int64(100*time.Millisecond), 10)}},
		{"new", map[string]string{"fencekit": "lock-v1", "fence-token": "0", "fence-owner": "old", "fence-new": "1"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := ctxFor(t)
			name, key := fencetest.Name("old-free"), fencetest.Name("data")
			w := newWriter(t, e, nil)
			if err := w.Write(ctx, key, []byte("before the upgrade"), 1000); err != nil {
				t.Fatal(err)
			}
			putOldFormatLock(t, e, name, c.meta)
			time.Sleep(150 * time.Millisecond) // past the expired holder's ttl
			l, err := newAcquirer(t, e).Acquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatalf("Acquire on an old-format %s lock: %v", c.name, err)
			}
			defer l.Release(ctx)
			if l.Token() <= 1000 {
				t.Fatalf("grant on an old-format %s lock at counter 1000: token %d", c.name, l.Token())
			}
			if err := w.Write(ctx, key, []byte("new holder"), l.Token()); err != nil {
				t.Fatalf("the new holder's write with token %d: %v", l.Token(), err)
			}
			if err := w.Write(ctx, key, []byte("stale"), 1000); !errors.Is(err, fence.ErrStale) {
				t.Fatalf("a write of the pre-upgrade token 1000 after the new holder's: %v, want ErrStale", err)
			}
		})
	}
}

// metagenerationBump answers every attributes read of one object with a
// metageneration of 2, as GCS does once an object's metadata was patched in
// place (fake-gcs-server always answers 1).
type metagenerationBump struct {
	next   http.Handler
	object string // URL-escaped object name
}

func (m metagenerationBump) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet || !strings.Contains(r.URL.EscapedPath(), "/o/"+m.object) {
		m.next.ServeHTTP(w, r)
		return
	}
	rec := httptest.NewRecorder()
	m.next.ServeHTTP(rec, r)
	body := strings.ReplaceAll(rec.Body.String(), `"metageneration":"1"`, `"metageneration":"2"`)
	for k, v := range rec.Header() {
		if k != "Content-Length" {
			w.Header()[k] = v
		}
	}
	w.WriteHeader(rec.Code)
	_, _ = w.Write([]byte(body))
}

// TestOldFormatLockObjectEditedIsRefusedWithErrMetadataChanged: a lock
// object of the older format (empty body) whose metadata GCS reports
// edited (metageneration above 1) is refused with an error matching
// ErrMetadataChanged, as the package documents, whatever the edit removed;
// nothing is granted on it.
func TestOldFormatLockObjectEditedIsRefusedWithErrMetadataChanged(t *testing.T) {
	for _, c := range []struct {
		name string
		meta map[string]string
	}{
		{"token lowered", map[string]string{"fencekit": "lock-v1", "fence-token": "1", "fence-owner": "old"}},
		{"holder removed", map[string]string{"fencekit": "lock-v1", "fence-token": "7", "fence-owner": "old"}},
		{"everything removed", map[string]string{"note": "by hand"}},
		{"format key removed", map[string]string{"fence-token": "7", "fence-owner": "old", "fence-holder": "oldnonce", "fence-ttl-ns": strconv.FormatInt(int64(time.Minute), 10)}},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := fakeGCS(t)
			name := fencetest.Name("old-edited")
			e.f.next = metagenerationBump{next: e.f.next, object: strings.ReplaceAll("fencekit-locks/"+name, "/", "%2F")}
			ctx := ctxFor(t)
			attrs := putOldFormatLock(t, e, name, c.meta)
			got, err := e.b().Object(attrs.Name).Attrs(ctx)
			if err != nil || got.Metageneration != 2 {
				t.Fatalf("the edited object reads metageneration %v (%v), want 2", got, err)
			}
			l, err := newAcquirer(t, e).TryAcquire(ctx, name, time.Minute)
			if l != nil {
				t.Errorf("granted token %d on an edited old-format lock object", l.Token())
				_ = l.Release(ctx)
			}
			if !errors.Is(err, gcsfence.ErrMetadataChanged) {
				t.Errorf("TryAcquire on an old-format lock object with its metadata edited (%s): %v, want ErrMetadataChanged", c.name, err)
			}
			if _, err := newAcquirer(t, e).Inspect(ctx, name); !errors.Is(err, gcsfence.ErrMetadataChanged) {
				t.Errorf("Inspect of it: %v, want ErrMetadataChanged", err)
			}
		})
	}
}
