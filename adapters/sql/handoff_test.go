package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The handoff on PostgreSQL (transfer.go): a release through an Acquirer
// grants the lock to the head of that Acquirer's line in its own statement.

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

// handoffRig is an acquirer whose grant and handoff statements are counted
// (on PostgreSQL by a tracer, on MySQL by its proxy), and an acquirer on a
// handle of its own that checks the row.
type handoffRig struct {
	a, check         *sqlfence.Acquirer
	grants, handoffs *atomic.Int64
}

// newHandoffRig builds a handoffRig with opts on server ("postgres" or "mysql").
func newHandoffRig(t *testing.T, server string, opts *sqlfence.AcquirerOptions) handoffRig {
	t.Helper()
	if server == "postgres" {
		c := &stmtCounter{}
		a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, c)), opts)
		return handoffRig{a: a, check: newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil), grants: &c.grants, handoffs: &c.handoffs}
	}
	c := newMySQLCounted(t, opts)
	_, direct := openMySQL(t, "")
	return handoffRig{a: c.a, check: newAcquirerOn(t, direct, nil), grants: c.grants, handoffs: c.handoffs}
}

// handoffServers are the servers with a handoff statement. PostgreSQL's
// acquirers in these tests disable notifications (see idleHead); MySQL has
// none but the bell.
var handoffServers = []string{"postgres", "mysql"}

// TestHandoffOneStatement: a release through the Acquirer whose Acquire call
// waits grants the lock to that waiter in the release's own statement: the
// waiter sends no grant statement, holds a larger token, and the released
// lease is lost and the handed one renews and releases. On MySQL the token
// is the released one + 1 (the row's), and the row keeps the head's own ttl.
func TestHandoffOneStatement(t *testing.T) {
	for _, server := range handoffServers {
		t.Run(server, func(t *testing.T) {
			ctx := context.Background()
			c := newHandoffRig(t, server, &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: server == "postgres"})
			name := fencetest.Name("handoff-" + server)
			h := mustGrant(t, ctx, c.a, name, time.Minute)
			headTTL := time.Minute
			if server == "mysql" {
				headTTL = 45 * time.Second // its own ttl, not the released lease's
			}
			head := goAcquire(ctx, c.a, name, headTTL)
			waitLine(t, c.a, name, 1)
			waitHeadIdle(t, c.a, name)
			grants := c.grants.Load()
			if err := h.Release(ctx); err != nil {
				t.Fatal(err)
			}
			r := leaseWithin(t, head, 10*time.Second, "the head")
			if n := c.grants.Load() - grants; n != 0 || c.handoffs.Load() != 1 {
				t.Fatalf("after the release: %d grant statements and %d handoffs, want 0 and 1 (the release grants to the head)", n, c.handoffs.Load())
			}
			if r.l.Token() <= h.Token() {
				t.Fatalf("handed token %d, not above the released %d", r.l.Token(), h.Token())
			}
			if server == "mysql" && r.l.Token() != h.Token()+1 {
				t.Fatalf("handed token %d, want the released %d + 1", r.l.Token(), h.Token())
			}
			info, err := c.check.Inspect(ctx, name)
			if err != nil || !info.Held || info.Token != r.l.Token() || info.Owner != c.a.Owner() {
				t.Fatalf("the row after the handoff: %+v, %v; want held by %s with token %d", info, err, c.a.Owner(), r.l.Token())
			}
			if server == "mysql" && (info.TimeLeft > 45*time.Second || info.TimeLeft < 35*time.Second) {
				t.Fatalf("the row after the handoff: %+v; want held for the head's ttl (45s)", info)
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
			if info, err := c.check.Inspect(ctx, name); err != nil || info.Held {
				t.Fatalf("the row after the handed lease's release: %+v, %v; want free", info, err)
			}
		})
	}
}

// lockLeaseRow locks name's lease row on server in a transaction of its own,
// as an operator's SELECT ... FOR UPDATE would. waiting waits until a handoff
// statement (on PostgreSQL, of the session named app when app is not "")
// waits for that lock; unlock rolls the transaction back.
func lockLeaseRow(t *testing.T, server, name, app string) (waiting func(), unlock func() error) {
	t.Helper()
	ctx := context.Background()
	if server == "mysql" {
		raw, _ := openMySQL(t, "")
		tx := lockRowMySQL(t, raw, name)
		return func() { mysqlHandoffWaiting(t, raw, tx) }, tx.Rollback
	}
	admin := pgPool(t, pgOpts{})
	tx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if _, err := tx.Exec(ctx, "SELECT 1 FROM fence_leases WHERE name = $1 FOR UPDATE", name); err != nil {
		t.Fatal(err)
	}
	waiting = func() {
		if app != "" {
			waitHandoffBlocked(t, admin, app)
			return
		}
		for end := time.Now().Add(10 * time.Second); ; {
			var n int
			if err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'WITH g AS (UPDATE%'").Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n == 1 {
				return
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
	}
	return waiting, func() error { return tx.Rollback(ctx) }
}

// releaseWhileLocked locks name's lease row (lockLeaseRow), starts h's
// release, and returns once the release's handoff statement waits for the
// row: released gets the release's error, start is when it began, and unlock
// ends the lock.
func releaseWhileLocked(t *testing.T, server, name, app string, h fence.Lease) (released <-chan error, start time.Time, unlock func() error) {
	t.Helper()
	waiting, unlock := lockLeaseRow(t, server, name, app)
	ch := make(chan error, 1)
	start = time.Now()
	go func() { ch <- h.Release(context.Background()) }()
	waiting()
	return ch, start, unlock
}

// TestHandoffHeadGivesUp: the head's context ends while the handoff
// statement waits for the row (another transaction holds it). The head
// returns at once with ErrHeld and its context's error; when the statement
// then grants, the grant is given back at once, and the next waiter is
// granted without waiting out the ttl.
func TestHandoffHeadGivesUp(t *testing.T) {
	for _, server := range handoffServers {
		t.Run(server, func(t *testing.T) {
			ctx := context.Background()
			c := newHandoffRig(t, server, &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: server == "postgres"})
			name := fencetest.Name("handoff-gone-" + server)
			h := mustGrant(t, ctx, c.a, name, time.Minute)
			hctx, cancel := context.WithCancel(ctx)
			defer cancel()
			head := goAcquire(hctx, c.a, name, time.Minute)
			waitLine(t, c.a, name, 1)
			waitHeadIdle(t, c.a, name)
			next := goAcquire(ctx, c.a, name, time.Minute)
			waitLine(t, c.a, name, 2)

			// Another transaction holds the row: the handoff statement waits.
			released, _, unlock := releaseWhileLocked(t, server, name, "", h)
			cancel()
			r := within(t, head, 2*time.Second, "the head whose context ended during the handoff")
			if r.l != nil || !errors.Is(r.err, fence.ErrHeld) || !errors.Is(r.err, context.Canceled) {
				t.Fatalf("the head whose context ended: %v, %v; want ErrHeld and context.Canceled, at once", r.l, r.err)
			}
			if err := unlock(); err != nil {
				t.Fatal(err)
			}
			if err := <-released; err != nil {
				t.Fatalf("the release that granted to a head that had gone: %v", err)
			}
			n := leaseWithin(t, next, 10*time.Second, "the next waiter (a handed grant of a head that had gone was not given back: it holds the row for its ttl)")
			defer n.l.Release(ctx)
			info, err := c.check.Inspect(ctx, name)
			if err != nil || !info.Held || info.Token != n.l.Token() {
				t.Fatalf("the row: %+v, %v; want held by the next waiter's token %d", info, err, n.l.Token())
			}
		})
	}
}

