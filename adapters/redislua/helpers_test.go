package redislua_test

import (
	"context"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// must returns v, or fails t with err when a constructor refused its
// options.
func must[T any](t testing.TB, v T, err error) T {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// newAcquirerOn returns an Acquirer on c with opts, failing t if NewAcquirer
// refuses them.
func newAcquirerOn(t testing.TB, c redislua.Client, opts *redislua.AcquirerOptions) *redislua.Acquirer {
	t.Helper()
	a, err := redislua.NewAcquirer(c, opts)
	return must(t, a, err)
}

// newWriterOn returns a Writer on c with opts, failing t if NewWriter
// refuses them.
func newWriterOn(t testing.TB, c redislua.Client, opts *redislua.WriterOptions) *redislua.Writer {
	t.Helper()
	w, err := redislua.NewWriter(c, opts)
	return must(t, w, err)
}

// newStoreOn returns an IdempotencyStore on c with opts, failing t if
// NewIdempotencyStore refuses them.
func newStoreOn(t testing.TB, c redislua.Client, opts *redislua.IdempotencyOptions) *redislua.IdempotencyStore {
	t.Helper()
	s, err := redislua.NewIdempotencyStore(c, opts)
	return must(t, s, err)
}

// newRedlock returns a Redlock over clients with opts, failing t if
// NewRedlock refuses them.
func newRedlock(t testing.TB, clients []redislua.Client, opts *redislua.RedlockOptions) *redislua.Redlock {
	t.Helper()
	r, err := redislua.NewRedlock(clients, opts)
	return must(t, r, err)
}

// warmUp grants name for ttl and releases it, renewing it in between when
// renew is set: the scripts are loaded and a connection is open before the
// test's own calls.
func warmUp(ctx context.Context, t testing.TB, a fence.Acquirer, name string, ttl time.Duration, renew bool) {
	t.Helper()
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	if renew {
		if err := l.Renew(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// mustTryAcquire grants name for ttl, failing t if TryAcquire does not.
func mustTryAcquire(ctx context.Context, t testing.TB, a fence.Acquirer, name string, ttl time.Duration) fence.Lease {
	t.Helper()
	l, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// acquireWithin runs a.Acquire for at most within; the wait's context
// lives until the test ends, as the lease's may depend on it.
func acquireWithin(ctx context.Context, t testing.TB, a fence.Acquirer, name string, ttl, within time.Duration) (fence.Lease, error) {
	actx, cancel := context.WithTimeout(ctx, within)
	t.Cleanup(cancel)
	return a.Acquire(actx, name, ttl)
}

// acquired is the outcome of an Acquire run in the background.
type acquired struct {
	l   fence.Lease
	err error
}

// acquireReleasing runs a.Acquire(wctx, name, ttl) in a goroutine, releases
// (with ctx) any lease it gets, and delivers its error.
func acquireReleasing(ctx, wctx context.Context, a fence.Acquirer, name string, ttl time.Duration) <-chan error {
	done := make(chan error, 1)
	go func() {
		l, err := a.Acquire(wctx, name, ttl)
		if l != nil {
			_ = l.Release(ctx)
		}
		done <- err
	}()
	return done
}

// acquireInBackground runs a.Acquire(ctx, name, ttl) in a goroutine and
// delivers its outcome.
func acquireInBackground(ctx context.Context, a fence.Acquirer, name string, ttl time.Duration) <-chan acquired {
	done := make(chan acquired, 1)
	go func() {
		l, err := a.Acquire(ctx, name, ttl)
		done <- acquired{l, err}
	}()
	return done
}

// grantedAfter waits for the background Acquire in done, fails t with what
// unless it was granted with a token above the holder's h, and releases
// the lease when the test ends.
func grantedAfter(t testing.TB, done <-chan acquired, h fence.Lease, what string) fence.Lease {
	t.Helper()
	r := <-done
	if r.err != nil {
		t.Fatalf("%s: %v", what, r.err)
	}
	t.Cleanup(func() { _ = r.l.Release(context.Background()) })
	if r.l.Token() <= h.Token() {
		t.Errorf("%s: token %d, the holder's %d", what, r.l.Token(), h.Token())
	}
	return r.l
}

// waitUntil calls cond every poll until it reports true, and fails t with
// cond's last message once within has passed without it.
func waitUntil(t testing.TB, within, poll time.Duration, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		ok, why := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal(why)
		}
		time.Sleep(poll)
	}
}

// nodeClients returns a new client of each server, in order.
func nodeClients(t testing.TB, servers []*testenv.RedisServer) []redislua.Client {
	clients := make([]redislua.Client, len(servers))
	for i, s := range servers {
		clients[i] = s.Client(t)
	}
	return clients
}

// acquireAfresh waits up to 20s for name on a new Redlock over clients
// (NodeTimeout 2s): one that never granted it and has no call of its own in
// flight.
func acquireAfresh(ctx context.Context, t testing.TB, clients []redislua.Client, name string, ttl time.Duration) (fence.Lease, error) {
	t.Helper()
	return acquireWithin(ctx, t, newRedlock(t, clients, &redislua.RedlockOptions{NodeTimeout: 2 * time.Second}), name, ttl, 20*time.Second)
}

// writtenKey writes value under token to a new key named after prefix, and
// returns the key.
func writtenKey(ctx context.Context, t testing.TB, w fence.FencedWriter, prefix, value string, token fence.Token) string {
	t.Helper()
	key := fencetest.Name(prefix)
	if err := w.Write(ctx, key, []byte(value), token); err != nil {
		t.Fatal(err)
	}
	return key
}

// waitJoined waits up to within until name's line holds a waiter, and
// fails t with what if it does not.
func waitJoined(t testing.TB, c *redis.Client, name string, within time.Duration, what string) {
	t.Helper()
	line := redislua.DefaultPrefix + "{" + name + "}:line"
	waitUntil(t, within, 5*time.Millisecond, func() (bool, string) {
		return c.LLen(context.Background(), line).Val() > 0, what
	})
}
