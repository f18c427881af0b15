package azfence_test

// The in-process waiter line of the Azure acquirer (its waiters queue on a
// wakeup.Line and the head tries first when a release pokes it): each test
// asserts a promise of Acquire's doc comment, the README or fence.Acquirer
// against Azurite.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	azfence "github.com/fencekit/fencekit/adapters/azure"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// acquired is the outcome of one Acquire call run in its own goroutine.
type acquired struct {
	l   fence.Lease
	err error
	at  time.Time
}

func goAcquire(ctx context.Context, a *azfence.Acquirer, name string, ttl time.Duration) <-chan acquired {
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
func waitLine(t *testing.T, a *azfence.Acquirer, name string, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for azfence.LineLen(a, name) != n {
		if time.Now().After(deadline) {
			t.Fatalf("line of %q: %d waiters, want %d", name, azfence.LineLen(a, name), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// releases is a transport that acts on the lease releases of one blob:
// while armed, the first fail of them get no answer (not sent: an error
// from the transport), and the next is held until a value arrives on
// release; its status then goes to landed.
type releases struct {
	next    http.RoundTripper
	mu      sync.Mutex
	blob    string
	fail    int
	hold    bool
	held    chan struct{}
	release chan struct{}
	landed  chan int
}

func (h *releases) arm(blob string, fail int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.blob, h.fail, h.hold = blob, fail, true
	h.held, h.release, h.landed = make(chan struct{}, 1), make(chan struct{}), make(chan int, 1)
}

func (h *releases) RoundTrip(r *http.Request) (*http.Response, error) {
	h.mu.Lock()
	mine := h.blob != "" && strings.HasSuffix(r.URL.Path, "/"+h.blob) && strings.EqualFold(leaseAction(r), "release")
	var fail, hold bool
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
		return nil, errors.New("injected: no answer")
	case hold:
		held <- struct{}{}
		<-release
		resp, err := h.next.RoundTrip(r)
		code := 0
		if resp != nil {
			code = resp.StatusCode
		}
		landed <- code
		return resp, err
	}
	return h.next.RoundTrip(r)
}

// TestWaitingLineReleaseLaterPokesHead: a Release through the acquirer that
// cannot confirm (its releases get no answer MaxAttempts times) returns
// ErrUnknown and releases in the background (abandon). README and Acquire's
// doc: "a Release through that Acquirer (whatever its outcome) lets the head
// try at once". Release pokes the head when it returns, while the background
// release is still on its way (held here), so the head finds the lease
// held; once the background release lands the lock is free, and the head
// must be granted at once, not after its backoff (10 minutes here) nor the
// lease's 15s.
func TestWaitingLineReleaseLaterPokesHead(t *testing.T) {
	e := newEnv(t)
	h := &releases{next: &http.Transport{}}
	c := newClientVia(t, e.srv, e.srv.ServiceURL, e.container, h)
	ctx := context.Background()
	a, err := azfence.NewAcquirer(c, &azfence.AcquirerOptions{MaxAttempts: 2,
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

	h.arm(name, 2) // Release's two releases get no answer; the background one is held
	rerr := hl.Release(ctx)
	if !errors.Is(rerr, fence.ErrUnknown) {
		t.Fatalf("Release after two lost releases: %v, want ErrUnknown", rerr)
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
		props, err := e.c.NewBlobClient("fencekit-locks/"+name).GetProperties(ctx, nil)
		state := "?"
		if err == nil && props.LeaseState != nil {
			state = string(*props.LeaseState)
		}
		t.Fatalf("the background release landed 3s ago (blob lease state now %q, %v) and the head of the line, poked only when Release returned (the lease still held), is still waiting out its 10m backoff", state, err)
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
	{
		e := newEnv(t)
		ctx := context.Background()
		a, err := azfence.NewAcquirer(e.c, &azfence.AcquirerOptions{
			Backoff: fence.Backoff{Min: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
		if err != nil {
			t.Fatal(err)
		}
		name := fencetest.Name("line-leaks")
		// The longest lease: the waits and the goroutine count below may
		// take 30s on a loaded machine (a 20s lease was lost before its
		// Release in a full run with -p 24).
		h, err := a.TryAcquire(ctx, name, azfence.MaxAcquirerTTL)
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
				_, err := a.Acquire(c, name, 20*time.Second)
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
		if n := azfence.LineLen(a, name); n != 0 {
			t.Fatalf("%d places left in the line", n)
		}
		// The background releases of the given-up waits (abandon) and the
		// HTTP client's idle connections end on their own: 30s on a loaded
		// machine (5s was not enough in a loaded full run: 16 against 4).
		deadline := time.Now().Add(30 * time.Second)
		for runtime.NumGoroutine() > before+5 {
			if time.Now().After(deadline) {
				t.Fatalf("%d goroutines, %d before the waits", runtime.NumGoroutine(), before)
			}
			time.Sleep(10 * time.Millisecond)
		}
		next := goAcquire(ctx, a, name, 20*time.Second)
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
	}
}

// TestWaitingLineTwoAcquirers: two acquirers on clients of their own, 8
// workers each, 3 rounds each of Acquire, a short hold and Release on one
// name (MaxAttempts 1, so contention is frequent): every Acquire is granted,
// no two holds overlap, and tokens grow in grant order.
func TestWaitingLineTwoAcquirers(t *testing.T) {
	{
		e := newEnv(t)
		ctx := context.Background()
		var as []*azfence.Acquirer
		for range 2 {
			a, err := azfence.NewAcquirer(e.other(t), &azfence.AcquirerOptions{MaxAttempts: 1,
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
					l, err := a.Acquire(ctx, name, 20*time.Second)
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
			if n := azfence.LineLen(a, name); n != 0 {
				t.Errorf("acquirer %d: %d places left", i, n)
			}
		}
	}
}

// TestWaitingLineCauseStillMatches (fence.Acquirer: "Giving up returns an
// error matching both ErrHeld and the context error (context.DeadlineExceeded
// or context.Canceled)"): a waiter whose context carries a cause of its own
// (context.WithCancelCause, context.WithTimeoutCause) gives up with an error
// that must still match ctx.Err(). The line's loop returns ErrHeld joined
// with context.Cause(ctx) only, which is the caller's cause and not the
// context error.
func TestWaitingLineCauseStillMatches(t *testing.T) {
	{
		e := newEnv(t)
		ctx := context.Background()
		a := newAcquirer(t, e.c)
		name := fencetest.Name("line-cause")
		h, err := a.TryAcquire(ctx, name, 20*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Release(ctx)
		shutdown := errors.New("shutting down")
		cctx, cancel := context.WithCancelCause(ctx)
		time.AfterFunc(300*time.Millisecond, func() { cancel(shutdown) })
		_, cerr := a.Acquire(cctx, name, 20*time.Second)
		tctx, tcancel := context.WithTimeoutCause(ctx, 300*time.Millisecond, shutdown)
		defer tcancel()
		_, terr := a.Acquire(tctx, name, 20*time.Second)
		for _, c := range []struct {
			err  error
			want error
		}{{cerr, context.Canceled}, {terr, context.DeadlineExceeded}} {
			if !errors.Is(c.err, fence.ErrHeld) || !errors.Is(c.err, c.want) {
				t.Errorf("Acquire given up on a context cancelled with a cause: %v; matches ErrHeld %v, %v %v", c.err, errors.Is(c.err, fence.ErrHeld), c.want, errors.Is(c.err, c.want))
			}
		}
	}
}

// stalledAcquire is a transport that holds the next lease acquire of one
// blob, unsent, until its request's context ends (then it fails with the
// context's error, as a transport does).
type stalledAcquire struct {
	next http.RoundTripper
	mu   sync.Mutex
	blob string
	held chan struct{}
}

func (s *stalledAcquire) RoundTrip(r *http.Request) (*http.Response, error) {
	s.mu.Lock()
	hold := s.blob != "" && strings.HasSuffix(r.URL.Path, "/"+s.blob) && strings.EqualFold(leaseAction(r), "acquire")
	if hold {
		s.blob = ""
	}
	held := s.held
	s.mu.Unlock()
	if hold {
		held <- struct{}{}
		<-r.Context().Done()
		return nil, r.Context().Err()
	}
	return s.next.RoundTrip(r)
}

// TestWaitingLineStuckHead: a release through the acquirer pokes the head,
// whose lease acquire then hangs. The waiters behind the stuck head are
// granted one after the other within a few seconds each (they try when the
// head's attempt has lasted over a second); the stuck head gives up at its
// deadline with ErrHeld and DeadlineExceeded; the line empties.
func TestWaitingLineStuckHead(t *testing.T) {
	e := newEnv(t)
	s := &stalledAcquire{next: &http.Transport{}, held: make(chan struct{}, 1)}
	a, err := azfence.NewAcquirer(newClientVia(t, e.srv, e.srv.ServiceURL, e.container, s),
		&azfence.AcquirerOptions{Backoff: fence.Backoff{Min: 20 * time.Millisecond, Max: 200 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	name := fencetest.Name("line-stuck-head")
	hl, err := a.TryAcquire(ctx, name, 20*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	hctx, hcancel := context.WithTimeout(ctx, 8*time.Second)
	defer hcancel()
	stuck := goAcquire(hctx, a, name, 20*time.Second)
	waitLine(t, a, name, 1)
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	defer wcancel()
	var behind []<-chan acquired
	for i := range 3 {
		behind = append(behind, goAcquire(wctx, a, name, 20*time.Second))
		waitLine(t, a, name, i+2)
	}
	time.Sleep(100 * time.Millisecond)
	s.mu.Lock()
	s.blob = name
	s.mu.Unlock()
	if err := hl.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-s.held:
	case <-time.After(5 * time.Second):
		t.Fatal("the poked head sent no acquire")
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
	waitLine(t, a, name, 0)
}