// TestHandoffLostReplies: every reply to the handoff statement and to the
// reads that look for its grant is lost (the release returns ErrUnknown),
// though the first one granted to the head. The head, told the handoff made
// no grant it knows of, is granted at once: its own attempt recognises the
// handoff's grant (it runs as the handoff's owner) instead of finding the
// row held by nobody for a ttl. On MySQL its token is the handoff's (the
// released one + 1).
func TestHandoffLostReplies(t *testing.T) {
	for _, server := range handoffServers {
		t.Run(server, func(t *testing.T) {
			ctx := context.Background()
			var a, check *sqlfence.Acquirer
			var px *faultnet.Proxy
			grantWithin, soon := 40*time.Second, time.Second
			if server == "postgres" {
				px = faultnet.Start(t, pgTarget(t))
				owner := "handoff-" + fencetest.Name("o")
				a = newAcquirerOn(t, sqlfence.Pgx(proxiedPool(t, px, 0)), &sqlfence.AcquirerOptions{Owner: owner,
					Backoff: idleHead, DisableNotify: true})
				check = newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
			} else {
				// Without the bell: its ringer's reads of the row carry the name too,
				// and would take the faults meant for the handoff.
				c := newMySQLCounted(t, &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
				_, direct := openMySQL(t, "")
				a, px, check = c.a, c.px, newAcquirerOn(t, direct, nil)
				grantWithin, soon = 30*time.Second, 10*time.Second
			}
			name := fencetest.Name("handoff-lost-" + server)
			h := mustGrant(t, ctx, a, name, time.Minute)
			head := goAcquire(ctx, a, name, time.Minute)
			waitLine(t, a, name, 1)
			waitHeadIdle(t, a, name)
			// 4 handoff statements and the 3 reads after the 2nd to 4th.
			for range 7 {
				px.LoseReply(carrying(name))
			}
			err := h.Release(ctx)
			if !errors.Is(err, fence.ErrUnknown) {
				t.Fatalf("Release with its replies lost: %v, want ErrUnknown (the test did not test it)", err)
			}
			if n := px.Pending(); server == "mysql" && n != 2 { // the two counters
				t.Fatalf("%d faults left armed, want none (the test did not test it)", n-2)
			}
			released := time.Now()
			r := leaseWithin(t, head, grantWithin, "the head (it did not recognise the handoff's grant)")
			defer r.l.Release(ctx)
			if took := r.at.Sub(released); took > soon {
				t.Fatalf("the head was granted %v after a handoff whose replies were lost: it did not recognise the handoff's grant", took.Round(time.Millisecond))
			}
			info, err := check.Inspect(ctx, name)
			if err != nil || !info.Held || info.Token != r.l.Token() || r.l.Token() <= h.Token() {
				t.Fatalf("the row: %+v, %v; want held by the head's token %d (above %d)", info, err, r.l.Token(), h.Token())
			}
			if server == "mysql" && r.l.Token() != h.Token()+1 {
				t.Fatalf("the head's token %d, want the handoff's, %d + 1", r.l.Token(), h.Token())
			}
		})
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
				ol := mustGrant(t, ctx, a, other, time.Minute)
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
			l := mustGrant(t, ctx, a, name, time.Minute)
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
		r := leaseWithin(t, head, 10*time.Second, "the head (a plain release did not wake or poke it)")
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
		panic("test: the driver panics in the handoff")
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
	h := mustGrant(t, ctx, a, name, time.Minute)
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

// The handoff on MySQL (transfer.go): as on PostgreSQL, a release through an
// Acquirer grants the lock to the head of that Acquirer's line in its own
// statement (an UPDATE whose LAST_INSERT_ID is the new token).

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
	h := mustGrant(t, ctx, c.a, name, time.Second)
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
	r := leaseWithin(t, head, 30*time.Second, "the head (not poked after a handoff that matched nothing)")
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

// TestHandoffMySQLChainBound: at most 8 releases in a row hand the lock
// over; the 9th releases it and pokes the head (MySQL has no
// notifications: the waiters of other processes poll), which is granted at
// once.
func TestHandoffMySQLChainBound(t *testing.T) {
	ctx := context.Background()
	c := newMySQLCounted(t, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("handoff-my-chain")
	l := mustGrant(t, ctx, c.a, name, time.Minute)
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
// tests and packages share the server and the table (a loaded run can show
// another test's grant): their handoffs, which wait for no lock, end within
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

// The PostgreSQL handoff under faults (transfer.go, internal/wakeup/line.go):
// a release through an Acquirer whose own Acquire calls wait grants the lock
// to the head of that line in its own statement. Each test names the promise
// it checks.

// handoffPool is a pgx pool on the test database, through px when not nil,
// whose sessions carry application_name app (so that pg_stat_activity shows
// this test's statements only), of at most maxConns connections (0: pgx's
// default).
func handoffPool(t *testing.T, px *faultnet.Proxy, app string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	pgPool(t, pgOpts{}) // the default tables
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	if px != nil {
		cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Fallbacks = "127.0.0.1", uint16(px.Port()), nil
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// waitHandoffBlocked waits until a handoff statement of a session
// named app waits for a row lock on the server.
func waitHandoffBlocked(t *testing.T, admin *pgxpool.Pool, app string) {
	t.Helper()
	ctx := context.Background()
	for end := time.Now().Add(10 * time.Second); ; {
		var n int
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock' AND query LIKE 'WITH g AS (UPDATE%'", app).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			return
		}
		if time.Now().After(end) {
			t.Fatal("the handoff statement was not seen waiting for the row")
		}
		time.Sleep(time.Millisecond) // polling the server's view
	}
}

// TestHandoffHintedGrantDeadline checks: "the handed lease's local deadline
// counts from before the handoff statement was sent" (transfer.go; leasekit:
// the holder stops believing it holds the lease before the backend can grant
// it to anyone else), also for a handoff whose outcome the releaser could not
// learn and whose grant the head then recognises by the owner hint.
//
// The handoff statement lands at once, but its reply is late (the proxy
// throws it away and cuts the connection 1.5s later); the release's context
// ends after 1s, so Release returns ErrUnknown and hands the head the owner.
// The head's own attempt finds the grant held by that owner and returns it as
// its lease. The server counts the grant's ttl from the handoff statement;
// the head's local deadline must not be later than that. The test waits
// until the server shows the row expired, and checks that the head's lease
// context is done by then, and that another acquirer is not granted while
// the head still believes it holds the lock.
func TestHandoffHintedGrantDeadline(t *testing.T) {
	ctx := context.Background()
	px := faultnet.Start(t, pgTarget(t))
	owner := "handoff-" + fencetest.Name("o")
	a := newAcquirerOn(t, sqlfence.Pgx(handoffPool(t, px, owner, 0)), &sqlfence.AcquirerOptions{Owner: owner,
		Backoff: idleHead, DisableNotify: true})
	check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	name := fencetest.Name("handoff-hint-deadline")
	const ttl = 3 * time.Second
	h := mustGrant(t, ctx, a, name, time.Minute)
	head := goAcquire(ctx, a, name, ttl)
	waitLine(t, a, name, 1)
	waitHeadIdle(t, a, name)

	px.ReplyWindow(1500 * time.Millisecond)
	px.LoseReply(carrying(name))
	rctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	sent := time.Now()
	err := h.Release(rctx)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("Release whose reply came after its context ended: %v, want ErrUnknown (the test did not test it)", err)
	}
	r := leaseWithin(t, head, 20*time.Second, "the head")
	defer r.l.Release(ctx)
	info, err := check.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != r.l.Token() {
		t.Fatalf("the row: %+v, %v; want held by the head's token %d (the handoff's grant)", info, err, r.l.Token())
	}
	// The server's expiry of the handoff's grant.
	for {
		info, err = check.Inspect(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if !info.Held {
			break
		}
		if time.Since(sent) > 30*time.Second {
			t.Fatalf("the row is still held %v after the handoff: %+v", time.Since(sent), info)
		}
		time.Sleep(time.Millisecond) // polling the server's view
	}
	expired := time.Since(sent)
	other, err := check.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatalf("another acquirer after the handoff's grant expired on the server: %v", err)
	}
	defer other.Release(ctx)
	if r.l.Context().Err() == nil {
		t.Fatalf("the handed lease (token %d, ttl %v) still believes it holds the lock %v after the handoff statement was sent, when the server already expired it (%v after) and granted it to another holder (token %d): its local deadline was counted from the head's own attempt, after the release's context ended, not from the handoff statement",
			r.l.Token(), ttl, time.Since(sent).Round(time.Millisecond), expired.Round(time.Millisecond), other.Token())
	}
}

// TestHandoffGoneHeadLostReplies checks: "a head that gave up while the
// statement ran gets nothing and the releaser gives the grant back at once"
// (transfer.go; a waiter that left must not keep a free lock from
// the others for a whole ttl), when the handoff's replies are lost.
//
// The handoff statement waits for the row (another transaction holds it);
// the head's context ends meanwhile, and it returns. Then the statement
// grants the lock to the head that left, and every reply to it and to the
// reads after it is lost: Release returns ErrUnknown and hands the owner
// hint to a head that is no longer there (Hand reports false, ignored), so
// nobody recognises or gives back the grant. Once the network is healthy
// again, the lock must not stay held by nobody for the head's one-minute
// ttl: another acquirer, polling, must be granted within 10s.
func TestHandoffGoneHeadLostReplies(t *testing.T) {
	for _, server := range handoffServers {
		t.Run(server, func(t *testing.T) {
			ctx := context.Background()
			fast := &sqlfence.AcquirerOptions{Backoff: fence.Backoff{Min: 5 * time.Millisecond, Max: 20 * time.Millisecond}}
			var a, b *sqlfence.Acquirer
			var px *faultnet.Proxy
			owner := ""
			if server == "postgres" {
				px = faultnet.Start(t, pgTarget(t))
				owner = "handoff-" + fencetest.Name("o")
				a = newAcquirerOn(t, sqlfence.Pgx(handoffPool(t, px, owner, 0)), &sqlfence.AcquirerOptions{Owner: owner,
					Backoff: idleHead, DisableNotify: true})
				b = newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), fast)
			} else {
				_, direct := openMySQL(t, "")
				b = newAcquirerOn(t, direct, fast)
				px = faultnet.Start(t, mysqlAddr(t))
				// Without the bell, as in TestHandoffMySQLNamesAndSessions.
				a = newAcquirerOn(t, sqlfence.MySQL(handoffMySQLDB(t, px, "")), &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
			}
			name := fencetest.Name("handoff-gone-lost-" + server)
			h := mustGrant(t, ctx, a, name, time.Minute)
			hctx, hcancel := context.WithCancel(ctx)
			defer hcancel()
			head := goAcquire(hctx, a, name, time.Minute)
			waitLine(t, a, name, 1)
			waitHeadIdle(t, a, name)

			// 4 handoff statements and the 3 reads after the 2nd to 4th.
			for range 7 {
				px.LoseReply(carrying(name))
			}
			released, _, unlock := releaseWhileLocked(t, server, name, owner, h)
			hcancel()
			hr := within(t, head, 2*time.Second, "the head whose context ended during the handoff")
			if hr.l != nil || !errors.Is(hr.err, fence.ErrHeld) {
				t.Fatalf("the head whose context ended: %v, %v; want ErrHeld at once", hr.l, hr.err)
			}
			if err := unlock(); err != nil {
				t.Fatal(err)
			}
			var rerr error
			select {
			case rerr = <-released:
			case <-time.After(30 * time.Second):
				t.Fatal("the release did not return within 30s")
			}
			t.Logf("Release = %v (%d faults left)", rerr, px.Pending())
			// All 7 faults are checked as taken on PostgreSQL; on MySQL only logged.
			if !errors.Is(rerr, fence.ErrUnknown) || server == "postgres" && px.Pending() != 0 {
				t.Fatalf("Release with every reply lost: %v (%d faults left), want ErrUnknown (on PostgreSQL with all 7 taken; else the test did not test it)", rerr, px.Pending())
			}
			info, err := b.Inspect(ctx, name)
			if err != nil && server == "postgres" {
				t.Fatal(err)
			}
			t.Logf("the row after the release: %+v (released token %d)", info, h.Token())
			bctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			l, err := b.Acquire(bctx, name, time.Minute)
			if err != nil {
				info, _ := b.Inspect(ctx, name)
				t.Fatalf("another acquirer, 10s after a handoff to a head that had left, whose replies were lost: %v; the row: %+v: the grant made to the head that left is held by nobody until its ttl (a minute): the releaser ignores Hand's false in the lost-reply case and nobody looks for the grant", err, info)
			}
			l.Release(ctx)
		})
	}
}

// TestHandoffUncertainThenRefused checks, for the handoff, that an unknown outcome is never reported as definite: a
// release whose first handoff statement landed but whose reply was lost, and
// whose next attempt could not be sent (the connection is refused), must
// report an outcome matching fence.ErrUnknown, not a definite error (the
// transfer's default case says "Refused as a whole: nothing changed, l still
// holds"). The row shows that the release did land: the lock was granted to
// the head.
func TestHandoffUncertainThenRefused(t *testing.T) {
	ctx := context.Background()
	px := faultnet.Start(t, pgTarget(t))
	owner := "handoff-" + fencetest.Name("o")
	a := newAcquirerOn(t, sqlfence.Pgx(handoffPool(t, px, owner, 1)), &sqlfence.AcquirerOptions{Owner: owner,
		Backoff: idleHead, DisableNotify: true})
	check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	name := fencetest.Name("handoff-refused")
	h := mustGrant(t, ctx, a, name, time.Minute)
	head := goAcquire(ctx, a, name, time.Minute)
	waitLine(t, a, name, 1)
	waitHeadIdle(t, a, name)
	px.Refuse(true) // the pool's one connection stays; a new one is refused
	px.LoseReply(carrying(name))
	err := h.Release(ctx)
	px.Refuse(false)
	if px.Pending() != 0 {
		t.Fatal("the lost reply was not taken: the test did not test it")
	}
	info, ierr := check.Inspect(ctx, name)
	t.Logf("the row after the release: %+v, %v (released token %d)", info, ierr, h.Token())
	if r := within(t, head, 20*time.Second, "the head"); r.l != nil {
		defer r.l.Release(ctx)
	}
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("Release whose handoff landed with its reply lost, then whose retry was refused: %v; want an error matching fence.ErrUnknown (the first attempt may have applied; here it did: the row %+v)", err, info)
	}
}

// TestHandoffChainEndPokesHead checks the README's and Acquire's promise
// "a release through that acquirer lets the head try at once", through the
// chain of handoffs: each release of a lease through the Acquirer, while a
// waiter of the same Acquirer waits and nobody else does, must lead to that
// waiter's grant within a second, also the release that ends a chain of
// maxChain (8) handoffs. With notifications off (DisableNotify, an option the
// promise does not exclude) that release does not poke the head, which then
// sleeps its backoff (20s here) while the lock is free.
func TestHandoffChainEndPokesHead(t *testing.T) {
	for _, notify := range []bool{false, true} {
		t.Run(fmt.Sprintf("notify=%v", notify), func(t *testing.T) {
			ctx := context.Background()
			a := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), &sqlfence.AcquirerOptions{DisableNotify: !notify, Backoff: idleHead})
			name := fencetest.Name("handoff-chain-end")
			cur := mustGrant(t, ctx, a, name, time.Minute)
			for i := 1; i <= 12; i++ {
				w := goAcquire(ctx, a, name, time.Minute)
				waitLine(t, a, name, 1)
				waitHeadIdle(t, a, name)
				released := time.Now()
				if err := cur.Release(ctx); err != nil {
					t.Fatalf("release %d: %v", i, err)
				}
				r := within(t, w, 30*time.Second, fmt.Sprintf("the waiter after release %d", i))
				if r.err != nil {
					t.Fatalf("the waiter after release %d: %v", i, r.err)
				}
				if took := r.at.Sub(released); took > 10*time.Second { // unpoked: up to an hour
					r.l.Release(ctx)
					t.Fatalf("release %d through the Acquirer: its waiting head was granted %v later, with the lock free meanwhile (the release that ends a chain of handoffs does not poke the head, which sleeps its backoff)", i, took.Round(time.Millisecond))
				}
				if r.l.Token() <= cur.Token() {
					t.Fatalf("grant %d: token %d not above %d", i, r.l.Token(), cur.Token())
				}
				cur = r.l
			}
			if err := cur.Release(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestHandoffReleasedEndsBeforeHanded checks "the holder's context ends
// before anyone else is granted" for the handoff: the head of the
// line is granted in this process, so when its Acquire returns, the released
// lease's context must already be done. transfer hands the lease to the head
// (Hand) before Release ends the old lease (its deferred End), so the head
// can run with the lock while the old holder's context is still live. The
// window is short (the releaser's return from transfer to its deferred End),
// so each of many handoffs (420) checks it once, in chains of 7 (below maxChain,
// whose end is not poked without notifications) on fresh names; any handoff
// that sees both alive fails. With the old lease ended before Hand, no
// interleaving can fail it.
func TestHandoffReleasedEndsBeforeHanded(t *testing.T) {
	ctx := context.Background()
	a := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
	seen, total := 0, 0
	var first string
	// More Ps than CPUs: an idle P takes the woken head sooner, as on a
	// larger machine, which makes the window more likely to show.
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(8))
	for chain := 0; chain < 60; chain++ {
		name := fencetest.Name("handoff-end-order")
		cur := mustGrant(t, ctx, a, name, time.Minute)
		for i := 0; i < 7; i++ {
			old := cur
			type res struct {
				l          fence.Lease
				err        error
				oldCtxLive bool
			}
			ch := make(chan res, 1)
			go func() {
				l, err := a.Acquire(ctx, name, time.Minute)
				ch <- res{l, err, old.Context().Err() == nil}
			}()
			waitLine(t, a, name, 1)
			waitHeadIdle(t, a, name)
			if err := old.Release(ctx); err != nil {
				t.Fatal(err)
			}
			r := <-ch
			if r.err != nil {
				t.Fatal(r.err)
			}
			total++
			if r.oldCtxLive {
				seen++
				if first == "" {
					first = fmt.Sprintf("token %d handed while token %d's context was live", r.l.Token(), old.Token())
				}
			}
			cur = r.l
		}
		cur.Release(ctx)
	}
	if seen > 0 {
		t.Fatalf("in %d of %d handoffs the head returned from Acquire holding the lock while the released lease's context was still live (first: %s)", seen, total, first)
	}
}

// TestHandoffMaxToken checks that a handoff whose grant would pass
// fence.MaxToken releases the lease (Release returns nil, the row is free)
// and that the head learns of the exhausted counter (ErrTokensExhausted)
// instead of waiting.
func TestHandoffMaxToken(t *testing.T) {
	_, my := openMySQL(t, "")
	for dialect, fdb := range map[string]*sqlfence.DB{"postgres": sqlfence.Pgx(pgPool(t, pgOpts{})), "mysql": my} {
		t.Run(dialect, func(t *testing.T) { checkHandoffMaxToken(t, fdb) })
	}
}

func checkHandoffMaxToken(t *testing.T, fdb *sqlfence.DB) {
	ctx := context.Background()
	a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("handoff-maxtoken")
	if err := a.Bump(ctx, name, fence.MaxToken-1); err != nil {
		t.Fatal(err)
	}
	h := mustGrant(t, ctx, a, name, time.Minute)
	if h.Token() != fence.MaxToken {
		t.Fatalf("token %d, want MaxToken", h.Token())
	}
	head := goAcquire(ctx, a, name, time.Minute)
	waitLine(t, a, name, 1)
	waitHeadIdle(t, a, name)
	if err := h.Release(ctx); err != nil {
		t.Fatalf("Release at MaxToken with a waiting head: %v", err)
	}
	r := within(t, head, 10*time.Second, "the head")
	if r.l != nil || !errors.Is(r.err, fence.ErrTokensExhausted) {
		t.Fatalf("the head: %v, %v; want ErrTokensExhausted", r.l, r.err)
	}
	info, err := a.Inspect(ctx, name)
	if err != nil || info.Held || info.Counter != fence.MaxToken {
		t.Fatalf("the row: %+v, %v; want free at MaxToken", info, err)
	}
}

// TestHandoffTTLs checks that each handed lease carries its own
// waiter's ttl (on the server), with two waiters of different
// ttls, through database/sql (sqlfence.Postgres) as well as a pgx pool and
// on MySQL (where each handed token is one above the one before), and that
// the line order holds across the handoffs.
func TestHandoffTTLs(t *testing.T) {
	for _, style := range []string{"pgx", "database/sql", "mysql"} {
		t.Run(style, func(t *testing.T) {
			ctx := context.Background()
			c := &stmtCounter{}
			var a, check *sqlfence.Acquirer
			switch style {
			case "pgx":
				a = newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, c)), &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
			case "database/sql":
				a = newAcquirerOn(t, sqlfence.Postgres(pgStd(t)), &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
			default:
				_, direct := openMySQL(t, "")
				check = newAcquirerOn(t, direct, nil)
				a = newAcquirerOn(t, sqlfence.MySQL(handoffMySQLDB(t, nil, "interpolateParams=true")), &sqlfence.AcquirerOptions{Backoff: idleHead})
			}
			if check == nil {
				check = a
			}
			name := fencetest.Name("handoff-ttls")
			h := mustGrant(t, ctx, a, name, time.Minute)
			w1 := goAcquire(ctx, a, name, 7*time.Second)
			waitLine(t, a, name, 1)
			waitHeadIdle(t, a, name)
			w2 := goAcquire(ctx, a, name, 40*time.Second)
			waitLine(t, a, name, 2)
			if err := h.Release(ctx); err != nil {
				t.Fatal(err)
			}
			r1 := leaseWithin(t, w1, 10*time.Second, "the first waiter")
			info, err := check.Inspect(ctx, name)
			if err != nil || info.Token != r1.l.Token() || info.TimeLeft > 7*time.Second || info.TimeLeft < 5*time.Second {
				t.Fatalf("after the first handoff: %+v, %v; want the first waiter's 7s", info, err)
			}
			if style == "mysql" {
				if ttl, ok := r1.l.(interface{ TTL() time.Duration }); !ok || ttl.TTL() != 7*time.Second {
					t.Fatalf("the first handed lease's ttl: want 7s (%v)", ok)
				}
			}
			waitLine(t, a, name, 1) // w2, now the head (it does not try at once after a grant to the head before it)
			if err := r1.l.Release(ctx); err != nil {
				t.Fatal(err)
			}
			r2 := leaseWithin(t, w2, 10*time.Second, "the second waiter")
			defer r2.l.Release(ctx)
			info, err = check.Inspect(ctx, name)
			if err != nil || info.Token != r2.l.Token() || info.TimeLeft < 35*time.Second {
				t.Fatalf("after the second handoff: %+v, %v; want the second waiter's 40s", info, err)
			}
			if style == "mysql" && (r2.l.Token() != r1.l.Token()+1 || r1.l.Token() != h.Token()+1) {
				t.Fatalf("tokens %d %d %d; want +1 each", h.Token(), r1.l.Token(), r2.l.Token())
			}
			if style == "pgx" && c.handoffs.Load() != 2 {
				t.Fatalf("%d handoff statements, want 2", c.handoffs.Load())
			}
		})
	}
}

// The handoff on MySQL/MariaDB. A release through
// an Acquirer whose own Acquire calls wait for the name grants the head in
// one UPDATE (token = LAST_INSERT_ID(token + 1)). Each test asserts a promise
// of the README or the doc comments against the real MariaDB server.

// TestHandoffLateGivenBack checks "a grant that comes back past [the
// head's local deadline] is given back": the handoff statement waits for the
// row (another transaction holds it) longer than the head's ttl. Release
// returns nil, the head is not handed a lease already lost, and it is
// granted at once (not after its backoff, an hour here), holding the row.
func TestHandoffLateGivenBack(t *testing.T) {
	for _, server := range handoffServers {
		t.Run(server, func(t *testing.T) {
			ctx := context.Background()
			var a, check *sqlfence.Acquirer
			owner, soon := "", 3*time.Second
			if server == "postgres" {
				owner, soon = "handoff-"+fencetest.Name("o"), 2*time.Second
				a = newAcquirerOn(t, sqlfence.Pgx(handoffPool(t, nil, owner, 0)), &sqlfence.AcquirerOptions{Owner: owner, Backoff: idleHead, DisableNotify: true})
				check = newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
			} else {
				_, direct := openMySQL(t, "")
				check = newAcquirerOn(t, direct, nil)
				a = newAcquirerOn(t, sqlfence.MySQL(handoffMySQLDB(t, nil, "")), &sqlfence.AcquirerOptions{Backoff: idleHead})
			}
			name := fencetest.Name("handoff-late-" + server)
			const ttl = 300 * time.Millisecond
			h := mustGrant(t, ctx, a, name, time.Minute)
			head := goAcquire(ctx, a, name, ttl)
			waitLine(t, a, name, 1)
			waitHeadIdle(t, a, name)
			released, start, unlock := releaseWhileLocked(t, server, name, owner, h)
			time.Sleep(2*ttl - time.Since(start)) // the scenario: the row stays locked past the head's ttl
			if err := unlock(); err != nil {
				t.Fatal(err)
			}
			if err := <-released; err != nil {
				t.Fatalf("the release whose handoff came back late: %v", err)
			}
			r := leaseWithin(t, head, 5*time.Second, "the head after a late handoff (not poked)")
			defer r.l.Release(ctx)
			if took := r.at.Sub(start); took > soon {
				t.Fatalf("the head was granted %v after the release began", took)
			}
			if server == "mysql" && r.l.Context().Err() != nil && r.at.Sub(start) < ttl {
				t.Fatalf("the head was handed a lease already lost")
			}
			info, err := check.Inspect(ctx, name)
			if err != nil || !info.Held || info.Token != r.l.Token() || r.l.Token() <= h.Token() {
				t.Fatalf("the row: %+v, %v; want held by the head's token %d (released %d)", info, err, r.l.Token(), h.Token())
			}
		})
	}
}

// handoffMySQLDB is a database/sql handle on the test MySQL server through px,
// with extra DSN parameters.
func handoffMySQLDB(t *testing.T, px *faultnet.Proxy, params string) *sql.DB {
	t.Helper()
	addr := ""
	if px != nil {
		addr = px.Addr()
	}
	db := mysqlDB(t, addr, params)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		t.Fatalf("open with %q: %v", params, err)
	}
	return db
}

// handoffMySQLSessions are DSN settings that change how names and owners
// reach the server: connection character
// sets, a non-strict mode, EMPTY_STRING_IS_NULL, clientFoundRows and
// client-side interpolation.
var handoffMySQLSessions = []string{
	"",
	"charset=utf8",
	"charset=latin1&sql_mode=" + url.QueryEscape("''"),
	"charset=utf8&sql_mode=" + url.QueryEscape("''") + "&interpolateParams=true",
	"clientFoundRows=true",
	"clientFoundRows=true&interpolateParams=true&charset=latin1",
	"sql_mode=" + url.QueryEscape("'STRICT_TRANS_TABLES,EMPTY_STRING_IS_NULL'"),
}

// TestHandoffMySQLNamesAndSessions: for each DSN setting and each pair of
// names a conversion could make one (4-byte UTF-8, trailing space, case),
// with an owner that has a 4-byte character: a handoff whose replies are all
// lost on name a is recognised by the head (by the owner's bytes), hands a
// token one above the released one, and leaves name b's lease alone; a plain
// handoff on b then hands b and leaves a's new holder alone.
func TestHandoffMySQLNamesAndSessions(t *testing.T) {
	ctx := context.Background()
	_, direct := openMySQL(t, "")
	check := newAcquirerOn(t, direct, nil)
	pairs := []struct{ what, a, b string }{
		{"4-byte vs ????", "X\U0001F600", "X????"},
		{"two 4-byte", "X\U0001F600", "X\U0001F601"},
		{"trailing space", "k", "k "},
		{"case", "Key", "key"},
	}
	for si, params := range handoffMySQLSessions {
		t.Run(fmt.Sprintf("session%d", si), func(t *testing.T) {
			t.Logf("DSN params: %q", params)
			px := faultnet.Start(t, mysqlAddr(t))
			owner := "mysql-\U0001F600-" + fencetest.Name("o")
			// Without the bell: its ringer's reads of the row carry the
			// name too, and would take the faults meant for the handoff.
			a := newAcquirerOn(t, sqlfence.MySQL(handoffMySQLDB(t, px, params)), &sqlfence.AcquirerOptions{Owner: owner, Backoff: idleHead, DisableNotify: true})
			for _, p := range pairs {
				t.Run(p.what, func(t *testing.T) {
					na, nb := unique(p.a, p.b)
					// b first, so that a request carrying a's bytes is a's
					// (with "k"/"k " b's name contains a's).
					la := mustGrant(t, ctx, a, na, time.Minute)
					lb, err := a.TryAcquire(ctx, nb, time.Minute)
					if err != nil {
						t.Fatalf("TryAcquire %q while %q is held: %v (one row?)", nb, na, err)
					}
					headA := goAcquire(ctx, a, na, 45*time.Second)
					waitLine(t, a, na, 1)
					waitHeadIdle(t, a, na)
					for range 7 {
						px.LoseReply(carrying(na))
					}
					err = la.Release(ctx)
					pending := px.Pending()
					if !errors.Is(err, fence.ErrUnknown) || pending != 0 {
						t.Fatalf("Release of %q with its replies lost: %v (%d faults left); want ErrUnknown with all 7 taken (the test did not test it)", na, err, pending)
					}
					r := leaseWithin(t, headA, 15*time.Second, "the head of "+na+" (did not recognise the handoff's grant)")
					if r.l.Token() != la.Token()+1 || r.l.Name() != na {
						t.Fatalf("handed %q token %d, want %q token %d", r.l.Name(), r.l.Token(), na, la.Token()+1)
					}
					ia, err := check.Inspect(ctx, na)
					if err != nil || !ia.Held || ia.Token != r.l.Token() || ia.Owner != owner || ia.TimeLeft > 45*time.Second || ia.TimeLeft < 35*time.Second {
						t.Fatalf("row %q after the handoff: %+v, %v; want held by %q token %d for ~45s", na, ia, err, owner, r.l.Token())
					}
					ib, err := check.Inspect(ctx, nb)
					if err != nil || !ib.Held || ib.Token != lb.Token() || ib.TimeLeft < 50*time.Second {
						t.Fatalf("row %q after the handoff on %q: %+v, %v; want still held by token %d (one row?)", nb, na, ib, err, lb.Token())
					}
					// A plain handoff on b.
					headB := goAcquire(ctx, a, nb, 20*time.Second)
					waitLine(t, a, nb, 1)
					waitHeadIdle(t, a, nb)
					if err := lb.Release(ctx); err != nil {
						t.Fatalf("Release %q: %v", nb, err)
					}
					rb := leaseWithin(t, headB, 10*time.Second, "the head of "+nb)
					if rb.l.Token() != lb.Token()+1 {
						t.Fatalf("handed %q token %d, want %d", nb, rb.l.Token(), lb.Token()+1)
					}
					ib, err = check.Inspect(ctx, nb)
					if err != nil || !ib.Held || ib.Token != rb.l.Token() || ib.TimeLeft > 20*time.Second || ib.TimeLeft < 15*time.Second {
						t.Fatalf("row %q after its handoff: %+v, %v; want token %d for ~20s", nb, ib, err, rb.l.Token())
					}
					ia, err = check.Inspect(ctx, na)
					if err != nil || !ia.Held || ia.Token != r.l.Token() {
						t.Fatalf("row %q after the handoff on %q: %+v, %v; want still token %d", na, nb, ia, err, r.l.Token())
					}
					if err := r.l.Release(ctx); err != nil {
						t.Errorf("Release handed %q: %v", na, err)
					}
					if err := rb.l.Release(ctx); err != nil {
						t.Errorf("Release handed %q: %v", nb, err)
					}
				})
			}
		})
	}
}

// TestHandoffMySQLKilled: the handoff statement waits for the row and is
// killed from another session (KILL QUERY, KILL CONNECTION). Whatever
// Release returns must agree with the row (an unknown outcome is never reported as definite): nil only if the row
// was handed to the head; a definite error (neither nil nor ErrUnknown) only
// if the row is still the released lease's; never ErrLost (the lease held
// the row). And the head must not be left waiting on a row that was handed
// to it.
func TestHandoffMySQLKilled(t *testing.T) {
	for _, kill := range []string{"KILL QUERY", "KILL CONNECTION"} {
		t.Run(strings.ReplaceAll(kill, " ", "_"), func(t *testing.T) {
			ctx := context.Background()
			raw, direct := openMySQL(t, "")
			check := newAcquirerOn(t, direct, nil)
			a := newAcquirerOn(t, sqlfence.MySQL(handoffMySQLDB(t, nil, "")), &sqlfence.AcquirerOptions{Backoff: idleHead})
			name := fencetest.Name("handoff-my-kill")
			h := mustGrant(t, ctx, a, name, time.Minute)
			hctx, hcancel := context.WithCancel(ctx)
			defer hcancel()
			head := goAcquire(hctx, a, name, time.Minute)
			waitLine(t, a, name, 1)
			waitHeadIdle(t, a, name)
			tx := lockRowMySQL(t, raw, name)
			released := make(chan error, 1)
			go func() { released <- h.Release(ctx) }()
			id := mysqlHandoffWaiting(t, raw, tx)
			if _, err := raw.ExecContext(ctx, fmt.Sprintf("%s %d", kill, id)); err != nil {
				t.Fatal(err)
			}
			time.Sleep(200 * time.Millisecond) // a retried statement queues behind the lock again
			if err := tx.Rollback(); err != nil {
				t.Fatal(err)
			}
			var rerr error
			select {
			case rerr = <-released:
			case <-time.After(20 * time.Second):
				t.Fatal("Release did not return")
			}
			info, err := check.Inspect(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: Release = %v; row %+v (released token %d)", kill, rerr, info, h.Token())
			handed := info.Held && info.Token == h.Token()+1
			still := info.Held && info.Token == h.Token()
			switch {
			case errors.Is(rerr, fence.ErrLost):
				t.Fatalf("Release = %v: ErrLost for a lease that held the row", rerr)
			case rerr == nil && !handed:
				t.Fatalf("Release = nil, but the row is %+v, not handed", info)
			case rerr != nil && !errors.Is(rerr, fence.ErrUnknown) && !still:
				t.Fatalf("Release = %v (definite), but the row changed: %+v", rerr, info)
			}
			if handed {
				r := within(t, head, 10*time.Second, "the head, whose handoff landed")
				if r.err != nil || r.l.Token() != info.Token {
					t.Fatalf("the head: %v, %v; want the handed token %d", r.l, r.err, info.Token)
				}
				r.l.Release(ctx)
			} else {
				hcancel()
				<-head
			}
		})
	}
}

// TestHandoffMySQLHeadCancelSweep: the head's ctx ends at every moment around a
// handoff (the proxy adds latency, so that the cancel lands before, during
// and after the statement). Whatever the head returns, nobody keeps a free
// lock: a lease returned to the head is the row's, and otherwise the next
// waiter of the line (whose backoff is an hour: only a poke or a handoff
// wakes it) is granted within 10s; never after a ttl (a minute). Tokens grow.
func TestHandoffMySQLHeadCancelSweep(t *testing.T) {
	ctx := context.Background()
	_, direct := openMySQL(t, "")
	check := newAcquirerOn(t, direct, nil)
	px := faultnet.Start(t, mysqlAddr(t))
	px.Latency(2*time.Millisecond, 8*time.Millisecond)
	a := newAcquirerOn(t, sqlfence.MySQL(handoffMySQLDB(t, px, "")), &sqlfence.AcquirerOptions{Backoff: idleHead})
	var headGot, headGaveUp int
	for i := range 40 {
		name := fencetest.Name("handoff-my-sweep")
		h := mustGrant(t, ctx, a, name, time.Minute)
		hctx, hcancel := context.WithCancel(ctx)
		head := goAcquire(hctx, a, name, time.Minute)
		waitLine(t, a, name, 1)
		waitHeadIdle(t, a, name)
		next := goAcquire(ctx, a, name, time.Minute)
		waitLine(t, a, name, 2)
		delay := time.Duration(i%20) * 2 * time.Millisecond
		released := make(chan error, 1)
		go func() { released <- h.Release(ctx) }()
		time.Sleep(delay)
		hcancel()
		hr := within(t, head, 10*time.Second, "the head whose ctx ended")
		if err := <-released; err != nil {
			t.Fatalf("iteration %d: Release: %v", i, err)
		}
		if hr.err == nil {
			headGot++
			info, err := check.Inspect(ctx, name)
			if err != nil || !info.Held || info.Token != hr.l.Token() || hr.l.Token() <= h.Token() {
				t.Fatalf("iteration %d (cancel after %v): the head returned token %d but the row is %+v, %v", i, delay, hr.l.Token(), info, err)
			}
			if err := hr.l.Release(ctx); err != nil {
				t.Fatalf("iteration %d: the head's release: %v", i, err)
			}
		} else {
			headGaveUp++
			if !errors.Is(hr.err, fence.ErrHeld) {
				t.Fatalf("iteration %d: the head: %v, want ErrHeld", i, hr.err)
			}
		}
		nr := within(t, next, 10*time.Second, fmt.Sprintf("iteration %d (cancel %v after the release began; head: %v): the next waiter (a free lock kept by a head that left, or not poked)", i, delay, hr.err))
		if nr.err != nil {
			t.Fatalf("iteration %d: the next waiter: %v", i, nr.err)
		}
		if nr.l.Token() <= h.Token() {
			t.Fatalf("iteration %d: token %d after %d", i, nr.l.Token(), h.Token())
		}
		info, err := check.Inspect(ctx, name)
		if err != nil || !info.Held || info.Token != nr.l.Token() {
			t.Fatalf("iteration %d: the row %+v, %v; want the next waiter's token %d", i, info, err, nr.l.Token())
		}
		nr.l.Release(ctx)
	}
	t.Logf("the head was granted %d times, gave up %d times", headGot, headGaveUp)
}

// TestHandoffMySQLExclusion: many names, several waiters per name in two
// Acquirers whose connections are cut at random (replies lost, requests
// dropped), with TryAcquire, Renew and Inspect from a third Acquirer on a
// direct connection. No two holders of a name are ever live at once, and
// each holder's token is larger than every earlier one for its name.
func TestHandoffMySQLExclusion(t *testing.T) {
	ctx := context.Background()
	_, direct := openMySQL(t, "")
	other := newAcquirerOn(t, direct, nil)
	var acqs []*sqlfence.Acquirer
	for range 2 {
		px := faultnet.Start(t, mysqlAddr(t))
		db := handoffMySQLDB(t, px, "")
		px.CutRate(0.01) // after the first connection's ping, which a cut would fail
		acqs = append(acqs, newAcquirerOn(t, sqlfence.MySQL(db), &sqlfence.AcquirerOptions{
			Backoff: fence.Backoff{Min: time.Millisecond, Max: 20 * time.Millisecond}}))
	}
	const names = 4
	type state struct {
		mu      sync.Mutex
		holders int
		last    fence.Token
		grants  int
	}
	var st [names]state
	var nameOf [names]string
	for i := range names {
		nameOf[i] = fencetest.Name("handoff-my-excl")
	}
	var violations atomic.Int64
	var firstViolation atomic.Value
	violate := func(s string) {
		if violations.Add(1) == 1 {
			firstViolation.Store(s)
		}
	}
	enter := func(i int, l fence.Lease, who string) bool {
		s := &st[i]
		s.mu.Lock()
		defer s.mu.Unlock()
		if l.Context().Err() != nil {
			return false // already lost locally: holds nothing
		}
		s.holders++
		s.grants++
		if s.holders > 1 {
			violate(fmt.Sprintf("%s: %s token %d granted while another holder is live", nameOf[i], who, l.Token()))
		}
		if l.Token() <= s.last {
			violate(fmt.Sprintf("%s: %s token %d after %d", nameOf[i], who, l.Token(), s.last))
		}
		s.last = l.Token()
		return true
	}
	leave := func(i int) {
		st[i].mu.Lock()
		st[i].holders--
		st[i].mu.Unlock()
	}
	var unknown atomic.Int64
	deadline := time.Now().Add(8 * time.Second)
	var wg sync.WaitGroup
	for ai, a := range acqs {
		for w := range 3 * names {
			wg.Add(1)
			go func() {
				defer wg.Done()
				i := w % names
				for time.Now().Before(deadline) {
					actx, cancel := context.WithTimeout(ctx, 2*time.Second+time.Duration(rand.IntN(1000))*time.Millisecond)
					l, err := a.Acquire(actx, nameOf[i], 3*time.Second)
					cancel()
					if err != nil {
						continue
					}
					if enter(i, l, fmt.Sprintf("acquirer %d", ai)) {
						time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond)
						if rand.IntN(4) == 0 {
							_ = l.Renew(ctx)
						}
						if l.Context().Err() != nil {
							// Lost locally while in the section: the others
							// may be granted from here on.
						}
						leave(i)
					}
					if err := l.Release(ctx); errors.Is(err, fence.ErrUnknown) {
						unknown.Add(1)
					}
				}
			}()
		}
	}
	for i := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) {
				if l, err := other.TryAcquire(ctx, nameOf[i], 2*time.Second); err == nil {
					if enter(i, l, "TryAcquire of another acquirer") {
						time.Sleep(time.Millisecond)
						leave(i)
					}
					_ = l.Release(ctx)
				}
				_, _ = other.Inspect(ctx, nameOf[i])
				time.Sleep(time.Duration(rand.IntN(5)) * time.Millisecond)
			}
		}()
	}
	wg.Wait()
	for i := range names {
		t.Logf("%s: %d grants, last token %d", nameOf[i], st[i].grants, st[i].last)
	}
	t.Logf("%d releases returned ErrUnknown", unknown.Load())
	if n := violations.Load(); n > 0 {
		t.Fatalf("%d violations; first: %v", n, firstViolation.Load())
	}
}

// TestHandoffMySQLReleaseCtxEnds: the releaser's ctx ends while its
// handoff statement waits for the row (another transaction holds it). The
// MySQL driver then closes the connection without stopping the statement on
// the server, which may land once the row is free. Release must say
// ErrUnknown, and a handoff that landed is the head's (it must be granted
// at once, not wait for the grant's ttl). (With the head gone as well:
// TestHandoffMySQLOrphanOutlivesReleasedTTL, which fails.)
func TestHandoffMySQLReleaseCtxEnds(t *testing.T) {
	for _, headGone := range []bool{false} {
		t.Run(fmt.Sprintf("headGone=%v", headGone), func(t *testing.T) {
			ctx := context.Background()
			raw, direct := openMySQL(t, "")
			check := newAcquirerOn(t, direct, &sqlfence.AcquirerOptions{Backoff: fence.Backoff{Min: 5 * time.Millisecond, Max: 20 * time.Millisecond}})
			a := newAcquirerOn(t, sqlfence.MySQL(handoffMySQLDB(t, nil, "")), &sqlfence.AcquirerOptions{Backoff: idleHead})
			name := fencetest.Name("handoff-my-relctx")
			h := mustGrant(t, ctx, a, name, time.Minute)
			hctx, hcancel := context.WithCancel(ctx)
			defer hcancel()
			head := goAcquire(hctx, a, name, time.Minute)
			waitLine(t, a, name, 1)
			waitHeadIdle(t, a, name)
			tx := lockRowMySQL(t, raw, name)
			rctx, rcancel := context.WithTimeout(ctx, 300*time.Millisecond)
			defer rcancel()
			released := make(chan error, 1)
			go func() { released <- h.Release(rctx) }()
			mysqlHandoffWaiting(t, raw, tx)
			if headGone {
				hcancel()
			}
			rerr := <-released
			if !errors.Is(rerr, fence.ErrUnknown) {
				t.Errorf("Release whose ctx ended during the handoff: %v, want ErrUnknown", rerr)
			}
			time.Sleep(500 * time.Millisecond)
			if err := tx.Rollback(); err != nil {
				t.Fatal(err)
			}
			time.Sleep(200 * time.Millisecond)
			info, _ := check.Inspect(ctx, name)
			t.Logf("Release = %v; row after the blocker's rollback: %+v (released %d)", rerr, info, h.Token())
			if !headGone {
				select {
				case r := <-head:
					if r.err != nil {
						t.Fatalf("the head: %v", r.err)
					}
					defer r.l.Release(ctx)
					info, err := check.Inspect(ctx, name)
					if err != nil || info.Token != r.l.Token() || !info.Held {
						t.Fatalf("the head holds %d, the row %+v, %v", r.l.Token(), info, err)
					}
				case <-time.After(10 * time.Second):
					info, _ := check.Inspect(ctx, name)
					if info.Held && info.Token == h.Token() {
						t.Logf("the handoff never landed: the row is the released lease's until its ttl (allowed after ErrUnknown)")
						return
					}
					t.Fatalf("the head was not granted within 10s, the row is %+v (released %d): a handoff that landed after the head's hinted attempt is held by nobody for the head's ttl", info, h.Token())
				}
				return
			}
			r := within(t, head, 5*time.Second, "the head whose ctx ended")
			if r.err == nil {
				r.l.Release(ctx)
			}
			bctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			l, err := check.Acquire(bctx, name, time.Minute)
			if err != nil {
				info, _ := check.Inspect(ctx, name)
				if info.Held && info.Token == h.Token() {
					t.Logf("the handoff never landed: the row is the released lease's until its ttl (allowed after ErrUnknown)")
					return
				}
				t.Fatalf("another acquirer 10s after a handoff to a head that left: %v; row %+v (released %d): the grant made for the head that left is not given back", err, info, h.Token())
			}
			l.Release(ctx)
		})
	}
}

// TestHandoffMySQLOrphanOutlivesReleasedTTL: a handoff that runs on in the
// server after both its head and its releaser gave up must not hold the row
// past the released lease's ttl.
//
// Release documents: "when it cannot know it returns an error matching
// fence.ErrUnknown (the lease then ends on the server by its ttl at the
// latest)", and transfer.go: "a head that gave up while the statement ran
// gets nothing, and the releaser gives the grant back at once (also one
// whose reply was lost, if a read finds it)"; a waiter that left
// must not keep a free lock for a ttl.
//
// The released lease has a 5s ttl; the head asks for a minute. The handoff
// statement waits for the row (another transaction holds it for 3s); the
// head's ctx ends, then the releaser's (300ms). On MySQL the driver only
// closes the socket on a ctx's end: the statement stays queued on the
// server. The releaser's give-back (giveBack: a locked read, 2s at most)
// times out behind the same row lock and settles nothing; Release returns
// ErrUnknown. When the blocker ends, the orphaned handoff lands and grants
// the row to the head that left, for the head's ttl (a minute): nobody holds
// it, and nobody else is granted for a minute, long past the released
// lease's 5s ttl that ErrUnknown promised as the bound.
//
// Why it can happen: a give-back that is one read after the ctx ended
// relies on the statement being over by then, which holds on PostgreSQL
// (pgx cancels the statement on the server) but not with
// go-sql-driver/mysql, which leaves it running; and the handoff grants the
// head's ttl, not bounded by the released lease's. settleHandoff
// (transfer.go) therefore keeps settling such a handoff in the background
// until it can no longer grant.
func TestHandoffMySQLOrphanOutlivesReleasedTTL(t *testing.T) {
	ctx := context.Background()
	raw, direct := openMySQL(t, "")
	check := newAcquirerOn(t, direct, &sqlfence.AcquirerOptions{Backoff: fence.Backoff{Min: 5 * time.Millisecond, Max: 50 * time.Millisecond}})
	a := newAcquirerOn(t, sqlfence.MySQL(handoffMySQLDB(t, nil, "")), &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("handoff-my-orphan")
	const hTTL = 5 * time.Second
	granted := time.Now()
	h := mustGrant(t, ctx, a, name, hTTL)
	hctx, hcancel := context.WithCancel(ctx)
	defer hcancel()
	head := goAcquire(hctx, a, name, time.Minute)
	waitLine(t, a, name, 1)
	waitHeadIdle(t, a, name)
	tx := lockRowMySQL(t, raw, name)
	blocked := time.Now()
	rctx, rcancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer rcancel()
	released := make(chan error, 1)
	go func() { released <- h.Release(rctx) }()
	mysqlHandoffWaiting(t, raw, tx)
	hcancel()
	if r := within(t, head, 2*time.Second, "the head whose ctx ended"); r.l != nil {
		t.Fatalf("the head whose ctx ended got %d", r.l.Token())
	}
	time.Sleep(3*time.Second - time.Since(blocked))
	if err := tx.Rollback(); err != nil {
		t.Fatal(err)
	}
	rerr := <-released
	if !errors.Is(rerr, fence.ErrUnknown) {
		t.Fatalf("Release whose ctx ended during the handoff: %v, want ErrUnknown", rerr)
	}
	// ErrUnknown's bound: the released lease's ttl from its grant (+ 3s margin).
	bctx, cancel := context.WithDeadline(ctx, granted.Add(hTTL+3*time.Second))
	defer cancel()
	l, err := check.Acquire(bctx, name, time.Minute)
	if err != nil {
		info, _ := check.Inspect(ctx, name)
		t.Fatalf("another acquirer %v after the released lease's grant (its ttl %v): %v; row %+v (released token %d): the orphaned handoff granted the head that left for its own ttl, and nobody gave it back", time.Since(granted).Round(time.Millisecond), hTTL, err, info, h.Token())
	}
	l.Release(ctx)
}

// The handoff to a head that is inside an attempt
// of its own (wakeup.Line.Offer, Hand and the take-back timer), against the
// real PostgreSQL server.

// stmtGate holds the first statement that match accepts after arm, until
// open is closed or the statement's context ends.
type stmtGate struct {
	match   func(sql string) bool
	armed   atomic.Bool
	seen    atomic.Int64 // the statements match accepted, armed or not
	started chan struct{}
	open    chan struct{}
	once    sync.Once
}

func newStmtGate(match func(string) bool) *stmtGate {
	return &stmtGate{match: match, started: make(chan struct{}), open: make(chan struct{})}
}

func (g *stmtGate) release() { g.once.Do(func() { close(g.open) }) }

// gateTracer runs each of its gates on every statement a connection starts.
type gateTracer []*stmtGate

func (tr gateTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	for _, g := range tr {
		if !g.match(d.SQL) {
			continue
		}
		g.seen.Add(1)
		if g.armed.CompareAndSwap(true, false) {
			close(g.started)
			select {
			case <-g.open:
			case <-ctx.Done():
			}
		}
	}
	return ctx
}

func (gateTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func isGrantStmt(sql string) bool {
	return strings.Contains(sql, "INSERT INTO") && strings.Contains(sql, "RETURNING token")
}

func isHandoffStmt(sql string) bool { return strings.HasPrefix(sql, "WITH g AS (UPDATE") }

// waitUntil waits up to d for f to report true, polling an observable state.
func waitUntil(t *testing.T, d time.Duration, what string, f func() bool) {
	t.Helper()
	for end := time.Now().Add(d); !f(); {
		if time.Now().After(end) {
			t.Fatalf("%s: not within %v", what, d)
		}
		time.Sleep(2 * time.Millisecond) // polling a state
	}
}

// lineStacks returns the stacks of the goroutines that are inside the
// line's code, for a failure's evidence.
func lineStacks() string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, "internal/wakeup") {
			out = append(out, g)
		}
	}
	return strings.Join(out, "\n\n")
}

