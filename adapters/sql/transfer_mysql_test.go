package sqlfence_test

// The handoff on MySQL (transfer.go): as on PostgreSQL, a release through an
// Acquirer grants the lock to the head of that Acquirer's line in its own
// statement (an UPDATE whose LAST_INSERT_ID is the new token).

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

// mysqlCounted is an Acquirer on MySQL whose connections pass a proxy that
// counts the statements it sends: grants (the upsert) and handoffs.
type mysqlCounted struct {
	a                *sqlfence.Acquirer
	px               *faultnet.Proxy
	grants, handoffs *atomic.Int64
}

func newMySQLCounted(t *testing.T, opts *sqlfence.AcquirerOptions) mysqlCounted {
	t.Helper()
	px := faultnet.Start(t, mysqlAddr(t))
	c := mysqlCounted{px: px,
		grants:   observe(px, "ON DUPLICATE KEY UPDATE token"),
		handoffs: observe(px, "LAST_INSERT_ID(token + 1), owner")}
	c.a = newAcquirerOn(t, sqlfence.MySQL(proxiedMySQL(t, px)), opts)
	if err := c.a.CreateTable(context.Background()); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestHandoffMySQLOneStatement: on MySQL, a release through the Acquirer
// whose Acquire call waits grants the lock to that waiter in one statement:
// the waiter sends no grant statement, holds a larger token (the row's),
// the row keeps the head's own ttl, the released lease is lost and the
// handed one renews and releases.
func TestHandoffMySQLOneStatement(t *testing.T) {
	ctx := context.Background()
	c := newMySQLCounted(t, &sqlfence.AcquirerOptions{Backoff: idleHead})
	_, direct := openMySQL(t, "")
	check := newAcquirerOn(t, direct, nil)
	name := fencetest.Name("handoff-my")
	h, err := c.a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	head := goAcquire(ctx, c.a, name, 45*time.Second) // its own ttl, not the released lease's
	waitLine(t, c.a, name, 1)
	waitHeadIdle(t, c.a, name)
	grants := c.grants.Load()
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	r := within(t, head, 10*time.Second, "the head")
	if r.err != nil {
		t.Fatal(r.err)
	}
	if n := c.grants.Load() - grants; n != 0 || c.handoffs.Load() != 1 {
		t.Fatalf("after the release: %d grant statements and %d handoffs, want 0 and 1 (the release grants to the head)", n, c.handoffs.Load())
	}
	if r.l.Token() != h.Token()+1 {
		t.Fatalf("handed token %d, want the released %d + 1", r.l.Token(), h.Token())
	}
	info, err := check.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != r.l.Token() || info.Owner != c.a.Owner() ||
		info.TimeLeft > 45*time.Second || info.TimeLeft < 35*time.Second {
		t.Fatalf("the row after the handoff: %+v, %v; want held by %s with token %d for the head's ttl (45s)", info, err, c.a.Owner(), r.l.Token())
	}
	if err := h.Renew(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("Renew of the released lease: %v, want ErrLost", err)
	}
	if err := r.l.Renew(ctx); err != nil {
		t.Fatalf("Renew of the handed lease: %v", err)
	}
	if err := r.l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if info, err := check.Inspect(ctx, name); err != nil || info.Held {
		t.Fatalf("the row after the handed lease's release: %+v, %v; want free", info, err)
	}
}

// TestHandoffMySQLExpiredRelease: the released lease's row expired (and no
// one took it): the handoff statement matches nothing, the release reports
// ErrLost, and the head, handed nothing, is granted by its own attempt at
// once.
func TestHandoffMySQLExpiredRelease(t *testing.T) {
	ctx := context.Background()
	// Without the bell, whose ringer would wake the head when the row
	// expires (TestBellExpiredHolder), before the release.
	c := newMySQLCounted(t, &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
	name := fencetest.Name("handoff-my-exp")
	h, err := c.a.TryAcquire(ctx, name, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	head := goAcquire(ctx, c.a, name, time.Minute)
	waitLine(t, c.a, name, 1)
	waitHeadIdle(t, c.a, name)
	<-h.Context().Done()
	time.Sleep(1100 * time.Millisecond) // past the row's expiry on the server's clock (ms)
	grants := c.grants.Load()
	released := time.Now()
	if err := h.Release(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("Release of an expired lease: %v, want ErrLost", err)
	}
	r := within(t, head, 30*time.Second, "the head (not poked after a handoff that matched nothing)")
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.l.Release(ctx)
	if took := r.at.Sub(released); took > 10*time.Second {
		t.Fatalf("the head was granted %v after the release", took)
	}
	if c.handoffs.Load() != 1 || c.grants.Load() == grants {
		t.Fatalf("%d handoffs, %d grants after the release; want 1 handoff (that matched nothing) and the head's own grant", c.handoffs.Load(), c.grants.Load()-grants)
	}
	if r.l.Token() <= h.Token() {
		t.Fatalf("token %d after %d", r.l.Token(), h.Token())
	}
}

// TestHandoffMySQLLostReplies: every reply to the handoff statement and to
// the reads that look for its grant is lost (the release returns
// ErrUnknown), though the first one granted to the head. The head is
// granted at once: its own attempt runs as the handoff's owner and
// recognises the grant.
func TestHandoffMySQLLostReplies(t *testing.T) {
	ctx := context.Background()
	// Without the bell: its ringer's reads of the row carry the name too,
	// and would take the faults meant for the handoff.
	c := newMySQLCounted(t, &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
	_, direct := openMySQL(t, "")
	check := newAcquirerOn(t, direct, nil)
	name := fencetest.Name("handoff-my-lost")
	h, err := c.a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	head := goAcquire(ctx, c.a, name, time.Minute)
	waitLine(t, c.a, name, 1)
	waitHeadIdle(t, c.a, name)
	// 4 handoff statements and the 3 reads after the 2nd to 4th.
	for range 7 {
		c.px.LoseReply(carrying(name))
	}
	err = h.Release(ctx)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("Release with its replies lost: %v, want ErrUnknown (the test did not test it)", err)
	}
	if n := c.px.Pending(); n != 2 { // the two counters
		t.Fatalf("%d faults left armed, want none (the test did not test it)", n-2)
	}
	released := time.Now()
	r := within(t, head, 30*time.Second, "the head (it did not recognise the handoff's grant)")
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.l.Release(ctx)
	if took := r.at.Sub(released); took > 10*time.Second {
		t.Fatalf("the head was granted %v after a handoff whose replies were lost", took.Round(time.Millisecond))
	}
	info, err := check.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != r.l.Token() || r.l.Token() != h.Token()+1 {
		t.Fatalf("the row: %+v, %v; want held by the head's token %d (the handoff's, %d + 1)", info, err, r.l.Token(), h.Token())
	}
}

// TestHandoffMySQLHeadGivesUp: the head's context ends while the handoff
// statement waits for the row (another transaction holds it). The head
// returns at once with ErrHeld and its context's error; when the statement
// then grants, the grant is given back at once, and the next waiter is
// granted without waiting out the ttl.
func TestHandoffMySQLHeadGivesUp(t *testing.T) {
	ctx := context.Background()
	c := newMySQLCounted(t, &sqlfence.AcquirerOptions{Backoff: idleHead})
	raw, direct := openMySQL(t, "")
	check := newAcquirerOn(t, direct, nil)
	name := fencetest.Name("handoff-my-gone")
	h, err := c.a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	hctx, cancel := context.WithCancel(ctx)
	defer cancel()
	head := goAcquire(hctx, c.a, name, time.Minute)
	waitLine(t, c.a, name, 1)
	waitHeadIdle(t, c.a, name)
	next := goAcquire(ctx, c.a, name, time.Minute)
	waitLine(t, c.a, name, 2)

	tx := lockRowMySQL(t, raw, name)
	released := make(chan error, 1)
	go func() { released <- h.Release(ctx) }()
	mysqlHandoffWaiting(t, raw, tx)
	cancel()
	r := within(t, head, 2*time.Second, "the head whose context ended during the handoff")
	if r.l != nil || !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.Canceled) {
		t.Fatalf("the head whose context ended: %v, %v; want ErrHeld and context.Canceled, at once", r.l, r.err)
	}
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	if err := <-released; err != nil {
		t.Fatalf("the release that granted to a head that had gone: %v", err)
	}
	n := within(t, next, 10*time.Second, "the next waiter (a handed grant of a head that had gone was not given back: it holds the row for its ttl)")
	if n.err != nil {
		t.Fatal(n.err)
	}
	defer n.l.Release(ctx)
	info, err := check.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != n.l.Token() {
		t.Fatalf("the row: %+v, %v; want held by the next waiter's token %d", info, err, n.l.Token())
	}
}

// TestHandoffMySQLChainBound: at most 8 releases in a row hand the lock
// over; the 9th releases it and pokes the head (MySQL has no
// notifications: the waiters of other processes poll), which is granted at
// once.
func TestHandoffMySQLChainBound(t *testing.T) {
	ctx := context.Background()
	c := newMySQLCounted(t, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("handoff-my-chain")
	l, err := c.a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	checkChainBound(t, c.a, name, l, c.handoffs.Load)
}

// lockRowMySQL locks name's lease row in a transaction of its own on raw, as
// an operator's SELECT ... FOR UPDATE would; the test ends it.
func lockRowMySQL(t *testing.T, raw *sql.DB, name string) *sql.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := raw.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback() })
	if _, err := tx.ExecContext(ctx, "SELECT 1 FROM fence_leases WHERE name = CAST(? AS BINARY) FOR UPDATE", name); err != nil {
		t.Fatal(err)
	}
	return tx
}

