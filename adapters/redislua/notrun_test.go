package redislua_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// busyHook counts the BUSY replies a client gets and signals each one.
type busyHook struct{ seen chan struct{} }

func (h busyHook) note(err error) {
	if err != nil && strings.HasPrefix(err.Error(), "BUSY ") {
		select {
		case h.seen <- struct{}{}:
		default:
		}
	}
}

func (h busyHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h busyHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		h.note(err)
		return err
	}
}

func (h busyHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		for _, c := range cmds {
			h.note(c.Err())
		}
		return err
	}
}

// busyRedis is a redis-server of the test's own that answers BUSY to every
// other client 50ms into a script, and a client of it whose BUSY replies the
// test can wait for (a new one per step, so that work an earlier step left
// in the background does not count).
type busyRedis struct {
	srv   *testenv.RedisServer
	admin *redis.Client
	c     *redis.Client
	hook  busyHook
}

func startBusyRedis(t *testing.T) *busyRedis {
	t.Helper()
	srv := testenv.StartRedis(t, "--busy-reply-threshold", "50")
	b := &busyRedis{srv: srv, admin: srv.Client(t)}
	b.newClient(t)
	return b
}

// newClient replaces the test's client with a new one.
func (b *busyRedis) newClient(t *testing.T) *redis.Client {
	b.hook = busyHook{seen: make(chan struct{}, 1)}
	c := redis.NewClient(&redis.Options{Addr: b.srv.Addr})
	c.AddHook(b.hook)
	t.Cleanup(func() { c.Close() })
	b.c = c
	return c
}

// busy runs an endless read-only script on its own connection until the
// returned stop is called (SCRIPT KILL), and returns once the server answers
// BUSY.
func (b *busyRedis) busy(t *testing.T) (stop func()) {
	t.Helper()
	ctx := context.Background()
	spinner := redis.NewClient(&redis.Options{Addr: b.srv.Addr, MaxRetries: -1, ReadTimeout: -1})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = spinner.Eval(ctx, "while true do end", nil).Err() // ends with SCRIPT KILL
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := b.admin.Ping(ctx).Err()
		if err != nil && strings.HasPrefix(err.Error(), "BUSY") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the server never answered BUSY: %v", err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	select { // a BUSY the test's client got before the step counts for nothing
	case <-b.hook.seen:
	default:
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			deadline := time.Now().Add(30 * time.Second)
			for {
				err := b.admin.ScriptKill(ctx).Err()
				if err == nil || strings.Contains(err.Error(), "No scripts in execution") {
					break
				}
				if time.Now().After(deadline) {
					t.Errorf("SCRIPT KILL: %v", err)
					break
				}
				time.Sleep(5 * time.Millisecond)
			}
			wg.Wait()
			spinner.Close()
		})
	}
	t.Cleanup(stop)
	return stop
}

// sawBusy waits until the test's client got a BUSY reply.
func (b *busyRedis) sawBusy(t *testing.T) {
	t.Helper()
	select {
	case <-b.hook.seen:
	case <-time.After(30 * time.Second):
		t.Fatal("the step never got a BUSY reply")
	}
}

// notRunStep is one single-instance step. prep runs before the server is
// busy and returns the step, which returns nil when it did what it should;
// unblock, when set, runs once the server is no longer busy (a waiting
// Acquire needs the holder to release); unchanged, when set, checks after a
// step that did not run that it changed nothing.
type notRunStep struct {
	name      string
	prep      func(t *testing.T, e *notRunEnv) (step func(ctx context.Context) error, unblock func(), unchanged func(t *testing.T))
	stepError func(err error) bool // what a step whose ctx ended while busy returns, besides ErrNotRun
}

type notRunEnv struct {
	a *redislua.Acquirer
	w *redislua.Writer
	s *redislua.IdempotencyStore
	c *redis.Client
}

