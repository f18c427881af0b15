package fence_test

// Hold with a grant that answers late: its first renewal comes at once when
// the lease's local deadline is nearer than two renewal intervals away, and
// later renewals keep pace with the time left. The tests run on real
// backends: SQLite through sqlfence, Redis through redislua.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/fencekit/fencekit/adapters/redislua"
	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/internal/testenv"
)

// How a slowAcq lease answers LocalDeadline.
const (
	dlForward = iota // the wrapped lease's (leasekit.Base's)
	dlHide           // no LocalDeadline method at all (embeds fence.Lease only)
	dlCustom         // slowAcq.deadline's answer
)

// How a slowAcq lease renews.
const (
	renewReal      = iota // the backend's Renew
	renewFakeOK           // nil, without renewing: the backend does not extend
	renewTransient        // a transient error, without a request
)

// slowAcq wraps a real acquirer: its grant answers lateBy after the backend
// granted (a slow reply, simulated with a sleep), and its leases record every
// Renew call.
type slowAcq struct {
	fence.Acquirer
	lateBy    time.Duration
	dlMode    int
	deadline  func() time.Time
	renewMode int

	renews  atomic.Int32 // Renew calls
	renewed atomic.Int32 // renewals the backend confirmed
	lost    atomic.Int32 // renewals answered ErrLost

	mu      sync.Mutex
	gotAt   time.Time   // when Acquire returned the lease to Hold
	renewAt []time.Time // when each Renew was called
}

type slowLease struct {
	fence.Lease
	a *slowAcq
}

// slowLeaseD is slowLease with a LocalDeadline method.
type slowLeaseD struct{ *slowLease }

func (l slowLeaseD) LocalDeadline() time.Time {
	if l.a.dlMode == dlCustom {
		return l.a.deadline()
	}
	return l.Lease.(interface{ LocalDeadline() time.Time }).LocalDeadline()
}

func (a *slowAcq) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	l, err := a.Acquirer.Acquire(ctx, name, ttl)
	if err != nil {
		return nil, err
	}
	time.Sleep(a.lateBy) // the answer on its way back (a slow backend), not a synchronisation
	rl := &slowLease{Lease: l, a: a}
	a.mu.Lock()
	a.gotAt = time.Now()
	a.mu.Unlock()
	if a.dlMode == dlHide {
		return rl, nil
	}
	return slowLeaseD{rl}, nil
}

func (l *slowLease) Renew(ctx context.Context) error {
	l.a.renews.Add(1)
	l.a.mu.Lock()
	l.a.renewAt = append(l.a.renewAt, time.Now())
	l.a.mu.Unlock()
	switch l.a.renewMode {
	case renewFakeOK:
		return nil
	case renewTransient:
		return errors.New("connection refused (simulated)")
	}
	err := l.Lease.Renew(ctx)
	switch {
	case err == nil:
		l.a.renewed.Add(1)
	case errors.Is(err, fence.ErrLost):
		l.a.lost.Add(1)
	}
	return err
}

// firstRenewalAfter is how long after Acquire returned the first Renew came
// (ok false: none).
func (a *slowAcq) firstRenewalAfter() (time.Duration, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.renewAt) == 0 {
		return 0, false
	}
	return a.renewAt[0].Sub(a.gotAt), true
}

// waitRenewed is work that runs until the backend confirmed n renewals: nil,
// or the cause of its context's end, or an error after limit.
func waitRenewed(a *slowAcq, n int32, limit time.Duration) func(context.Context, fence.Lease) error {
	return func(ctx context.Context, l fence.Lease) error {
		giveUp := time.After(limit)
		tick := time.NewTicker(5 * time.Millisecond) // a poll, not a synchronisation
		defer tick.Stop()
		for a.renewed.Load() < n {
			select {
			case <-ctx.Done():
				return fmt.Errorf("work cancelled after %d confirmed renewals (%d calls): %w", a.renewed.Load(), a.renews.Load(), context.Cause(ctx))
			case <-giveUp:
				return fmt.Errorf("only %d of %d renewals confirmed (%d calls) after %v", a.renewed.Load(), n, a.renews.Load(), limit)
			case <-tick.C:
			}
		}
		return nil
	}
}

