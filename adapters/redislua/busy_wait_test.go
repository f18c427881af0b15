package redislua_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/redis/go-redis/v9"
)

// waitThroughBusy runs a.Acquire of name, held by h, with a deadline 2s
// ahead, and calls busy once the wait has started: busy makes Redis answer
// BUSY and returns what ends that. Once the wait has ended (within 30s),
// Redis answers again and h is released; it returns how long after its
// deadline the wait returned, and its error.
func waitThroughBusy(ctx context.Context, t *testing.T, a *redislua.Acquirer, h fence.Lease, name string, busy func() (stop func())) (time.Duration, error) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	wctx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		l, err := a.Acquire(wctx, name, time.Minute)
		if l != nil {
			_ = l.Release(ctx)
		}
		done <- err
	}()
	stop := busy()
	var werr error
	select {
	case werr = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the wait never ended")
	}
	late := time.Since(deadline)
	stop()
	_ = h.Release(ctx)
	t.Logf("Acquire returned %v after its deadline: %v", late.Round(time.Millisecond), werr)
	return late, werr
}

// A waiting Acquire that was in line when Redis began to answer BUSY, and
// whose deadline comes while it still does, returns soon after its context
// ends (the package's Client documentation: "Every call of this package
// returns once its context ends"; an acquire that gives up spends up to 1s
// more leaving the line, as TestCallsKeepTheirContextDeadline allows), with
// an error matching fence.ErrHeld, the context's error and ErrNotRun.
func TestWaitEndingWhileBusyReturnsSoonAfterDeadline(t *testing.T) {
	b := startBusyRedis(t)
	ctx := context.Background()
	a := newAcquirerOn(t, b.c, nil)
	name := fencetest.Name("busy-deadline")
	h := mustTryAcquire(ctx, t, a, name, time.Minute)
	late, werr := waitThroughBusy(ctx, t, a, h, name, func() (stop func()) {
		waitInLine(t, b.admin, name, 1)
		return b.busy(t)
	})
	if !errors.Is(werr, fence.ErrHeld) || !errors.Is(werr, context.DeadlineExceeded) || !errors.Is(werr, redislua.ErrNotRun) {
		t.Errorf("a wait whose deadline came while Redis was busy: %v, want ErrHeld, DeadlineExceeded and ErrNotRun", werr)
	}
	if late > 1500*time.Millisecond {
		t.Errorf("the wait returned %v after its context's deadline", late.Round(time.Millisecond))
	}
}

// lateSubscriber is a client whose pub/sub subscriptions reach Redis only
// once the test opens gate: a slow dial of the subscription's connection,
// during which another client's script starts.
type lateSubscriber struct {
	*redis.Client
	gate chan struct{}
}

func (c lateSubscriber) Subscribe(ctx context.Context, channels ...string) *redis.PubSub {
	<-c.gate
	return c.Client.Subscribe(ctx, channels...)
}

// A waiting Acquire whose grant channel's SUBSCRIBE Redis answers BUSY until
// the wait's deadline (the try before it ran, and found the name held) is
// a wait that ran out while Redis did not run its step: its error matches
// fence.ErrHeld, the context's error and ErrNotRun, as the package
// documentation says of every step Redis refused until the context ended.
func TestWaitWhoseSubscribeIsBusyUntilDeadlineSaysNotRun(t *testing.T) {
	b := startBusyRedis(t)
	ctx := context.Background()
	holder := newAcquirerOn(t, b.admin, nil)
	c := lateSubscriber{Client: b.c, gate: make(chan struct{})}
	a := newAcquirerOn(t, c, nil)
	name := fencetest.Name("busy-sub")
	h := mustTryAcquire(ctx, t, holder, name, time.Minute)
	_, werr := waitThroughBusy(ctx, t, a, h, name, func() (stop func()) {
		// The waiter's first try runs (Redis is not busy yet) and finds the
		// name held; then another client's script starts, and the SUBSCRIBE
		// goes.
		time.Sleep(200 * time.Millisecond)
		stop = b.busy(t)
		close(c.gate)
		return stop
	})
	if !errors.Is(werr, fence.ErrHeld) || !errors.Is(werr, context.DeadlineExceeded) || !errors.Is(werr, redislua.ErrNotRun) {
		t.Errorf("a wait whose SUBSCRIBE Redis answered BUSY until its deadline: %v, want ErrHeld, DeadlineExceeded and ErrNotRun", werr)
	}
}

// A waiter whose wait ended while Redis answered BUSY keeps its place in
// line until its leave runs; the leave is sent again in the background for
// up to the ttl only. When the script runs longer than that, the holder's
// release after it grants the name to the departed waiter (its acquirer
// still listens for another waiter), and the name is held by nobody for a
// whole ttl. The name must be free for the others soon after the release.
func TestReleaseAfterLongBusyDoesNotGrantDepartedWaiter(t *testing.T) {
	b := startBusyRedis(t)
	ctx := context.Background()
	const ttl = 2 * time.Second
	holder := newAcquirerOn(t, b.admin, nil)
	// Places in line live five polls of 2s: the departed waiter's outlives
	// the script.
	a := newAcquirerOn(t, b.c, &redislua.AcquirerOptions{Backoff: fence.Backoff{Min: 20 * time.Millisecond, Max: 2 * time.Second}})
	name, other := fencetest.Name("busy-departed"), fencetest.Name("busy-other")
	h := mustTryAcquire(ctx, t, holder, name, time.Minute)
	ho := mustTryAcquire(ctx, t, holder, other, time.Minute)
	defer ho.Release(ctx)
	// Another waiter of the same acquirer keeps its grant subscription.
	octx, ocancel := context.WithTimeout(ctx, time.Minute)
	defer ocancel()
	go func() {
		if l, _ := a.Acquire(octx, other, time.Minute); l != nil {
			_ = l.Release(ctx)
		}
	}()
	wctx, cancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		l, err := a.Acquire(wctx, name, ttl)
		if l != nil {
			_ = l.Release(ctx)
		}
		done <- err
	}()
	waitInLine(t, b.admin, name, 1)
	waitInLine(t, b.admin, other, 1)
	stop := b.busy(t)
	werr := <-done
	t.Logf("the departed waiter: %v", werr)
	time.Sleep(ttl + 2*time.Second) // the script outlasts the background leave
	stop()
	if err := h.Release(ctx); err != nil {
		t.Fatalf("holder's release: %v", err)
	}
	released := time.Now()
	third := newAcquirerOn(t, b.admin, nil)
	var heldBy string
	for {
		l, err := third.TryAcquire(ctx, name, time.Second)
		if err == nil {
			_ = l.Release(ctx)
			break
		}
		if heldBy == "" {
			v, _ := b.admin.Get(ctx, "fence:{"+name+"}:lock").Result()
			pttl, _ := b.admin.PTTL(ctx, "fence:{"+name+"}:lock").Result()
			heldBy = fmt.Sprintf("%q for %v", v, pttl)
		}
		if time.Since(released) > 10*time.Second {
			t.Fatalf("name still held 10s after its holder released: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if took := time.Since(released); took > 500*time.Millisecond {
		t.Errorf("the name was free only %v after its holder released (held meanwhile by %s): granted to the waiter that had left", took.Round(time.Millisecond), heldBy)
	}
}
