package redislua_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// TestTokensSurviveCounterDelete: holder A has a token and
// stalls; the name's counter and lock are deleted (a DEL, FLUSHALL, eviction);
// the next grant's token must still be above A's, so the fenced writer
// refuses A's late write. Without the clock floor the counter restarted at 1.
func TestTokensSurviveCounterDelete(t *testing.T) {
	c := testenv.RedisClient(t)
	ctx := context.Background()
	a, _ := redislua.NewAcquirer(c, nil)
	w, _ := redislua.NewWriter(c, nil)
	name, key := fencetest.Name("del"), fencetest.Name("delkey")
	for i := 0; i < 3; i++ { // a few grants before the holder that stalls
		l := mustTryAcquire(ctx, t, a, name, time.Minute)
		l.Release(ctx)
	}
	stalled := mustTryAcquire(ctx, t, a, name, time.Minute)
	lock := redislua.DefaultPrefix + "{" + name + "}"
	if err := c.Del(ctx, lock+":token", lock+":lock").Err(); err != nil {
		t.Fatal(err)
	}
	b := mustTryAcquire(ctx, t, a, name, time.Minute)
	defer b.Release(ctx)
	checkStaleRefused(t, w, key, b.Token(), stalled.Token(), "after the counter was deleted")
}

// checkStaleRefused checks that a newer grant's token is above a stalled
// holder's, that the newer holder's write lands, and that the stalled
// holder's late write is refused and changes nothing.
func checkStaleRefused(t *testing.T, w *redislua.Writer, key string, newer, stalled fence.Token, when string) {
	t.Helper()
	ctx := context.Background()
	if newer <= stalled {
		t.Fatalf("token %d %s, not above the stalled holder's %d", newer, when, stalled)
	}
	if err := w.Write(ctx, key, []byte("second holder"), newer); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(ctx, key, []byte("paused holder"), stalled); !errors.Is(err, fence.ErrStale) {
		t.Fatalf("the paused holder's write %s: %v, want ErrStale", when, err)
	}
	if v, _, err := w.Read(ctx, key); err != nil || string(v) != "second holder" {
		t.Errorf("stored %q, %v", v, err)
	}
}

// acquireAsync runs a.Acquire in the background and delivers its outcome.
func acquireAsync(ctx context.Context, a fence.Acquirer, name string) <-chan fence.Lease {
	ch := make(chan fence.Lease, 1)
	go func() {
		l, err := a.Acquire(ctx, name, time.Minute)
		if err != nil {
			l = nil
		}
		ch <- l
	}()
	return ch
}

// first waits for the lease of want and checks that other is still waiting.
func first(t *testing.T, what string, want, other <-chan fence.Lease) fence.Lease {
	t.Helper()
	select {
	case l := <-want:
		if l == nil {
			t.Fatalf("%s: Acquire failed", what)
		}
		return l
	case l := <-other:
		t.Fatalf("%s: the wrong waiter was granted first (%v)", what, l != nil)
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: never granted", what)
	}
	return nil
}

