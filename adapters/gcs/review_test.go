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

// TestClockObjectSparesOtherObjects (HAZARDS 4): a contender reads GCS's clock
// by writing the clock object; an object of that name that fencekit did not
// write as a clock (here a fenced Writer's value, in the same bucket as the
// locks, as in the package example) must not be overwritten.
func TestClockObjectSparesOtherObjects(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	w := newWriter(t, e, nil)
	if err := w.Write(ctx, "fencekit-clock", []byte("payload"), 5); err != nil {
		t.Fatal(err)
	}
	a, b := newAcquirer(t, e), newAcquirer(t, e)
	name := fencetest.Name("clockname")
	l, err := a.TryAcquire(ctx, name, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	// A held lock: b reads GCS's clock.
	_, err = b.TryAcquire(ctx, name, 5*time.Second)
	t.Logf("TryAcquire on the held lock: %v", err)
	v, tok, err := w.Read(ctx, "fencekit-clock")
	if err != nil || string(v) != "payload" || tok != 5 {
		t.Fatalf("the writer's object after a clock reading: %q token %d, %v; want \"payload\" token 5", v, tok, err)
	}
}

// TestReleaseLandedThenGranted (HAZARDS 3): a release that landed but whose
// answer was lost, after which another grant took the lock before the
// releaser read it again, is not reported as ErrLost (the lease was never
// lost): nil or fence.ErrUnknown.
func TestReleaseLandedThenGranted(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	a, other := newAcquirer(t, e), newAcquirer(t, e)
	name := fencetest.Name("rel")
	l, err := a.TryAcquire(ctx, name, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var l2 fence.Lease
	var err2 error
	e.f.mu.Lock()
	e.f.afterApply = func() {
		e.f.mu.Lock()
		e.f.afterApply = nil
		e.f.mu.Unlock()
		l2, err2 = other.TryAcquire(ctx, name, 5*time.Second)
	}
	e.f.mu.Unlock()
	e.f.inject("drop-response")
	err = l.Release(ctx)
	if err2 != nil {
		t.Fatalf("the other grant after the release landed: %v", err2)
	}
	defer l2.Release(ctx)
	if errors.Is(err, fence.ErrLost) || (err != nil && !errors.Is(err, fence.ErrUnknown)) {
		t.Fatalf("Release whose upload landed (answer lost) = %v, want nil or ErrUnknown", err)
	}
}

// TestRenewUnconfirmed (HAZARDS 3, 7): a Renew whose every upload got a 5xx
// (each may have landed) returns an error matching fence.ErrUnknown, as its
// doc promises.
func TestRenewUnconfirmed(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	a, err := gcsfence.NewAcquirer(e.b(), &gcsfence.AcquirerOptions{MaxAttempts: 3})
	if err != nil {
		t.Fatal(err)
	}
	l, err := a.TryAcquire(ctx, fencetest.Name("renew"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	e.f.inject("apply-503", "apply-503", "apply-503")
	if err := l.Renew(ctx); !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("Renew through three 503s after applying = %v, want ErrUnknown", err)
	}
}

// TestWriterKeysByteForByte (HAZARDS 4): keys that URL handling could merge
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
