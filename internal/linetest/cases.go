package linetest

// The waiting-line cases that the object-store adapters (azure, gcs, s3)
// share: each asserts a promise of Acquire's doc comment, the README or
// fence.Acquirer. An adapter's test passes what differs: a factory of its
// acquirers, its LineLen, its fault hooks and its ttls.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// Options are the acquirer options a case sets; the factory of an adapter
// maps them onto its own. The zero Options asks for the adapter's test
// default acquirer (its newAcquirer).
type Options struct {
	MaxAttempts int
	Backoff     fence.Backoff
}

// NewAcquirer returns an acquirer of the adapter under test with o.
type NewAcquirer func(t *testing.T, o Options) fence.Acquirer

// Factory returns the NewAcquirer that gives def(t) for the zero Options and
// withOptions(o) otherwise, failing the test on withOptions' error.
func Factory[A fence.Acquirer](def func(t *testing.T) A, withOptions func(o Options) (A, error)) NewAcquirer {
	return func(t *testing.T, o Options) fence.Acquirer {
		if o == (Options{}) {
			return def(t)
		}
		a, err := withOptions(o)
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
}

// LineLen is how many Acquire calls of a wait in name's line (the adapter's
// LineLen from its export_test.go).
type LineLen func(a fence.Acquirer, name string) int

// Acquired is the outcome of one Acquire call run in its own goroutine.
type Acquired struct {
	Lease fence.Lease
	Err   error
	At    time.Time // when Acquire returned
}

// Go runs a.Acquire(ctx, name, ttl) in its own goroutine; its outcome comes
// on the channel.
func Go(ctx context.Context, a fence.Acquirer, name string, ttl time.Duration) <-chan Acquired {
	ch := make(chan Acquired, 1)
	go func() {
		l, err := a.Acquire(ctx, name, ttl)
		ch <- Acquired{l, err, time.Now()}
	}()
	return ch
}

// Within waits up to d for ch; it fails the test when nothing came.
func Within(t *testing.T, ch <-chan Acquired, d time.Duration, what string) Acquired {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(d):
		t.Fatalf("%s: nothing after %v", what, d)
		return Acquired{}
	}
}

// WaitLine waits up to 10s until name's line in a has n waiters.
func WaitLine(t *testing.T, lineLen LineLen, a fence.Acquirer, name string, n int) {
	t.Helper()
	waitLen(t, 10*time.Second, func(name string) int { return lineLen(a, name) }, name, n)
}

// HeldRelease arms a fault in front of the backend for name's lock: its
// next two releases fail (Release cannot confirm them) and the one after
// (the background release) is held, unsent, until land is called; held is
// told once it arrives, and land returns the status the backend answered.
type HeldRelease func(name string) (held <-chan struct{}, land func() int)

// ReleaseLaterPokesHead: a Release through the acquirer that cannot confirm
// (its requests fail MaxAttempts times, as failures says) returns
// ErrUnknown and frees the lock in the background (abandon). README and
// Acquire's doc: "a Release through that Acquirer (whatever its outcome)
// lets the head try at once". Release pokes the head when it returns, while
// the background release is still on its way (held by arm), so the head
// finds the lock held; once the background release lands the lock is free,
// and the head must be granted at once, not after its backoff (10 minutes
// here). newA's acquirers reach the backend through arm's fault; state
// describes name's lock in a failure's message.
func ReleaseLaterPokesHead(t *testing.T, newA NewAcquirer, lineLen LineLen, ttl time.Duration, arm HeldRelease, failures string, state func(ctx context.Context, name string) string) {
	ctx := context.Background()
	a := newA(t, Options{MaxAttempts: 2, Backoff: fence.Backoff{Min: 10 * time.Minute, Max: 10 * time.Minute}})
	name := fencetest.Name("line-release-later")
	h, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	head := Go(wctx, a, name, ttl)
	WaitLine(t, lineLen, a, name, 1)
	time.Sleep(300 * time.Millisecond) // its first attempt found the lock held

	held, land := arm(name) // Release's two requests fail; the background one is held
	rerr := h.Release(ctx)
	if !errors.Is(rerr, fence.ErrUnknown) {
		t.Fatalf("Release after two %s: %v, want ErrUnknown", failures, rerr)
	}
	<-held                             // the background release is on its way
	time.Sleep(300 * time.Millisecond) // the poked head tried, and found the lock held
	if code := land(); code != http.StatusOK {
		t.Fatalf("the background release answered %d", code)
	}
	freed := time.Now()
	var r Acquired
	select {
	case r = <-head:
	case <-time.After(3 * time.Second):
		t.Fatalf("the background release landed 3s ago (%s) and the head of the line, poked only when Release returned (the lock still held), is still waiting out its 10m backoff", state(ctx, name))
	}
	if r.Err != nil {
		t.Fatalf("head: %v", r.Err)
	}
	defer r.Lease.Release(ctx)
	if d := r.At.Sub(freed); d > 3*time.Second {
		t.Fatalf("the head was granted %v after the background release freed the lock (Backoff 10m): the release through this acquirer did not let it try once the lock was free", d.Round(time.Millisecond))
	}
}

