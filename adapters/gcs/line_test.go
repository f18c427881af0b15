package gcsfence_test

// The in-process waiter line of the GCS acquirer (its waiters queue on a
// wakeup.Line and the head tries first when a release pokes it): each test
// asserts a promise of Acquire's doc comment, the README or fence.Acquirer
// against fake-gcs-server.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	gcsfence "github.com/fencekit/fencekit/adapters/gcs"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fsouza/fake-gcs-server/fakestorage"
)

// acquired is the outcome of one Acquire call run in its own goroutine.
type acquired struct {
	l   fence.Lease
	err error
	at  time.Time
}

func goAcquire(ctx context.Context, a *gcsfence.Acquirer, name string, ttl time.Duration) <-chan acquired {
	ch := make(chan acquired, 1)
	go func() {
		l, err := a.Acquire(ctx, name, ttl)
		ch <- acquired{l, err, time.Now()}
	}()
	return ch
}

// within waits up to d for ch; it fails the test when nothing came.
func within(t *testing.T, ch <-chan acquired, d time.Duration, what string) acquired {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(d):
		t.Fatalf("%s: nothing after %v", what, d)
		return acquired{}
	}
}

// waitLine waits until name's line in a has n waiters.
func waitLine(t *testing.T, a *gcsfence.Acquirer, name string, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for gcsfence.LineLen(a, name) != n {
		if time.Now().After(deadline) {
			t.Fatalf("line of %q: %d waiters, want %d", name, gcsfence.LineLen(a, name), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// lockUploads sits in front of the fake and acts on the uploads whose body
// names one lock object (not the clock object): while armed, the first fail
// of them answer 503 without being applied, and the next is held until a
// value arrives on release; its status then goes to landed.
type lockUploads struct {
	next    http.Handler
	mu      sync.Mutex
	object  string
	skip    int // uploads let through before fail and hold apply
	fail    int
	hold    bool
	held    chan struct{}
	release chan struct{}
	landed  chan int
}

func (h *lockUploads) arm(object string, fail int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.object, h.fail, h.hold = object, fail, true
	h.held, h.release, h.landed = make(chan struct{}, 1), make(chan struct{}), make(chan int, 1)
}

func (h *lockUploads) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || !strings.HasPrefix(r.URL.Path, "/upload/") {
		h.next.ServeHTTP(w, r)
		return
	}
	body, _ := io.ReadAll(r.Body)
	r.Body = io.NopCloser(bytes.NewReader(body))
	h.mu.Lock()
	mine := h.object != "" && (bytes.Contains(body, []byte(h.object)) || strings.Contains(r.URL.RawQuery, h.object))
	var fail, hold bool
	if mine && h.skip > 0 {
		h.skip--
		mine = false
	}
	if mine && h.fail > 0 {
		h.fail--
		fail = true
	} else if mine && h.hold {
		h.hold = false
		hold = true
	}
	held, release, landed := h.held, h.release, h.landed
	h.mu.Unlock()
	switch {
	case fail:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprint(w, `{"error":{"code":503,"message":"injected"}}`)
	case hold:
		held <- struct{}{}
		<-release
		r2 := r.Clone(context.Background())
		r2.Body = io.NopCloser(bytes.NewReader(body))
		rec := httptest.NewRecorder()
		h.next.ServeHTTP(rec, r2)
		landed <- rec.Code
	default:
		h.next.ServeHTTP(w, r)
	}
}

// heldGCS is the in-process fake behind a lockUploads.
func heldGCS(t *testing.T) (*gcsEnv, *lockUploads) {
	t.Helper()
	srv, err := fakestorage.NewServerWithOptions(fakestorage.Options{NoListener: true, Scheme: "http"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	h := &lockUploads{next: srv.HTTPHandler()}
	hs := httptest.NewServer(h)
	t.Cleanup(hs.Close)
	bucket := "fence-" + strings.ToLower(fencetest.Name("b")[2:])
	srv.CreateBucketWithOpts(fakestorage.CreateBucketOpts{Name: bucket})
	return &gcsEnv{c: newClient(t, hs.URL), bucket: bucket, url: hs.URL}, h
}

// TestWaitingLineReleaseLaterPokesHead: a Release through the acquirer that
// cannot confirm (its uploads answer 503 MaxAttempts times) returns
// ErrUnknown and frees the lock in the background (releaseLater, abandon).
// README and Acquire's doc: "a Release through that Acquirer (whatever its
// outcome) lets the head try at once". Release pokes the head when it
// returns, while the background upload is still on its way (held here), so
// the head finds the lock held; once the background upload lands the lock
// is free, and the head must be granted at once, not after its backoff (10
// minutes here).
func TestWaitingLineReleaseLaterPokesHead(t *testing.T) {
	e, h := heldGCS(t)
	ctx := context.Background()
	a, err := gcsfence.NewAcquirer(e.b(), &gcsfence.AcquirerOptions{MaxAttempts: 2,
		Backoff: fence.Backoff{Min: 10 * time.Minute, Max: 10 * time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("line-release-later")
	hl, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	head := goAcquire(wctx, a, name, time.Minute)
	waitLine(t, a, name, 1)
	time.Sleep(300 * time.Millisecond) // its first attempt found the lock held

	h.arm(name, 2) // Release's two uploads answer 503; the background one is held
	rerr := hl.Release(ctx)
	if !errors.Is(rerr, fence.ErrUnknown) {
		t.Fatalf("Release after two 503s: %v, want ErrUnknown", rerr)
	}
	<-h.held                           // the background release is on its way
	time.Sleep(300 * time.Millisecond) // the poked head tried, and found the lock held
	h.release <- struct{}{}
	if code := <-h.landed; code != http.StatusOK {
		t.Fatalf("the background release answered %d", code)
	}
	freed := time.Now()
	var r acquired
	select {
	case r = <-head:
	case <-time.After(3 * time.Second):
		info, err := a.Inspect(ctx, name)
		t.Fatalf("the background release landed 3s ago (lock now: held %v, %v) and the head of the line, poked only when Release returned (the lock still held), is still waiting out its 10m backoff", info.Held, err)
	}
	if r.err != nil {
		t.Fatalf("head: %v", r.err)
	}
	defer r.l.Release(ctx)
	if d := r.at.Sub(freed); d > 3*time.Second {
		t.Fatalf("the head was granted %v after the background release freed the lock (Backoff 10m)", d.Round(time.Millisecond))
	}
}

// TestWaitingLineNoLeaks: 40 Acquire calls on a held name that give up (20
// past their deadline, 20 cancelled) leave no place in the line and no
// goroutine behind, and the next Acquire after a release through the
// acquirer is granted at once.
func TestWaitingLineNoLeaks(t *testing.T) {
	servers(t, func(t *testing.T, e *gcsEnv) {
		ctx := context.Background()
		a, err := gcsfence.NewAcquirer(e.b(), &gcsfence.AcquirerOptions{
			Backoff: fence.Backoff{Min: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
		if err != nil {
			t.Fatal(err)
		}
		name := fencetest.Name("line-leaks")
		h, err := a.TryAcquire(ctx, name, time.Minute)
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
				_, err := a.Acquire(c, name, time.Minute)
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
		if n := gcsfence.LineLen(a, name); n != 0 {
			t.Fatalf("%d places left in the line", n)
		}
		deadline := time.Now().Add(5 * time.Second)
		for runtime.NumGoroutine() > before+5 {
			if time.Now().After(deadline) {
				t.Fatalf("%d goroutines, %d before the waits", runtime.NumGoroutine(), before)
			}
			time.Sleep(10 * time.Millisecond)
		}
		next := goAcquire(ctx, a, name, time.Minute)
		waitLine(t, a, name, 1)
		time.Sleep(100 * time.Millisecond)
		if err := h.Release(ctx); err != nil {
			t.Fatal(err)
		}
		released := time.Now()
		r := within(t, next, 5*time.Second, "the next Acquire after the release")
		if r.err != nil {
			t.Fatal(r.err)
		}
		if d := r.at.Sub(released); d > time.Second {
			t.Errorf("granted %v after the release", d)
		}
		_ = r.l.Release(ctx)
	})
}

// TestWaitingLineTwoAcquirers: two acquirers on clients of their own, 8
// workers each, 3 rounds each of Acquire, a short hold and Release on one
// name (MaxAttempts 1, so contention is frequent): every Acquire is granted,
// no two holds overlap, and tokens grow in grant order.
func TestWaitingLineTwoAcquirers(t *testing.T) {
	servers(t, func(t *testing.T, e *gcsEnv) {
		if e.url == "" {
			t.Skip("the fake only: 48 grants on one object take minutes on GCS")
		}
		ctx := context.Background()
		var as []*gcsfence.Acquirer
		for range 2 {
			c := newClient(t, e.url)
			a, err := gcsfence.NewAcquirer(c.Bucket(e.bucket), &gcsfence.AcquirerOptions{MaxAttempts: 1,
				Backoff: fence.Backoff{Min: 5 * time.Millisecond, Max: 100 * time.Millisecond, MaxWait: 2 * time.Minute}})
			if err != nil {
				t.Fatal(err)
			}
			as = append(as, a)
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
					l, err := a.Acquire(ctx, name, 10*time.Second)
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
			if n := gcsfence.LineLen(a, name); n != 0 {
				t.Errorf("acquirer %d: %d places left", i, n)
			}
		}
	})
}

// TestWaitingLineCauseStillMatches (fence.Acquirer: "Giving up returns an
// error matching both ErrHeld and the context error (context.DeadlineExceeded
// or context.Canceled)"): a waiter whose context carries a cause of its own
// (context.WithCancelCause, context.WithTimeoutCause) gives up with an error
// that must still match ctx.Err(). The line's loop returns ErrHeld joined
// with context.Cause(ctx) only, which is the caller's cause and not the
// context error.
func TestWaitingLineCauseStillMatches(t *testing.T) {
	servers(t, func(t *testing.T, e *gcsEnv) {
		ctx := context.Background()
		a := newAcquirer(t, e)
		name := fencetest.Name("line-cause")
		h, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Release(ctx)
		shutdown := errors.New("shutting down")
		cctx, cancel := context.WithCancelCause(ctx)
		time.AfterFunc(300*time.Millisecond, func() { cancel(shutdown) })
		_, cerr := a.Acquire(cctx, name, time.Minute)
		tctx, tcancel := context.WithTimeoutCause(ctx, 300*time.Millisecond, shutdown)
		defer tcancel()
		_, terr := a.Acquire(tctx, name, time.Minute)
		for _, c := range []struct {
			err  error
			want error
		}{{cerr, context.Canceled}, {terr, context.DeadlineExceeded}} {
			if !errors.Is(c.err, fence.ErrHeld) || !errors.Is(c.err, c.want) {
				t.Errorf("Acquire given up on a context cancelled with a cause: %v; matches ErrHeld %v, %v %v", c.err, errors.Is(c.err, fence.ErrHeld), c.want, errors.Is(c.err, c.want))
			}
		}
	})
}

// TestWaitingLineStuckHead: a release through the acquirer pokes the head,
// whose grant upload then hangs on its way. The waiters behind the stuck
// head are granted one after the other within a few seconds each (they try
// when the head's attempt has lasted over a second); the stuck head gives up
// at its deadline with ErrHeld and DeadlineExceeded (while its upload still
// hangs); the line empties.
func TestWaitingLineStuckHead(t *testing.T) {
	e, h := heldGCS(t)
	ctx := context.Background()
	a := newAcquirer(t, e)
	name := fencetest.Name("line-stuck-head")
	hl, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	hctx, hcancel := context.WithTimeout(ctx, 8*time.Second)
	defer hcancel()
	stuck := goAcquire(hctx, a, name, time.Minute)
	waitLine(t, a, name, 1)
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	defer wcancel()
	var behind []<-chan acquired
	for i := range 3 {
		behind = append(behind, goAcquire(wctx, a, name, time.Minute))
		waitLine(t, a, name, i+2)
	}
	h.arm(name, 0)
	h.mu.Lock()
	h.skip = 1 // the release
	h.mu.Unlock()
	if err := hl.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-h.held:
	case <-time.After(5 * time.Second):
		t.Fatal("the poked head sent no grant upload")
	}
	var last fence.Token
	pending := map[int]bool{0: true, 1: true, 2: true}
	for len(pending) > 0 {
		got := -1
		var r acquired
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
				t.Fatalf("waiters %v behind a stuck head: none granted within 4s", pending)
			case <-time.After(5 * time.Millisecond):
			}
		}
		delete(pending, got)
		if r.err != nil {
			t.Fatalf("waiter %d: %v", got, r.err)
		}
		if r.l.Token() <= last {
			t.Fatalf("token %v after %v", r.l.Token(), last)
		}
		last = r.l.Token()
		if err := r.l.Release(ctx); err != nil {
			t.Fatalf("release: %v", err)
		}
	}
	r := within(t, stuck, 10*time.Second, "the stuck head, at its deadline")
	if r.err == nil {
		_ = r.l.Release(ctx)
		t.Fatal("the stuck head was granted")
	}
	if !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.DeadlineExceeded) {
		t.Fatalf("the stuck head at its deadline: %v", r.err)
	}
	h.release <- struct{}{}
	if code := <-h.landed; code != http.StatusPreconditionFailed {
		t.Errorf("the stuck grant upload landed with %d, want 412", code)
	}
	waitLine(t, a, name, 0)
}
