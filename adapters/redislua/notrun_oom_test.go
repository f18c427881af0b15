package redislua_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// oom sets maxmemory so low that Redis refuses every command that may grow
// memory (OOM, with noeviction), and returns the undo.
func oom(t *testing.T, admin *redis.Client) (undo func()) {
	t.Helper()
	ctx := context.Background()
	if err := admin.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err(); err != nil {
		t.Fatal(err)
	}
	if err := admin.ConfigSet(ctx, "maxmemory", "1").Err(); err != nil {
		t.Fatal(err)
	}
	return func() {
		if err := admin.ConfigSet(ctx, "maxmemory", "0").Err(); err != nil {
			t.Error(err)
		}
	}
}

// TestStepsRefusedOOMSayWhatHappened: with maxmemory reached (noeviction),
// Redis refuses a script's first write that may grow memory. A write, a
// fenced delete, a grant and an idempotency completion sent then either
// happen (nil error, the effect is there) or end with their context
// matching redislua.ErrNotRun with nothing changed: never an error for a
// step Redis kept, never nil for one it refused.
func TestStepsRefusedOOMSayWhatHappened(t *testing.T) {
	srv := testenv.StartRedis(t)
	admin := srv.Client(t)
	c := srv.Client(t)
	ctx := context.Background()
	w, _ := redislua.NewWriter(c, nil)
	a, _ := redislua.NewAcquirer(c, nil)
	s, _ := redislua.NewIdempotencyStore(c, nil)
	short := func() (context.Context, context.CancelFunc) { return context.WithTimeout(ctx, 300*time.Millisecond) }
	check := func(t *testing.T, what string, err error, landed bool) {
		t.Helper()
		switch {
		case err == nil && !landed:
			t.Errorf("%s under OOM: nil error, but Redis did not keep it", what)
		case err != nil && landed:
			t.Errorf("%s under OOM: %v, but Redis kept it", what, err)
		case err != nil && (!errors.Is(err, redislua.ErrNotRun) || errors.Is(err, fence.ErrUnknown)):
			t.Errorf("%s under OOM: %v, want ErrNotRun alone", what, err)
		}
	}

	t.Run("write", func(t *testing.T) {
		key := fencetest.Name("oom-write")
		if err := w.Write(ctx, key, []byte("old"), 5); err != nil {
			t.Fatal(err)
		}
		undo := oom(t, admin)
		sctx, cancel := short()
		err := w.Write(sctx, key, []byte("new-and-longer-value"), 6)
		cancel()
		undo()
		v, tok, _ := w.Read(ctx, key)
		check(t, "write", err, string(v) == "new-and-longer-value" && tok == 6)
	})
	t.Run("delete", func(t *testing.T) {
		key := fencetest.Name("oom-delete")
		if err := w.Write(ctx, key, []byte("old"), 5); err != nil {
			t.Fatal(err)
		}
		undo := oom(t, admin)
		sctx, cancel := short()
		err := w.Delete(sctx, key, 6)
		cancel()
		undo()
		_, _, rerr := w.Read(ctx, key)
		check(t, "delete", err, errors.Is(rerr, fence.ErrNotFound))
		if werr := w.Write(ctx, key, []byte("stale"), 5); errors.Is(rerr, fence.ErrNotFound) && !errors.Is(werr, fence.ErrStale) {
			t.Errorf("a stale write after the delete: %v, want ErrStale", werr)
		}
	})
	t.Run("grant", func(t *testing.T) {
		name := fencetest.Name("oom-grant")
		undo := oom(t, admin)
		sctx, cancel := short()
		l, err := a.TryAcquire(sctx, name, time.Minute)
		cancel()
		undo()
		held := admin.Exists(ctx, "fence:{"+name+"}:lock").Val() == 1
		check(t, "grant", err, held)
		if l != nil {
			if err := l.Renew(ctx); err != nil {
				t.Errorf("renew of the grant made under OOM: %v", err)
			}
			_ = l.Release(ctx)
		}
	})
	t.Run("idempotency-completion", func(t *testing.T) {
		key := fencetest.Name("oom-idem")
		rec, _, err := s.Begin(ctx, key, "fp", "me", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		undo := oom(t, admin)
		sctx, cancel := short()
		_, err = s.Update(sctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{
			State: idempotency.Completed, Fence: rec.Fence, Owner: "me", Result: []byte("result"), Retention: time.Hour})
		cancel()
		undo()
		got, gerr := s.Get(ctx, key)
		if gerr != nil {
			t.Fatal(gerr)
		}
		check(t, "idempotency completion", err, got.State == idempotency.Completed)
	})
}

// TestReleaseRefusedOOMDoesNotFreeNextHolder: a release that Redis refused
// (OOM) goes on in the background. When the name has meanwhile passed to
// another holder, that background release, once Redis runs it, must leave
// the new holder's lease alone (it is checked against the old grant).
func TestReleaseRefusedOOMDoesNotFreeNextHolder(t *testing.T) {
	srv := testenv.StartRedis(t)
	admin := srv.Client(t)
	ctx := context.Background()
	a1, _ := redislua.NewAcquirer(srv.Client(t), nil)
	a2, _ := redislua.NewAcquirer(srv.Client(t), nil)
	name := fencetest.Name("oom-release")
	lock := "fence:{" + name + "}:lock"
	l1 := mustTryAcquire(ctx, t, a1, name, time.Minute)
	undo := oom(t, admin)
	rctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	err := l1.Release(rctx)
	cancel()
	if !errors.Is(err, redislua.ErrNotRun) {
		undo()
		t.Fatalf("release under OOM: %v, want ErrNotRun (sent again in the background)", err)
	}
	// The old grant ends as if it had expired; another holder takes the
	// name while Redis still refuses the release.
	if err := admin.Del(ctx, lock).Err(); err != nil {
		t.Fatal(err)
	}
	l2, err := a2.TryAcquire(ctx, name, time.Minute)
	undo()
	if err != nil {
		t.Fatalf("the next holder: %v", err)
	}
	holder := admin.Get(ctx, lock).Val()
	// The background release has run once the old grant's nonce is marked gone.
	deadline := time.Now().Add(20 * time.Second)
	for {
		keys, _ := admin.Keys(ctx, "fence:{"+name+"}:gone:*").Result()
		if len(keys) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the background release never ran")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if got := admin.Get(ctx, lock).Val(); got != holder {
		t.Errorf("the lock after the old holder's background release: %q, want the new holder's %q", got, holder)
	}
	if err := l2.Renew(ctx); err != nil {
		t.Errorf("the new holder's renewal after the old holder's background release: %v", err)
	}
	_ = l2.Release(ctx)
}