// TestHoldDriftOverAThirdOfTheTTL: an acquirer whose Drift is 1s (a
// clock allowance set once), and a 1.5s lease, which the acquirer accepts
// (the ttl is longer than the drift). Every confirmed renewal puts the local
// deadline 500ms after the renewal was sent; Hold renewed 500ms after the
// renewal answered, always after the deadline, and the work was cancelled
// with ErrLost though no renewal failed (as when Hold read the deadline for
// the first renewal only). The next renewal is now due
// within a third of the time left.
func TestHoldDriftOverAThirdOfTheTTL(t *testing.T) {
	const ttl = 1500 * time.Millisecond
	_, db := sqliteAcquirerDB(t)
	sa, err := sqlfence.NewAcquirer(sqlfence.SQLite(db), &sqlfence.AcquirerOptions{Drift: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	a := &slowAcq{Acquirer: sa}
	err = fence.Hold(context.Background(), a, "drift", ttl, waitRenewed(a, 3, hangGuard))
	if err != nil {
		t.Fatalf("Hold with Drift 1s, ttl 1.5s, every renewal confirmed: %v (renew calls %d, confirmed %d, lost %d); want the work to run through its renewals, or the acquirer to refuse the ttl",
			err, a.renews.Load(), a.renewed.Load(), a.lost.Load())
	}
}

// TestHoldNoRenewalOfAnExpiredGrant: the grant answers after its whole
// local deadline has passed, so its context is done before Hold's renewal loop
// starts. Hold must report ErrLost and never call Renew on it (while the
// first renewal was a third of the ttl away, the lease's end always came
// first). With the first renewal due at once, the loop's select
// picked at random between the lease's end and the renewal (7 to 11 renewals
// in 20 rounds, reported to observers as renewals); the loop now checks the
// lease before it renews.
func TestHoldNoRenewalOfAnExpiredGrant(t *testing.T) {
	const rounds = 20
	a := &slowAcq{Acquirer: sqliteAcquirer(t), lateBy: ttl + 50*time.Millisecond}
	for i := range rounds {
		err := fence.Hold(context.Background(), a, fmt.Sprintf("expired-%d", i), ttl, func(ctx context.Context, l fence.Lease) error {
			if err := awaitCancel(ctx); err != nil {
				return err
			}
			return nil
		})
		if !errors.Is(err, fence.ErrLost) {
			t.Fatalf("round %d: Hold of a grant that answered after its deadline = %v, want ErrLost", i, err)
		}
	}
	if n := a.renews.Load(); n != 0 {
		t.Fatalf("Hold called Renew %d times in %d rounds on leases whose context was done before its loop started (%d answered ErrLost); want none", n, rounds, a.lost.Load())
	}
}

// TestHoldLateGrantCadence: a grant answered 400ms into a 600ms lease,
// renewals confirmed. The first renewal is at once; afterwards Hold renews
// every ttl/3 (200ms), no more often: over 1.8s of work (three ttls) at most
// 3 per ttl plus the early one and a margin, and the lease is kept.
func TestHoldLateGrantCadence(t *testing.T) {
	const ttl = 600 * time.Millisecond
	a := &slowAcq{Acquirer: sqliteAcquirer(t), lateBy: 400 * time.Millisecond}
	err := fence.Hold(context.Background(), a, "cadence", ttl, func(ctx context.Context, l fence.Lease) error {
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-time.After(3 * ttl): // how long the work runs
			return nil
		}
	})
	if err != nil {
		t.Fatalf("Hold of a late grant, renewals confirmed: %v (renew calls %d)", err, a.renews.Load())
	}
	n := a.renews.Load()
	if n < 1 || n > 3*3+1+2 {
		t.Fatalf("%d Renew calls in 3 ttls, %d confirmed; want 1..12 (every ttl/3, one early)", n, a.renewed.Load())
	}
}

// holdLateGrantUntilLost holds name on SQLite through a grant answered 400ms
// late (200ms of a 600ms ttl left) whose renewals answer as mode, until Hold
// returns; it fails the test (as what) unless Hold returns ErrLost, and
// returns the Renew calls made.
func holdLateGrantUntilLost(t *testing.T, mode int, name, what string) int32 {
	t.Helper()
	const ttl = 600 * time.Millisecond
	a := &slowAcq{Acquirer: sqliteAcquirer(t), lateBy: 400 * time.Millisecond, renewMode: mode}
	err := fence.Hold(context.Background(), a, name, ttl, func(ctx context.Context, l fence.Lease) error {
		return awaitCancel(ctx)
	})
	if !errors.Is(err, fence.ErrLost) {
		t.Fatalf("%s = %v, want ErrLost", what, err)
	}
	return a.renews.Load()
}

// TestHoldNoSpinWhenTheDeadlineStaysNear: a late grant whose renewals
// the backend "confirms" without extending anything (Renew returns nil, the
// local deadline stays where it was, 200ms off): Hold must not renew in a
// tight loop because the deadline keeps being near; the lease ends at its
// deadline with ErrLost after a handful of calls. After a confirmed renewal
// the next is due within a third of the time left, but never sooner than
// ttl/12 (50ms), the pace of a retry after a transient error.
func TestHoldNoSpinWhenTheDeadlineStaysNear(t *testing.T) {
	n := holdLateGrantUntilLost(t, renewFakeOK, "stuck", "Hold of a lease never extended")
	// 200ms left: one renewal at once, then at most one every 50ms: 5.
	if n > 5 {
		t.Fatalf("%d Renew calls in the 200ms before the local deadline; want at most 5 (one at once, then at most one every ttl/12: no spin)", n)
	}
}

// TestHoldLateGrantTransientRetryPace: a late grant (200ms left) whose renewals
// fail with a transient error: Hold retries every ttl/12 (50ms), not in a
// tight loop, until the local deadline ends the lease with ErrLost.
func TestHoldLateGrantTransientRetryPace(t *testing.T) {
	n := holdLateGrantUntilLost(t, renewTransient, "flaky", "Hold whose renewals all fail")
	// At once, then every 50ms for about 200ms: about 5.
	if n < 1 || n > 8 {
		t.Fatalf("%d Renew calls in the 200ms before the local deadline; want 1..8 (a retry every 50ms, no spin)", n)
	}
}

// TestHoldDeadlineUnknownOrFar: leases whose LocalDeadline Hold cannot
// use (a wrapper that embeds fence.Lease and hides it, the same wrapper under
// fence.Observe, a lease that answers the zero time) or that is far away (an
// hour): Hold keeps the old cadence, the first renewal a full ttl/3 after it
// got the lease (a timer never fires early, so the lower bound is exact), and
// the work runs through its renewals without a panic.
func TestHoldDeadlineUnknownOrFar(t *testing.T) {
	const ttl = 600 * time.Millisecond
	for _, c := range []struct {
		name     string
		dlMode   int
		deadline func() time.Time
		observe  bool
	}{
		{"hidden", dlHide, nil, false},
		{"hidden-observed", dlHide, nil, true},
		{"zero", dlCustom, func() time.Time { return time.Time{} }, false},
		{"zero-observed", dlCustom, func() time.Time { return time.Time{} }, true},
		{"far", dlCustom, func() time.Time { return time.Now().Add(time.Hour) }, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			a := &slowAcq{Acquirer: sqliteAcquirer(t), dlMode: c.dlMode, deadline: c.deadline}
			var acq fence.Acquirer = a
			if c.observe {
				acq = fence.Observe(a, "sqlite", fence.SlogObserver(slog.New(slog.DiscardHandler)))
			}
			if err := fence.Hold(context.Background(), acq, "unknown", ttl, waitRenewed(a, 2, 15*time.Second)); err != nil {
				t.Fatalf("Hold: %v", err)
			}
			first, ok := a.firstRenewalAfter()
			if !ok || first < ttl/3 {
				t.Fatalf("first renewal %v after Hold got the lease (any: %v); want a full ttl/3 (%v)", first, ok, ttl/3)
			}
		})
	}
}

