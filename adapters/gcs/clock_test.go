package gcsfence_test

import (
	"context"
	"errors"
	"testing"
	"time"

	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestClockObjectSparesOtherObjects: a contender reads GCS's clock
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

// TestClockObjectDeleted: the clock object deleted between two
// readings (by an operator or a lifecycle rule) is written again; an expired
// lease is taken over.
func TestClockObjectDeleted(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	a, b := newAcquirer(t, e), newAcquirer(t, e)
	name := fencetest.Name("clockdel")
	const ttl = 200 * time.Millisecond
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.TryAcquire(ctx, name, ttl); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("TryAcquire on a live lease = %v, want ErrHeld", err)
	}
	if err := e.b().Object("fencekit-clock").Delete(ctx); err != nil {
		t.Fatal(err)
	}
	actx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	l2, err := b.Acquire(actx, name, ttl)
	if err != nil {
		t.Fatalf("TryAcquire on an expired lease after the clock object was deleted: %v", err)
	}
	if l2.Token() <= l.Token() {
		t.Errorf("token %d after %d", l2.Token(), l.Token())
	}
	_ = l2.Release(ctx)
}

// TestMillisecondTimestamps: GCS stamps objects in milliseconds
// (the fake in microseconds; here its answers are truncated as GCS's are).
// A contender's grant comes only after the holder's local context ended,
// through renewals, and a deleted lock object's next token is still above
// the old ones.
func TestMillisecondTimestamps(t *testing.T) {
	e := fakeGCS(t)
	e.f.msTimes.Store(true)
	ctx := ctxFor(t)
	a, b := newAcquirer(t, e), newAcquirer(t, e)
	name := fencetest.Name("ms")
	// Long enough for the renewal right after the grant to find the lease
	// live on a loaded machine (150ms was lost before it in a loaded run).
	const ttl = 400 * time.Millisecond
	for round := range 5 {
		l, err := a.Acquire(ctx, name, ttl)
		if err != nil {
			t.Fatal(err)
		}
		if round%2 == 0 {
			if err := l.Renew(ctx); err != nil {
				t.Fatal(err)
			}
		}
		// The contender's own lease is long: it is released below, after
		// the checks, which a loaded machine can delay past a 150ms ttl.
		l2, err := b.Acquire(ctx, name, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if l.Context().Err() == nil {
			t.Fatalf("round %d: granted token %d while the holder of %d is live", round, l2.Token(), l.Token())
		}
		if l2.Token() <= l.Token() {
			t.Fatalf("token %d after %d", l2.Token(), l.Token())
		}
		if err := l2.Release(ctx); err != nil {
			t.Fatal(err)
		}
		attrs, err := e.b().Object("fencekit-locks/" + name).Attrs(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if attrs.Updated.Nanosecond()%int(time.Millisecond) != 0 {
			t.Fatalf("the lock object's updated time %v is not in whole milliseconds", attrs.Updated)
		}
		if round == 2 {
			if err := e.b().Object("fencekit-locks/" + name).Delete(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestClockReplyLost: the clock upload's answer lost (applied,
// then the connection died) or a 503 once is no reason to fail an Acquire:
// the clock upload changes nothing a retry could harm.
func TestClockReplyLost(t *testing.T) {
	for _, kind := range []string{"drop-response", "503"} {
		t.Run(kind, func(t *testing.T) {
			e := fakeGCS(t)
			ctx := ctxFor(t)
			a, b := newAcquirer(t, e), newAcquirer(t, e)
			name := fencetest.Name("clocklost")
			l, err := a.TryAcquire(ctx, name, 200*time.Millisecond)
			if err != nil {
				t.Fatal(err)
			}
			e.f.inject(kind) // b's first upload: its clock reading
			l2, err := b.Acquire(ctx, name, time.Second)
			if err != nil {
				t.Fatalf("Acquire with the clock upload's answer %s: %v", kind, err)
			}
			if l.Context().Err() == nil || l2.Token() <= l.Token() {
				t.Errorf("granted %d while %d live=%v", l2.Token(), l.Token(), l.Context().Err() == nil)
			}
			_ = l2.Release(ctx)
		})
	}
}

// TestExpiredLockMaxAttemptsOne: an acquirer with MaxAttempts
// 1, new to a bucket whose clock object another acquirer wrote, takes over an
// expired lease at its first TryAcquire: ErrHeld would leave a free lock
// unused.
func TestExpiredLockMaxAttemptsOne(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	a, b := newAcquirer(t, e), newAcquirer(t, e)
	name := fencetest.Name("one")
	l, err := a.TryAcquire(ctx, name, 150*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.TryAcquire(ctx, name, time.Second); !errors.Is(err, fence.ErrHeld) { // b writes the clock object
		t.Fatalf("TryAcquire on a live lease = %v, want ErrHeld", err)
	}
	actx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	l2, err := b.Acquire(actx, name, time.Second) // waits for the expiry; b's reading is kept
	if err != nil {
		t.Fatal(err)
	}
	_ = l2.Release(ctx)
	// The lease l2 released; take it again and let it expire.
	l3, err := b.TryAcquire(ctx, name, 150*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	<-l3.Context().Done()
	one, err := gcsfence.NewAcquirer(e.b(), &gcsfence.AcquirerOptions{MaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	var l4 fence.Lease
	for range 50 { // until GCS's expiry, at most 5ms after the local one
		if l4, err = one.TryAcquire(ctx, name, time.Second); err == nil || !errors.Is(err, fence.ErrHeld) {
			break
		}
		if _, err := b.Inspect(ctx, name); err != nil { // a round trip, not a sleep
			t.Fatal(err)
		}
	}
	if err != nil {
		t.Fatalf("TryAcquire with MaxAttempts 1 on an expired lease: %v", err)
	}
	_ = l4.Release(ctx)
	_ = l
}