func notRunSteps() []notRunStep {
	ctx := context.Background()
	const ttl = time.Minute
	freeAfter := func(t *testing.T, e *notRunEnv, name string) func(t *testing.T) {
		return func(t *testing.T) {
			l, err := e.a.TryAcquire(ctx, name, ttl)
			if err != nil {
				t.Errorf("the name after a try that did not run: %v, want free", err)
				return
			}
			_ = l.Release(ctx)
		}
	}
	heldBy := func(l fence.Lease, e *notRunEnv) func(t *testing.T) {
		return func(t *testing.T) {
			if err := l.Renew(ctx); err != nil {
				t.Errorf("the lease after a step that did not run: %v, want still held", err)
			}
			_ = l.Release(ctx)
		}
	}
	readIs := func(e *notRunEnv, key, want string, tok fence.Token) func(t *testing.T) {
		return func(t *testing.T) {
			v, got, err := e.w.Read(ctx, key)
			if err != nil || string(v) != want || got != tok {
				t.Errorf("read %q after a step that did not run: %q token %d err %v, want %q token %d", key, v, got, err, want, tok)
			}
		}
	}
	return []notRunStep{
		{name: "try", prep: func(t *testing.T, e *notRunEnv) (func(context.Context) error, func(), func(*testing.T)) {
			name := fencetest.Name("notrun-try")
			return func(ctx context.Context) error {
				l, err := e.a.TryAcquire(ctx, name, ttl)
				if err == nil {
					err = l.Release(ctx)
				}
				return err
			}, nil, freeAfter(t, e, name)
		}},
		{name: "wait-in-line", prep: func(t *testing.T, e *notRunEnv) (func(context.Context) error, func(), func(*testing.T)) {
			name := fencetest.Name("notrun-wait")
			h, err := e.a.TryAcquire(ctx, name, ttl)
			if err != nil {
				t.Fatal(err)
			}
			return func(ctx context.Context) error {
					l, err := e.a.Acquire(ctx, name, ttl)
					if err != nil {
						return err
					}
					defer l.Release(ctx)
					if l.Token() <= h.Token() {
						t.Errorf("waiter's token %d, holder's %d", l.Token(), h.Token())
					}
					return nil
				}, func() {
					if err := h.Release(ctx); err != nil {
						t.Errorf("holder's release: %v", err)
					}
				}, heldBy(h, e)
		}, stepError: func(err error) bool { return errors.Is(err, fence.ErrHeld) }},
		{name: "renew", prep: func(t *testing.T, e *notRunEnv) (func(context.Context) error, func(), func(*testing.T)) {
			l, err := e.a.TryAcquire(ctx, fencetest.Name("notrun-renew"), ttl)
			if err != nil {
				t.Fatal(err)
			}
			return func(ctx context.Context) error { return l.Renew(ctx) }, nil, heldBy(l, e)
		}},
		{name: "release", prep: func(t *testing.T, e *notRunEnv) (func(context.Context) error, func(), func(*testing.T)) {
			name := fencetest.Name("notrun-release")
			l, err := e.a.TryAcquire(ctx, name, ttl)
			if err != nil {
				t.Fatal(err)
			}
			return func(ctx context.Context) error {
					if err := l.Release(ctx); err != nil {
						return err
					}
					if _, err := e.a.TryAcquire(ctx, name, ttl); err != nil {
						t.Errorf("the name after its release: %v, want free", err)
					}
					return nil
				}, nil, func(t *testing.T) {
					// A release Redis did not run goes on in the background:
					// the name is free soon after the script ends.
					deadline := time.Now().Add(20 * time.Second)
					for {
						l2, err := e.a.TryAcquire(ctx, name, ttl)
						if err == nil {
							_ = l2.Release(ctx)
							return
						}
						if time.Now().After(deadline) {
							t.Errorf("name still held 20s after a release Redis did not run: %v", err)
							return
						}
						time.Sleep(20 * time.Millisecond)
					}
				}
		}},
		{name: "write", prep: func(t *testing.T, e *notRunEnv) (func(context.Context) error, func(), func(*testing.T)) {
			key := writtenKey(ctx, t, e.w, "notrun-write", "old", 5)
			return func(ctx context.Context) error {
				if err := e.w.Write(ctx, key, []byte("new"), 6); err != nil {
					return err
				}
				if err := e.w.Write(ctx, key, []byte("stale"), 5); !errors.Is(err, fence.ErrStale) {
					t.Errorf("a lower token after the write: %v, want ErrStale", err)
				}
				return nil
			}, nil, readIs(e, key, "old", 5)
		}},
		{name: "delete", prep: func(t *testing.T, e *notRunEnv) (func(context.Context) error, func(), func(*testing.T)) {
			key := writtenKey(ctx, t, e.w, "notrun-delete", "old", 5)
			return func(ctx context.Context) error {
				if err := e.w.Delete(ctx, key, 6); err != nil {
					return err
				}
				if _, _, err := e.w.Read(ctx, key); !errors.Is(err, fence.ErrNotFound) {
					t.Errorf("read after the delete: %v, want ErrNotFound", err)
				}
				return nil
			}, nil, readIs(e, key, "old", 5)
		}},
		{name: "read", prep: func(t *testing.T, e *notRunEnv) (func(context.Context) error, func(), func(*testing.T)) {
			key := writtenKey(ctx, t, e.w, "notrun-read", "v", 7)
			return func(ctx context.Context) error {
				v, tok, err := e.w.Read(ctx, key)
				if err == nil && (string(v) != "v" || tok != 7) {
					t.Errorf("read %q token %d, want \"v\" token 7", v, tok)
				}
				return err
			}, nil, nil
		}},
		{name: "fenced-script", prep: func(t *testing.T, e *notRunEnv) (func(context.Context) error, func(), func(*testing.T)) {
			key := fencetest.Name("notrun-script")
			s := redislua.NewFencedScript(`return redis.call('INCR', KEYS[1])`)
			fenceKey, counter := "{"+key+"}:fence", "{"+key+"}:n"
			return func(ctx context.Context) error {
					res, err := s.Run(ctx, e.c, fenceKey, 3, []string{counter})
					if err == nil && res != int64(1) {
						t.Errorf("the body's result %v, want 1 (it ran once)", res)
					}
					return err
				}, nil, func(t *testing.T) {
					if n, err := e.c.Exists(ctx, fenceKey, counter).Result(); err != nil || n != 0 {
						t.Errorf("%d keys (err %v) after a fenced script that did not run, want 0", n, err)
					}
				}
		}},
		{name: "idempotency-begin", prep: func(t *testing.T, e *notRunEnv) (func(context.Context) error, func(), func(*testing.T)) {
			key := fencetest.Name("notrun-begin")
			return func(ctx context.Context) error {
					rec, claimed, err := e.s.Begin(ctx, key, "fp", "me", time.Minute)
					if err == nil && (!claimed || rec.State != idempotency.Claimed) {
						t.Errorf("begin: claimed %v, state %q", claimed, rec.State)
					}
					return err
				}, nil, func(t *testing.T) {
					if _, err := e.s.Get(ctx, key); !errors.Is(err, fence.ErrNotFound) {
						t.Errorf("record after a begin that did not run: %v, want ErrNotFound", err)
					}
				}
		}},
		{name: "idempotency-update", prep: func(t *testing.T, e *notRunEnv) (func(context.Context) error, func(), func(*testing.T)) {
			key := fencetest.Name("notrun-update")
			rec, _, err := e.s.Begin(ctx, key, "fp", "me", time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			return func(ctx context.Context) error {
					got, err := e.s.Update(ctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me", Lease: time.Minute})
					if err == nil && got.State != idempotency.Armed {
						t.Errorf("state after the update %q, want armed", got.State)
					}
					return err
				}, nil, func(t *testing.T) {
					if got, err := e.s.Get(ctx, key); err != nil || got.State != idempotency.Claimed {
						t.Errorf("record after an update that did not run: %q, %v, want claimed", got.State, err)
					}
				}
		}},
		{name: "idempotency-get", prep: func(t *testing.T, e *notRunEnv) (func(context.Context) error, func(), func(*testing.T)) {
			key := fencetest.Name("notrun-get")
			if _, _, err := e.s.Begin(ctx, key, "fp", "me", time.Minute); err != nil {
				t.Fatal(err)
			}
			return func(ctx context.Context) error {
				got, err := e.s.Get(ctx, key)
				if err == nil && got.State != idempotency.Claimed {
					t.Errorf("state %q, want claimed", got.State)
				}
				return err
			}, nil, nil
		}},
	}
}

func newNotRunEnv(t *testing.T, c *redis.Client) *notRunEnv {
	t.Helper()
	a := newAcquirerOn(t, c, nil)
	w := newWriterOn(t, c, nil)
	s := newStoreOn(t, c, nil)
	return &notRunEnv{a: a, w: w, s: s, c: c}
}

// TestStepsWaitThroughBusyScript: while another client's script runs, Redis
// answers BUSY to every other command without running it. Each step sent
// then (grant, waiting in line, renew, release, write, delete, read, a fenced
// script, the idempotency store's steps) is sent again until it runs, within
// its context, and does what it does when Redis is not busy.
func TestStepsWaitThroughBusyScript(t *testing.T) {
	b := startBusyRedis(t)
	for _, s := range notRunSteps() {
		t.Run(s.name, func(t *testing.T) {
			e := newNotRunEnv(t, b.newClient(t))
			step, unblock, _ := s.prep(t, e)
			stop := b.busy(t)
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- step(ctx) }()
			select {
			case <-b.hook.seen:
			case err := <-done:
				t.Fatalf("the step returned while Redis was busy: %v", err)
			case <-time.After(30 * time.Second):
				t.Fatal("the step never got a BUSY reply")
			}
			stop()
			if unblock != nil {
				unblock()
			}
			if err := <-done; err != nil {
				t.Errorf("the step after Redis was busy: %v", err)
			}
		})
	}
}

// TestStepNotRunWhileBusySaysSo: a step whose context ends while Redis still
// answers BUSY returns an error matching redislua.ErrNotRun and the
// context's error (never fence.ErrUnknown: Redis said it did not run it), and
// changed nothing.
func TestStepNotRunWhileBusySaysSo(t *testing.T) {
	b := startBusyRedis(t)
	for _, s := range notRunSteps() {
		t.Run(s.name, func(t *testing.T) {
			e := newNotRunEnv(t, b.newClient(t))
			step, _, unchanged := s.prep(t, e)
			stop := b.busy(t)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- step(ctx) }()
			// Two BUSY replies: the step has handled the first one (it sent
			// the step again), so the cancel does not race with its reply.
			b.sawBusy(t)
			b.sawBusy(t)
			cancel()
			err := <-done
			// A send still in flight when the context ended (sent again
			// after a BUSY) may land: then the error may match ErrUnknown,
			// and holds the BUSY reply.
			var reply redis.Error
			inFlight := errors.As(err, &reply) && strings.HasPrefix(reply.Error(), "BUSY ")
			if !(errors.Is(err, redislua.ErrNotRun) || inFlight) || !errors.Is(err, context.Canceled) || errors.Is(err, fence.ErrLost) ||
				(errors.Is(err, fence.ErrUnknown) && errors.Is(err, redislua.ErrNotRun)) {
				t.Errorf("a step whose context ended while Redis was busy: %v, want ErrNotRun (or BUSY, a send in flight) and context.Canceled, not ErrLost", err)
			}
			if s.stepError != nil && !s.stepError(err) {
				t.Errorf("a step whose context ended while Redis was busy: %v, want also its own error", err)
			}
			stop()
			if unchanged != nil {
				unchanged(t)
			}
		})
	}
}

