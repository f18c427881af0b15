package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// TestRingerHeadLeftDuringLockWait: B's head gives up while the
// ringer's grant for it waits for the row lock. It returns at once; once the
// lock is let go the ringer's grant lands for a head that has left, and must
// be given back at once, not held for its ttl (a minute, HAZARDS 6).
func TestRingerHeadLeftDuringLockWait(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("ringrev-leftlock")
	wctx, cancelW := context.WithCancel(ctx)
	defer cancelW()
	bellFreshRow(t, a, name)
	started := make(chan struct{})
	var ch <-chan acquired
	go func() {
		ringWaitHeld(a, name)
		ch = goAcquire(wctx, b, name, time.Minute)
		close(started)
	}()
	la, tx, _ := ringLockWaitStarted(t, dbA, a, b, name, started)
	cancelW()
	r := within(t, ch, 2*time.Second, "B's head after its context ended with the ringer's grant waiting")
	if r.err == nil || !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.Canceled) {
		t.Fatalf("B's head: %v, %v; want ErrHeld and context.Canceled", r.l, r.err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	committed := time.Now()
	// A locking read waits for the ringer's grant, queued on the lock before it.
	var tok int64
	if err := dbA.QueryRowContext(ctx, "SELECT token FROM fence_leases WHERE name = ? FOR UPDATE", []byte(name)).Scan(&tok); err != nil {
		t.Fatal(err)
	}
	var info fence.LockInfo
	bellWaitFor(t, 3*time.Second, "the ringer's grant for the head that left given back", func() bool {
		var err error
		info, err = a.Inspect(ctx, name)
		return err == nil && !info.Held
	}, func() string { return fmt.Sprintf("; the row: %+v", info) })
	t.Logf("given back %v after the lock was let go", time.Since(committed))
	if info.Counter != la.Token()+1 {
		t.Fatalf("the row's counter %d, want %d: the ringer's grant did not land, the test proves nothing", info.Counter, la.Token()+1)
	}
	mustTryAcquire(t, a, name)
	_ = la.Release(ctx) // its session was killed: ErrLost or ErrUnknown, and its pinned connection back
	bellNoLeak(t, []*sql.DB{dbA, dbB}, []*sqlfence.Acquirer{a, b}, dbA, sqlfence.BellKey(a, name))
}

// TestRingerHeadLeftDuringLockWaitNextGranted: as above, with W2 behind the
// head W1 in B's line: W1 leaves, and W2 (Backoff of an hour) must be
// granted promptly once the lock is let go, whether the ringer's grant
// for W1 is handed on to it or W2's own attempt wins.
func TestRingerHeadLeftDuringLockWaitNextGranted(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("ringrev-leftnext")
	w1ctx, cancel1 := context.WithCancel(ctx)
	defer cancel1()
	w2ctx, cancel2 := context.WithTimeout(ctx, 30*time.Second)
	defer cancel2()
	var ch1, ch2 <-chan acquired
	bellFreshRow(t, a, name)
	started := make(chan struct{})
	go func() {
		ringWaitHeld(a, name)
		ch1 = goAcquire(w1ctx, b, name, time.Minute)
		for sqlfence.LineLen(b, name) < 1 {
			time.Sleep(time.Millisecond) // polling the line
		}
		ch2 = goAcquire(w2ctx, b, name, time.Minute)
		for sqlfence.LineLen(b, name) < 2 {
			time.Sleep(time.Millisecond) // polling the line
		}
		close(started)
	}()
	la, tx, _ := ringLockWaitStarted(t, dbA, a, b, name, started)
	cancel1()
	r1 := within(t, ch1, 2*time.Second, "W1 after its context ended with the ringer's grant waiting")
	if r1.err == nil || !errors.Is(r1.err, fence.ErrHeld) || !errors.Is(r1.err, context.Canceled) {
		t.Fatalf("W1: %v, %v; want ErrHeld and context.Canceled", r1.l, r1.err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	released := time.Now()
	l2 := bellGranted(t, ch2, 5*time.Second, "W2 after W1 left and the lock was let go")
	t.Logf("W2 granted %v after the commit, token A's + %d", time.Since(released), l2.Token()-la.Token())
	if l2.Token() != la.Token()+1 && l2.Token() != la.Token()+2 {
		t.Fatalf("W2's token %d, A's %d", l2.Token(), la.Token())
	}
	info, err := a.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != l2.Token() {
		t.Fatalf("the row: %+v, %v; W2 holds %d", info, err, l2.Token())
	}
	if err := l2.Release(ctx); err != nil {
		t.Fatal(err)
	}
	mustTryAcquire(t, a, name)
	_ = la.Release(ctx) // its session was killed: ErrLost or ErrUnknown, and its pinned connection back
	bellNoLeak(t, []*sql.DB{dbA, dbB}, []*sqlfence.Acquirer{a, b}, dbA, sqlfence.BellKey(a, name))
}

// ringLockWaitStarted sets up a ringer's grant that waits for the row
// lock: A holds name (with its bell); B's waiters are started by the
// caller once A holds (started is closed then); a transaction tx of the
// test's releases A's row (expires_at = 0, as an operator would) and so
// holds the row's lock; A's session is then killed, which lets the bell go:
// B's ringer takes it and its grant for B's head waits for tx. (A grant's
// clock is read when its statement starts: the row must be free then, or
// the grant finds it held once it has the lock.) It returns A's lease, tx,
// and the server id of B's ringer session (which holds the bell).
func ringLockWaitStarted(t *testing.T, dbA *sql.DB, a, b *sqlfence.Acquirer, name string, started <-chan struct{}) (fence.Lease, *sql.Tx, int64) {
	t.Helper()
	ctx := context.Background()
	key := sqlfence.BellKey(a, name)
	la, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	aID := bellHolderID(t, dbA, key)
	if aID == 0 {
		t.Fatal("A's takeover grant took no bell")
	}
	select {
	case <-started:
	case <-time.After(10 * time.Second):
		t.Fatal("B's waiters not started")
	}
	waitHeadIdle(t, b, name)
	waitPinned(t, b, 1) // B's ringer
	tx, err := dbA.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	if _, err := tx.ExecContext(ctx, "UPDATE fence_leases SET expires_at = 0 WHERE name = ? AND token = ?", []byte(name), int64(la.Token())); err != nil {
		t.Fatal(err)
	}
	if _, err := dbA.ExecContext(ctx, fmt.Sprintf("KILL %d", aID)); err != nil {
		t.Fatal(err)
	}
	var rid int64
	bellWaitFor(t, 10*time.Second, "B's ringer taking the bell after A's session was killed, its grant waiting for the row lock", func() bool {
		id := bellHolderID(t, dbA, key)
		if id == 0 || id == aID {
			return false
		}
		var n int
		_ = dbA.QueryRow("SELECT COUNT(*) FROM information_schema.processlist WHERE id = ? AND info LIKE 'INSERT INTO%' AND time_ms > 20", id).Scan(&n)
		rid = id
		return n == 1
	})
	return la, tx, rid
}

// TestRingerKilledDuringLockWait: an operator KILLs the session of
// B's ringer while its grant for B's head waits for the row lock. Nothing
// was granted by it; B's head must still be granted once the lock is let
// go, one grant only, and nothing may stay pinned or hold the bell.
func TestRingerKilledDuringLockWait(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("ringrev-kill")
	bellFreshRow(t, a, name)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	started := make(chan struct{})
	var ch <-chan acquired
	go func() {
		ringWaitHeld(a, name)
		ch = goAcquire(wctx, b, name, time.Minute)
		close(started)
	}()
	la, tx, rid := ringLockWaitStarted(t, dbA, a, b, name, started)
	if _, err := dbA.Exec(fmt.Sprintf("KILL %d", rid)); err != nil {
		t.Fatal(err)
	}
	bellWaitFor(t, 5*time.Second, "the killed session gone", func() bool {
		var n int
		_ = dbA.QueryRow("SELECT COUNT(*) FROM information_schema.processlist WHERE id = ?", rid).Scan(&n)
		return n == 0
	})
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	l := bellGranted(t, ch, 5*time.Second, "after the ringer's session was killed during its grant")
	info, err := a.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != l.Token() || info.Owner != b.Owner() {
		t.Fatalf("the row %+v, %v; B holds %d", info, err, l.Token())
	}
	if l.Token() != la.Token()+1 {
		t.Fatalf("B's token %d, want %d (the killed grant granted nothing, B's the next)", l.Token(), la.Token()+1)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	mustTryAcquire(t, a, name)
	_ = la.Release(ctx) // its session was killed: ErrLost or ErrUnknown, and its pinned connection back
	bellNoLeak(t, []*sql.DB{dbA, dbB}, []*sqlfence.Acquirer{a, b}, dbA, sqlfence.BellKey(a, name))
}

// TestRingerGrantTimesOutInLockWait: the ringer's grant waits for the
// row lock longer than its own timeout (5s): the driver gives up and closes
// the connection, but the server runs the statement on, and it lands once
// the lock is let go. B's head is handed its owner (a hint): it must hold
// that one grant (not wait out its minute behind it), with a local deadline
// counted from before the ringer's statement.
func TestRingerGrantTimesOutInLockWait(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("ringrev-timeout")
	bellFreshRow(t, a, name)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	started := make(chan struct{})
	var ch <-chan acquired
	ttl := 7 * time.Second
	go func() {
		ringWaitHeld(a, name)
		ch = goAcquire(wctx, b, name, ttl)
		close(started)
	}()
	la, tx, rid := ringLockWaitStarted(t, dbA, a, b, name, started)
	grantSent := time.Now()
	// The ringer's grant gives up after 5s; its statement stays on the
	// server, waiting for the lock.
	bellWaitFor(t, 10*time.Second, "the ringer's grant timing out (its statement waiting on in the server), the head trying with the hint", func() bool {
		var n int
		_ = dbA.QueryRow("SELECT COUNT(*) FROM information_schema.processlist WHERE info LIKE 'INSERT INTO%' AND id <> ?", rid).Scan(&n)
		return time.Since(grantSent) > 5*time.Second && n >= 1
	})
	var still int
	_ = dbA.QueryRow("SELECT COUNT(*) FROM information_schema.processlist WHERE id = ? AND info LIKE 'INSERT INTO%'", rid).Scan(&still)
	if still != 1 {
		t.Fatalf("the ringer's statement is not waiting on in the server (%d): the test proves nothing", still)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	l := bellGranted(t, ch, 5*time.Second, "after the lock was let go")
	info, err := a.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != l.Token() {
		t.Fatalf("the row %+v, %v; B holds %d", info, err, l.Token())
	}
	if l.Token() != la.Token()+1 {
		t.Fatalf("B's token %d, want %d: one grant", l.Token(), la.Token()+1)
	}
	// The local deadline counts from before the ringer's statement (at
	// the latest grantSent), not from the head's attempt with the hint.
	select {
	case <-l.Context().Done():
		t.Logf("B's lease ended locally %v after the ringer's grant was sent (ttl %v)", time.Since(grantSent), ttl)
	case <-time.After(time.Until(grantSent.Add(ttl + 100*time.Millisecond))):
		t.Fatalf("B's lease still live %v after the ringer's grant was sent: its local deadline is later than the grant's send + ttl (%v)", time.Since(grantSent), ttl)
	}
	_ = l.Release(ctx)
	mustTryAcquire(t, a, name)
	_ = la.Release(ctx) // its session was killed: ErrLost or ErrUnknown, and its pinned connection back
	bellNoLeak(t, []*sql.DB{dbA, dbB}, []*sqlfence.Acquirer{a, b}, dbA, sqlfence.BellKey(a, name))
}

// ringWaitHeld returns once a's Inspect shows name held.
func ringWaitHeld(a *sqlfence.Acquirer, name string) {
	for {
		info, err := a.Inspect(context.Background(), name)
		if err == nil && info.Held {
			return
		}
		time.Sleep(time.Millisecond) // polling the row
	}
}
