package s3fence_test

// The in-process waiter line of the S3 acquirer (its waiters queue on a
// wakeup.Line and the head tries first when a release pokes it): each test
// asserts a promise of Acquire's doc comment, the README or fence.Acquirer
// against gofakes3 and versitygw.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// acquired is the outcome of one Acquire call run in its own goroutine.
type acquired struct {
	l   fence.Lease
	err error
	at  time.Time
}

func goAcquire(ctx context.Context, a *s3fence.Acquirer, name string, ttl time.Duration) <-chan acquired {
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
func waitLine(t *testing.T, a *s3fence.Acquirer, name string, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for s3fence.LineLen(a, name) != n {
		if time.Now().After(deadline) {
			t.Fatalf("line of %q: %d waiters, want %d", name, s3fence.LineLen(a, name), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestWaitingLineReleaseLaterPokesHead: a Release through the acquirer that
// cannot confirm (its PUTs answer 500 MaxAttempts times) returns ErrUnknown
// and frees the lock in the background (releaseLater, abandon). README and
// Acquire's doc: "a Release through that Acquirer (whatever its outcome) lets
// the head try at once". Release pokes the head when it returns, while the
// background PUT is still on its way (held here), so the head finds the lock
// held; once the background PUT lands the lock is free, and the head must be
// granted at once, not after its backoff (10 minutes here).
func TestWaitingLineReleaseLaterPokesHead(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		f := e.f
		if f == nil {
			t.Skip("no fault injector on an external server")
		}
		ctx := context.Background()
		a, err := s3fence.NewAcquirer(e.c, e.bucket, &s3fence.AcquirerOptions{MaxAttempts: 2,
			Backoff: fence.Backoff{Min: 10 * time.Minute, Max: 10 * time.Minute}})
		if err != nil {
			t.Fatal(err)
		}
		name := fencetest.Name("line-release-later")
		h, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		head := goAcquire(wctx, a, name, time.Minute)
		waitLine(t, a, name, 1)
		time.Sleep(200 * time.Millisecond) // its first attempt found the lock held

		f.release, f.landed, f.held = make(chan int), make(chan int, 1), make(chan struct{}, 1)
		defer func() { f.held = nil }()
		f.inject("500", "500", "hold") // Release's two PUTs, then the background one
		rerr := h.Release(ctx)
		if !errors.Is(rerr, fence.ErrUnknown) {
			t.Fatalf("Release after two 500s: %v, want ErrUnknown", rerr)
		}
		<-f.held                           // the background release is on its way
		time.Sleep(300 * time.Millisecond) // the poked head tried, and found the lock held
		f.release <- 1
		if code := <-f.landed; code != http.StatusOK {
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
			t.Fatalf("the head was granted %v after the background release freed the lock (Backoff 10m): the release through this acquirer did not let it try once the lock was free", d.Round(time.Millisecond))
		}
	})
}

// TestWaitingLineAbandonedGrantPokesNext: the head's grant PUT lands but its
// answer is lost, and the head's context ends meanwhile: TryAcquire frees
// the grant in the background (abandon) and the head's Acquire gives up with
// ErrHeld. The next waiter becomes the head and is poked, but finds the
// abandoned grant still on the lock object; once abandon has freed it,
// nothing pokes the line again, and the waiter waits out its backoff (10
// minutes here) with the lock free (a slow participant stalls
// everyone).
func TestWaitingLineAbandonedGrantPokesNext(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		f := e.f
		if f == nil {
			t.Skip("no fault injector on an external server")
		}
		ctx := context.Background()
		a, err := s3fence.NewAcquirer(e.c, e.bucket, &s3fence.AcquirerOptions{
			Backoff: fence.Backoff{Min: 10 * time.Minute, Max: 10 * time.Minute}})
		if err != nil {
			t.Fatal(err)
		}
		name := fencetest.Name("line-abandoned-grant")
		h, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		ctx1, cancel1 := context.WithTimeout(ctx, 3*time.Second)
		defer cancel1()
		first := goAcquire(ctx1, a, name, time.Minute)
		waitLine(t, a, name, 1)
		ctx2, cancel2 := context.WithTimeout(ctx, time.Minute)
		defer cancel2()
		second := goAcquire(ctx2, a, name, time.Minute)
		waitLine(t, a, name, 2)
		time.Sleep(200 * time.Millisecond) // the head's first attempt found the lock held

		f.mu.Lock()
		f.afterDrop = func() { <-ctx1.Done(); time.Sleep(50 * time.Millisecond) }
		f.mu.Unlock()
		defer func() { f.mu.Lock(); f.afterDrop = nil; f.mu.Unlock() }()
		f.inject("", "drop-response") // the release; the head's grant lands, its answer is lost
		if err := h.Release(ctx); err != nil {
			t.Fatal(err)
		}
		r1 := within(t, first, 10*time.Second, "the head")
		if r1.err == nil {
			_ = r1.l.Release(ctx)
			t.Fatal("the head was granted; the test needs its grant abandoned")
		}
		if !errors.Is(r1.err, fence.ErrHeld) || !errors.Is(r1.err, context.DeadlineExceeded) {
			t.Fatalf("the head past its deadline: %v", r1.err)
		}
		gaveUp := time.Now()
		deadline := time.Now().Add(10 * time.Second)
		for { // abandon frees the lock (or the next waiter already has it)
			select {
			case r2 := <-second:
				if r2.err != nil {
					t.Fatalf("next waiter: %v", r2.err)
				}
				_ = r2.l.Release(ctx)
				return
			default:
			}
			info, err := a.Inspect(ctx, name)
			if err == nil && !info.Held {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the abandoned grant is still held: %+v %v", info, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
		freed := time.Now()
		r2 := within(t, second, 10*time.Second, fmt.Sprintf("the abandoned grant was freed %v after the head gave up, but the next waiter (poked when the head left, the grant still on the object) waits out its 10m backoff", freed.Sub(gaveUp).Round(time.Millisecond)))
		if r2.err != nil {
			t.Fatalf("next waiter: %v", r2.err)
		}
		_ = r2.l.Release(ctx)
	})
}

// TestWaitingLineStuckHead: a release through the acquirer pokes the head,
// whose grant PUT then hangs on its way (held by the server's front). The
// waiters behind the stuck head are granted one after the other within a
// couple of seconds each (they try when the head's attempt has lasted over a
// second); the stuck head, cancelled, gives up with ErrHeld and Canceled; the
// stuck PUT, let through, is refused (the object changed); the line empties.
func TestWaitingLineStuckHead(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		f := e.f
		if f == nil {
			t.Skip("no fault injector on an external server")
		}
		ctx := context.Background()
		a := newAcquirer(t, e)
		name := fencetest.Name("line-stuck-head")
		h, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		hctx, hcancel := context.WithTimeout(ctx, 20*time.Second)
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
		f.release, f.landed, f.held = make(chan int), make(chan int, 1), make(chan struct{}, 1)
		defer func() { f.held = nil }()
		f.inject("", "hold") // the release; the head's grant PUT hangs
		if err := h.Release(ctx); err != nil {
			t.Fatal(err)
		}
		select {
		case <-f.held:
		case <-time.After(5 * time.Second):
			t.Fatal("the poked head sent no grant PUT")
		}
		pending := map[int]bool{0: true, 1: true, 2: true}
		var last fence.Token
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
					t.Fatalf("waiters %v behind a stuck head: none granted within 4s of the lock being free", pending)
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
		// The head gives up (the held PUT would be answered with an empty
		// 200 by the fault injector, which is not S3's answer).
		hcancel()
		r := within(t, stuck, 5*time.Second, "the stuck head, cancelled")
		if r.err == nil {
			_ = r.l.Release(ctx)
			t.Fatal("the stuck head was granted")
		}
		if !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.Canceled) {
			t.Fatalf("the stuck head, cancelled: %v", r.err)
		}
		f.release <- 1
		if code := <-f.landed; code != http.StatusPreconditionFailed {
			t.Errorf("the stuck grant PUT landed with %d, want 412", code)
		}
		waitLine(t, a, name, 0)
	})
}

