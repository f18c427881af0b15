package gcsfence_test

import (
	"context"
	"errors"
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
