package sqlfence_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// waitPinned waits until a has n connections pinned for bells.
func waitPinned(t *testing.T, a *sqlfence.Acquirer, n int) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); sqlfence.BellPinned(a) != n; {
		if time.Now().After(end) {
			t.Fatalf("%d connections pinned for bells after 10s, want %d", sqlfence.BellPinned(a), n)
		}
		time.Sleep(5 * time.Millisecond) // polling the acquirer's state
	}
}

// TestMySQLBellWakesOtherAcquirer: a release on MySQL wakes the waiter of
// another Acquirer (as another process would be) through the bell, not
// its backoff, which is an hour here: without the bell it would not be
// granted within the test. Each round the holder's grant takes over the
// existing row (and the bell), the waiter's first attempt is refused and
// it waits, and the release hands the bell to the waiter's ringer. At the
// end nothing stays pinned.
func TestMySQLBellWakesOtherAcquirer(t *testing.T) {
	_, fdb := openMySQL(t, "")
	ctx := context.Background()
	holder := newAcquirerOn(t, fdb, nil)
	waiter := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Backoff: idleHead})
	if err := holder.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("bell")
	l0, err := holder.TryAcquire(ctx, name, time.Minute) // creates the row (no bell: see bell.go)
	if err != nil {
		t.Fatal(err)
	}
	if err := l0.Release(ctx); err != nil {
		t.Fatal(err)
	}
	last := l0.Token()
	for round := 0; round < 5; round++ {
		l, err := holder.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if sqlfence.BellPinned(holder) != 1 {
			t.Fatalf("round %d: the holder's grant pinned %d connections, want 1", round, sqlfence.BellPinned(holder))
		}
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		ch := goAcquire(wctx, waiter, name, time.Minute)
		waitHeadIdle(t, waiter, name)
		start := time.Now()
		if err := l.Release(ctx); err != nil {
			t.Fatalf("round %d: release: %v", round, err)
		}
		select {
		case r := <-ch:
			if r.err != nil {
				t.Fatalf("round %d: the waiter: %v", round, r.err)
			}
			if r.l.Token() <= l.Token() || l.Token() <= last {
				t.Fatalf("round %d: tokens %d, %d, %d do not grow", round, last, l.Token(), r.l.Token())
			}
			last = r.l.Token()
			t.Logf("round %d: granted %v after the release began", round, r.at.Sub(start))
			if err := r.l.Release(ctx); err != nil {
				t.Fatal(err)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("round %d: the waiter of the other Acquirer was not granted within 10s of the release (its backoff is an hour): not woken by the bell", round)
		}
		cancel()
	}
	waitPinned(t, holder, 0)
	waitPinned(t, waiter, 0)
}

// TestMySQLBellKilledSession: the session of a lease's pinned connection
// ends (an operator's KILL, a server-side timeout): the bell goes with it,
// and the release still releases, on a connection of the pool, as it would
// without the bell; nothing stays pinned.
func TestMySQLBellKilledSession(t *testing.T) {
	raw, fdb := openMySQL(t, "")
	ctx := context.Background()
	a := newAcquirerOn(t, fdb, nil)
	other := newAcquirerOn(t, fdb, nil)
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("bell-killed")
	l0, err := a.TryAcquire(ctx, name, time.Minute) // creates the row: no bell
	if err != nil {
		t.Fatal(err)
	}
	if err := l0.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l, err := a.TryAcquire(ctx, name, time.Minute) // takes over the row, and the bell
	if err != nil {
		t.Fatal(err)
	}
	key := sqlfence.BellKey(a, name)
	var id sql.NullInt64
	if err := raw.QueryRowContext(ctx, "SELECT IS_USED_LOCK(?)", key).Scan(&id); err != nil || !id.Valid {
		t.Fatalf("the grant's bell is not held: %v, %v", id, err)
	}
	if _, err := raw.ExecContext(ctx, fmt.Sprintf("KILL %d", id.Int64)); err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(10 * time.Second); id.Valid; {
		if time.Now().After(end) {
			t.Fatal("the killed session still holds the bell after 10s")
		}
		time.Sleep(5 * time.Millisecond) // polling the server's state
		if err := raw.QueryRowContext(ctx, "SELECT IS_USED_LOCK(?)", key).Scan(&id); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Release(ctx); err != nil {
		t.Fatalf("release after the lease's session was killed: %v", err)
	}
	nl, err := other.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatalf("the lock is not free after the release: %v", err)
	}
	if nl.Token() <= l.Token() {
		t.Fatalf("token %d after %d", nl.Token(), l.Token())
	}
	if err := nl.Release(ctx); err != nil {
		t.Fatal(err)
	}
	waitPinned(t, a, 0)
	waitPinned(t, other, 0)
}
