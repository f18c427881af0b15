package redislua_test

import (
	"context"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
)

// TestWaiterKeepsItsPlaceWithAHugeBackoffMax: NewAcquirer
// accepts Backoff{Max: 1<<61} (fence.Backoff.Validate: every field up to
// math.MaxInt64 is valid). A waiter in line polls at least every ttl/4, and
// its place must outlive its last poll ("by five times Max, at least 1s").
// Five times Max overflows int64: the place lived 1s, and a waiter with an 8s
// ttl, polling every 2s, lost its place between polls (a later waiter got
// ahead of it).
func TestWaiterKeepsItsPlaceWithAHugeBackoffMax(t *testing.T) {
	c := testenv.RedisClient(t)
	ctx := context.Background()
	holder := newAcquirerOn(t, c, nil)
	waiter, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{Backoff: fence.Backoff{Max: 1 << 61}})
	if err != nil {
		t.Fatalf("NewAcquirer with Backoff.Max 1<<61: %v", err)
	}
	name := fencetest.Name("hugemax")
	held := mustTryAcquire(ctx, t, holder, name, time.Minute)
	defer func() { _ = held.Release(ctx) }()

	const ttl = 8 * time.Second // the waiter polls every ttl/4 = 2s
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	got := make(chan error, 1)
	go func() {
		l, err := waiter.Acquire(wctx, name, ttl)
		if err == nil {
			_ = l.Release(ctx)
		}
		got <- err
	}()
	defer func() { cancel(); <-got }()

	pattern := redislua.DefaultPrefix + "{" + name + "}:w:*"
	entries := func() int {
		keys, err := c.Keys(ctx, pattern).Result()
		if err != nil {
			t.Fatal(err)
		}
		return len(keys)
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for entries() == 0 {
		select {
		case err := <-got:
			t.Fatalf("Acquire ended before its waiter joined the line: %v", err)
		case <-time.After(10 * time.Second):
			t.Fatal("the waiter never joined the line")
		case <-tick.C:
		}
	}
	joined := time.Now()
	// Two poll rounds: the place must be there all along.
	for time.Since(joined) < ttl/2 {
		if entries() == 0 {
			t.Fatalf("the waiter's place in line expired %v after it joined, while it was still waiting (it polls every %v)", time.Since(joined), ttl/4)
		}
		<-tick.C
	}
}