// TestHoldLateGrantParentCancelled: a late grant (200ms of 600ms left)
// whose caller's context is cancelled as the work starts, the work taking
// another 700ms to stop (a step it cannot interrupt). Hold renews at once and
// on, whatever the caller's context: the work's context ends with
// context.Canceled, not ErrLost, and Hold does not report the lease lost.
func TestHoldLateGrantParentCancelled(t *testing.T) {
	const ttl = 600 * time.Millisecond
	a := &slowAcq{Acquirer: sqliteAcquirer(t), lateBy: 400 * time.Millisecond}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	err := fence.Hold(ctx, a, "parent", ttl, func(wctx context.Context, l fence.Lease) error {
		cancel()
		time.Sleep(700 * time.Millisecond) // a step that does not look at ctx, not a synchronisation
		if errors.Is(context.Cause(wctx), fence.ErrLost) {
			return fmt.Errorf("lease lost while the work ran on after its caller left: %w", context.Cause(wctx))
		}
		return wctx.Err()
	})
	if !errors.Is(err, context.Canceled) || errors.Is(err, fence.ErrLost) {
		t.Fatalf("Hold after the caller's cancel = %v (renew calls %d, confirmed %d); want context.Canceled alone", err, a.renews.Load(), a.renewed.Load())
	}
	if a.renewed.Load() < 1 {
		t.Fatalf("no renewal confirmed in 700ms of a lease with 200ms left")
	}
}

