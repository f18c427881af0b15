package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
)

// The ringer's grant (bell.go's handOn, Acquirer.ringGrant): on MySQL the
// ringer of an Acquirer that gets a name's bell grants the lock to the head
// of its line on the bell's connection and hands it the lease. Each test
// has a holder A whose lease holds the bell, and a waiter B, behind a fault
// proxy, whose backoff is an hour: only B's ringer grants within the test.

// ringPair is A, on its own pool, holding name with its bell (checked on
// the server), and B, behind a fault proxy, whose backoff is an hour, with
// that proxy and the count of B's grant statements; dbA is A's pool.
type ringPair struct {
	dbA    *sql.DB
	a, b   *sqlfence.Acquirer
	la     fence.Lease
	pb     *faultnet.Proxy
	grants *atomic.Int64
}

func newRingPair(t *testing.T, name string) ringPair {
	t.Helper()
	var rp ringPair
	var fdbA, fdbB *sqlfence.DB
	rp.dbA, fdbA = openMySQL(t, "")
	_, fdbB, rp.pb, rp.grants = bellProxied(t)
	rp.a = newAcquirerOn(t, fdbA, nil)
	rp.b = newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	bellFreshRow(t, rp.a, name) // the next grant takes over the row, and the bell
	var err error
	if rp.la, err = rp.a.TryAcquire(context.Background(), name, time.Minute); err != nil {
		t.Fatal(err)
	}
	if sqlfence.BellPinned(rp.a) != 1 {
		t.Fatalf("A's grant pinned %d connections, want 1 (the bell's)", sqlfence.BellPinned(rp.a))
	}
	if bellHolderID(t, rp.dbA, sqlfence.BellKey(rp.a, name)) == 0 {
		t.Fatal("A's takeover grant took no bell")
	}
	return rp
}

// ringSetup returns A (holding name, with its bell) and B's Acquire, already
// waiting, with B's proxy and the count of B's grant statements.
func ringSetup(t *testing.T, name string, bctx context.Context) (fence.Lease, *sqlfence.Acquirer, *sqlfence.Acquirer, <-chan acquired, *faultnet.Proxy, *atomic.Int64) {
	t.Helper()
	rp := newRingPair(t, name)
	ch := goAcquire(bctx, rp.b, name, time.Minute)
	waitHeadIdle(t, rp.b, name)
	waitPinned(t, rp.b, 1) // B's ringer
	return rp.la, rp.a, rp.b, ch, rp.pb, rp.grants
}

// ringGrantStatement matches the grant statement that takes the bell.
func ringGrantStatement(req []byte) bool {
	return faultnet.Carries(req, "INSERT INTO") && faultnet.Carries(req, "GET_LOCK")
}

// TestRingGrantLostReply: the reply of the ringer's grant is lost after the
// server applied it. The head is handed the grant's owner and recognises
// the grant: it holds the lease the lost statement granted (the row's token,
// one past A's), instead of waiting out its ttl behind it.
func TestRingGrantLostReply(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("ringgrant-lost")
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	la, a, b, ch, pb, _ := ringSetup(t, name, wctx)
	pb.LoseReply(ringGrantStatement)
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l := bellGranted(t, ch, 10*time.Second, "after the ringer's grant whose reply was lost")
	if n := pb.Stats().LostReplies; n != 1 {
		t.Fatalf("%d replies lost, want 1 (the ringer's grant)", n)
	}
	info, err := a.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if l.Token() != la.Token()+1 || info.Token != l.Token() || info.Owner != b.Owner() {
		t.Fatalf("B holds token %d; the row: token %d, owner %q; A released %d: want B to hold the one grant made, %d, as %q", l.Token(), info.Token, info.Owner, la.Token(), la.Token()+1, b.Owner())
	}
	if err := l.Release(ctx); err != nil {
		t.Fatalf("B's release of the recognised grant: %v", err)
	}
	mustTryAcquire(t, a, name)
}

