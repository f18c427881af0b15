package gcsfence_test

import (
	"context"
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

// TestAbandonedGrantFreed (HAZARDS 6): a TryAcquire whose grant landed but
// whose answer was lost, and whose context ended right then, returns an error
// and frees the lock in the background: another contender gets it well
// before the ttl.
func TestAbandonedGrantFreed(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	a, other := newAcquirer(t, e), newAcquirer(t, e)
	name := fencetest.Name("aband")
	l, err := a.TryAcquire(ctx, name, time.Second) // creates the object
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	const ttl = 20 * time.Second
	gctx, cancel := context.WithCancel(ctx)
	e.f.mu.Lock()
	e.f.afterApply = func() { cancel() }
	e.f.mu.Unlock()
	e.f.inject("drop-response")
	if l, err := a.TryAcquire(gctx, name, ttl); err == nil {
		t.Fatalf("TryAcquire whose context ended after its upload landed returned lease %d", l.Token())
	}
	e.f.mu.Lock()
	e.f.afterApply = nil
	e.f.mu.Unlock()
	start := time.Now()
	actx, acancel := context.WithTimeout(ctx, 5*time.Second)
	defer acancel()
	l2, err := other.Acquire(actx, name, time.Second)
	if err != nil {
		t.Fatalf("Acquire after an abandoned grant: %v after %v (ttl %v)", err, time.Since(start), ttl)
	}
	t.Logf("granted %v after the abandoned grant", time.Since(start))
	_ = l2.Release(ctx)
}

// TestLongLockNames (HAZARDS 4, 8): a lock name that makes its object name
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

// TestClockObjectDeleted (HAZARDS 1): the clock object deleted between two
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

// TestWriterSparesLockObjects (HAZARDS 4): a Writer on the locks' bucket
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

// TestObjectDeletedByHand (HAZARDS 1, 7) records what the README says: an
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

// TestBadBucketNames (HAZARDS 8): a bucket handle whose name GCS cannot have
// is refused by New and NewAcquirer with fence.ErrInvalid naming the bucket,
// not at the first write.
func TestBadBucketNames(t *testing.T) {
	e := fakeGCS(t)
	for _, name := range []string{"", "ab", "Upper", "under space", strings.Repeat("b", 64), "-dash-first", "dot-last.", "a/b"} {
		b := e.c.Bucket(name)
		var ie *fence.InvalidError
		if _, err := gcsfence.New(b, nil); !errors.As(err, &ie) || ie.Arg != "bucket" {
			t.Errorf("New on bucket %q = %v, want ErrInvalid naming bucket", name, err)
		}
		if _, err := gcsfence.NewAcquirer(b, nil); !errors.As(err, &ie) || ie.Arg != "bucket" {
			t.Errorf("NewAcquirer on bucket %q = %v, want ErrInvalid naming bucket", name, err)
		}
	}
	for _, name := range []string{e.bucket, "a_b", "a.b-c", strings.Repeat("b", 63)} {
		if _, err := gcsfence.New(e.c.Bucket(name), nil); err != nil {
			t.Errorf("New on bucket %q: %v", name, err)
		}
	}
}

// TestMillisecondTimestamps (HAZARDS 5): GCS stamps objects in milliseconds
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

// TestClockReplyLost (HAZARDS 3): the clock upload's answer lost (applied,
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

// TestRequestCounts checks the figures the docs give: a new name's first
// grant + release take 5 requests (two more than a free lock's), a free
// lock's grant + release 3.
func TestRequestCounts(t *testing.T) {
	e := fakeGCS(t)
	ctx := ctxFor(t)
	a := newAcquirer(t, e)
	name := fencetest.Name("count")
	for i, want := range []int32{5, 3, 3} {
		before := e.f.reqs.Load()
		l, err := a.TryAcquire(ctx, name, time.Second)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		if n := e.f.reqs.Load() - before; n != want {
			t.Errorf("grant %d + release: %d requests, want %d", i, n, want)
		}
	}
}

// TestBadOwner (HAZARDS 8): Owner goes into every lock object's custom
// metadata, which GCS limits to 8 KiB in all and keeps as UTF-8 text: an
// Owner it cannot keep is refused by NewAcquirer, naming Owner, not by
// every grant on GCS.
func TestBadOwner(t *testing.T) {
	e := fakeGCS(t)
	for _, owner := range []string{strings.Repeat("o", 9000), "bad \xff", "nul\x00"} {
		_, err := gcsfence.NewAcquirer(e.b(), &gcsfence.AcquirerOptions{Owner: owner})
		var ie *fence.InvalidError
		if !errors.As(err, &ie) || ie.Arg != "Owner" {
			t.Errorf("Owner of %d bytes %.12q: %v, want ErrInvalid naming Owner", len(owner), owner, err)
		}
	}
}

// TestExpiredLockMaxAttemptsOne (HAZARDS 6, 8): an acquirer with MaxAttempts
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
