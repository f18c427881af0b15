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
	"github.com/redis/go-redis/v9"
)

// counterOf reads name's token counter: a grant sets it to the token it
// handed out.
func counterOf(t *testing.T, c *redis.Client, name string) uint64 {
	t.Helper()
	n, err := c.Get(context.Background(), redislua.DefaultPrefix+"{"+name+"}:token").Uint64()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// lockHeld reports whether name's lock key exists.
func lockHeld(t *testing.T, c *redis.Client, name string) bool {
	t.Helper()
	n, err := c.Exists(context.Background(), redislua.DefaultPrefix+"{"+name+"}:lock").Result()
	if err != nil {
		t.Fatal(err)
	}
	return n == 1
}

// TestHandoffToLocalWaiter: a Release hands the lease to the Acquire waiting in
// the same process, with a larger token, and the old lease is over. The
// release script itself makes the grant: right after Release the lock is held
// and the counter is at the waiter's token, before the waiter asked again.
func TestHandoffToLocalWaiter(t *testing.T) {
	c := testenv.RedisClient(t)
	a, _ := redislua.NewAcquirer(c, nil)
	ctx := context.Background()
	name := fencetest.Name("handoff")
	h := mustTryAcquire(ctx, t, a, name, time.Minute)
	got := make(chan fence.Lease, 1)
	go func() {
		l, err := a.Acquire(ctx, name, 30*time.Second)
		if err != nil {
			t.Error(err)
		}
		got <- l
	}()
	waitInLine(t, c, name, 1)
	if err := h.Release(ctx); err != nil {
		t.Fatalf("Release with a waiter: %v", err)
	}
	held, byRelease := lockHeld(t, c, name), counterOf(t, c, name)
	w := <-got
	if w == nil {
		t.FailNow()
	}
	if w.Token() <= h.Token() {
		t.Errorf("handed-over token %d not above %d", w.Token(), h.Token())
	}
	if !held || uint64(w.Token()) != byRelease {
		t.Errorf("right after Release: lock held %v, counter %d; the waiter got %d: not handed over by the release", held, byRelease, w.Token())
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
	h := mustTryAcquire(ctx, t, a, name, 100*time.Millisecond)
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
// The race must happen: a round where the release granted the waiter (the
// counter moved past the holder's token) and the waiter still gave up.
func TestHandoffToGivenUpWaiter(t *testing.T) {
	c := testenv.RedisClient(t)
	a, _ := redislua.NewAcquirer(c, nil)
	ctx := context.Background()
	name := fencetest.Name("givenup")
	raced := 0
	const rounds = 40
	for i := 0; i < rounds; i++ {
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
		waitInLine(t, c, name, 1)
		// Cancel and release at about the same moment, in varying order.
		if i%2 == 0 {
			cancel()
		}
		relErr := h.Release(ctx)
		cancel()
		werr := <-done
		if werr != nil && !errors.Is(werr, context.Canceled) {
			t.Fatalf("round %d: waiter: %v", i, werr)
		}
		if relErr != nil {
			t.Fatalf("round %d: Release: %v", i, relErr)
		}
		if werr != nil && counterOf(t, c, name) > uint64(h.Token()) {
			raced++ // handed to the waiter, which gave up anyway
		}
		// Whatever happened, the lock is free now.
		if lockHeld(t, c, name) {
			t.Fatalf("round %d: the lock is still held after the waiter gave up", i)
		}
	}
	t.Logf("the release granted a waiter that gave up in %d of %d rounds", raced, rounds)
	if raced == 0 {
		t.Fatalf("in %d rounds the release never granted a waiter that was giving up: the race was not tested", rounds)
	}
}

// TestHandoffFairAcrossAcquirers: waiters of one acquirer keep the lease
// busy, yet a waiter of another acquirer (another process) that joins the line
// gets it after exactly one grant to each waiter ahead of it, though those
// waiters queue again at once: the line is FIFO across processes.
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
	// A blocker holds the lock until every local waiter and the remote one
	// are in line, so the remote waiter always queues.
	blocker := mustTryAcquire(ctx, t, local, name, time.Minute)
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
	waitInLine(t, c, name, workers)
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
	// The remote waiter's entry is in line behind the local ones.
	waitInLine(t, c, name, workers+1)
	entries := redislua.DefaultPrefix + "{" + name + "}:w:*"
	id := redislua.AcquirerID(remote) + " "
	keys, err := c.Keys(ctx, entries).Result()
	if err != nil {
		t.Fatal(err)
	}
	queued := false
	for _, k := range keys {
		v, err := c.Get(ctx, k).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			t.Fatal(err)
		}
		queued = queued || strings.HasPrefix(v, id)
	}
	if !queued {
		t.Fatal("the other acquirer's waiter is not in line")
	}
	grantsAtJoin := total.Load() // 0: the blocker still holds the lock
	if err := blocker.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatalf("the other acquirer's waiter never got in: %v", err)
	}
	n := grantsAtGrant - grantsAtJoin
	t.Logf("the other acquirer's waiter got the lease after %d local grants", n)
	if n != workers {
		t.Errorf("%d local grants after the remote waiter joined the line, want %d (one per waiter ahead, in line order)", n, workers)
	}
	cancel()
	wg.Wait()
}
