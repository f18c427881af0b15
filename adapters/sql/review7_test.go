package sqlfence_test

// Review 7: tests that try to break the PostgreSQL handoff (commit 86ef842,
// adapters/sql/transfer.go, internal/wakeup/line.go): a release through an
// Acquirer whose own Acquire calls wait grants the lock to the head of that
// line in its own statement. Each test names the promise it checks.

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/internal/testenv"
)

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
	owner := "review7-" + fencetest.Name("o")
	a := newAcquirerOn(t, sqlfence.Pgx(handoffPool(t, px, owner, 0)), &sqlfence.AcquirerOptions{Owner: owner,
		Backoff: idleHead, DisableNotify: true})
	check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	name := fencetest.Name("review7-hint-deadline")
	const ttl = 3 * time.Second
	h, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	head := goAcquire(ctx, a, name, ttl)
	waitLine(t, a, name, 1)
	waitHeadIdle(t, a, name)

	px.ReplyWindow(1500 * time.Millisecond)
	px.LoseReply(carrying(name))
	rctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	sent := time.Now()
	err = h.Release(rctx)
	if !errors.Is(err, fence.ErrUnknown) {
		t.Fatalf("Release whose reply came after its context ended: %v, want ErrUnknown (the test did not test it)", err)
	}
	r := within(t, head, 20*time.Second, "the head")
	if r.err != nil {
		t.Fatal(r.err)
	}
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
// (transfer.go; HAZARDS 6: a waiter that left must not keep a free lock from
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
	ctx := context.Background()
	px := faultnet.Start(t, pgTarget(t))
	owner := "review7-" + fencetest.Name("o")
	a := newAcquirerOn(t, sqlfence.Pgx(handoffPool(t, px, owner, 0)), &sqlfence.AcquirerOptions{Owner: owner,
		Backoff: idleHead, DisableNotify: true})
	admin := pgPool(t, pgOpts{})
	b := newAcquirerOn(t, sqlfence.Pgx(admin), &sqlfence.AcquirerOptions{Backoff: fence.Backoff{Min: 5 * time.Millisecond, Max: 20 * time.Millisecond}})
	name := fencetest.Name("review7-gone-lost")
	h, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	hctx, hcancel := context.WithCancel(ctx)
	defer hcancel()
	head := goAcquire(hctx, a, name, time.Minute)
	waitLine(t, a, name, 1)
	waitHeadIdle(t, a, name)

	tx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SELECT 1 FROM fence_leases WHERE name = $1 FOR UPDATE", name); err != nil {
		t.Fatal(err)
	}
	// 4 handoff statements and the 3 reads after the 2nd to 4th.
	for range 7 {
		px.LoseReply(carrying(name))
	}
	released := make(chan error, 1)
	go func() { released <- h.Release(ctx) }()
	waitHandoffBlocked(t, admin, owner)
	hcancel()
	hr := within(t, head, 2*time.Second, "the head whose context ended during the handoff")
	if hr.l != nil || !errors.Is(hr.err, fence.ErrHeld) {
		t.Fatalf("the head whose context ended: %v, %v; want ErrHeld at once", hr.l, hr.err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	var rerr error
	select {
	case rerr = <-released:
	case <-time.After(30 * time.Second):
		t.Fatal("the release did not return within 30s")
	}
	if !errors.Is(rerr, fence.ErrUnknown) || px.Pending() != 0 {
		t.Fatalf("Release with every reply lost: %v (%d faults left), want ErrUnknown with all 7 taken (the test did not test it)", rerr, px.Pending())
	}
	info, err := b.Inspect(ctx, name)
	if err != nil {
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
}

// TestHandoffUncertainThenRefused checks HAZARDS 3 for the handoff: a
// release whose first handoff statement landed but whose reply was lost, and
// whose next attempt could not be sent (the connection is refused), must
// report an outcome matching fence.ErrUnknown, not a definite error (the
// transfer's default case says "Refused as a whole: nothing changed, l still
// holds"). The row shows that the release did land: the lock was granted to
// the head.
func TestHandoffUncertainThenRefused(t *testing.T) {
	ctx := context.Background()
	px := faultnet.Start(t, pgTarget(t))
	owner := "review7-" + fencetest.Name("o")
	a := newAcquirerOn(t, sqlfence.Pgx(handoffPool(t, px, owner, 1)), &sqlfence.AcquirerOptions{Owner: owner,
		Backoff: idleHead, DisableNotify: true})
	check := newAcquirerOn(t, sqlfence.Pgx(pgPool(t, pgOpts{})), nil)
	name := fencetest.Name("review7-refused")
	h, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	head := goAcquire(ctx, a, name, time.Minute)
	waitLine(t, a, name, 1)
	waitHeadIdle(t, a, name)
	px.Refuse(true) // the pool's one connection stays; a new one is refused
	px.LoseReply(carrying(name))
	err = h.Release(ctx)
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
			name := fencetest.Name("review7-chain-end")
			cur, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
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
// before anyone else is granted" (HAZARDS 2) for the handoff: the head of the
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
		name := fencetest.Name("review7-end-order")
		cur, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
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
	name := fencetest.Name("review7-maxtoken")
	if err := a.Bump(ctx, name, fence.MaxToken-1); err != nil {
		t.Fatal(err)
	}
	h, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
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
// ttls, through database/sql (sqlfence.Postgres) as well as a pgx pool, and
// that the line order holds across the handoffs.
func TestHandoffTTLs(t *testing.T) {
	for _, style := range []string{"pgx", "database/sql"} {
		t.Run(style, func(t *testing.T) {
			ctx := context.Background()
			c := &stmtCounter{}
			var fdb *sqlfence.DB
			if style == "pgx" {
				fdb = sqlfence.Pgx(tracedPool(t, c))
			} else {
				fdb = sqlfence.Postgres(pgStd(t))
			}
			a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Backoff: idleHead, DisableNotify: true})
			name := fencetest.Name("review7-ttls")
			h, err := a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			w1 := goAcquire(ctx, a, name, 7*time.Second)
			waitLine(t, a, name, 1)
			waitHeadIdle(t, a, name)
			w2 := goAcquire(ctx, a, name, 40*time.Second)
			waitLine(t, a, name, 2)
			if err := h.Release(ctx); err != nil {
				t.Fatal(err)
			}
			r1 := within(t, w1, 10*time.Second, "the first waiter")
			if r1.err != nil {
				t.Fatal(r1.err)
			}
			info, err := a.Inspect(ctx, name)
			if err != nil || info.Token != r1.l.Token() || info.TimeLeft > 7*time.Second || info.TimeLeft < 5*time.Second {
				t.Fatalf("after the first handoff: %+v, %v; want the first waiter's 7s", info, err)
			}
			waitLine(t, a, name, 1) // w2, now the head (it does not try at once after a grant to the head before it)
			if err := r1.l.Release(ctx); err != nil {
				t.Fatal(err)
			}
			r2 := within(t, w2, 10*time.Second, "the second waiter")
			if r2.err != nil {
				t.Fatal(r2.err)
			}
			defer r2.l.Release(ctx)
			info, err = a.Inspect(ctx, name)
			if err != nil || info.Token != r2.l.Token() || info.TimeLeft < 35*time.Second {
				t.Fatalf("after the second handoff: %+v, %v; want the second waiter's 40s", info, err)
			}
			if style == "pgx" && c.handoffs.Load() != 2 {
				t.Fatalf("%d handoff statements, want 2", c.handoffs.Load())
			}
		})
	}
}

// TestHandoffLateGivenBack checks "a grant that comes back past [the
// head's local deadline] is given back": the handoff statement waits for the
// row (another transaction holds it) longer than the head's ttl. Release
// returns nil, the head is not handed a lease already lost, and it is
// granted at once (not after its backoff, an hour here), holding the row.
func TestHandoffLateGivenBack(t *testing.T) {
	ctx := context.Background()
	owner := "review7-" + fencetest.Name("o")
	a := newAcquirerOn(t, sqlfence.Pgx(handoffPool(t, nil, owner, 0)), &sqlfence.AcquirerOptions{Owner: owner, Backoff: idleHead, DisableNotify: true})
	admin := pgPool(t, pgOpts{})
	check := newAcquirerOn(t, sqlfence.Pgx(admin), nil)
	name := fencetest.Name("review7-late")
	const ttl = 300 * time.Millisecond
	h, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	head := goAcquire(ctx, a, name, ttl)
	waitLine(t, a, name, 1)
	waitHeadIdle(t, a, name)
	tx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SELECT 1 FROM fence_leases WHERE name = $1 FOR UPDATE", name); err != nil {
		t.Fatal(err)
	}
	released := make(chan error, 1)
	start := time.Now()
	go func() { released <- h.Release(ctx) }()
	waitHandoffBlocked(t, admin, owner)
	time.Sleep(2*ttl - time.Since(start)) // the scenario: the row stays locked past the head's ttl
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-released; err != nil {
		t.Fatalf("the release whose handoff came back late: %v", err)
	}
	r := within(t, head, 5*time.Second, "the head after a late handoff")
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.l.Release(ctx)
	if took := r.at.Sub(start); took > 2*time.Second {
		t.Fatalf("the head was granted %v after the release began", took)
	}
	info, err := check.Inspect(ctx, name)
	if err != nil || !info.Held || info.Token != r.l.Token() || r.l.Token() <= h.Token() {
		t.Fatalf("the row: %+v, %v; want held by the head's token %d (released %d)", info, err, r.l.Token(), h.Token())
	}
}