// TestLineOutlivesItsExpiry: the line's list expires a while
// after the last poll of any waiter, not after the last newcomer: a long
// waiter keeps its place however long nobody new comes. Before, a waiter
// that had waited longer than the list's life was served after every later
// newcomer.
func TestLineOutlivesItsExpiry(t *testing.T) {
	c := testenv.RedisClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const life = time.Second
	a1, _ := redislua.NewAcquirer(c, nil)
	a2, _ := redislua.NewAcquirer(c, nil)
	redislua.SetLineLife(a1, life)
	redislua.SetLineLife(a2, life)
	name := fencetest.Name("linelife")
	h := mustTryAcquire(ctx, t, a1, name, time.Minute)
	w1 := acquireAsync(ctx, a1, name)
	waitInLine(t, c, name, 1)
	// Three lives of the list pass with nobody new; the old waiter polls.
	end := time.Now().Add(3 * life)
	line := redislua.DefaultPrefix + "{" + name + "}:line"
	for time.Now().Before(end) {
		n, err := c.LLen(ctx, line).Result()
		if err != nil {
			t.Fatal(err)
		}
		if n != 1 {
			t.Fatalf("the line holds %d waiters while the old waiter waits, want 1", n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	w2 := acquireAsync(ctx, a2, name)
	waitInLine(t, c, name, 2)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l := first(t, "after the line's life passed", w1, w2)
	l.Release(ctx)
	first(t, "the newcomer", w2, nil).Release(ctx)
}

// TestUnheardWaiterKeepsPlace: the first waiter's acquirer cannot
// hear a grant (its pub/sub connection is down and reconnecting). The grant
// goes to the next waiter, but the first keeps its place at the head of the
// line: the next grant is its, not a later newcomer's. Before, it was dropped
// and queued again at the back on its next poll.
func TestUnheardWaiterKeepsPlace(t *testing.T) {
	c := testenv.RedisClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := faultnet.Start(t, testenv.RedisAddr())
	// Polls every 0.5-1s and a place that lives 5s: the waiter keeps its
	// entry through the outage.
	a1, _ := redislua.NewAcquirer(viaProxy(t, p, 0), &redislua.AcquirerOptions{Backoff: fence.Backoff{Min: 20 * time.Millisecond, Max: time.Second}})
	a2, _ := redislua.NewAcquirer(c, nil)
	name := fencetest.Name("unheard")
	h := mustTryAcquire(ctx, t, a2, name, time.Minute)
	w1 := acquireAsync(ctx, a1, name)
	waitInLine(t, c, name, 1)
	channel := redislua.DefaultPrefix + "grant:" + redislua.AcquirerID(a1)
	p.Refuse(true)
	p.CutAll()
	waitSubscribers(t, c, channel, 0)
	w2 := acquireAsync(ctx, a2, name)
	waitInLine(t, c, name, 2)
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l2 := first(t, "while the first waiter cannot hear", w2, w1)
	w3 := acquireAsync(ctx, a2, name)
	waitInLine(t, c, name, 2) // the unheard waiter and the newcomer
	p.Refuse(false)
	waitSubscribers(t, c, channel, 1)
	if err := l2.Release(ctx); err != nil {
		t.Fatal(err)
	}
	first(t, "the unheard waiter, back", w1, w3).Release(ctx)
	first(t, "the newcomer", w3, nil).Release(ctx)
}

// waitSubscribers waits until channel has n subscribers.
func waitSubscribers(t *testing.T, c *redis.Client, channel string, n int64) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		got, err := c.PubSubNumSub(context.Background(), channel).Result()
		if err == nil && got[channel] == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("channel %s has %d subscribers (%v), want %d", channel, got[channel], err, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestRingRefused: a redis.Ring routes the grant channel and the lock key
// (and the idempotency notifications and records) to different shards.
func TestRingRefused(t *testing.T) {
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": testenv.RedisAddr()}})
	defer ring.Close()
	if _, err := redislua.NewAcquirer(ring, nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("NewAcquirer on a Ring: %v, want ErrInvalid", err)
	}
	if _, err := redislua.NewIdempotencyStore(ring, nil); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("NewIdempotencyStore on a Ring: %v, want ErrInvalid", err)
	}
}

// TestRenewInDriftMarginDoesNotExtendKey: the suite's
// LateRenewHoldsNothing, with a Drift of 100ms (the default is 1% of the
// ttl plus 2ms), so that the Renew after the local deadline leaves while
// the key still lives on Redis. It returns ErrLost and does not hold the
// lock on Redis for another ttl: another acquirer gets it when the first
// grant expires.
func TestRenewInDriftMarginDoesNotExtendKey(t *testing.T) {
	c := testenv.RedisClient(t)
	ctx := context.Background()
	a, _ := redislua.NewAcquirer(c, &redislua.AcquirerOptions{Drift: 100 * time.Millisecond})
	other, _ := redislua.NewAcquirer(c, nil)
	name := fencetest.Name("latrenew")
	const ttl = 3 * time.Second
	l := mustTryAcquire(ctx, t, a, name, ttl)
	<-l.Context().Done() // the local deadline: at most ttl - drift after the grant
	if err := l.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("Renew after the local deadline: %v, want ErrLost", err)
	}
	// The grant expires on Redis within the drift; a renewal would have held
	// it for another 3s.
	actx, cancel := context.WithTimeout(ctx, ttl/2)
	defer cancel()
	ol, err := other.Acquire(actx, name, time.Second)
	if err != nil {
		t.Fatalf("another acquirer after a Renew past the local deadline: %v", err)
	}
	ol.Release(ctx)
}