// TestWaiterThatLeavesWhileBusyDoesNotStrandLock: a waiter whose wait ends
// while Redis answers BUSY has not left the line yet. Its leave is sent again
// until Redis runs it; the holder's release after the script ended then does
// not strand the name with the departed waiter for its ttl.
func TestWaiterThatLeavesWhileBusyDoesNotStrandLock(t *testing.T) {
	b := startBusyRedis(t)
	ctx := context.Background()
	a := newAcquirerOn(t, b.c, nil)
	name := fencetest.Name("notrun-leave")
	const ttl = 5 * time.Minute
	h := mustTryAcquire(ctx, t, a, name, ttl)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := acquireReleasing(ctx, wctx, a, name, ttl)
	line := "fence:{" + name + "}:line"
	deadline := time.Now().Add(30 * time.Second)
	for {
		if n, _ := b.admin.LLen(ctx, line).Result(); n > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the waiter never joined the line")
		}
		time.Sleep(5 * time.Millisecond)
	}
	stop := b.busy(t)
	cancel()
	if err := <-done; !errors.Is(err, fence.ErrHeld) {
		t.Errorf("the wait that ended: %v, want ErrHeld", err)
	}
	stop()
	if err := h.Release(ctx); err != nil {
		t.Fatalf("holder's release: %v", err)
	}
	other := newAcquirerOn(t, b.admin, nil)
	deadline = time.Now().Add(20 * time.Second)
	for {
		l, err := other.TryAcquire(ctx, name, time.Second)
		if err == nil {
			_ = l.Release(ctx)
			return
		}
		if time.Now().After(deadline) {
			v, _ := b.admin.Get(ctx, "fence:{"+name+"}:lock").Result()
			pttl, _ := b.admin.PTTL(ctx, "fence:{"+name+"}:lock").Result()
			t.Fatalf("name still held 20s after its holder released, by %q for %v: %v", v, pttl, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestAcquireStartedWhileBusyWaitsInLine: an Acquire that starts while
// Redis answers BUSY subscribes to its grant channel then, and Redis refuses
// the SUBSCRIBE without running it. Once the script ends the waiter still
// joins the line (its subscription is made again), and the holder's release
// grants it the lease; a subscription never made would keep it from the line
// and from polling until its context ended.
func TestAcquireStartedWhileBusyWaitsInLine(t *testing.T) {
	b := startBusyRedis(t)
	ctx := context.Background()
	holder := newAcquirerOn(t, b.admin, nil)
	a := newAcquirerOn(t, b.c, nil)
	name := fencetest.Name("notrun-sub")
	h := mustTryAcquire(ctx, t, holder, name, time.Minute)
	stop := b.busy(t)
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	done := acquireInBackground(wctx, a, name, time.Minute)
	b.sawBusy(t) // its first try; the SUBSCRIBE went before it
	stop()
	waitJoined(t, b.admin, name, 20*time.Second, "the waiter never joined the line after Redis stopped answering BUSY")
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	grantedAfter(t, done, h, "the waiter after the holder's release")
}

// TestWaitWhoseDeadlineEndsWhileBusySaysHeld: a waiting Acquire whose
// deadline comes while Redis answers BUSY ends as a wait that ran out:
// fence.ErrHeld, context.DeadlineExceeded and ErrNotRun, in line (its
// polls refused) and polling alike.
func TestWaitWhoseDeadlineEndsWhileBusySaysHeld(t *testing.T) {
	b := startBusyRedis(t)
	ctx := context.Background()
	for _, disable := range []bool{false, true} {
		t.Run(map[bool]string{false: "in-line", true: "polling"}[disable], func(t *testing.T) {
			a := newAcquirerOn(t, b.newClient(t), &redislua.AcquirerOptions{DisableNotify: disable})
			name := fencetest.Name("notrun-deadline")
			h := mustTryAcquire(ctx, t, a, name, time.Minute)
			wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
			defer cancel()
			done := make(chan error, 1)
			var wdeadline time.Time
			started := make(chan struct{})
			go func() {
				// The deadline is set once the waiter is in line (or has
				// polled): it comes while Redis is busy.
				<-started
				dctx, dcancel := context.WithDeadline(wctx, wdeadline)
				defer dcancel()
				l, err := a.Acquire(dctx, name, time.Minute)
				if l != nil {
					_ = l.Release(ctx)
				}
				done <- err
			}()
			wdeadline = time.Now().Add(time.Second)
			close(started)
			if !disable {
				waitInLine(t, b.admin, name, 1)
			}
			stop := b.busy(t)
			var err2 error
			select {
			case err2 = <-done:
			case <-wctx.Done():
				t.Fatal("the wait never ended")
			}
			if !errors.Is(err2, fence.ErrHeld) || !errors.Is(err2, context.DeadlineExceeded) || !errors.Is(err2, redislua.ErrNotRun) {
				t.Errorf("a wait whose deadline came while Redis was busy: %v, want ErrHeld, DeadlineExceeded and ErrNotRun", err2)
			}
			stop()
			if err := h.Release(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

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
	w := newWriterOn(t, c, nil)
	a := newAcquirerOn(t, c, nil)
	s := newStoreOn(t, c, nil)
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
		key := writtenKey(ctx, t, w, "oom-write", "old", 5)
		undo := oom(t, admin)
		sctx, cancel := short()
		err := w.Write(sctx, key, []byte("new-and-longer-value"), 6)
		cancel()
		undo()
		v, tok, _ := w.Read(ctx, key)
		check(t, "write", err, string(v) == "new-and-longer-value" && tok == 6)
	})
	t.Run("delete", func(t *testing.T) {
		key := writtenKey(ctx, t, w, "oom-delete", "old", 5)
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
	a1 := newAcquirerOn(t, srv.Client(t), nil)
	a2 := newAcquirerOn(t, srv.Client(t), nil)
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

// TestRedlockWithOneNodeBusyForever: one of three Redlock nodes answers BUSY
// for the whole test. A try still gets a majority within its node timeout,
// the release frees the name on the other two (and returns nil), and the
// next try is granted a larger token.
func TestRedlockWithOneNodeBusyForever(t *testing.T) {
	b := startBusyRedis(t)
	n1, n2 := testenv.StartRedis(t), testenv.StartRedis(t)
	ctx := context.Background()
	r := newRedlock(t, []redislua.Client{n1.Client(t), n2.Client(t), b.c}, nil)
	name := fencetest.Name("redlock-busy")
	warm := mustTryAcquire(ctx, t, r, fencetest.Name("warm"), time.Minute) // loads the scripts
	_ = warm.Release(ctx)
	b.busy(t)
	var last fence.Token
	for i := 0; i < 3; i++ {
		tctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		l, err := r.TryAcquire(tctx, name, 10*time.Second)
		cancel()
		if err != nil {
			t.Fatalf("try %d with one node busy: %v", i, err)
		}
		if l.Token() <= last {
			t.Errorf("token %d after %d", l.Token(), last)
		}
		last = l.Token()
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err = l.Release(rctx)
		cancel()
		if err != nil {
			t.Errorf("release %d with one node busy: %v", i, err)
		}
	}
}

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
	done := acquireReleasing(ctx, wctx, a, name, time.Minute)
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
	done := acquireReleasing(ctx, wctx, a, name, ttl)
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
