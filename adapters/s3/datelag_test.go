package s3fence_test

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// staleLag is how much older than the server's clock the Date headers of the
// stale tests are: within the default DateLag (2s), and more than the
// whole second that a Date's truncation alone accounts for.
const staleLag = 1900 * time.Millisecond

// otherAcquirer is an acquirer on a client (and connections) of its own, as in
// another process, through the same server (and fault proxy) as e.
func otherAcquirer(t testing.TB, e *s3env) *s3fence.Acquirer {
	c := s3.New(e.c.Options(), func(o *s3.Options) {
		o.HTTPClient = &http.Client{Transport: &http.Transport{}}
	})
	return newAcquirer(t, &s3env{c: c, bucket: e.bucket})
}

// atFraction waits until the local clock's fraction of a second is frac, so
// that a Date staleLag old, truncated, is as far behind as it can be.
func atFraction(frac time.Duration) {
	now := time.Now()
	wait := frac - now.Sub(now.Truncate(time.Second))
	if wait < 0 {
		wait += time.Second
	}
	time.Sleep(wait)
}

// TestAcquirerStaleDate: the server caches its Date header, so a Date can be
// older than its truncation to whole seconds (staleLag, 1.9s, within the
// default DateLag). A takes the lock on a read whose Date is that stale; then
// the Dates are fresh, and B waits for the lock. A's expiry must not be early
// by the Date's age: when B's Acquire returns, A's lease context is already
// done. (With only a second for the truncation, A's expiry was up to 1.9s
// early, and B was granted while A's context was live.)
func TestAcquirerStaleDate(t *testing.T) { faultServers(t, testStaleDate) }

func testStaleDate(t *testing.T, e *s3env, f *faults) {
	a, b := newAcquirer(t, e), otherAcquirer(t, e)
	ctx := context.Background()
	name := fencetest.Name("stale-date")
	const ttl = 2 * time.Second
	f.ownDate.Store(true)
	defer f.ownDate.Store(false)
	defer f.dateLag.Store(0)
	// The lock object exists (and is free) before the timed grant.
	l0, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if err := l0.Release(ctx); err != nil {
		t.Fatal(err)
	}

	// A's read sees a Date 1.9s old, taken just before a whole second: the
	// Date is then nearly 2.9s behind the server's clock.
	f.dateLag.Store(int64(staleLag))
	atFraction(850 * time.Millisecond)
	la, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	answered := time.Now()
	defer la.Release(ctx)
	f.dateLag.Store(0)

	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	lb, err := b.Acquire(wctx, name, 10*time.Second)
	granted := time.Now()
	if err != nil {
		t.Fatalf("B waiting for A's expired lease: %v", err)
	}
	aDone := la.Context().Err() != nil
	defer lb.Release(ctx)
	if !aDone {
		t.Errorf("B was granted %v after A's grant was answered, while A's %v lease context was still live: A's expiry, computed from a Date %v old, was early",
			granted.Sub(answered).Round(time.Millisecond), ttl, staleLag)
	}
	if lb.Token() <= la.Token() {
		t.Errorf("B's token %d not above A's %d", lb.Token(), la.Token())
	}
	// The promise's other side: an expired lock is granted again at most 2s
	// + 2 x DateLag after its ttl; allow 1s more for the polls of a loaded
	// machine.
	if late := answered.Add(ttl + 2*time.Second + 2*s3fence.DefaultDateLag + time.Second); granted.After(late) {
		t.Errorf("B was granted %v after A's grant was answered: over the %v ttl plus 2s + 2 x DateLag plus 1s", granted.Sub(answered).Round(time.Millisecond), ttl)
	}
}

// TestLockObjectDeletedStaleDate: a lock object is created, granted
// and deleted within a second or two; the next grant creates a new object and
// reads it with a Date staleLag old (within the default DateLag). Its first
// token must still be above the deleted object's: a token from the second
// after that Date alone (no DateLag) is below it, and the deleted object's
// stalled holder would win over the new holder's writes.
func TestLockObjectDeletedStaleDate(t *testing.T) { faultServers(t, testLockObjectDeletedStaleDate) }

func testLockObjectDeletedStaleDate(t *testing.T, e *s3env, f *faults) {
	a := newAcquirer(t, e)
	w := newWriter(t, e, nil)
	ctx := context.Background()
	name := fencetest.Name("deleted-stale")
	f.ownDate.Store(true)
	defer f.ownDate.Store(false)
	defer f.dateLag.Store(0)
	holderA, err := a.TryAcquire(ctx, name, 30*time.Second) // a new object: its token is from S3's clock
	if err != nil {
		t.Fatal(err)
	}
	defer holderA.Release(ctx)
	if _, err := e.c.DeleteObject(ctx, &s3.DeleteObjectInput{Bucket: aws.String(e.bucket), Key: aws.String("fencekit-locks/" + name)}); err != nil {
		t.Fatal(err)
	}
	f.dateLag.Store(int64(staleLag))
	holderB, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatalf("grant after the lock object was deleted: %v", err)
	}
	defer holderB.Release(ctx)
	f.dateLag.Store(0)
	if holderB.Token() <= holderA.Token() {
		t.Errorf("the new object's first grant, read with a Date %v old, has token %d, not above the deleted object's %d", staleLag, holderB.Token(), holderA.Token())
	}
	key := fencetest.Name("fresh")
	if err := w.Write(ctx, key, []byte("B"), holderB.Token()); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, key, []byte("A, late"), holderA.Token()); !errors.Is(err, fence.ErrStale) && holderB.Token() > holderA.Token() {
		t.Errorf("the stalled holder's write over the new holder's: %v, want ErrStale", err)
	}
}

// TestAcquirerDateLagOptions: a negative DateLag, or one above
// MaxDateLag, is refused with ErrInvalid naming DateLag; zero (the default),
// a nanosecond (no lag beyond whole seconds) and MaxDateLag are taken.
func TestAcquirerDateLagOptions(t *testing.T) {
	e := fakeS3(t)
	for _, lag := range []time.Duration{-1, -time.Second, s3fence.MaxDateLag + 1, 1<<63 - 1} {
		_, err := s3fence.NewAcquirer(e.c, e.bucket, &s3fence.AcquirerOptions{DateLag: lag})
		var ie *fence.InvalidError
		if !errors.Is(err, fence.ErrInvalid) || !errors.As(err, &ie) || ie.Arg != "DateLag" {
			t.Errorf("DateLag %v: %v, want ErrInvalid naming DateLag", lag, err)
		}
	}
	for _, lag := range []time.Duration{0, time.Nanosecond, s3fence.MaxDateLag} {
		if _, err := s3fence.NewAcquirer(e.c, e.bucket, &s3fence.AcquirerOptions{DateLag: lag}); err != nil {
			t.Errorf("DateLag %v: %v", lag, err)
		}
	}
}