// HeldGrant arms a fault in front of the backend for name's lock: the
// request after the next (the next is the release) is held; held is told
// once it arrives. land, nil when the held request is never sent (it fails
// with its context's error when that ends), lets it through and returns the
// status the backend answered.
type HeldGrant func(name string) (held <-chan struct{}, land func() int)

// StuckHead: a release through the acquirer pokes the head, whose grant
// request (what) then hangs on its way (held by arm). The waiters behind
// the stuck head are granted one after the other within a few seconds each
// (they try when the head's attempt has lasted over a second); the stuck
// head gives up with ErrHeld, cancelled when cancelHead (and then within
// 5s) or at its deadline of headDeadline (DeadlineExceeded, within 10s);
// the held grant request, when it is let through, is refused (412, the
// object changed); the line empties. newA's acquirers reach the backend
// through arm's fault.
func StuckHead(t *testing.T, newA NewAcquirer, lineLen LineLen, ttl time.Duration, arm HeldGrant, what string, headDeadline time.Duration, cancelHead bool) {
	ctx := context.Background()
	a := newA(t, Options{})
	name := fencetest.Name("line-stuck-head")
	h, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	hctx, hcancel := context.WithTimeout(ctx, headDeadline)
	defer hcancel()
	stuck := Go(hctx, a, name, ttl)
	WaitLine(t, lineLen, a, name, 1)
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	defer wcancel()
	var behind []<-chan Acquired
	for i := range 3 {
		behind = append(behind, Go(wctx, a, name, ttl))
		WaitLine(t, lineLen, a, name, i+2)
	}
	time.Sleep(100 * time.Millisecond) // the head's first attempt found the lock held
	held, land := arm(name)            // the release; the head's grant request hangs
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-held:
	case <-time.After(5 * time.Second):
		t.Fatalf("the poked head sent no %s", what)
	}
	pending := map[int]bool{0: true, 1: true, 2: true}
	var last fence.Token
	for len(pending) > 0 {
		got := -1
		var r Acquired
		deadline := time.After(4 * time.Second)
	wait:
		for {
			for i := range pending {
				select {
				case r = <-behind[i]:
					got = i
					break wait
				default:
				}
			}
			select {
			case <-deadline:
				t.Fatalf("waiters %v behind a stuck head: none granted within 4s of the lock being free", pending)
			case <-time.After(5 * time.Millisecond):
			}
		}
		delete(pending, got)
		if r.Err != nil {
			t.Fatalf("waiter %d: %v", got, r.Err)
		}
		if r.Lease.Token() <= last {
			t.Fatalf("token %v after %v", r.Lease.Token(), last)
		}
		last = r.Lease.Token()
		if err := r.Lease.Release(ctx); err != nil {
			t.Fatalf("release: %v", err)
		}
	}
	var r Acquired
	want, how := context.DeadlineExceeded, "at its deadline"
	if cancelHead {
		hcancel()
		want, how = context.Canceled, "cancelled"
		r = Within(t, stuck, 5*time.Second, "the stuck head, "+how)
	} else {
		r = Within(t, stuck, 10*time.Second, "the stuck head, "+how)
	}
	if r.Err == nil {
		_ = r.Lease.Release(ctx)
		t.Fatal("the stuck head was granted")
	}
	if !errors.Is(r.Err, fence.ErrHeld) || !errors.Is(r.Err, want) {
		t.Fatalf("the stuck head, %s: %v", how, r.Err)
	}
	if land != nil {
		if code := land(); code != http.StatusPreconditionFailed {
			t.Errorf("the stuck %s landed with %d, want 412", what, code)
		}
	}
	WaitLine(t, lineLen, a, name, 0)
}

