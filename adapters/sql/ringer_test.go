package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
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
// to release it (review 2 of the ringer's grant; HAZARDS 6).
func TestRingGrantHintAfterContextEnded(t *testing.T) {
	for dname, db := range lateDialects(t) {
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
