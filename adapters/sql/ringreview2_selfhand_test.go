package sqlfence_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/jackc/pgx/v5"
)

// Review 2 of the ringer's grant and the wakeup changes (544949c, fe9bf49,
// bb88dbf).

// slowGrants is a pgx tracer that delays the grant statements (INSERT ...
// RETURNING token) by delay while it is not zero, and counts the handoff
// statements (WITH g AS (UPDATE ...) sent.
type slowGrants struct {
	delay     atomic.Int64
	grants    atomic.Int64
	transfers atomic.Int64
}

func (s *slowGrants) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	switch {
	case strings.Contains(d.SQL, "INSERT INTO") && strings.Contains(d.SQL, "RETURNING token"):
		s.grants.Add(1)
		if dl := time.Duration(s.delay.Load()); dl > 0 {
			t := time.NewTimer(dl)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
			}
		}
	case strings.Contains(d.SQL, "WITH g AS (UPDATE"):
		s.transfers.Add(1)
	}
	return ctx
}

func (s *slowGrants) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestHandoffPostgresEndedAttemptHandedToItself (HAZARDS 6, review 8's
// class): a release through the Acquirer hands the lock to a head that is
// inside a slow attempt of its own (Line.Offer offers a head inside a
// younger attempt); when the attempt ends, the handed lease is already past
// its local deadline. AcquireHanded now settles it through abandon instead
// of returning it (544949c). But abandon releases it with lease.Release,
// whose releaseRow makes a handoff to the head of the line: the very waiter
// that is abandoning it (it is not gone, not trying, not offered). The
// handoff grants the row again, with a fresh server-side ttl, and hands the
// new lease to the same waiter, whose next attempt (slow) finds the row held
// by it, then takes the new lease, already ended too, and abandons it the
// same way: a loop of self-handoffs, up to maxChain, each keeping the row
// held with nobody holding the lease, while another process's TryAcquire
// finds it held. A give-back of a lease the waiter will not take must be a
// release only (giveBackRelease), as for a late grant.
func TestHandoffPostgresEndedAttemptHandedToItself(t *testing.T) {
	ctx := context.Background()
	tr := &slowGrants{}
	const ttl = 2 * time.Second
	// The local deadline of a ttl grant is 150ms after its statement was
	// sent; the server holds it 2s.
	a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, tr)), &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true, Drift: ttl - 150*time.Millisecond})
	check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	name := fencetest.Name("rr2-selfhand")
	l, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	// The waiter's grants now take 400ms to be sent: longer than the 150ms
	// its handed leases are valid for.
	tr.delay.Store(int64(400 * time.Millisecond))
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	ch := goAcquire(wctx, a, name, ttl)
	bellWaitFor(t, 5*time.Second, "the head inside its first (slow) attempt", func() bool { return sqlfence.LineHeadTrying(a, name) })
	before := tr.transfers.Load()
	released := time.Now()
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if n := tr.transfers.Load() - before; n != 1 {
		t.Fatalf("the release sent %d handoff statements, want 1 (a handoff to the head inside its attempt)", n)
	}
	// Watch the row for 4s: how long it stays held after the waiter's
	// first attempt ended (400ms after the release at most), with nobody
	// holding a lease; and how many handoffs run.
	var heldFor time.Duration
	for end := released.Add(4 * time.Second); time.Now().Before(end); {
		info, err := check.Inspect(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if info.Held {
			heldFor = time.Since(released)
		}
		time.Sleep(5 * time.Millisecond) // polling the row
	}
	select {
	case r := <-ch:
		if r.err == nil {
			// Not asserted (see the report): a lease taken late whose
			// context's timer had not run yet would be returned.
			t.Logf("the waiter returned a lease (token %d) at %v after the release", r.l.Token(), r.at.Sub(released))
			r.l.Release(ctx)
		}
	default:
	}
	self := tr.transfers.Load() - before - 1
	t.Logf("after the release: %d more handoffs, the row held for %v; %d grants sent", self, heldFor, tr.grants.Load())
	if self > 0 {
		t.Errorf("the waiter handed the ended lease back to itself %d times (each a handoff statement granting the row again): "+
			"the row stayed held for %v after the release, with no holder (abandon releases with a handoff, not giveBackRelease)", self, heldFor)
	}
	cancel()
	within(t, ch, 5*time.Second, "the waiter's Acquire after its context ended")
	// The chain of handoffs ends (maxChain) and the row is free again.
	bellWaitFor(t, 5*time.Second, "the name free after the waiter left", func() bool {
		info, err := check.Inspect(ctx, name)
		return err == nil && !info.Held
	})
	mustTryAcquire(t, check, name)
}
