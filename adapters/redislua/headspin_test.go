package redislua_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fencekit/fencekit/adapters/redislua"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/redis/go-redis/v9"
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
		a := newAcquirerOn(t, c, &redislua.AcquirerOptions{HeadSpin: 20 * time.Millisecond})
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

// TestHeadSpinCtxEndsTheSpin: a waiter that is spinning (told it is next)
// when its ctx is cancelled gives up: a grant that reaches it afterwards,
// while the spin would still run, is not handed out as a lease (ctx bounds
// the wait, fence.Acquirer), and Acquire returns ErrHeld and the ctx error.
func TestHeadSpinCtxEndsTheSpin(t *testing.T) {
	c := testenv.RedisClient(t)
	a := newAcquirerOn(t, c, &redislua.AcquirerOptions{HeadSpin: 100 * time.Millisecond})
	b := newAcquirerOn(t, c, &redislua.AcquirerOptions{HeadSpin: 100 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := fencetest.Name("spinctx")
	h0 := mustTryAcquire(ctx, t, a, name, time.Minute)
	// X, first in line, of a: its grant tells W (of b, second) it is next.
	xGot := make(chan fence.Lease, 1)
	go func() {
		l, err := a.Acquire(ctx, name, time.Minute)
		if err != nil {
			t.Error(err)
		}
		xGot <- l
	}()
	waitInLine(t, c, name, 1)
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	spinning := make(chan struct{}, 1)
	redislua.ObserveSpins(t, func(acq *redislua.Acquirer, d int) {
		if acq == b && d > 0 {
			select {
			case spinning <- struct{}{}:
			default:
			}
			wcancel() // W's caller gives up while W spins
		}
	})
	wres := acquireInBackground(wctx, b, name, time.Minute)
	waitInLine(t, c, name, 2)
	if err := h0.Release(ctx); err != nil {
		t.Fatal(err)
	}
	x := <-xGot
	if x == nil {
		t.Fatal("X was not granted")
	}
	// The spin's signal comes before the cancel, so W's answer may also be
	// ready when this select runs (it picks either): an answer counts as
	// "without spinning" only when no spin was signalled.
	var early *acquired
	select {
	case <-spinning:
	case r := <-wres:
		select {
		case <-spinning:
			early = &r
		default:
			t.Fatalf("W returned (%v, %v) without spinning: it was not told it is next", r.l, r.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("W never spun")
	}
	// W's ctx is cancelled; this release grants W by pub/sub.
	if err := x.Release(ctx); err != nil {
		t.Fatal(err)
	}
	var r acquired
	if early != nil {
		r = *early
	} else {
		r = <-wres
	}
	if r.err == nil {
		_ = r.l.Release(ctx)
		t.Fatalf("Acquire returned a lease (token %d) granted after its ctx was cancelled, while it spun", r.l.Token())
	}
	if !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.Canceled) {
		t.Fatalf("Acquire: %v, want ErrHeld and context.Canceled", r.err)
	}
	// The grant W did not take went on: the name is free again, not held for
	// the ttl.
	l, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatalf("after W gave up: %v (W's grant was not released)", err)
	}
	_ = l.Release(ctx)
}

// TestHeadSpinStopsForLongHolds: a waiter told it is next whose grant then
// takes longer than HeadSpin (the holder before it works 60ms, HeadSpin is
// 20ms) spins at most once: the doc promises no spin "while that time is
// above HeadSpin". The waiter polls every 5-10ms, so its grant comes in a
// later poll round than its notice.
func TestHeadSpinStopsForLongHolds(t *testing.T) {
	c := testenv.RedisClient(t)
	a := newAcquirerOn(t, c, &redislua.AcquirerOptions{HeadSpin: 20 * time.Millisecond})
	b, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{HeadSpin: 20 * time.Millisecond,
		Backoff: fence.Backoff{Min: time.Millisecond, Max: 10 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	var spins atomic.Int64
	redislua.ObserveSpins(t, func(acq *redislua.Acquirer, d int) {
		if acq == b && d > 0 {
			spins.Add(1)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	name := fencetest.Name("spinlong")
	const rounds = 4
	for r := 0; r < rounds; r++ {
		h0 := mustTryAcquire(ctx, t, a, name, time.Minute)
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			l, err := a.Acquire(ctx, name, time.Minute)
			if err != nil {
				t.Error(err)
				return
			}
			time.Sleep(60 * time.Millisecond) // the work under the lease
			if err := l.Release(ctx); err != nil {
				t.Error(err)
			}
		}()
		waitInLine(t, c, name, 1)
		go func() {
			defer wg.Done()
			l, err := b.Acquire(ctx, name, time.Minute)
			if err != nil {
				t.Error(err)
				return
			}
			if err := l.Release(ctx); err != nil {
				t.Error(err)
			}
		}()
		waitInLine(t, c, name, 2)
		if err := h0.Release(ctx); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
	}
	if n := spins.Load(); n > 1 {
		t.Errorf("the waiter spun in %d of %d rounds, each waiting 60ms from its notice to its grant (HeadSpin 20ms): want at most 1", n, rounds)
	}
}

// TestHeadSpinMixedLine: waiters of acquirers with and without HeadSpin,
// and one whose process died while it was next in line, share one name: they
// are granted in line order, one at a time, with growing tokens, and the dead
// one (told it is next, then skipped) stalls nobody for a ttl.
func TestHeadSpinMixedLine(t *testing.T) {
	c := testenv.RedisClient(t)
	opts := []*redislua.AcquirerOptions{
		{HeadSpin: 100 * time.Millisecond},
		nil,
		{HeadSpin: time.Millisecond},
		{Backoff: fence.Backoff{Min: time.Millisecond, Max: 5 * time.Millisecond}},
		{HeadSpin: 50 * time.Millisecond, Backoff: fence.Backoff{Min: time.Millisecond, Max: 5 * time.Millisecond}},
	}
	var acqs []*redislua.Acquirer
	for _, o := range opts {
		a := newAcquirerOn(t, c, o)
		acqs = append(acqs, a)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := fencetest.Name("spinmixed")
	const ttl = 20 * time.Second
	start := time.Now()
	holder, err := acqs[0].TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
	// The dead waiter: second in line (told it is next when the first is
	// granted), on a client that closes, as a process that died.
	dc := testenv.RedisClient(t)
	dead := newAcquirerOn(t, dc, &redislua.AcquirerOptions{HeadSpin: 100 * time.Millisecond})
	const waiters = 10
	var (
		inside atomic.Int64
		mu     sync.Mutex
		order  []int
		tokens []fence.Token
	)
	errs := make(chan error, waiters+1)
	var deadDone chan struct{}
	dctx, dcancel := context.WithCancel(ctx)
	defer dcancel()
	queued := int64(0)
	for i := 0; i < waiters; i++ {
		if i == 1 {
			deadDone = make(chan struct{})
			go func() {
				defer close(deadDone)
				_, _ = dead.Acquire(dctx, name, ttl)
			}()
			queued++
			waitInLine(t, c, name, queued)
		}
		go func() {
			l, err := acqs[i%len(acqs)].Acquire(ctx, name, ttl)
			if err != nil {
				errs <- err
				return
			}
			if n := inside.Add(1); n != 1 {
				t.Errorf("%d holders at once", n)
			}
			mu.Lock()
			order = append(order, i)
			tokens = append(tokens, l.Token())
			mu.Unlock()
			time.Sleep(2 * time.Millisecond) // the work under the lease
			inside.Add(-1)
			errs <- l.Release(ctx)
		}()
		queued++
		waitInLine(t, c, name, queued)
	}
	// The dead waiter's process dies: its subscription is gone, its entry
	// stays until it expires.
	_ = dc.Close()
	dcancel()
	<-deadDone
	if n, err := c.LLen(ctx, redislua.DefaultPrefix+"{"+name+"}:line").Result(); err != nil || n != queued {
		t.Fatalf("line holds %d (%v), want %d: the dead waiter must still be in it", n, err, queued)
	}
	if err := holder.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < waiters; i++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if took := time.Since(start); took > ttl/2 {
		t.Errorf("the line took %v: someone waited for a ttl (%v)", took, ttl)
	}
	mu.Lock()
	defer mu.Unlock()
	for k, i := range order {
		if i != k {
			t.Errorf("waiter %d granted in place %d: %v, not line order", i, k, order)
			break
		}
	}
	for k := 1; k < len(tokens); k++ {
		if tokens[k] <= tokens[k-1] {
			t.Errorf("token %d after %d", tokens[k], tokens[k-1])
		}
	}
	if tokens[0] <= holder.Token() {
		t.Errorf("first waiter's token %d is not above the holder's %d", tokens[0], holder.Token())
	}
}

// TestHeadSpinLostReleaseReply: the release whose script
// grants the next waiter and tells the one after it that it is next loses its
// reply. The release reports nil or fence.ErrUnknown (never "not the
// holder"), and the line goes on in order: the first waiter is granted, the
// second (told it is next) after it, neither after a ttl.
func TestHeadSpinLostReleaseReply(t *testing.T) {
	direct := testenv.RedisClient(t)
	p := faultnet.Start(t, testenv.RedisAddr())
	pc := redis.NewClient(&redis.Options{Addr: p.Addr(), ReadTimeout: 500 * time.Millisecond})
	t.Cleanup(func() { pc.Close() })
	spin := &redislua.AcquirerOptions{HeadSpin: 50 * time.Millisecond}
	ha := newAcquirerOn(t, pc, spin)
	a, _ := redislua.NewAcquirer(direct, spin)
	b, _ := redislua.NewAcquirer(direct, spin)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := fencetest.Name("spinlost")
	const ttl = 20 * time.Second
	h0 := mustTryAcquire(ctx, t, ha, name, ttl)
	got := make(chan string, 2)
	errs := make(chan error, 2)
	for i, acq := range []*redislua.Acquirer{a, b} {
		go func() {
			l, err := acq.Acquire(ctx, name, ttl)
			if err != nil {
				errs <- err
				return
			}
			got <- fmt.Sprint(i)
			time.Sleep(5 * time.Millisecond) // the work under the lease
			errs <- l.Release(ctx)
		}()
		waitInLine(t, direct, name, int64(i+1))
	}
	start := time.Now()
	p.LoseReply(func(req []byte) bool { return bytes.Contains(req, []byte("release")) })
	if err := h0.Release(ctx); err != nil && !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("release whose reply was lost: %v, want nil or ErrUnknown", err)
	}
	if p.Pending() != 0 {
		t.Fatal("the release's reply was not lost")
	}
	for i := 0; i < 2; i++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if took := time.Since(start); took > ttl/2 {
		t.Errorf("the line took %v after the release: a ttl (%v)", took, ttl)
	}
	if first, second := <-got, <-got; first != "0" || second != "1" {
		t.Errorf("granted %s then %s, want 0 then 1", first, second)
	}
}

// TestHeadSpinCutWhileSpinning: the connections of a waiter's
// process are cut while it spins (told it is next); the release then finds
// nobody listening for it. Nobody waits for a ttl: the waiter behind it is
// granted, and the cut waiter is granted after its process reconnects.
func TestHeadSpinCutWhileSpinning(t *testing.T) {
	direct := testenv.RedisClient(t)
	p := faultnet.Start(t, testenv.RedisAddr())
	pc := redis.NewClient(&redis.Options{Addr: p.Addr(), ReadTimeout: 500 * time.Millisecond})
	t.Cleanup(func() { pc.Close() })
	spin := &redislua.AcquirerOptions{HeadSpin: 100 * time.Millisecond}
	a, _ := redislua.NewAcquirer(direct, spin)
	w := newAcquirerOn(t, pc, spin)
	c, _ := redislua.NewAcquirer(direct, spin)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	name := fencetest.Name("spincut")
	const ttl = 20 * time.Second
	h0 := mustTryAcquire(ctx, t, a, name, ttl)
	cut := make(chan struct{})
	var once sync.Once
	redislua.ObserveSpins(t, func(acq *redislua.Acquirer, d int) {
		if acq == w && d > 0 {
			once.Do(func() { p.CutAll(); close(cut) })
		}
	})
	xGot := make(chan fence.Lease, 1)
	go func() {
		l, err := a.Acquire(ctx, name, ttl)
		if err != nil {
			t.Error(err)
		}
		xGot <- l
	}()
	waitInLine(t, direct, name, 1)
	type result struct {
		who string
		err error
	}
	res := make(chan result, 2)
	for i, acq := range []*redislua.Acquirer{w, c} {
		go func() {
			l, err := acq.Acquire(ctx, name, ttl)
			if err == nil {
				time.Sleep(5 * time.Millisecond) // the work under the lease
				err = l.Release(ctx)
			}
			res <- result{[]string{"cut", "behind"}[i], err}
		}()
		waitInLine(t, direct, name, int64(i+2))
	}
	if err := h0.Release(ctx); err != nil {
		t.Fatal(err)
	}
	x := <-xGot
	if x == nil {
		t.FailNow()
	}
	select {
	case <-cut:
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter told it is next never spun")
	}
	start := time.Now()
	if err := x.Release(ctx); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		r := <-res
		if r.err != nil {
			t.Fatalf("%s: %v", r.who, r.err)
		}
	}
	if took := time.Since(start); took > ttl/2 {
		t.Errorf("the line took %v after the release: a ttl (%v)", took, ttl)
	}
}
