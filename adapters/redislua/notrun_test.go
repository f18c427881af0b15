package redislua_test

import (
	"context"
	"errors"
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
			key := fencetest.Name("notrun-write")
			if err := e.w.Write(ctx, key, []byte("old"), 5); err != nil {
				t.Fatal(err)
			}
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
			key := fencetest.Name("notrun-delete")
			if err := e.w.Write(ctx, key, []byte("old"), 5); err != nil {
				t.Fatal(err)
			}
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
			key := fencetest.Name("notrun-read")
			if err := e.w.Write(ctx, key, []byte("v"), 7); err != nil {
				t.Fatal(err)
			}
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
	w, err := redislua.NewWriter(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, err := redislua.NewIdempotencyStore(c, nil)
	if err != nil {
		t.Fatal(err)
	}
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
	done := make(chan error, 1)
	go func() {
		l, err := a.Acquire(wctx, name, ttl)
		if l != nil {
			_ = l.Release(ctx)
		}
		done <- err
	}()
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
	type result struct {
		l   fence.Lease
		err error
	}
	done := make(chan result, 1)
	go func() {
		l, err := a.Acquire(wctx, name, time.Minute)
		done <- result{l, err}
	}()
	b.sawBusy(t) // its first try; the SUBSCRIBE went before it
	stop()
	line := "fence:{" + name + "}:line"
	deadline := time.Now().Add(20 * time.Second)
	for b.admin.LLen(ctx, line).Val() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the waiter never joined the line after Redis stopped answering BUSY")
		}
		time.Sleep(5 * time.Millisecond) // polls Redis for the waiter's place
	}
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil {
		t.Fatalf("the waiter after the holder's release: %v", r.err)
	}
	defer r.l.Release(ctx)
	if r.l.Token() <= h.Token() {
		t.Errorf("waiter's token %d, holder's %d", r.l.Token(), h.Token())
	}
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