// waitRowFree waits until check shows name not held (a lease expired on the
// server).
func waitRowFree(t *testing.T, check *sqlfence.Acquirer, name string) {
	t.Helper()
	waitUntil(t, 10*time.Second, "the row to expire on the server", func() bool {
		info, err := check.Inspect(context.Background(), name)
		if err != nil {
			t.Fatal(err)
		}
		return !info.Held
	})
}

// TestHandoffSecondOfferWhileHeadTries checks the promise of Hand ("never
// blocks: one offer at a time, and each outcome is received before the next
// offer") and Release's, that a release returns, now that Offer also offers
// to a head inside an attempt of its own.
//
// The head's attempt is stuck in its grant statement (a slow connection,
// well under the stall limit). A release through the acquirer of a lease
// that had expired on the server offers to that head, finds nothing to hand
// over (ErrLost) and hands it an empty outcome, which waits in the head's
// channel until its attempt ends. The lock is free, so a TryAcquire through
// the same acquirer is granted; its Release offers to the same head again
// (still trying, still young), grants it the lock, and Hand sends the second
// outcome into the full channel while holding the place's mutex. The head's
// attempt, when it ends, needs that mutex (Trying(false)) before it can
// drain the channel: Release and the head hang for ever, and so would the
// waiters behind the head (HeadStalled takes the same mutex).
func TestHandoffSecondOfferWhileHeadTries(t *testing.T) {
	ctx := context.Background()
	grant := newStmtGate(isGrantStmt)
	a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, gateTracer{grant})), &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
	t.Cleanup(grant.release) // before the pool closes
	sqlfence.SetLineStall(a, time.Minute)
	check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	name := fencetest.Name("offer-second-offer")

	l1 := mustGrant(t, ctx, a, name, 300*time.Millisecond)
	grant.armed.Store(true)
	hctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	head := goAcquire(hctx, a, name, time.Minute)
	<-grant.started // the head is inside its first attempt
	if !sqlfence.LineHeadTrying(a, name) {
		t.Fatal("the head is not inside an attempt")
	}
	waitRowFree(t, check, name)
	if err := l1.Release(ctx); !errors.Is(err, fence.ErrLost) {
		t.Fatalf("Release of a lease expired on the server: %v, want ErrLost", err)
	}
	l2, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatalf("TryAcquire of the free lock while the head's attempt is stuck: %v", err)
	}
	released := make(chan error, 1)
	go func() { released <- l2.Release(ctx) }()
	select {
	case err := <-released:
		if err != nil {
			t.Fatalf("the second release: %v", err)
		}
	case <-time.After(5 * time.Second):
		grant.release()
		select {
		case <-head:
			t.Fatal("the second release through the acquirer did not return within 5s while the head was inside its attempt")
		case <-time.After(5 * time.Second):
		}
		t.Fatalf("the second release through the acquirer did not return within 5s while the head was inside its attempt (an empty handoff already waited in its channel: Hand blocks on the full channel holding the place's mutex); the head, unstuck, did not return either 5s later (deadlock: its attempt waits for that mutex); line %d; goroutines in the line:\n%s", sqlfence.LineLen(a, name), lineStacks())
	}
	grant.release()
	r := leaseWithin(t, head, 10*time.Second, "the head after its attempt ended")
	defer r.l.Release(ctx)
	info, err := check.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != r.l.Token() {
		t.Fatalf("the row: %+v, %v; want held by the head's token %d", info, err, r.l.Token())
	}
}

