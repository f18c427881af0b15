package redislua_test

import (
	"context"
	"errors"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// settleGoroutines waits until the goroutine count is back near base (every
// background call has ended), failing after limit.
func settleGoroutines(t *testing.T, base int, limit time.Duration, what string) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for n := runtime.NumGoroutine(); n > base+10; n = runtime.NumGoroutine() {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			buf = buf[:runtime.Stack(buf, true)]
			t.Fatalf("%s: %d goroutines after %v, %d before; stacks:\n%s", what, n, limit, base, topStacks(string(buf)))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// topStacks counts the goroutines' stacks by their first redislua frame.
func topStacks(all string) string {
	count := map[string]int{}
	for _, g := range strings.Split(all, "\n\n") {
		key := "other"
		for _, line := range strings.Split(g, "\n") {
			if strings.Contains(line, "redislua.") && !strings.Contains(line, "_test.") {
				key = strings.TrimSpace(line)
				break
			}
		}
		count[key]++
	}
	var b strings.Builder
	for k, n := range count {
		b.WriteString("  " + strconv.Itoa(n) + " x " + k + "\n")
	}
	return b.String()
}

// defaultTimeoutClients returns go-redis clients with the library's default timeouts
// (ReadTimeout 3s, 3 retries), a pool of 2 connections, and on odd nodes
// ContextTimeoutEnabled.
func defaultTimeoutClients(t *testing.T, servers []*testenv.RedisServer) []redislua.Client {
	clients := make([]redislua.Client, len(servers))
	for i, s := range servers {
		c := redis.NewClient(&redis.Options{Addr: s.Addr, PoolSize: 2, ContextTimeoutEnabled: i%2 == 1})
		t.Cleanup(func() { c.Close() })
		clients[i] = c
	}
	return clients
}

// warmRedlockOnDefaultClients starts five nodes, reached through
// defaultTimeoutClients, and returns a Redlock over them (NodeTimeout 300ms,
// a fast Backoff) that has granted and released name once, with the count
// of goroutines after that.
func warmRedlockOnDefaultClients(ctx context.Context, t *testing.T, name string, ttl time.Duration) ([]*testenv.RedisServer, []redislua.Client, *redislua.Redlock, int) {
	t.Helper()
	servers, _ := fiveNodes(t)
	clients := defaultTimeoutClients(t, servers)
	r := newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 300 * time.Millisecond,
		Backoff: fence.Backoff{Min: time.Millisecond, Max: 20 * time.Millisecond}})
	warmUp(ctx, t, r, name, ttl, false)
	return servers, clients, r, runtime.NumGoroutine()
}

// TestRedlockGoroutinesAfterPausedWaits: four waiters try for 5s while 3 of
// 5 nodes are paused, on clients with default timeouts and tiny pools. Once
// the nodes resume, the goroutines return to the baseline within the ttl
// (plus slack), and a new Acquire is granted.
func TestRedlockGoroutinesAfterPausedWaits(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("bgreleasegoroutines")
	const ttl = 4 * time.Second
	servers, _, r, base := warmRedlockOnDefaultClients(ctx, t, name, ttl)
	pauseNodes(t, servers, 0, 1, 2)
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			_, err := r.Acquire(wctx, name, ttl)
			if !errors.Is(err, fence.ErrHeld) {
				t.Errorf("Acquire with 3 of 5 paused: %v", err)
			}
		}()
	}
	wg.Wait()
	t.Logf("goroutines: %d before, %d after the waits", base, runtime.NumGoroutine())
	resumeNodes(t, servers, 0, 1, 2)
	settleGoroutines(t, base, ttl+20*time.Second, "after the nodes resumed")
	l, err := acquireWithin(ctx, t, r, name, ttl, 20*time.Second)
	if err != nil {
		t.Fatalf("Acquire after the nodes resumed: %v%s", err, redlockLocks(ctx, t, servers, name))
	}
	_ = l.Release(ctx)
}

// TestRedlockCloseClientsDuringBackgroundRelease: failed tries against 3
// paused nodes leave releases running in the background; the clients are
// closed, then the nodes resume. Nothing panics or hangs, and the
// goroutines return to the baseline.
func TestRedlockCloseClientsDuringBackgroundRelease(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("bgreleaseclose")
	const ttl = 30 * time.Second
	servers, clients, r, base := warmRedlockOnDefaultClients(ctx, t, name, ttl)
	pauseNodes(t, servers, 0, 1, 2)
	wctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err := r.Acquire(wctx, name, ttl)
	cancel()
	if !errors.Is(err, fence.ErrHeld) {
		t.Errorf("Acquire with 3 of 5 paused: %v", err)
	}
	for _, c := range clients {
		_ = c.(*redis.Client).Close()
	}
	resumeNodes(t, servers, 0, 1, 2)
	// Well within the 30s ttl the background releases would run for.
	settleGoroutines(t, base, 15*time.Second, "after the clients were closed")
}

// TestRedlockGoroutinesWhileMajorityDown measures what a wait against a dead
// majority (killed, connection refused: every try fails at once) leaves in
// the background: each failed try starts one release per dead node, alive
// for the ttl plus 1s. It logs the count after a 10s wait with the default
// Backoff, and checks that the goroutines return to the baseline about a
// ttl after the wait, the nodes still down.
func TestRedlockGoroutinesWhileMajorityDown(t *testing.T) {
	servers, clients := fiveNodes(t)
	r := newRedlock(t, clients, nil)
	ctx := context.Background()
	name := fencetest.Name("bgreleasedead")
	const ttl = 10 * time.Second
	warmUp(ctx, t, r, name, ttl, false)
	base := runtime.NumGoroutine()
	for _, i := range []int{0, 1, 2} {
		servers[i].Kill()
	}
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err := r.Acquire(wctx, name, ttl)
	cancel()
	if !errors.Is(err, redislua.ErrNoQuorum) {
		t.Errorf("Acquire with 3 of 5 killed: %v", err)
	}
	t.Logf("goroutines: %d before, %d after a 10s wait (ttl %v), nodes still down", base, runtime.NumGoroutine(), ttl)
	settleGoroutines(t, base, ttl+20*time.Second, "nodes still down")
}
