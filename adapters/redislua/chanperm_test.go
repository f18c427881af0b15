package redislua_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// noChannelUser starts a redis-server of the test's own with a user that may
// run every command on every key but use no pub/sub channel (resetchannels,
// the default for a new Redis 7 user), and returns a client of that user and
// one of the default user.
func noChannelUser(t *testing.T) (nochan, admin *redis.Client) {
	t.Helper()
	srv := testenv.StartRedis(t)
	admin = srv.Client(t)
	ctx := context.Background()
	if err := admin.Do(ctx, "ACL", "SETUSER", "nochan", "on", ">pw", "~*", "+@all", "resetchannels").Err(); err != nil {
		t.Fatal(err)
	}
	nochan = redis.NewClient(&redis.Options{Addr: srv.Addr, Username: "nochan", Password: "pw"})
	t.Cleanup(func() { nochan.Close() })
	if n, err := nochan.Publish(ctx, "probe", "x").Result(); err == nil {
		t.Fatalf("the user may publish (%d receivers): the ACL did not apply", n)
	}
	return nochan, admin
}

// TestAcquireWithoutChannelPermissionPolls: a Redis user that may not
// subscribe to the grant channel gets no line; its Acquire polls instead,
// and is granted a name soon after the holder's lease expires, not at the
// end of its wait.
func TestAcquireWithoutChannelPermissionPolls(t *testing.T) {
	nochan, _ := noChannelUser(t)
	ctx := context.Background()
	a := newAcquirerOn(t, nochan, nil)
	name := fencetest.Name("nochan")
	h := mustTryAcquire(ctx, t, a, name, 2*time.Second)
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	l, err := a.Acquire(wctx, name, time.Minute)
	if err != nil {
		t.Fatalf("Acquire of a name whose 2s lease expired, within 60s: %v", err)
	}
	defer l.Release(ctx)
	if wctx.Err() != nil {
		t.Fatalf("granted only once its wait had ended")
	}
	if l.Token() <= h.Token() {
		t.Errorf("token %d after the holder's %d", l.Token(), h.Token())
	}
}

// TestWaitWithoutChannelPermissionSaysWhy: a wait of such a user that ends
// while the name is held matches fence.ErrHeld and the context's error, and
// says that Redis refused the grant channel (NOPERM).
func TestWaitWithoutChannelPermissionSaysWhy(t *testing.T) {
	nochan, _ := noChannelUser(t)
	ctx := context.Background()
	a := newAcquirerOn(t, nochan, nil)
	name := fencetest.Name("nochan-why")
	h := mustTryAcquire(ctx, t, a, name, time.Minute)
	defer h.Release(ctx)
	wctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	_, err := a.Acquire(wctx, name, time.Minute)
	if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) || err == nil || !strings.Contains(err.Error(), "NOPERM") {
		t.Errorf("a wait that ended without channel permission: %v, want ErrHeld, DeadlineExceeded and Redis's NOPERM", err)
	}
}

// TestReleaseWithoutChannelPermissionToWaiterInLine: a holder whose Redis
// user may not publish releases while a waiter of a user that may is in
// line: the release succeeds (it cannot tell the waiter, which finds the
// name on its next poll) and the waiter is granted the name.
func TestReleaseWithoutChannelPermissionToWaiterInLine(t *testing.T) {
	nochan, admin := noChannelUser(t)
	ctx := context.Background()
	ha := newAcquirerOn(t, nochan, nil)
	wa := newAcquirerOn(t, admin, nil)
	name := fencetest.Name("nochan-release")
	h := mustTryAcquire(ctx, t, ha, name, time.Minute)
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	done := acquireInBackground(wctx, wa, name, time.Minute)
	waitJoined(t, admin, name, 30*time.Second, "the waiter never joined the line")
	if err := h.Release(ctx); err != nil {
		t.Errorf("release by a user without channel permission, a waiter in line: %v", err)
	}
	grantedAfter(t, done, h, "the waiter after the release")
}

// TestIdempotencyCompletionWithoutChannelPermission: a store whose Redis user
// may not publish completes a record. The completion either succeeds, or
// its error says it did not happen: an error for a completion that Redis
// kept would have the caller run the effect again, or report a failure for
// work that is recorded as done.
func TestIdempotencyCompletionWithoutChannelPermission(t *testing.T) {
	nochan, admin := noChannelUser(t)
	ctx := context.Background()
	s := newStoreOn(t, nochan, nil)
	rs := newStoreOn(t, admin, nil)
	for _, final := range []idempotency.State{idempotency.Completed, idempotency.Failed} {
		t.Run(string(final), func(t *testing.T) {
			key := fencetest.Name("nochan-idem")
			rec, claimed, err := s.Begin(ctx, key, "fp", "me", time.Minute)
			if err != nil || !claimed {
				t.Fatalf("begin: claimed %v, %v", claimed, err)
			}
			_, err = s.Update(ctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{
				State: final, Fence: rec.Fence, Owner: "me", Result: []byte("done"), Retention: time.Hour})
			got, gerr := rs.Get(ctx, key)
			if gerr != nil {
				t.Fatal(gerr)
			}
			if err != nil && got.State == final {
				t.Errorf("update to %s by a user without channel permission: %v; but the record is %s (Redis kept it)", final, err, got.State)
			}
			if err == nil && got.State != final {
				t.Errorf("update to %s returned nil, record is %s", final, got.State)
			}
		})
	}
}
