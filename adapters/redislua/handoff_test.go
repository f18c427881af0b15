package redislua_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
)

// waitUntilWaiting gives a started Acquire time to find the lease held and wait.
func waitUntilWaiting() { time.Sleep(50 * time.Millisecond) }

// TestHandoffToLocalWaiter: a Release hands the lease to the Acquire waiting in
// the same process, with a larger token, and the old lease is over.
func TestHandoffToLocalWaiter(t *testing.T) {
	c := testenv.RedisClient(t)
	a, _ := redislua.NewAcquirer(c, nil)
	ctx := context.Background()
	name := fencetest.Name("handoff")
	h, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan fence.Lease, 1)
	go func() {
		l, err := a.Acquire(ctx, name, 30*time.Second)
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	waitUntilWaiting()
	if err := h.Release(ctx); err != nil {
		t.Fatalf("Release with a waiter: %v", err)
	}
	w := <-got
	if w == nil {
		t.FailNow()
	}
	if w.Token() <= h.Token() {
		t.Errorf("handed-over token %d not above %d", w.Token(), h.Token())
	}
	if h.Context().Err() == nil {
		t.Error("the releasing holder's context is not done")
	}
	if err := h.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("old holder's Renew after the hand-over: %v, want ErrLost", err)
	}
	// The new holder holds it on Redis, with its own ttl.
	other, _ := redislua.NewAcquirer(c, nil)
	if _, err := other.TryAcquire(ctx, name, time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Errorf("another acquirer after the hand-over: %v, want ErrHeld", err)
	}
	if pttl, _ := c.PTTL(ctx, "fence:{"+name+"}:lock").Result(); pttl > 30*time.Second || pttl < 25*time.Second {
		t.Errorf("handed-over lock expires in %v, want the waiter's 30s", pttl)
	}
	if err := w.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestHandoffExpiredHolder: a holder whose lease expired cannot hand it over;
// its Release reports the loss and the waiter gets the lease by itself.
func TestHandoffExpiredHolder(t *testing.T) {
	c := testenv.RedisClient(t)
	a, _ := redislua.NewAcquirer(c, nil)
	ctx := context.Background()
	name := fencetest.Name("expired")
	h, err := a.TryAcquire(ctx, name, 100*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan fence.Lease, 1)
	go func() {
		l, err := a.Acquire(ctx, name, time.Second)
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	time.Sleep(150 * time.Millisecond) // h expired; the waiter may already have the lease
	if err := h.Release(ctx); !errors.Is(err, fence.ErrLost) {
		t.Errorf("expired holder's Release: %v, want ErrLost", err)
	}
	select {
	case w := <-got:
		if w == nil {
			t.FailNow()
		}
		if w.Token() <= h.Token() {
			t.Errorf("token %d not above %d", w.Token(), h.Token())
		}
		_ = w.Release(ctx)
	case <-time.After(5 * time.Second):
		t.Fatal("the waiter never got the lease")
	}
}

// TestHandoffToGivenUpWaiter: a waiter whose context ends while the lease is
// being handed to it releases what it was handed; the lock does not stay held.
func TestHandoffToGivenUpWaiter(t *testing.T) {
	c := testenv.RedisClient(t)
	a, _ := redislua.NewAcquirer(c, nil)
	ctx := context.Background()
	name := fencetest.Name("givenup")
	for i := 0; i < 20; i++ {
		h, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatalf("round %d: %v", i, err)
		}
		wctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() {
			l, err := a.Acquire(wctx, name, time.Minute)
			if err == nil {
				err = l.Release(ctx)
			}
			done <- err
		}()
		waitUntilWaiting()
		// Cancel and release at about the same moment, in varying order.
		if i%2 == 0 {
			cancel()
		}
		relErr := h.Release(ctx)
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Fatalf("round %d: waiter: %v", i, err)
		}
		if relErr != nil {
			t.Fatalf("round %d: Release: %v", i, relErr)
		}
		// Whatever happened, the lock is free now.
		if n, _ := c.Exists(ctx, "fence:{"+name+"}:lock").Result(); n != 0 {
			t.Fatalf("round %d: the lock is still held after the waiter gave up", i)
		}
	}
}

// TestHandoffFairAcrossAcquirers: waiters of one acquirer keep the lease
// busy, yet a waiter of another acquirer (another process) that joins the line
// gets it after at most one grant to each waiter ahead of it: the line is FIFO
// across processes.
func TestHandoffFairAcrossAcquirers(t *testing.T) {
	c := testenv.RedisClient(t)
	local, _ := redislua.NewAcquirer(c, nil)
	remote, _ := redislua.NewAcquirer(c, nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	name := fencetest.Name("fair")
	const workers = 4
	var (
		wg    sync.WaitGroup
		total atomic.Int64
	)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				l, err := local.Acquire(ctx, name, 10*time.Second)
				if err != nil {
					return
				}
				total.Add(1)
				time.Sleep(time.Millisecond)
				_ = l.Release(context.Background())
			}
		}()
	}
	time.Sleep(50 * time.Millisecond)
	got := make(chan error, 1)
	var grantsAtGrant int64
	go func() {
		rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
		defer rcancel()
		l, err := remote.Acquire(rctx, name, 10*time.Second)
		if err == nil {
			grantsAtGrant = total.Load()
			_ = l.Release(context.Background())
		}
		got <- err
	}()
	// The moment the remote waiter's entry is in line.
	entries := redislua.DefaultPrefix + "{" + name + "}:w:*"
	id := redislua.AcquirerID(remote) + " "
	var grantsAtJoin int64 = -1
	for grantsAtJoin < 0 {
		keys, _ := c.Keys(ctx, entries).Result()
		for _, k := range keys {
			if v, _ := c.Get(ctx, k).Result(); strings.HasPrefix(v, id) {
				grantsAtJoin = total.Load()
			}
		}
		select {
		case err := <-got:
			if err != nil {
				t.Fatalf("the other acquirer's waiter: %v", err)
			}
			t.Log("the other acquirer's waiter found the lock free: it never queued")
			cancel()
			wg.Wait()
			return
		default:
		}
	}
	if err := <-got; err != nil {
		t.Fatalf("the other acquirer's waiter never got in: %v", err)
	}
	n := grantsAtGrant - grantsAtJoin
	t.Logf("the other acquirer's waiter got the lease after %d local grants", n)
	if n > workers {
		t.Errorf("%d local grants after the remote waiter joined the line, want at most %d (one per waiter ahead)", n, workers)
	}
	cancel()
	wg.Wait()
}
