package redislua_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
)

// TestHeadSpinOneWaiterInOrder: waiters of three acquirers with HeadSpin (as
// three processes would be), three of each in a row, queued one after
// another behind a holder, are granted the lease in line order; waiters told
// they were next spun; and never did two waiters of one acquirer spin at
// once (the one told it is next overlaps the one before it, which is taking
// its grant, when both are of one acquirer).
func TestHeadSpinOneWaiterInOrder(t *testing.T) {
	c := testenv.RedisClient(t)
	var (
		mu       sync.Mutex
		spinning = map[*redislua.Acquirer]int{}
		most     = 0
		spins    = 0
	)
	redislua.ObserveSpins(t, func(a *redislua.Acquirer, d int) {
		mu.Lock()
		defer mu.Unlock()
		spinning[a] += d
		if d > 0 {
			spins++
		}
		most = max(most, spinning[a])
	})
	var acqs []*redislua.Acquirer
	for i := 0; i < 3; i++ {
		a, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{HeadSpin: 20 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		acqs = append(acqs, a)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := fencetest.Name("headspin")
	holder, err := acqs[0].TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	const waiters = 9
	order := make(chan int, waiters)
	errs := make(chan error, waiters)
	for i := 0; i < waiters; i++ {
		go func() {
			l, err := acqs[i/3].Acquire(ctx, name, 10*time.Second)
			if err != nil {
				errs <- err
				return
			}
			order <- i
			// The workload's hold, so the next waiter spins a while.
			time.Sleep(time.Millisecond)
			errs <- l.Release(ctx)
		}()
		waitInLine(t, c, name, int64(i+1))
	}
	if err := holder.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < waiters; i++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	close(order)
	want := 0
	for got := range order {
		if got != want {
			t.Errorf("waiter %d granted in place %d: not in line order", got, want)
		}
		want++
	}
	mu.Lock()
	defer mu.Unlock()
	// Under load a waiter may get its grant before the notice that it is
	// next, and then does not spin; most do.
	if spins < 1 || spins > waiters-1 {
		t.Errorf("%d waiters spun, want 1 to %d (each but the first may be told it is next)", spins, waiters-1)
	}
	if most != 1 {
		t.Errorf("up to %d waiters of one acquirer spun at once, want 1", most)
	}
}

// TestHeadSpinOptions: HeadSpin may not be negative nor above 100ms.
func TestHeadSpinOptions(t *testing.T) {
	c := testenv.RedisClient(t)
	for _, d := range []time.Duration{-time.Nanosecond, 100*time.Millisecond + 1} {
		if _, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{HeadSpin: d}); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("HeadSpin %v: %v, want ErrInvalid", d, err)
		}
	}
	if _, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{HeadSpin: 100 * time.Millisecond}); err != nil {
		t.Errorf("HeadSpin 100ms: %v", err)
	}
}