// TestHandoffLateGrantYields checks ErrYield's promise (wakeup.ErrYield,
// Acquire: "Granted past its local deadline and given back: try again, after
// the others of the line and a full backoff delay"): a head whose grant
// comes back past its local deadline lets the waiters behind it go first.
//
// The head's grant statement is held up longer than the head's ttl; the
// lock is free, so the grant lands late. tryAcquire gives it back
// (giveBackLate → Release), and that release, through the same acquirer,
// now offers to the head of the line, which is the head itself, inside the
// very attempt that is giving the grant back (a young attempt: the stall
// limit is a minute). The release hands the lock straight back to the head;
// its attempt then yields (moves it behind the next waiter), but it takes
// the handoff from its channel and returns a lease at once, ahead of the
// waiter it yielded to, which is still waiting.
func TestHandoffLateGrantYields(t *testing.T) {
	ctx := context.Background()
	grant, handoffs := newStmtGate(isGrantStmt), newStmtGate(isHandoffStmt)
	a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, gateTracer{grant, handoffs})), &sqlfence.AcquirerOptions{
		Backoff: fence.Backoff{Min: 20 * time.Millisecond, Max: 50 * time.Millisecond, MaxWait: time.Minute}, DisableNotify: true})
	t.Cleanup(grant.release)
	sqlfence.SetLineStall(a, time.Minute)
	check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	name := fencetest.Name("offer-late-yield")
	const ttl = 200 * time.Millisecond

	// Another acquirer holds the lock, so the head's release is not a
	// handoff and the second waiter joins behind a head stuck in its grant.
	other := mustGrant(t, ctx, check, name, time.Minute)
	grant.armed.Store(true)
	head := goAcquire(ctx, a, name, ttl)
	<-grant.started
	next := goAcquire(ctx, a, name, time.Minute)
	waitLine(t, a, name, 2)
	if err := other.Release(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * ttl) // the scenario: the head's grant statement is held up past its ttl
	grant.release()

	// The head's grant lands late and is given back; the next waiter is to
	// be granted before the head.
	var first string
	var rh, rn acquired
	select {
	case rh = <-head:
		first = "head"
	case rn = <-next:
		first = "next"
	case <-time.After(10 * time.Second):
		t.Fatalf("neither waiter granted 10s after the late grant (line %d)", sqlfence.LineLen(a, name))
	}
	if first == "head" {
		if rh.err != nil {
			t.Fatalf("the head: %v", rh.err)
		}
		info, _ := check.Inspect(ctx, name)
		n := handoffs.seen.Load()
		_ = rh.l.Release(ctx)
		rn = within(t, next, 10*time.Second, "the next waiter")
		if rn.err == nil {
			_ = rn.l.Release(ctx)
		}
		t.Fatalf("the head whose grant came back past its ttl was granted first (token %d; row %+v; %d handoff statements ran, none released through the acquirer but the head's own give-back) while the waiter behind it still waited: it did not yield (its own give-back handed the lock back to it)", rh.l.Token(), info, n)
	}
	if rn.err != nil {
		t.Fatalf("the next waiter: %v", rn.err)
	}
	_ = rn.l.Release(ctx)
	rh = within(t, head, 10*time.Second, "the head after the next waiter's release")
	if rh.err != nil {
		t.Fatal(rh.err)
	}
	_ = rh.l.Release(ctx)
}

