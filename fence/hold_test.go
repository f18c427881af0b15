package fence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/leasekit"
)

// The Hold tests run on a real SQLite lease table, with faults injected by
// wrapping the acquirer's leases.

func sqliteAcquirer(t *testing.T) *sqlfence.Acquirer {
	t.Helper()
	a, _ := sqliteAcquirerDB(t)
	return a
}

// sqliteAcquirerDB is sqliteAcquirer with the database under it, for a test
// that changes the lease table as another process or an operator would.
func sqliteAcquirerDB(t *testing.T) (*sqlfence.Acquirer, *sql.DB) {
	t.Helper()
	db, err := sqlfence.OpenSQLite(filepath.Join(t.TempDir(), "hold.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	a, err := sqlfence.NewAcquirer(sqlfence.SQLite(db), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.CreateTable(context.Background()); err != nil {
		t.Fatal(err)
	}
	return a, db
}

// faulty wraps an acquirer; its leases fail Renew with renewErr while failing is
// set. renews counts Renew calls, renewed the ones the backend confirmed,
// renewLost the ones it answered ErrLost.
type faulty struct {
	fence.Acquirer
	failing   atomic.Bool
	renewErr  error
	renews    atomic.Int32
	renewed   atomic.Int32
	renewLost atomic.Int32
	releases  atomic.Int32
	// releaseErr, when set, is what Release returns, without releasing.
	releaseErr error
	// lateBy holds back Acquire's answer after the grant, as a reply that
	// came back late would.
	lateBy time.Duration
}

type faultyLease struct {
	fence.Lease
	f *faulty
}

func (f *faulty) Acquire(ctx context.Context, name string, ttl time.Duration) (fence.Lease, error) {
	l, err := f.Acquirer.Acquire(ctx, name, ttl)
	if err != nil {
		return nil, err
	}
	time.Sleep(f.lateBy) // the answer on its way back, not a synchronisation
	return &faultyLease{l, f}, nil
}

// LocalDeadline is the wrapped lease's: a wrapper that hid it would leave
// Hold to renew a late grant a third of the ttl after it got it.
func (l *faultyLease) LocalDeadline() time.Time {
	return l.Lease.(interface{ LocalDeadline() time.Time }).LocalDeadline()
}

func (l *faultyLease) Renew(ctx context.Context) error {
	l.f.renews.Add(1)
	if l.f.failing.Load() {
		return l.f.renewErr
	}
	err := l.Lease.Renew(ctx)
	switch {
	case err == nil:
		l.f.renewed.Add(1)
	case errors.Is(err, fence.ErrLost):
		l.f.renewLost.Add(1)
	}
	return err
}

func (l *faultyLease) Release(ctx context.Context) error {
	l.f.releases.Add(1)
	if l.f.releaseErr != nil {
		return l.f.releaseErr
	}
	return l.Lease.Release(ctx)
}

// ttl is the lease of the Hold tests that wait for it to run out: renewals
// every 50ms, retries every 12.5ms.
const ttl = 150 * time.Millisecond

// hangGuard bounds a wait that only a bug makes endless (it is no claim about
// speed).
const hangGuard = 30 * time.Second

// awaitCancel waits until Hold cancels the work's ctx; an error after
// hangGuard.
func awaitCancel(ctx context.Context) error {
	select {
	case <-ctx.Done():
		return nil
	case <-time.After(hangGuard):
		return errors.New("work never cancelled")
	}
}

// TestHoldKeepsLeaseAndReleases runs work until Hold has renewed the lease
// four times, past its first ttl: the lease is kept all along (the work's
// context stays live), and released once at the end. The lease is long
// (renewals every 200ms, a stalled renewal has 400ms before the local
// deadline) so that a loaded machine does not lose it.
func TestHoldKeepsLeaseAndReleases(t *testing.T) {
	const ttl = 600 * time.Millisecond
	f := &faulty{Acquirer: sqliteAcquirer(t)}
	start := time.Now()
	err := fence.Hold(context.Background(), f, "job", ttl, func(ctx context.Context, l fence.Lease) error {
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for f.renewed.Load() < 4 {
			select {
			case <-tick.C:
			case <-ctx.Done():
				return context.Cause(ctx)
			case <-time.After(hangGuard):
				return errors.New("no four renewals")
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("Hold: %v", err)
	}
	if d := time.Since(start); d <= ttl {
		t.Errorf("four renewals within %v, under the %v ttl: not every ttl/3", d, ttl)
	}
	if n := f.releases.Load(); n != 1 {
		t.Errorf("%d releases, want 1", n)
	}
}

// TestHoldCancelsWorkWhenLeaseLost: every renewal fails with a transient error
// (the backend is out of reach), so Hold retries until the lease's local
// deadline passes, then cancels the work with ErrLost: not at the first
// failure, and not later than the lease itself (the next holder takes the
// lock over with a larger token once it expired on the backend).
func TestHoldCancelsWorkWhenLeaseLost(t *testing.T) {
	// Longer than the package's 150ms: twice in loaded full runs the
	// SQLite grant answered after its whole 150ms lease, and
	// there was nothing left to renew (0 attempts).
	const ttl = time.Second
	a := sqliteAcquirer(t)
	f := &faulty{Acquirer: a, renewErr: errors.New("injected: connection reset")}
	var (
		cause     error
		took      time.Duration
		token     fence.Token
		next      fence.Lease
		nextErr   error
		heldAfter bool
	)
	start := time.Now()
	err := fence.Hold(context.Background(), f, "job", ttl, func(ctx context.Context, l fence.Lease) error {
		token = l.Token()
		f.failing.Store(true)
		if err := awaitCancel(ctx); err != nil {
			return err
		}
		took = time.Since(start)
		cause = context.Cause(ctx)
		// The backend expires the lease a moment later (the local deadline
		// is earlier by the drift margin); then the lock is another's.
		next, nextErr = a.Acquire(context.Background(), "job", time.Minute)
		heldAfter = l.Context().Err() == nil
		return errors.New("work stopped")
	})
	if !errors.Is(cause, fence.ErrLost) {
		t.Errorf("work context cause = %v, want ErrLost", cause)
	}
	if !errors.Is(err, fence.ErrLost) {
		t.Errorf("Hold returned %v, want an error matching ErrLost", err)
	}
	if err == nil || !containsText(err, "work stopped") {
		t.Errorf("Hold returned %v, want the work's error too", err)
	}
	// Transient errors were retried until the local deadline passed.
	if n := f.renews.Load(); n < 2 {
		t.Errorf("%d renewal attempts before giving up, want retries", n)
	}
	if min := ttl - leasekit.DefaultDrift(ttl); took < min {
		t.Errorf("work cancelled %v after the start, before the lease's local deadline (%v)", took, min)
	}
	if heldAfter {
		t.Error("the lease's context was live after the work was cancelled")
	}
	// The next holder took the lock over, with a larger token.
	if nextErr != nil {
		t.Fatalf("the next holder: %v", nextErr)
	}
	if next.Token() <= token {
		t.Errorf("the next holder's token %d, not above the lost lease's %d", next.Token(), token)
	}
	// Hold's release after the loss left the next holder's lease alone.
	if next.Context().Err() != nil {
		t.Errorf("the next holder's lease ended when Hold released the lost one: %v", context.Cause(next.Context()))
	}
	if err := next.Renew(context.Background()); err != nil {
		t.Errorf("the next holder's renewal after Hold's release: %v", err)
	}
	_ = next.Release(context.Background())
}

// TestHoldCancelsWorkOnTakeover: while work runs, another process takes the
// lock over (an operator ends the lease in the table, as an expiry the holder
// did not see would, and a second acquirer is granted it). Hold's next renewal
// reaches the database and is refused: the work is cancelled with ErrLost
// right after that renewal, long before the lease's local deadline (a 3s
// lease renewed every second), and the new holder's lease is untouched.
func TestHoldCancelsWorkOnTakeover(t *testing.T) {
	a, db := sqliteAcquirerDB(t)
	other, err := sqlfence.NewAcquirer(sqlfence.SQLite(db), nil)
	if err != nil {
		t.Fatal(err)
	}
	f := &faulty{Acquirer: a}
	var (
		cause error
		took  time.Duration
		token fence.Token
		taker fence.Lease
	)
	const holdTTL = 3 * time.Second
	start := time.Now()
	err = fence.Hold(context.Background(), f, "job", holdTTL, func(ctx context.Context, l fence.Lease) error {
		token = l.Token()
		if _, err := db.Exec(`UPDATE fence_leases SET expires_at = 0 WHERE name = 'job'`); err != nil {
			return err
		}
		var err error
		if taker, err = other.TryAcquire(context.Background(), "job", time.Minute); err != nil {
			return err
		}
		if err := awaitCancel(ctx); err != nil {
			return err
		}
		cause = context.Cause(ctx)
		took = time.Since(start)
		return nil
	})
	// Hold returns after its renewal loop, so the renewal that found the
	// loss (it ends the lease's context before it returns) is counted.
	lost, renewed := f.renewLost.Load(), f.renewed.Load()
	if taker == nil {
		t.Fatalf("Hold: %v (the takeover did not happen)", err)
	}
	defer taker.Release(context.Background())
	if !errors.Is(cause, fence.ErrLost) || !errors.Is(err, fence.ErrLost) {
		t.Errorf("work context cause %v, Hold returned %v: want ErrLost in both", cause, err)
	}
	if lost != 1 || renewed != 0 {
		t.Errorf("%d renewals refused and %d confirmed, want the first renewal refused and Hold stopping there", lost, renewed)
	}
	if min := holdTTL - leasekit.DefaultDrift(holdTTL); took >= min {
		t.Errorf("work cancelled %v after the start, not before the lease's local deadline (%v)", took, min)
	}
	if taker.Token() <= token {
		t.Errorf("the taker's token %d, not above the holder's %d", taker.Token(), token)
	}
	if err := taker.Renew(context.Background()); err != nil {
		t.Errorf("the taker's lease after Hold's release: %v", err)
	}
}

func TestHoldStopsOnErrLost(t *testing.T) {
	f := &faulty{Acquirer: sqliteAcquirer(t), renewErr: fence.ErrLost}
	f.failing.Store(true)
	renewsAtCancel := int32(-1)
	err := fence.Hold(context.Background(), f, "job", 3*time.Second, func(ctx context.Context, l fence.Lease) error {
		<-ctx.Done()
		renewsAtCancel = f.renews.Load()
		return nil
	})
	if !errors.Is(err, fence.ErrLost) {
		t.Fatalf("Hold = %v, want ErrLost", err)
	}
	if renewsAtCancel != 1 {
		t.Errorf("work cancelled after %d renewals, want right after the first one returned ErrLost", renewsAtCancel)
	}
}

func TestHoldReturnsWorkError(t *testing.T) {
	f := &faulty{Acquirer: sqliteAcquirer(t)}
	boom := errors.New("boom")
	err := fence.Hold(context.Background(), f, "job", time.Second, func(context.Context, fence.Lease) error { return boom })
	if !errors.Is(err, boom) || errors.Is(err, fence.ErrLost) {
		t.Fatalf("Hold = %v, want boom alone", err)
	}
	if f.releases.Load() != 1 {
		t.Error("lease not released after the work failed")
	}
}

func TestHoldReleasesOnPanic(t *testing.T) {
	a := sqliteAcquirer(t)
	func() {
		defer func() {
			if recover() == nil {
				t.Error("panic swallowed")
			}
		}()
		_ = fence.Hold(context.Background(), a, "job", 30*time.Second, func(context.Context, fence.Lease) error { panic("work panicked") })
	}()
	l, err := a.TryAcquire(context.Background(), "job", time.Second)
	if err != nil {
		t.Fatalf("lease still held after the work panicked: %v", err)
	}
	_ = l.Release(context.Background())
}

func TestHoldAcquireError(t *testing.T) {
	a := sqliteAcquirer(t)
	l, err := a.TryAcquire(context.Background(), "job", 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	ran := false
	err = fence.Hold(ctx, a, "job", time.Second, func(context.Context, fence.Lease) error { ran = true; return nil })
	if ran || !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Hold on a held lease: ran=%v err=%v", ran, err)
	}
}

func TestHoldParentCancel(t *testing.T) {
	f := &faulty{Acquirer: sqliteAcquirer(t)}
	ctx, cancel := context.WithCancel(context.Background())
	err := fence.Hold(ctx, f, "job", time.Second, func(ctx context.Context, l fence.Lease) error {
		cancel()
		<-ctx.Done()
		return ctx.Err()
	})
	if !errors.Is(err, context.Canceled) || errors.Is(err, fence.ErrLost) {
		t.Fatalf("Hold after parent cancel = %v, want context.Canceled alone", err)
	}
	if f.releases.Load() != 1 {
		t.Error("lease not released after the parent context was cancelled")
	}
}

func containsText(err error, s string) bool {
	return err != nil && strings.Contains(err.Error(), s)
}

func TestBackoffDelay(t *testing.T) {
	b := fence.Backoff{Min: time.Millisecond, Max: 8 * time.Millisecond}
	for attempt := 0; attempt < 40; attempt++ {
		ceil := time.Millisecond << min(attempt, 3)
		for i := 0; i < 200; i++ {
			if d := b.Delay(attempt); d < 0 || d > ceil {
				t.Fatalf("Delay(%d) = %v, want within [0, %v]", attempt, d, ceil)
			}
		}
	}
	// Full jitter: delays spread over the range instead of sitting at the cap.
	var low int
	for i := 0; i < 1000; i++ {
		if b.Delay(10) < 4*time.Millisecond {
			low++
		}
	}
	if low < 300 || low > 700 {
		t.Errorf("%d of 1000 delays below half the cap; want about half (full jitter)", low)
	}
}

// TestHoldRenewsALateGrantInTime: the grant's answer comes back 1.05s into a
// 1.5s lease (a loaded machine, a retried request). Hold's first renewal must
// come before the lease's local deadline (1.485s after the grant was sent),
// not a third of the ttl after Hold got the lease (1.55s): the work runs on
// through three confirmed renewals, its context never cancelled. Also through
// fence.Observe, whose leases wrap the acquirer's.
func TestHoldRenewsALateGrantInTime(t *testing.T) {
	const ttl = 1500 * time.Millisecond
	for _, observed := range []bool{false, true} {
		t.Run(fmt.Sprintf("observed=%v", observed), func(t *testing.T) {
			f := &faulty{Acquirer: sqliteAcquirer(t), lateBy: 1050 * time.Millisecond}
			var a fence.Acquirer = f
			if observed {
				a = fence.Observe(f, "sqlite", fence.SlogObserver(slog.New(slog.DiscardHandler)))
			}
			err := fence.Hold(context.Background(), a, "late", ttl, func(ctx context.Context, l fence.Lease) error {
				for f.renewed.Load() < 3 {
					select {
					case <-ctx.Done():
						return fmt.Errorf("work cancelled after %d confirmed renewals: %w", f.renewed.Load(), context.Cause(ctx))
					case <-time.After(5 * time.Millisecond): // a poll, not a synchronisation
					}
				}
				return nil
			})
			if err != nil {
				t.Fatalf("Hold of a grant that answered late: %v, want the work to run through its renewals", err)
			}
		})
	}
}