// TestHoldLateGrantPanic: work that panics at once on a late grant
// (renewal due at once, running alongside): the panic reaches the caller,
// and the lease is free afterwards. Several rounds, for -race.
func TestHoldLateGrantPanic(t *testing.T) {
	const ttl = 600 * time.Millisecond
	sa := sqliteAcquirer(t)
	a := &slowAcq{Acquirer: sa, lateBy: 400 * time.Millisecond}
	for i := range 5 {
		name := fmt.Sprintf("panic-%d", i)
		func() {
			defer func() {
				if p := recover(); p != "work panic" {
					t.Errorf("round %d: recovered %v, want the work's panic", i, p)
				}
			}()
			_ = fence.Hold(context.Background(), a, name, ttl, func(context.Context, fence.Lease) error { panic("work panic") })
		}()
		l, err := sa.TryAcquire(context.Background(), name, ttl)
		if err != nil {
			t.Fatalf("round %d: lease still held after the work panicked: %v", i, err)
		}
		_ = l.Release(context.Background())
	}
}

// TestHoldLateGrantRedis: the late-grant case on another backend,
// Redis through redislua under fence.Observe: a grant answered 1.05s into a
// 1.5s lease keeps its lease through three confirmed renewals.
func TestHoldLateGrantRedis(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
	t.Cleanup(func() { c.Close() })
	if err := c.Ping(context.Background()).Err(); err != nil {
		testenv.Missing(t, "Redis", err)
	}
	ra, err := redislua.NewAcquirer(c, &redislua.AcquirerOptions{Prefix: fmt.Sprintf("holdlate%d:", time.Now().UnixNano())})
	if err != nil {
		t.Fatal(err)
	}
	a := &slowAcq{Acquirer: ra, lateBy: 1050 * time.Millisecond}
	acq := fence.Observe(a, "redis", fence.SlogObserver(slog.New(slog.DiscardHandler)))
	if err := fence.Hold(context.Background(), acq, "late", 1500*time.Millisecond, waitRenewed(a, 3, hangGuard)); err != nil {
		t.Fatalf("Hold of a late Redis grant: %v", err)
	}
}