// TestHandoffOwnGrantDuringOffer checks that an offer to a head inside an
// attempt cannot leave two holders or a grant held by nobody: the head's own
// grant lands while the handoff statement is on its way (the released lease
// had expired on the server). The head returns its own grant, which the row
// shows; the release reports ErrLost (it held nothing) and hands nothing.
func TestHandoffOwnGrantDuringOffer(t *testing.T) {
	ctx := context.Background()
	grant, handoff := newStmtGate(isGrantStmt), newStmtGate(isHandoffStmt)
	a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, gateTracer{grant, handoff})), &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
	t.Cleanup(grant.release)
	t.Cleanup(handoff.release)
	sqlfence.SetLineStall(a, time.Minute)
	check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	name := fencetest.Name("offer-own-grant")
	l1 := mustGrant(t, ctx, a, name, 300*time.Millisecond)
	grant.armed.Store(true)
	head := goAcquire(ctx, a, name, time.Minute)
	<-grant.started
	waitRowFree(t, check, name)
	handoff.armed.Store(true)
	released := make(chan error, 1)
	go func() { released <- l1.Release(ctx) }()
	<-handoff.started // offered: the handoff statement is on its way
	grant.release()
	r := leaseWithin(t, head, 10*time.Second, "the head whose own grant landed during the offer")
	handoff.release()
	if err := <-released; !errors.Is(err, fence.ErrLost) {
		t.Fatalf("Release of a lease expired on the server (the head was granted meanwhile): %v, want ErrLost", err)
	}
	defer r.l.Release(ctx)
	if r.l.Context().Err() != nil {
		t.Fatalf("the head's lease is already done: %v", context.Cause(r.l.Context()))
	}
	info, err := check.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != r.l.Token() {
		t.Fatalf("the row: %+v, %v; want held by the head's own token %d", info, err, r.l.Token())
	}
	if n := sqlfence.LineLen(a, name); n != 0 {
		t.Fatalf("line has %d waiters after every Acquire returned", n)
	}
}

