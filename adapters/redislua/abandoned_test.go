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

// TestAbandonedLockCallLandsLate: a TryAcquire and an Acquire whose context
// ends in a partition that outlasts the client's ReadTimeout return
// fence.ErrUnknown while their lock script calls (on connections opened
// before the partition) are held; their leave, which needs a new connection,
// cannot even be sent before the client gives up. After the partition heals
// the held "try" lands and grants: the name must still be free soon for
// another acquirer (HAZARDS 3 and 6), not held for the minute's ttl.
func TestAbandonedLockCallLandsLate(t *testing.T) {
	ctx := context.Background()
	p := faultnet.Start(t, testenv.RedisAddr())
	// ContextTimeoutEnabled off; a short ReadTimeout so that the abandoned
	// calls return (and write their results) while the test still runs.
	c := redis.NewClient(&redis.Options{Addr: p.Addr(), ReadTimeout: 300 * time.Millisecond, MaxRetries: 1})
	t.Cleanup(func() { c.Close() })
	a, err := redislua.NewAcquirer(c, nil)
	if err != nil {
		t.Fatal(err)
	}
	warm := fencetest.Name("late")
	l, err := a.TryAcquire(ctx, warm, time.Minute) // connects and loads the scripts
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	tried, waited := fencetest.Name("late"), fencetest.Name("late")
	other, err := redislua.NewAcquirer(testenv.RedisClient(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	held, err := other.TryAcquire(ctx, waited, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	p.Partition()
	cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	_, terr := a.TryAcquire(cctx, tried, time.Minute)
	cancel()
	cctx, cancel = context.WithTimeout(ctx, 100*time.Millisecond)
	_, aerr := a.Acquire(cctx, waited, time.Minute)
	cancel()
	p.Heal()
	t.Logf("through a partition: TryAcquire(%s) %v; Acquire(%s) %v", tried, terr, waited, aerr)
	if terr == nil || aerr == nil {
		t.Fatalf("through a partition: TryAcquire %v, Acquire %v; want errors", terr, aerr)
	}
	if !errors.Is(terr, fence.ErrUnknown) && !errors.Is(terr, fence.ErrHeld) {
		t.Errorf("TryAcquire through a partition: %v", terr)
	}
	// The held calls land now; each of the two names must be free for the
	// other acquirer soon (not after the minute's ttl).
	if err := held.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{tried, waited} {
		actx, cancel := context.WithTimeout(ctx, 10*time.Second)
		start := time.Now()
		ol, err := other.Acquire(actx, name, time.Minute)
		cancel()
		if err != nil {
			t.Fatalf("%s after the partition healed: %v, want it free", name, err)
		}
		t.Logf("%s free for another acquirer after %v", name, time.Since(start).Round(time.Millisecond))
		_ = ol.Release(ctx)
	}
	// Let the abandoned calls' client timeouts pass, so that any result
	// they write lands while the test runs.
	time.Sleep(time.Second)
}