// TestRingGrantHeadLeft: the head gives up while the ringer's grant is on
// its way, and the grant lands (its reply lost too). Nobody holds what it
// granted for its ttl (a minute): it is given back within seconds.
func TestRingGrantHeadLeft(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("ringgrant-left")
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	la, a, _, ch, pb, grants := ringSetup(t, name, wctx)
	sent := grants.Load()
	// The grant is applied at once; its connection is cut 2s later.
	pb.ReplyWindow(2 * time.Second)
	pb.LoseReply(ringGrantStatement)
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	bellWaitFor(t, 10*time.Second, "the ringer's grant sent", func() bool { return grants.Load() > sent })
	cancel()
	select {
	case r := <-ch:
		if r.err == nil {
			t.Fatalf("B's Acquire returned a lease (token %d) after its context ended with the ringer's grant in flight", r.l.Token())
		}
		if !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.Canceled) {
			t.Fatalf("B's Acquire: %v, want ErrHeld and context.Canceled", r.err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("B's Acquire did not return within 5s of its context's end")
	}
	left := time.Now()
	var info fence.LockInfo
	inspect := func() fence.LockInfo {
		i, err := a.Inspect(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		return i
	}
	// The grant lands (the proxy forwarded it; its reply is held back).
	bellWaitFor(t, 5*time.Second, "the ringer's grant landed", func() bool { return inspect().Counter > la.Token() })
	bellWaitFor(t, 15*time.Second, "the grant made for the head that left given back", func() bool {
		info = inspect()
		return !info.Held
	})
	if info.Counter != la.Token()+1 {
		t.Fatalf("the row's counter %d, want %d: one grant, the ringer's", info.Counter, la.Token()+1)
	}
	t.Logf("given back %v after the head left", time.Since(left))
	mustTryAcquire(t, a, name)
}

// TestRingGrantTokensExhausted: the ringer's grant is refused because the
// counter is at MaxToken; the head learns it from its own attempt at once
// (ErrTokensExhausted), instead of waiting.
func TestRingGrantTokensExhausted(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("ringgrant-exhausted")
	_, fdbA := openMySQL(t, "")
	_, fdbB, _, _ := bellProxied(t)
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	if err := a.Bump(ctx, name, fence.MaxToken-1); err != nil {
		t.Fatal(err)
	}
	la, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil || la.Token() != fence.MaxToken {
		t.Fatalf("A's grant: %v, %v; want token %d", la, err, fence.MaxToken)
	}
	if sqlfence.BellPinned(a) != 1 {
		t.Fatalf("A's grant pinned %d connections, want 1 (the bell's)", sqlfence.BellPinned(a))
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ch := goAcquire(wctx, b, name, time.Minute)
	waitHeadIdle(t, b, name)
	waitPinned(t, b, 1)
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-ch:
		if !errors.Is(r.err, fence.ErrTokensExhausted) || r.l != nil {
			t.Fatalf("B's Acquire after the token %d was released: %v, %v; want ErrTokensExhausted", fence.MaxToken, r.l, r.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("B's Acquire did not return within 10s of the release: its head was not told of the exhausted counter")
	}
}

// mustTryAcquire asserts that name is free: a's TryAcquire grants it.
func mustTryAcquire(t *testing.T, a *sqlfence.Acquirer, name string) {
	t.Helper()
	l, err := a.TryAcquire(context.Background(), name, time.Minute)
	if err != nil {
		t.Fatalf("TryAcquire(%q) after the waiter's lease ended: %v, want a grant", name, err)
	}
	if err := l.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestRingGrantHintAfterContextEnded: the head was handed the hint of a
// grant whose reply was lost (it may have granted the hint's owner), and its
// context ended before its next attempt could look. The grant that did land
// is given back within seconds, not held for its ttl (a minute) with nobody
// to release it (a waiter that left must not keep a free lock from
// the others).
func TestRingGrantHintAfterContextEnded(t *testing.T) {
	for dname, db := range lineDialects(t) {
		t.Run(dname, func(t *testing.T) {
			ctx := context.Background()
			a := newAcquirerOn(t, db, nil)
			name := fencetest.Name("ringgrant-hint")
			owner := sqlfence.HintOwner(a)
			if err := sqlfence.GrantAs(ctx, a, name, owner, time.Minute); err != nil {
				t.Fatal(err)
			}
			if info, err := a.Inspect(ctx, name); err != nil || !info.Held {
				t.Fatalf("the landed grant: %+v, %v; want the name held", info, err)
			}
			ended, cancel := context.WithCancel(ctx)
			cancel()
			if l, err := sqlfence.AcquireHinted(ended, a, name, owner, time.Minute); err == nil {
				t.Fatalf("an attempt whose context had ended returned a lease (token %d)", l.Token())
			}
			bellWaitFor(t, 10*time.Second, "the grant of the hint's owner given back", func() bool {
				info, err := a.Inspect(ctx, name)
				return err == nil && !info.Held
			})
			mustTryAcquire(t, a, name)
		})
	}
}

// The ringer's grant (bell.go handOn, mysql.go ringGrant) under faults.

// TestRingerParkedAfterLateGrant: the ringer's grant for B's head comes
// back past the head's local deadline (B's connections are slow, the
// head's ttl short), so ringGrant gives it back and hands the head nothing
// (an empty Handoff), yet reports ringHanded: the ringer then waits for a
// new head to subscribe (ringer.gen) before its next GET_LOCK. But the head
// never left: it tries on its own, and A (another process) took the row
// first. The head now waits for a bell that no ringer of B listens for: A's
// release wakes nobody and B (Backoff of an hour) is never granted.
func TestRingerParkedAfterLateGrant(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("ringrev-late")
	rp := newRingPair(t, name)
	dbA, a, b, la, pb, grants := rp.dbA, rp.a, rp.b, rp.la, rp.pb, rp.grants
	key := sqlfence.BellKey(a, name)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ttl := 150 * time.Millisecond
	ch := goAcquire(wctx, b, name, ttl)
	waitHeadIdle(t, b, name)
	waitPinned(t, b, 1) // B's ringer
	sent := grants.Load()
	// Every chunk on B's connections now takes 100ms each way: the ringer's
	// grant takes 200ms at least, longer than the head's ttl.
	pb.Latency(100*time.Millisecond, 100*time.Millisecond)
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	// The ringer's grant lands (B's owner) and is given back late.
	bellWaitFor(t, 10*time.Second, "the ringer's grant for B's head landing", func() bool {
		info, err := a.Inspect(ctx, name)
		return err == nil && info.Held && info.Owner == b.Owner()
	})
	// A takes the row as soon as it is given back, before B's head's own
	// (slow) attempt.
	var la2 fence.Lease
	bellWaitFor(t, 10*time.Second, "A's grant after the late grant was given back", func() bool {
		l, err := a.TryAcquire(ctx, name, time.Minute)
		if err == nil {
			la2 = l
			return true
		}
		if !errors.Is(err, fence.ErrHeld) {
			t.Fatalf("A's TryAcquire: %v", err)
		}
		return false
	})
	defer la2.Release(ctx)
	if la2.Token() != la.Token()+2 {
		t.Fatalf("A's new token %d, want %d: the ringer's late grant (token %d) did not happen, the test proves nothing", la2.Token(), la.Token()+2, la.Token()+1)
	}
	if bellHolderID(t, dbA, key) == 0 {
		t.Fatal("A's grant took no bell")
	}
	// B's head's own attempt (after the empty handoff) finds A's grant.
	bellWaitFor(t, 10*time.Second, "B's head's own attempt after the late grant", func() bool {
		return grants.Load() >= sent+2 && sqlfence.LineHeadWaiting(b, name)
	})
	pb.Latency(0, 0)
	select {
	case r := <-ch:
		t.Fatalf("B's Acquire returned before A's release: %v, %v", r.l, r.err)
	default:
	}
	if err := la2.Release(ctx); err != nil {
		t.Fatal(err)
	}
	l := bellGranted(t, ch, 5*time.Second, "after A's release (B's ringer had handed its head nothing: its grant came back late)", func() string {
		var n int
		_ = dbA.QueryRow("SELECT COUNT(*) FROM information_schema.processlist WHERE info LIKE '%GET_LOCK(%' AND info NOT LIKE '%processlist%'").Scan(&n)
		return fmt.Sprintf("sessions in GET_LOCK: %d; B pins %d", n, sqlfence.BellPinned(b))
	})
	if l.Token() <= la2.Token() {
		t.Fatalf("B's token %d, not above A's %d", l.Token(), la2.Token())
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestRingerHeadLeftDuringLockWait: B's head gives up while the
// ringer's grant for it waits for the row lock. It returns at once; once the
// lock is let go the ringer's grant lands for a head that has left, and must
// be given back at once, not held for its ttl (a minute, nobody keeps a free lock from the others).
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
	w2ctx, cancel2 := context.WithTimeout(ctx, 60*time.Second)
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
	la := mustGrant(t, ctx, a, name, time.Minute)
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
	bellWaitFor(t, 30*time.Second, "B's ringer taking the bell after A's session was killed, its grant waiting for the row lock", func() bool {
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
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
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
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
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

// TestRingerFIFOTwoAcquirers: A holds a name with its bell; B and C
// (other processes, Backoff of an hour) each have three waiters, joined in
// order. A's release is granted by a ringer to the head of its line; each
// holder releases as soon as it holds. Within each Acquirer the waiters
// must be granted in the order they joined, every waiter must be granted
// promptly (only bells and handoffs wake them), tokens grow by one per
// grant, and afterwards nothing leaks.
func TestRingerFIFOTwoAcquirers(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "")
	dbC, fdbC := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	c := newAcquirerOn(t, fdbC, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("ringrev-fifo")
	bellFreshRow(t, a, name)
	la := mustGrant(t, ctx, a, name, time.Minute)
	if bellHolderID(t, dbA, sqlfence.BellKey(a, name)) == 0 {
		t.Fatal("A's takeover grant took no bell")
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	type got struct {
		who string
		tok fence.Token
		err error
	}
	out := make(chan got, 6)
	start := func(x *sqlfence.Acquirer, who string, n int) {
		go func() {
			l, err := x.Acquire(wctx, name, time.Minute)
			if err != nil {
				out <- got{who, 0, err}
				return
			}
			tok := l.Token()
			err = l.Release(ctx)
			out <- got{who, tok, err}
		}()
		for sqlfence.LineLen(x, name) < n {
			time.Sleep(time.Millisecond) // polling the line
		}
	}
	for i, who := range []string{"b1", "b2", "b3"} {
		start(b, who, i+1)
	}
	for i, who := range []string{"c1", "c2", "c3"} {
		start(c, who, i+1)
	}
	waitHeadIdle(t, b, name)
	waitHeadIdle(t, c, name)
	waitPinned(t, b, 1)
	waitPinned(t, c, 1)
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	var seq []got
	deadline := time.After(10 * time.Second)
	for len(seq) < 6 {
		select {
		case g := <-out:
			if g.err != nil {
				t.Fatalf("%s: %v (so far %v)", g.who, g.err, seq)
			}
			seq = append(seq, g)
		case <-deadline:
			t.Fatalf("only %d of 6 waiters granted within 10s: %v (B's line %d, C's line %d)", len(seq), seq, sqlfence.LineLen(b, name), sqlfence.LineLen(c, name))
		}
	}
	var bs, cs []string
	prev := la.Token()
	var order []string
	for _, g := range seq {
		order = append(order, g.who)
		if strings.HasPrefix(g.who, "b") {
			bs = append(bs, g.who)
		} else {
			cs = append(cs, g.who)
		}
		_ = prev
	}
	if strings.Join(bs, ",") != "b1,b2,b3" || strings.Join(cs, ",") != "c1,c2,c3" {
		t.Fatalf("grant order %v: not the join order within each Acquirer", order)
	}
	// The outcomes arrive in release order; tokens by grant order.
	toks := map[fence.Token]string{}
	for _, g := range seq {
		if w, dup := toks[g.tok]; dup {
			t.Fatalf("token %d granted to %s and %s", g.tok, w, g.who)
		}
		toks[g.tok] = g.who
	}
	for i := 1; i <= 6; i++ {
		if _, ok := toks[la.Token()+fence.Token(i)]; !ok {
			t.Fatalf("tokens %v: not A's %d + 1..6, one per grant", toks, la.Token())
		}
	}
	t.Logf("order %v", order)
	bellNoLeak(t, []*sql.DB{dbA, dbB, dbC}, []*sqlfence.Acquirer{a, b, c}, dbA, sqlfence.BellKey(a, name))
}

// TestRingerDroppedTable: the lease table is dropped while A holds
// (with its bell) and B's head waits (Backoff of an hour). A's release
// fails (no table) and closes its connection, which lets the bell go: B's
// ringer's grant fails on the missing table. B's head must then either learn
// it promptly (a *TableError) or wait on and be granted promptly once the
// table is back, with a token above A's; nothing may leak.
func TestRingerDroppedTable(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB, _, inserts := bellProxied(t)
	table := "ringrev_drop_" + strings.ReplaceAll(fencetest.Name("t"), "-", "_")
	t.Cleanup(func() { _, _ = dbA.Exec("DROP TABLE IF EXISTS " + table) })
	a := newAcquirerOn(t, fdbA, &sqlfence.AcquirerOptions{Table: table})
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Table: table, Backoff: idleHead})
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("ringrev-drop")
	bellFreshRow(t, a, name)
	la := mustGrant(t, ctx, a, name, time.Minute)
	key := sqlfence.BellKey(a, name)
	if bellHolderID(t, dbA, key) == 0 {
		t.Fatal("A's takeover grant took no bell")
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ch := goAcquire(wctx, b, name, time.Minute)
	waitHeadIdle(t, b, name)
	waitPinned(t, b, 1)
	if _, err := dbA.Exec("DROP TABLE " + table); err != nil {
		t.Fatal(err)
	}
	sent := inserts.Load()
	var te *sqlfence.TableError
	if err := la.Release(ctx); !errors.As(err, &te) {
		t.Fatalf("A's release without the table: %v, want a *TableError", err)
	}
	bellWaitFor(t, 5*time.Second, "B's ringer's grant sent against the missing table", func() bool { return inserts.Load() > sent })
	select {
	case r := <-ch:
		if r.err == nil || !errors.As(r.err, &te) || te.Table != table {
			t.Fatalf("B's Acquire while the table was missing: %v, %v; want a *TableError naming %s, or a wait", r.l, r.err, table)
		}
		t.Logf("B's head was told: %v", r.err)
	case <-time.After(300 * time.Millisecond):
		// B waits on: it must be granted once the table is back.
		if err := a.CreateTable(ctx); err != nil {
			t.Fatal(err)
		}
		l := bellGranted(t, ch, 5*time.Second, "after the table was recreated")
		if l.Token() <= la.Token() {
			t.Fatalf("B's token %d after the table was recreated, not above A's %d", l.Token(), la.Token())
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	bellNoLeak(t, []*sql.DB{dbA, dbB}, []*sqlfence.Acquirer{a, b}, dbA, key)
}

// TestRingerStressSmallPools: four Acquirers (processes), each on its
// own small pool (SetMaxOpenConns 4 to 16: bell budgets of 1 to 4 pins), run
// Acquire loops on a few names at once, some with contexts that end at
// once or after a few milliseconds (heads that leave while a ringer's or a
// release's grant for them is in flight). Every grant must be exclusive (no
// two holders of a name at once), its token above every earlier token of
// the name, its Release must succeed, and afterwards nothing stays pinned or in use and no session holds a bell.
func TestRingerStressSmallPools(t *testing.T) {
	ringStress(t, false)
}

func ringStress(t *testing.T, idleStress bool) {
	ctx := context.Background()
	maxOpen := []int{4, 8, 12, 16}
	var (
		dbs []*sql.DB
		as  []*sqlfence.Acquirer
	)
	for i, m := range maxOpen {
		db, fdb := openMySQL(t, "")
		db.SetMaxOpenConns(m)
		dbs = append(dbs, db)
		var opts *sqlfence.AcquirerOptions
		if i%2 == 1 && idleStress {
			opts = &sqlfence.AcquirerOptions{Backoff: idleHead}
		}
		as = append(as, newAcquirerOn(t, fdb, opts))
	}
	check, _ := openMySQL(t, "")
	names := make([]string, 3)
	for i := range names {
		names[i] = fencetest.Name(fmt.Sprintf("ringrev-stress%d", i))
		bellFreshRow(t, as[0], names[i])
	}
	type state struct {
		mu      sync.Mutex
		holders int
		max     fence.Token
	}
	st := make([]*state, len(names))
	for i := range st {
		st[i] = &state{}
	}
	var (
		grants, gaveUp atomic.Int64
		failed         atomic.Bool
		wg             sync.WaitGroup
	)
	fail := func(format string, args ...any) {
		if failed.CompareAndSwap(false, true) {
			t.Errorf(format, args...)
		}
	}
	stop := time.Now().Add(4 * time.Second)
	for ai, a := range as {
		for g := 0; g < 3; g++ {
			wg.Add(1)
			go func(ai int, a *sqlfence.Acquirer, seed uint64) {
				defer wg.Done()
				rng := rand.New(rand.NewPCG(seed, 7))
				for time.Now().Before(stop) && !failed.Load() {
					ni := rng.IntN(len(names))
					wait := 10 * time.Second
					switch rng.IntN(6) {
					case 0:
						wait = time.Duration(rng.IntN(20)) * time.Millisecond
					case 1:
						wait = time.Duration(20+rng.IntN(200)) * time.Millisecond
					}
					actx, cancel := context.WithTimeout(ctx, wait)
					l, err := a.Acquire(actx, names[ni], 3*time.Second)
					cancel()
					if err != nil {
						if errors.Is(err, fence.ErrHeld) && wait < 10*time.Second {
							gaveUp.Add(1)
							continue
						}
						fail("acquirer %d: Acquire(%s, wait %v): %v", ai, names[ni], wait, err)
						return
					}
					s := st[ni]
					s.mu.Lock()
					s.holders++
					h, prev := s.holders, s.max
					if l.Token() > s.max {
						s.max = l.Token()
					}
					s.mu.Unlock()
					if h != 1 {
						fail("acquirer %d: granted %s (token %d) while %d others hold it", ai, names[ni], l.Token(), h-1)
					}
					if l.Token() <= prev {
						fail("acquirer %d: granted %s token %d, not above the earlier %d", ai, names[ni], l.Token(), prev)
					}
					if l.Context().Err() != nil {
						fail("acquirer %d: granted %s token %d with its context already done: %v", ai, names[ni], l.Token(), context.Cause(l.Context()))
					}
					grants.Add(1)
					if rng.IntN(2) == 0 {
						time.Sleep(time.Duration(rng.IntN(3)) * time.Millisecond) // work under the lease
					}
					s.mu.Lock()
					s.holders--
					s.mu.Unlock()
					if err := l.Release(ctx); err != nil {
						fail("acquirer %d: release of %s token %d: %v", ai, names[ni], l.Token(), err)
						return
					}
				}
			}(ai, a, uint64(ai*10+g))
		}
	}
	wg.Wait()
	t.Logf("%d grants, %d waits given up", grants.Load(), gaveUp.Load())
	if failed.Load() {
		return
	}
	if grants.Load() < 50 {
		t.Fatalf("only %d grants: the test proves little", grants.Load())
	}
	keys := make([]string, len(names))
	for i, n := range names {
		keys[i] = sqlfence.BellKey(as[0], n)
	}
	bellNoLeak(t, dbs, as, check, keys...)
}

// TestRingerStressIdleWaiters: as TestRingerStressSmallPools, with
// two of the four Acquirers' Backoff an hour: their waiters are woken only
// by releases through their own Acquirer and by their ringer (the bell). A
// wait of 10s that runs out means a waiter nobody woke.
func TestRingerStressIdleWaiters(t *testing.T) {
	ringStress(t, true)
}

// TestRingerLateHeadYieldsToLine (nobody keeps a free lock from the others, wakeup.ErrYield's
// promise: "a head whose grants keep coming back late neither spins nor
// keeps a free lock from the waiters behind it"): B's line has a head W1
// whose ttl (150ms) is shorter than a round trip on B's slow connections
// (100ms each way), so every grant made for it comes back late, and behind
// it W2, whose ttl is a minute. A releases; B's ringer grants W1, the grant
// comes back late, is given back and the offer withdrawn (ringLate): W1
// "keeps its own pace". Were it to never yield its place, as its own late
// attempt does (wakeup.ErrYield moves it to the back), the ringer would
// grant W1 again and again (pausing up to 1s) and W2, which tries only when
// the head stalls in one attempt for a second, would wait while the name is
// free nearly all the time. It passes today only because the give-back's
// release pokes W1 (Line.Poke) and W1 takes the poke after the ringer's
// Withdraw: a poke taken while the offer is still in flight is swallowed
// (beginTry refuses, errOffered), and W1 then does not try.
func TestRingerLateHeadYieldsToLine(t *testing.T) {
	ctx := context.Background()
	name := fencetest.Name("rr2-latehead")
	rp := newRingPair(t, name)
	a, b, la, pb, grants := rp.a, rp.b, rp.la, rp.pb, rp.grants
	wctx, cancel := context.WithTimeout(ctx, 40*time.Second)
	defer cancel()
	ch1 := goAcquire(wctx, b, name, 150*time.Millisecond)
	waitHeadIdle(t, b, name)
	waitPinned(t, b, 1) // B's ringer
	ch2 := goAcquire(wctx, b, name, time.Minute)
	bellWaitFor(t, 5*time.Second, "W2 in B's line behind W1", func() bool { return sqlfence.LineLen(b, name) == 2 })
	sent := grants.Load()
	pb.Latency(100*time.Millisecond, 100*time.Millisecond)
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	select {
	case r := <-ch2:
		if r.err != nil {
			t.Fatalf("W2: %v", r.err)
		}
		t.Logf("W2 granted %v after A's release; %d grants sent by B", time.Since(start), grants.Load()-sent)
		r.l.Release(ctx)
	case r := <-ch1:
		t.Fatalf("W1 (every grant late) returned: %v, %v", r.l, r.err)
	case <-time.After(10 * time.Second):
		info, _ := a.Inspect(ctx, name)
		t.Fatalf("W2 (ttl 1m) not granted within 10s of A's release, behind W1 whose every grant comes back late: "+
			"%d grant statements sent by B meanwhile (the ringer's for W1, each given back); the name now %s; W1 never yields its place",
			grants.Load()-sent, fmt.Sprintf("held=%v counter=%d", info.Held, info.Counter))
	}
	cancel()
	within(t, ch1, 5*time.Second, "W1 after its context ended")
}
