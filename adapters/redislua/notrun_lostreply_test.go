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
	"github.com/redis/go-redis/v9"
)

// lostThenBusy runs step through a proxy that loses the reply of its first
// script call after Redis ran it (the connection is cut 2s after the request
// was forwarded), makes Redis busy meanwhile, once landed reports that the
// call ran, so that go-redis's resend of the call gets BUSY, and ends the
// step's context after two BUSY replies. It returns the step's error, once
// Redis is no longer busy.
func lostThenBusy(t *testing.T, b *busyRedis, c *redis.Client, p *faultnet.Proxy, name string, step func(ctx context.Context) error, landed func() bool) error {
	t.Helper()
	hook := busyHook{seen: make(chan struct{}, 1)}
	c.AddHook(hook)
	p.ReplyWindow(2 * time.Second)
	p.LoseReply(func(req []byte) bool { return isScript(req) && faultnet.Carries(req, name) })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- step(ctx) }()
	deadline := time.Now().Add(30 * time.Second)
	for !landed() {
		if time.Now().After(deadline) {
			t.Fatal("the first send never landed")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if p.Pending() != 0 {
		t.Fatal("the reply of the send that landed was not taken by the proxy")
	}
	stop := b.busy(t)
	for i := 0; i < 2; i++ {
		select {
		case <-hook.seen:
		case err := <-done:
			stop()
			t.Fatalf("the step returned before its resend got BUSY: %v", err)
		case <-time.After(30 * time.Second):
			stop()
			t.Fatal("the resend never got a BUSY reply")
		}
	}
	cancel()
	err := <-done
	stop()
	return err
}

// TestTryAcquireLandedThenBusyIsNotReportedNotRun: a try whose reply was
// lost after Redis granted, and whose resend (go-redis sends it again after
// the network error) Redis answers BUSY until the caller's context ends, may
// have granted: its error must not say that Redis ran nothing
// (redislua.ErrNotRun without fence.ErrUnknown). The grant is undone once
// Redis is no longer busy.
func TestTryAcquireLandedThenBusyIsNotReportedNotRun(t *testing.T) {
	b := startBusyRedis(t)
	p := faultnet.Start(t, b.srv.Addr)
	c := redis.NewClient(&redis.Options{Addr: p.Addr(), ReadTimeout: 10 * time.Second})
	t.Cleanup(func() { c.Close() })
	ctx := context.Background()
	a, err := redislua.NewAcquirer(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	warm, err := a.TryAcquire(ctx, fencetest.Name("warm"), time.Minute) // loads the script
	if err != nil {
		t.Fatal(err)
	}
	_ = warm.Release(ctx)
	name := fencetest.Name("landed-busy")
	lock, counter := "fence:{"+name+"}:lock", "fence:{"+name+"}:token"
	err = lostThenBusy(t, b, c, p, name, func(ctx context.Context) error {
		l, err := a.TryAcquire(ctx, name, time.Minute)
		if l != nil {
			_ = l.Release(context.Background())
		}
		return err
	}, func() bool { return b.admin.Exists(ctx, lock).Val() == 1 })
	tok, _ := b.admin.Get(ctx, counter).Result()
	if err != nil && errors.Is(err, redislua.ErrNotRun) && !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("a try that granted (counter now %s), reply lost, resend answered BUSY: %v; want fence.ErrUnknown, not ErrNotRun alone (\"changed nothing\")", tok, err)
	}
	// The orphan grant is released once Redis runs the leave.
	deadline := time.Now().Add(20 * time.Second)
	for b.admin.Exists(ctx, lock).Val() == 1 {
		if time.Now().After(deadline) {
			t.Fatalf("the name is still held 20s after Redis stopped being busy: %s", b.admin.Get(ctx, lock).Val())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestRenewLandedThenBusyIsNotReportedNotRun: a renewal whose reply was lost
// after Redis extended the lock, and whose resend Redis answers BUSY until the
// caller's context ends, changed the lock's expiry: its error must not say
// that Redis ran nothing (ErrNotRun without fence.ErrUnknown).
func TestRenewLandedThenBusyIsNotReportedNotRun(t *testing.T) {
	b := startBusyRedis(t)
	p := faultnet.Start(t, b.srv.Addr)
	c := redis.NewClient(&redis.Options{Addr: p.Addr(), ReadTimeout: 10 * time.Second})
	t.Cleanup(func() { c.Close() })
	ctx := context.Background()
	a, err := redislua.NewAcquirer(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("renew-landed-busy")
	l, err := a.TryAcquire(ctx, name, 10*time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Renew(ctx); err != nil { // loads the script
		t.Fatal(err)
	}
	lock := "fence:{" + name + "}:lock"
	if err := b.admin.PExpire(ctx, lock, time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	err = lostThenBusy(t, b, c, p, name, l.Renew, func() bool { return b.admin.PTTL(ctx, lock).Val() > 2*time.Minute })
	if err != nil && errors.Is(err, redislua.ErrNotRun) && !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("a renewal that extended the lock to %v, reply lost, resend answered BUSY: %v; want fence.ErrUnknown, not ErrNotRun alone (\"changed nothing\")", b.admin.PTTL(ctx, lock).Val(), err)
	}
}
