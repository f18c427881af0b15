package sqlfence_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// Review of the ringer's grant (bell.go handOn, mysql.go ringGrant).

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
