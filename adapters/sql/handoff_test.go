package sqlfence_test

// The handoff on PostgreSQL (transfer.go): a release through an Acquirer
// grants the lock to the head of that Acquirer's line in its own statement.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
)

// stmtCounter counts the grant statements (INSERT … RETURNING token) and
// the handoff statements (WITH g AS (UPDATE …) a pool's connections start.
type stmtCounter struct{ grants, handoffs atomic.Int64 }

func (c *stmtCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	switch {
	case strings.Contains(d.SQL, "INSERT INTO") && strings.Contains(d.SQL, "RETURNING token"):
		c.grants.Add(1)
	case strings.HasPrefix(d.SQL, "WITH g AS (UPDATE"):
		c.handoffs.Add(1)
	}
	return ctx
}

func (c *stmtCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// idleHead is a Backoff whose head tries on its own (at a random time within
// an hour) almost never during a test: it tries when it joins, and when a
// release pokes it or hands it a lease. (Its acquirers disable
// notifications too: the listener wakes every waiter once when it starts.)
var idleHead = fence.Backoff{Min: time.Hour, Max: time.Hour, MaxWait: 2 * time.Hour}

// waitHeadIdle waits until the head of name's line has made its first
// attempt and waits between attempts.
func waitHeadIdle(t *testing.T, a *sqlfence.Acquirer, name string) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); !sqlfence.LineHeadWaiting(a, name); {
		if time.Now().After(end) {
			t.Fatal("the head's attempt did not end within 10s")
		}
		time.Sleep(time.Millisecond) // polling the line's state
	}
}

// TestHandoffOneStatement: a release through the Acquirer whose Acquire call
// waits grants the lock to that waiter in the release's own statement: the
// waiter sends no grant statement, holds a larger token, and the released
// lease is lost.
func TestHandoffOneStatement(t *testing.T) {
	ctx := context.Background()
	c := &stmtCounter{}
	fdb := sqlfence.Pgx(tracedPool(t, c))
	a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
	check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	name := fencetest.Name("handoff")
	h, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	head := goAcquire(ctx, a, name, time.Minute)
	waitLine(t, a, name, 1)
	waitHeadIdle(t, a, name)
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
	if r.l.Token() <= h.Token() {
		t.Fatalf("handed token %d, not above the released %d", r.l.Token(), h.Token())
	}
	info, err := check.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != r.l.Token() || info.Owner != a.Owner() {
		t.Fatalf("the row after the handoff: %+v, %v; want held by %s with token %d", info, err, a.Owner(), r.l.Token())
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

// TestHandoffHeadGivesUp: the head's context ends while the handoff
// statement waits for the row (another transaction holds it). The head
// returns at once with ErrHeld and its context's error; when the statement
// then grants, the grant is given back at once, and the next waiter is
// granted without waiting out the ttl.
func TestHandoffHeadGivesUp(t *testing.T) {
	ctx := context.Background()
	pool := pgPool(t, pgOpts{})
	a := newAcquirerOn(t, sqlfence.Pgx(pool), &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
	admin := pgPool(t, pgOpts{})
	check := newAcquirerOn(t, sqlfence.Pgx(admin), nil)
	name := fencetest.Name("handoff-gone")
	h, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	hctx, cancel := context.WithCancel(ctx)
	defer cancel()
	head := goAcquire(hctx, a, name, time.Minute)
	waitLine(t, a, name, 1)
	waitHeadIdle(t, a, name)
	next := goAcquire(ctx, a, name, time.Minute)
	waitLine(t, a, name, 2)

	// Another transaction holds the row: the handoff statement waits.
	tx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SELECT 1 FROM fence_leases WHERE name = $1 FOR UPDATE", name); err != nil {
		t.Fatal(err)
	}
	released := make(chan error, 1)
	go func() { released <- h.Release(ctx) }()
	for end := time.Now().Add(10 * time.Second); ; {
		var n int
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'WITH g AS (UPDATE%'").Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			break
		}
		if time.Now().After(end) {
			rows, _ := admin.Query(ctx, "SELECT coalesce(wait_event_type,''), left(query, 60) FROM pg_stat_activity WHERE datname = current_database()")
			for rows.Next() {
				var w, q string
				_ = rows.Scan(&w, &q)
				t.Logf("%s %q", w, q)
			}
			t.Fatal("the handoff statement was not seen waiting for the row")
		}
		time.Sleep(time.Millisecond) // polling the server's view
	}
	cancel()
	r := within(t, head, 2*time.Second, "the head whose context ended during the handoff")
	if r.l != nil || !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.Canceled) {
		t.Fatalf("the head whose context ended: %v, %v; want ErrHeld and context.Canceled, at once", r.l, r.err)
	}
	if err := tx.Rollback(ctx); err != nil {
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

// TestHandoffLostReplies: every reply to the handoff statement and to the
// reads that look for its grant is lost (the release returns ErrUnknown),
// though the first one granted to the head. The head, told the handoff made
// no grant it knows of, is granted at once: its own attempt recognises the
// handoff's grant (it runs as the handoff's owner) instead of finding the
// row held by nobody for a ttl.
func TestHandoffLostReplies(t *testing.T) {
	ctx := context.Background()
	px := faultnet.Start(t, pgTarget(t))
	owner := "handoff-" + fencetest.Name("o")
	a := newAcquirerOn(t, sqlfence.Pgx(proxiedPool(t, px, 0)), &sqlfence.AcquirerOptions{Owner: owner,
		Backoff: idleHead, DisableNotify: true})
	check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	name := fencetest.Name("handoff-lost")
	h, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	head := goAcquire(ctx, a, name, time.Minute)
	waitLine(t, a, name, 1)
	waitHeadIdle(t, a, name)
	// 4 handoff statements and the 3 reads after the 2nd to 4th.
	for range 7 {
		px.LoseReply(carrying(name))
	}
	err = h.Release(ctx)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("Release with its replies lost: %v, want ErrUnknown (the test did not test it)", err)
	}
	released := time.Now()
	r := within(t, head, 40*time.Second, "the head")
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.l.Release(ctx)
	if took := r.at.Sub(released); took > time.Second {
		t.Fatalf("the head was granted %v after a handoff whose replies were lost: it did not recognise the handoff's grant", took.Round(time.Millisecond))
	}
	info, err := check.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != r.l.Token() || r.l.Token() <= h.Token() {
		t.Fatalf("the row: %+v, %v; want held by the head's token %d (above %d)", info, err, r.l.Token(), h.Token())
	}
}

// TestHandoffChainBound: of the releases through one Acquirer, each with
// one waiter of that Acquirer in line, at most 8 in a row hand the lock
// over; the 9th releases it (with notifications, the waiters of other
// processes hear of it with this Acquirer's head, which is not poked first),
// and the head is still granted, at once: by the release's notification, or
// by a poke without notifications.
func TestHandoffChainBound(t *testing.T) {
	for _, notify := range []bool{true, false} {
		t.Run(fmt.Sprintf("notify=%v", notify), func(t *testing.T) {
			ctx := context.Background()
			c := &stmtCounter{}
			a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, c)), &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: !notify})
			name := fencetest.Name("handoff-chain")
			if notify {
				// The listener runs while someone waits, and wakes every
				// waiter when it starts: a waiter on another name keeps
				// it running, so that each round's head is not woken by
				// a start (it would be trying when the release comes).
				other := fencetest.Name("handoff-chain-other")
				ol, err := a.TryAcquire(ctx, other, time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				octx, ocancel := context.WithCancel(ctx)
				sentinel := goAcquire(octx, a, other, time.Minute)
				defer func() {
					ocancel()
					<-sentinel
					_ = ol.Release(ctx)
				}()
				waitLine(t, a, other, 1)
				waitHeadIdle(t, a, other)
			}
			l, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			checkChainBound(t, a, name, l, c.handoffs.Load)
		})
	}
}

