package gcsfence_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestWriterKeysByteForByte: keys that URL handling could merge
// are different objects, and a key at the 1024-byte limit works.
func TestWriterKeysByteForByte(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	w := newWriter(t, e, nil)
	base := fencetest.Name("k")
	keys := []string{base + "a b", base + "a+b", base + "a%20b", base + "a%2Bb", base + "a/b", base + "a%2Fb", base + "a?b", base + "a#b", base + "a//b", base + "a/", base + "/a", base + "\u00e9", base + "e\u0301", base + "a;b", base + "a&b=c"}
	long := base + strings.Repeat("é", (gcsfence.MaxKeyBytes-len(base))/2)
	if len(long) < gcsfence.MaxKeyBytes-1 {
		long += "x"
	}
	keys = append(keys, long)
	for i, k := range keys {
		if err := w.Write(ctx, k, []byte(k), fence.Token(i+1)); err != nil {
			t.Fatalf("write %q: %v", k, err)
		}
	}
	for i, k := range keys {
		v, tok, err := w.Read(ctx, k)
		if err != nil || string(v) != k || tok != fence.Token(i+1) {
			t.Errorf("read %q: %q token %d, %v", k, v, tok, err)
		}
	}
}

// TestLongLockNames: a lock name that makes its object name
// exactly 1024 bytes is granted, and is a different lock from the same name
// one byte shorter; one byte more is fence.ErrInvalid before any request.
func TestLongLockNames(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	a := newAcquirer(t, e)
	room := gcsfence.MaxKeyBytes - len("fencekit-locks/")
	base := fencetest.Name("long")
	name := base + strings.Repeat("é", (room-len(base)-1)/2)
	for len(name) < room {
		name += "x"
	}
	l1, err := a.TryAcquire(ctx, name, 5*time.Second)
	if err != nil {
		t.Fatalf("a %d-byte name: %v", len(name), err)
	}
	defer l1.Release(ctx)
	l2, err := a.TryAcquire(ctx, name[:len(name)-1], 5*time.Second)
	if err != nil {
		t.Fatalf("the name one byte shorter: %v", err)
	}
	defer l2.Release(ctx)
	before := e.f.reqs.Load()
	if _, err := a.TryAcquire(ctx, name+"y", 5*time.Second); !errors.Is(err, fence.ErrInvalid) {
		t.Fatalf("a name one byte too long: %v, want ErrInvalid", err)
	}
	if n := e.f.reqs.Load() - before; n != 0 {
		t.Errorf("%d requests for a refused name", n)
	}
}

// TestWriterSparesLockObjects: a Writer on the locks' bucket
// given a key that names a lock object (the acquirer's Prefix + a lock name)
// refuses it instead of replacing the lock's state; the lock stays held and
// usable.
func TestWriterSparesLockObjects(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	a, other := newAcquirer(t, e), newAcquirer(t, e)
	w := newWriter(t, e, nil)
	name := fencetest.Name("lockkey")
	l, err := a.TryAcquire(ctx, name, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	err = w.Write(ctx, "fencekit-locks/"+name, []byte("value"), l.Token())
	t.Logf("Write to the lock object's name: %v", err)
	if !errors.Is(err, gcsfence.ErrLockObject) {
		t.Errorf("Write to a lock object's name = %v, want ErrLockObject", err)
	}
	if _, err := other.TryAcquire(ctx, name, 5*time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Errorf("TryAcquire after the write = %v, want ErrHeld", err)
	}
	if err := l.Renew(ctx); err != nil {
		t.Errorf("Renew after the write = %v", err)
	}
}