// TestWaitingLineNoLeaks: 40 Acquire calls on a held name that give up (20
// past their deadline, 20 cancelled) leave no place in the line and no
// goroutine behind, and the next Acquire after a release through the
// acquirer is granted at once.
func TestWaitingLineNoLeaks(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		ctx := context.Background()
		a, err := s3fence.NewAcquirer(e.c, e.bucket, &s3fence.AcquirerOptions{
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
		if n := s3fence.LineLen(a, name); n != 0 {
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
// name (MaxAttempts 2, so contention is frequent): every Acquire is granted,
// no two holds overlap, and tokens grow in grant order.
func TestWaitingLineTwoAcquirers(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		ctx := context.Background()
		var as []*s3fence.Acquirer
		for range 2 {
			c := s3.New(e.c.Options(), func(o *s3.Options) { o.HTTPClient = &http.Client{Transport: &http.Transport{}} })
			a, err := s3fence.NewAcquirer(c, e.bucket, &s3fence.AcquirerOptions{MaxAttempts: 2,
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
			if n := s3fence.LineLen(a, name); n != 0 {
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
	servers(t, func(t *testing.T, e *s3env) {
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

// TestWaitingLineExpiry: a holder of another acquirer that never releases (ttl
// 1s); the head of the line is granted within the ttl, S3's 2s + 2 x DateLag
// of clock uncertainty and one Backoff.Max (500ms) of it expiring, and so is
// each of the next two waiters after the lease before it expires in turn.
func TestWaitingLineExpiry(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		ctx := context.Background()
		a, err := s3fence.NewAcquirer(e.c, e.bucket, &s3fence.AcquirerOptions{
			Backoff: fence.Backoff{Min: 50 * time.Millisecond, Max: 500 * time.Millisecond}})
		if err != nil {
			t.Fatal(err)
		}
		other := newAcquirer(t, e)
		name := fencetest.Name("line-expiry")
		h, err := other.TryAcquire(ctx, name, time.Second)
		if err != nil {
			t.Fatal(err)
		}
		prev := time.Now() // the grant's answer: its expiry is at most a ttl later
		last := h.Token()
		var ws []<-chan acquired
		for i := range 3 {
			ws = append(ws, goAcquire(ctx, a, name, time.Second))
			waitLine(t, a, name, i+1)
		}
		for i, w := range ws {
			r := within(t, w, 15*time.Second, fmt.Sprintf("waiter %d", i))
			if r.err != nil {
				t.Fatalf("waiter %d: %v", i, r.err)
			}
			if d := r.at.Sub(prev); d > time.Second+2*time.Second+2*s3fence.DefaultDateLag+500*time.Millisecond+500*time.Millisecond {
				t.Errorf("waiter %d granted %v after the grant before it (ttl 1s, 2s + 2 x DateLag, Backoff.Max 500ms)", i, d.Round(time.Millisecond))
			}
			if r.l.Token() <= last {
				t.Fatalf("waiter %d: token %v after %v", i, r.l.Token(), last)
			}
			last, prev = r.l.Token(), r.at
		}
	})
}

// TestWaitingLineManyNames: one acquirer, 8 names, each held by a TryAcquire
// with 4 Acquire calls in line; the holders release together, and each
// grantee releases at once: every name's waiters are granted in arrival
// order, and every line empties.
func TestWaitingLineManyNames(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		ctx := context.Background()
		a, err := s3fence.NewAcquirer(e.c, e.bucket, &s3fence.AcquirerOptions{
			Backoff: fence.Backoff{Min: 30 * time.Second, Max: 30 * time.Second, MaxWait: 2 * time.Minute}})
		if err != nil {
			t.Fatal(err)
		}
		// The order is the case: a head inside one attempt past the line's
		// 1s stall limit (on a loaded machine the grants came in the order
		// [3 0 2 1]) lets the waiters behind it try out of turn, by design.
		s3fence.SetLineStall(a, time.Minute)
		const names, waiters = 8, 4
		var mu sync.Mutex
		order := map[string][]int{}
		var holders []fence.Lease
		var list []string
		var wg sync.WaitGroup
		errs := make(chan error, names*waiters)
		for range names {
			name := fencetest.Name("line-many")
			list = append(list, name)
			h, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			holders = append(holders, h)
			for w := range waiters {
				wg.Add(1)
				go func() {
					defer wg.Done()
					l, err := a.Acquire(ctx, name, time.Minute)
					if err != nil {
						errs <- fmt.Errorf("%s waiter %d: %v", name, w, err)
						return
					}
					mu.Lock()
					order[name] = append(order[name], w)
					mu.Unlock()
					if err := l.Release(ctx); err != nil {
						errs <- err
					}
				}()
				waitLine(t, a, name, w+1)
			}
		}
		time.Sleep(200 * time.Millisecond)
		start := time.Now()
		for _, h := range holders {
			go h.Release(ctx)
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		// A waiter that missed its release's poke waits out a 30s Backoff:
		// all the grants must come before any could.
		if d := time.Since(start); d > 25*time.Second {
			t.Errorf("%d grants took %v with releases through the acquirer (Backoff 30s)", names*waiters, d)
		}
		for _, name := range list {
			if got := order[name]; fmt.Sprint(got) != "[0 1 2 3]" {
				t.Errorf("%s: grant order %v, want [0 1 2 3]", name, got)
			}
			if n := s3fence.LineLen(a, name); n != 0 {
				t.Errorf("%s: %d places left", name, n)
			}
		}
	})
}