// NoLeaks: 40 Acquire calls (ttl) on a name held by a TryAcquire (holdTTL)
// that give up (20 past their deadline, 20 cancelled) leave no place in the
// line and, within settle, no goroutine behind, and the next Acquire after
// a release through the acquirer is granted at once.
func NoLeaks(t *testing.T, newA NewAcquirer, lineLen LineLen, holdTTL, ttl, settle time.Duration) {
	ctx := context.Background()
	a := newA(t, Options{Backoff: fence.Backoff{Min: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	name := fencetest.Name("line-leaks")
	h, err := a.TryAcquire(ctx, name, holdTTL)
	if err != nil {
		t.Fatal(err)
	}
	before := runtime.NumGoroutine()
	var wg sync.WaitGroup
	errs := make(chan error, 40)
	for i := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var c context.Context
			var cancel context.CancelFunc
			if i%2 == 0 {
				c, cancel = context.WithTimeout(ctx, time.Duration(50+i*10)*time.Millisecond)
			} else {
				c, cancel = context.WithCancel(ctx)
				time.AfterFunc(time.Duration(50+i*10)*time.Millisecond, cancel)
			}
			defer cancel()
			_, err := a.Acquire(c, name, ttl)
			if !errors.Is(err, fence.ErrHeld) || (!errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled)) {
				errs <- fmt.Errorf("waiter %d: %v", i, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := lineLen(a, name); n != 0 {
		t.Fatalf("%d places left in the line", n)
	}
	deadline := time.Now().Add(settle)
	for runtime.NumGoroutine() > before+5 {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines, %d before the waits", runtime.NumGoroutine(), before)
		}
		time.Sleep(10 * time.Millisecond)
	}
	next := Go(ctx, a, name, ttl)
	WaitLine(t, lineLen, a, name, 1)
	time.Sleep(100 * time.Millisecond)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	released := time.Now()
	r := Within(t, next, 5*time.Second, "the next Acquire after the release")
	if r.Err != nil {
		t.Fatal(r.Err)
	}
	if d := r.At.Sub(released); d > time.Second {
		t.Errorf("granted %v after the release", d)
	}
	_ = r.Lease.Release(ctx)
}

// TwoAcquirers: two acquirers of newOwn (each on a client of its own), 8
// workers each, 3 rounds each of Acquire (ttl), a short hold and Release on
// one name (maxAttempts small, so contention is frequent): every Acquire
// is granted, no two holds overlap, and tokens grow in grant order.
func TwoAcquirers(t *testing.T, newOwn NewAcquirer, lineLen LineLen, ttl time.Duration, maxAttempts int) {
	ctx := context.Background()
	var as []fence.Acquirer
	for range 2 {
		as = append(as, newOwn(t, Options{MaxAttempts: maxAttempts,
			Backoff: fence.Backoff{Min: 5 * time.Millisecond, Max: 100 * time.Millisecond, MaxWait: 2 * time.Minute}}))
	}
	name := fencetest.Name("line-two")
	var mu sync.Mutex
	var last fence.Token
	holding := 0
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for w := range 16 {
		a := as[w%2]
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 3 {
				l, err := a.Acquire(ctx, name, ttl)
				if err != nil {
					errs <- fmt.Errorf("worker %d: %v", w, err)
					return
				}
				mu.Lock()
				holding++
				if holding > 1 {
					errs <- fmt.Errorf("worker %d: %d holders at once", w, holding)
				}
				if l.Token() <= last {
					errs <- fmt.Errorf("worker %d: token %v after %v", w, l.Token(), last)
				}
				last = l.Token()
				mu.Unlock()
				time.Sleep(5 * time.Millisecond)
				mu.Lock()
				holding--
				mu.Unlock()
				if err := l.Release(ctx); err != nil {
					errs <- fmt.Errorf("worker %d: release: %v", w, err)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for i, a := range as {
		if n := lineLen(a, name); n != 0 {
			t.Errorf("acquirer %d: %d places left", i, n)
		}
	}
}

// CauseStillMatches (fence.Acquirer: "Giving up returns an error matching
// both ErrHeld and the context error (context.DeadlineExceeded or
// context.Canceled)"): a waiter whose context carries a cause of its own
// (context.WithCancelCause, context.WithTimeoutCause) gives up with an
// error that must still match ctx.Err(), not only the caller's cause.
func CauseStillMatches(t *testing.T, newA NewAcquirer, ttl time.Duration) {
	ctx := context.Background()
	a := newA(t, Options{})
	name := fencetest.Name("line-cause")
	h, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Release(ctx)
	shutdown := errors.New("shutting down")
	cctx, cancel := context.WithCancelCause(ctx)
	time.AfterFunc(300*time.Millisecond, func() { cancel(shutdown) })
	_, cerr := a.Acquire(cctx, name, ttl)
	tctx, tcancel := context.WithTimeoutCause(ctx, 300*time.Millisecond, shutdown)
	defer tcancel()
	_, terr := a.Acquire(tctx, name, ttl)
	for _, c := range []struct {
		err  error
		want error
	}{{cerr, context.Canceled}, {terr, context.DeadlineExceeded}} {
		if !errors.Is(c.err, fence.ErrHeld) || !errors.Is(c.err, c.want) {
			t.Errorf("Acquire given up on a context cancelled with a cause: %v; matches ErrHeld %v, %v %v", c.err, errors.Is(c.err, fence.ErrHeld), c.want, errors.Is(c.err, c.want))
		}
	}
}
