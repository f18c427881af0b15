package s3fence_test

// The in-process waiter line of the S3 acquirer (its waiters queue on a
// wakeup.Line and the head tries first when a release pokes it): each test
// asserts a promise of Acquire's doc comment, the README or fence.Acquirer
// against gofakes3 and versitygw. The cases the object-store adapters share
// are in internal/linetest.

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3fence "github.com/fencekit/fencekit/adapters/s3"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/linetest"
)

// lineLen is s3fence.LineLen for the shared cases.
func lineLen(a fence.Acquirer, name string) int { return s3fence.LineLen(a.(*s3fence.Acquirer), name) }

// acquirerOf returns the factory of acquirers on client c of e's bucket
// (the zero options: newAcquirer's).
func acquirerOf(e *s3env, c *s3.Client) linetest.NewAcquirer {
	return linetest.Factory(func(t *testing.T) *s3fence.Acquirer { return newAcquirer(t, &s3env{c: c, bucket: e.bucket}) },
		func(o linetest.Options) (*s3fence.Acquirer, error) {
			return s3fence.NewAcquirer(c, e.bucket, &s3fence.AcquirerOptions{MaxAttempts: o.MaxAttempts, Backoff: o.Backoff})
		})
}

// heldPut is a linetest hook on e's fault injector: the PUTs named by plan
// pass or fail, and the "hold" one after them is held until land.
func heldPut(t *testing.T, f *faults, plan ...string) func(string) (<-chan struct{}, func() int) {
	return func(string) (<-chan struct{}, func() int) {
		f.release, f.landed, f.held = make(chan int), make(chan int, 1), make(chan struct{}, 1)
		t.Cleanup(func() { f.held = nil })
		f.inject(plan...)
		return f.held, func() int { f.release <- 1; return <-f.landed }
	}
}

// inspected describes name's lock as a's Inspect sees it.
func inspected(a *s3fence.Acquirer) func(context.Context, string) string {
	return func(ctx context.Context, name string) string {
		info, err := a.Inspect(ctx, name)
		return fmt.Sprintf("lock now: held %v, %v", info.Held, err)
	}
}

func TestWaitingLineReleaseLaterPokesHead(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		if e.f == nil {
			t.Skip("no fault injector on an external server")
		}
		// Release's two PUTs answer 500, then the background one is held.
		linetest.ReleaseLaterPokesHead(t, acquirerOf(e, e.c), lineLen, time.Minute,
			heldPut(t, e.f, "500", "500", "hold"), "500s", inspected(newAcquirer(t, e)))
	})
}

func TestWaitingLineStuckHead(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		if e.f == nil {
			t.Skip("no fault injector on an external server")
		}
		// The release passes; the head's grant PUT hangs. The head is
		// cancelled: the held PUT would be answered with an empty 200 by
		// the fault injector, which is not S3's answer.
		linetest.StuckHead(t, acquirerOf(e, e.c), lineLen, time.Minute,
			heldPut(t, e.f, "", "hold"), "grant PUT", 20*time.Second, true)
	})
}

func TestWaitingLineNoLeaks(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		linetest.NoLeaks(t, acquirerOf(e, e.c), lineLen, time.Minute, time.Minute, 5*time.Second)
	})
}

// TestWaitingLineTwoAcquirers: MaxAttempts 2.
func TestWaitingLineTwoAcquirers(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		own := func(t *testing.T, o linetest.Options) fence.Acquirer {
			c := s3.New(e.c.Options(), func(o *s3.Options) { o.HTTPClient = &http.Client{Transport: &http.Transport{}} })
			return acquirerOf(e, c)(t, o)
		}
		linetest.TwoAcquirers(t, own, lineLen, 10*time.Second, 2)
	})
}

func TestWaitingLineCauseStillMatches(t *testing.T) {
	servers(t, func(t *testing.T, e *s3env) {
		linetest.CauseStillMatches(t, acquirerOf(e, e.c), time.Minute)
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
		first := linetest.Go(ctx1, a, name, time.Minute)
		linetest.WaitLine(t, lineLen, a, name, 1)
		ctx2, cancel2 := context.WithTimeout(ctx, time.Minute)
		defer cancel2()
		second := linetest.Go(ctx2, a, name, time.Minute)
		linetest.WaitLine(t, lineLen, a, name, 2)
		time.Sleep(200 * time.Millisecond) // the head's first attempt found the lock held

		f.mu.Lock()
		f.afterDrop = func() { <-ctx1.Done(); time.Sleep(50 * time.Millisecond) }
		f.mu.Unlock()
		defer func() { f.mu.Lock(); f.afterDrop = nil; f.mu.Unlock() }()
		f.inject("", "drop-response") // the release; the head's grant lands, its answer is lost
		if err := h.Release(ctx); err != nil {
			t.Fatal(err)
		}
		r1 := linetest.Within(t, first, 10*time.Second, "the head")
		if r1.Err == nil {
			_ = r1.Lease.Release(ctx)
			t.Fatal("the head was granted; the test needs its grant abandoned")
		}
		if !errors.Is(r1.Err, fence.ErrHeld) || !errors.Is(r1.Err, context.DeadlineExceeded) {
			t.Fatalf("the head past its deadline: %v", r1.Err)
		}
		gaveUp := time.Now()
		deadline := time.Now().Add(10 * time.Second)
		for { // abandon frees the lock (or the next waiter already has it)
			select {
			case r2 := <-second:
				if r2.Err != nil {
					t.Fatalf("next waiter: %v", r2.Err)
				}
				_ = r2.Lease.Release(ctx)
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
		r2 := linetest.Within(t, second, 10*time.Second, fmt.Sprintf("the abandoned grant was freed %v after the head gave up, but the next waiter (poked when the head left, the grant still on the object) waits out its 10m backoff", freed.Sub(gaveUp).Round(time.Millisecond)))
		if r2.Err != nil {
			t.Fatalf("next waiter: %v", r2.Err)
		}
		_ = r2.Lease.Release(ctx)
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
		var ws []<-chan linetest.Acquired
		for i := range 3 {
			ws = append(ws, linetest.Go(ctx, a, name, time.Second))
			linetest.WaitLine(t, lineLen, a, name, i+1)
		}
		for i, w := range ws {
			r := linetest.Within(t, w, 15*time.Second, fmt.Sprintf("waiter %d", i))
			if r.Err != nil {
				t.Fatalf("waiter %d: %v", i, r.Err)
			}
			if d := r.At.Sub(prev); d > time.Second+2*time.Second+2*s3fence.DefaultDateLag+500*time.Millisecond+500*time.Millisecond {
				t.Errorf("waiter %d granted %v after the grant before it (ttl 1s, 2s + 2 x DateLag, Backoff.Max 500ms)", i, d.Round(time.Millisecond))
			}
			if r.Lease.Token() <= last {
				t.Fatalf("waiter %d: token %v after %v", i, r.Lease.Token(), last)
			}
			last, prev = r.Lease.Token(), r.At
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
				linetest.WaitLine(t, lineLen, a, name, w+1)
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