// checkChainBound releases l, held through a, 19 times, each with one
// waiter of a in line, and checks that the releases hand the lock over 8
// times in a row, then release it (the head still granted, and with a
// larger token), and so on; handoffs counts the handoff statements sent.
func checkChainBound(t *testing.T, a *sqlfence.Acquirer, name string, l fence.Lease, handoffs func() int64) {
	t.Helper()
	ctx := context.Background()
	var kinds []string
	for range 19 {
		head := goAcquire(ctx, a, name, time.Minute)
		waitLine(t, a, name, 1)
		waitHeadIdle(t, a, name)
		before := handoffs()
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		r := within(t, head, 10*time.Second, "the head (a plain release did not wake or poke it)")
		if r.err != nil {
			t.Fatal(r.err)
		}
		if r.l.Token() <= l.Token() {
			t.Fatalf("token %d after %d", r.l.Token(), l.Token())
		}
		kind := "handoff"
		if handoffs() == before {
			kind = "release"
		}
		kinds = append(kinds, kind)
		l = r.l
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	want := strings.Repeat("handoff ", 8) + "release " + strings.Repeat("handoff ", 8) + "release handoff"
	if got := strings.Join(kinds, " "); got != want {
		t.Fatalf("releases: %s\nwant:     %s", got, want)
	}
}

// handoffPanicker is a pgx tracer that panics in the first handoff
// statement started after arm, and counts grant statements.
type handoffPanicker struct {
	armed  atomic.Bool
	grants atomic.Int64
}

func (p *handoffPanicker) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.HasPrefix(d.SQL, "WITH g AS (UPDATE") && p.armed.CompareAndSwap(true, false) {
		panic("review: the driver panics in the handoff")
	}
	if strings.Contains(d.SQL, "INSERT INTO") && strings.Contains(d.SQL, "RETURNING token") {
		p.grants.Add(1)
	}
	return ctx
}

func (p *handoffPanicker) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestHandoffPanicFreesHead: the handoff statement panics (a driver or a
// hook) and the releaser's caller recovers. The head is not left waiting on
// an offer that never ends: it tries on its own at once (a grant statement),
// and is free to be offered again.
func TestHandoffPanicFreesHead(t *testing.T) {
	ctx := context.Background()
	pk := &handoffPanicker{}
	a := newAcquirerOn(t, sqlfence.Pgx(panickyPool(t, pk)), &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
	name := fencetest.Name("handoff-panic")
	h, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	hctx, cancel := context.WithCancel(ctx)
	defer cancel()
	head := goAcquire(hctx, a, name, time.Minute)
	waitLine(t, a, name, 1)
	waitHeadIdle(t, a, name)
	grants := pk.grants.Load()
	pk.armed.Store(true)
	func() {
		defer func() {
			if r := recover(); r == nil {
				t.Fatal("the release did not panic: the test did not test it")
			}
		}()
		_ = h.Release(ctx)
	}()
	for end := time.Now().Add(5 * time.Second); pk.grants.Load() == grants; {
		if time.Now().After(end) {
			t.Fatal("the head made no attempt of its own within 5s of a handoff that panicked: it waits on an offer that never ended")
		}
		time.Sleep(time.Millisecond) // polling the statement count
	}
	waitHeadIdle(t, a, name) // the row is still held (the release never ran): the head waits again
	cancel()
	if r := within(t, head, 5*time.Second, "the head"); r.l != nil || !errors.Is(r.err, fence.ErrHeld) {
		t.Fatalf("the head after its context ended: %v, %v; want ErrHeld", r.l, r.err)
	}
}