// TestHandoffTakeBackRace checks the take-back timer ("a handoff it has not
// taken within the stall limit is taken back and settled") against the head
// taking the handoff at about the same moment: the head's attempt is stuck
// while the release hands it the lock, and is let go at about the stall
// limit. Whatever wins, the head returns a lease that is live and that the
// row shows as its holder (not one the timer released), the release returns
// nil, and nothing is left held when the head releases.
func TestHandoffTakeBackRace(t *testing.T) {
	ctx := context.Background()
	const stall = 60 * time.Millisecond
	takenBack := 0
	defer func() { t.Logf("the timer took the handoff back in %d of 12 iterations", takenBack) }()
	for i := range 12 {
		grant := newStmtGate(isGrantStmt)
		plain := newStmtGate(func(sql string) bool { return strings.Contains(sql, "SET expires_at = 0") })
		a := newAcquirerOn(t, sqlfence.Pgx(tracedPool(t, gateTracer{grant, plain})), &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
		sqlfence.SetLineStall(a, stall)
		check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
		name := fencetest.Name("offer-take-back")
		l1 := mustGrant(t, ctx, a, name, time.Minute)
		grant.armed.Store(true)
		head := goAcquire(ctx, a, name, time.Minute)
		<-grant.started
		if err := l1.Release(ctx); err != nil {
			t.Fatalf("iteration %d: the release: %v", i, err)
		}
		// Let the head's attempt go at about the stall limit after the hand.
		time.Sleep(stall - 15*time.Millisecond + time.Duration(i)*3*time.Millisecond)
		grant.release()
		r := within(t, head, 10*time.Second, "the head")
		if r.err != nil {
			t.Fatalf("iteration %d: the head: %v", i, r.err)
		}
		if r.l.Context().Err() != nil {
			t.Fatalf("iteration %d: the head returned a lease already done: %v", i, context.Cause(r.l.Context()))
		}
		info, err := check.Inspect(ctx, name)
		if err != nil || !info.Held || info.Token != r.l.Token() {
			t.Fatalf("iteration %d: the row: %+v, %v; want held by the head's token %d", i, info, err, r.l.Token())
		}
		if plain.seen.Load() > 0 { // the timer's abandon released the handed lease
			takenBack++
		}
		if err := r.l.Release(ctx); err != nil {
			t.Fatalf("iteration %d: the head's release: %v", i, err)
		}
		if info, err := check.Inspect(ctx, name); err != nil || info.Held {
			t.Fatalf("iteration %d: the row after the head's release: %+v, %v", i, info, err)
		}
	}
}

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

// TestHandoffPostgresEndedAttemptHandedToItself (a waiter must not
// keep a free lock from the others; a handoff to a head inside an attempt of
// its own): a release through the Acquirer hands the lock to a head that is
// inside a slow attempt of its own (Line.Offer offers a head inside a
// younger attempt); when the attempt ends, the handed lease is already past
// its local deadline. AcquireHanded now settles it through abandon instead
// of returning it. But abandon releases it with lease.Release,
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
	l := mustGrant(t, ctx, a, name, time.Minute)
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