// mysqlHandoffWaiting waits until the server shows a handoff statement
// that has been running (waiting for the row lock that tx, from
// lockRowMySQL, holds) for 200ms, and returns its connection's id. Other
// tests and packages share the server and the table (CI run d4 saw another
// test's grant): their handoffs, which wait for no lock, end within
// milliseconds, and listing the lock waits themselves needs the PROCESS
// privilege, which the test user lacks.
func mysqlHandoffWaiting(t *testing.T, raw *sql.DB, tx *sql.Tx) int64 {
	t.Helper()
	_ = tx // held by the caller; named so that each call shows which lock
	seen := map[int64]time.Time{}
	for end := time.Now().Add(10 * time.Second); ; {
		now := time.Now()
		rows, err := raw.Query("SELECT ID FROM information_schema.PROCESSLIST WHERE INFO LIKE '%LAST_INSERT_ID(token + 1), owner%' AND INFO NOT LIKE '%PROCESSLIST%'")
		if err != nil {
			t.Fatal(err)
		}
		running := map[int64]time.Time{}
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				t.Fatal(err)
			}
			first, ok := seen[id]
			if !ok {
				first = now
			}
			running[id] = first
		}
		rows.Close()
		seen = running
		var long []int64
		for id, first := range seen {
			if now.Sub(first) >= 200*time.Millisecond {
				long = append(long, id)
			}
		}
		if len(long) == 1 {
			return long[0]
		}
		if len(long) > 1 || now.After(end) {
			t.Fatalf("%d handoff statements seen waiting for 200ms, want 1", len(long))
		}
		time.Sleep(time.Millisecond) // polling the server's view
	}
}
