package sqlfence_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
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
)

// The MySQL bell (bell.go): the tests run two or more Acquirers
// (as separate processes would be) against the real server.

// bellWaitFor polls cond (an observable state) until it holds, failing the
// test after d.
func bellWaitFor(t *testing.T, d time.Duration, what string, cond func() bool, state ...func() string) {
	t.Helper()
	for end := time.Now().Add(d); !cond(); {
		if time.Now().After(end) {
			seen := ""
			for _, f := range state {
				seen += f()
			}
			t.Fatalf("%s: not within %v%s", what, d, seen)
		}
		time.Sleep(2 * time.Millisecond) // polling observable state
	}
}

// bellHolderID is the server connection id holding key's bell, 0 when free.
func bellHolderID(t *testing.T, db *sql.DB, key string) int64 {
	t.Helper()
	var id sql.NullInt64
	if err := db.QueryRow("SELECT IS_USED_LOCK(?)", key).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id.Int64
}

// bellFreshRow makes name's lease row exist and be free, so the next
// grant takes it over (and takes the bell).
func bellFreshRow(t *testing.T, a *sqlfence.Acquirer, name string) fence.Token {
	t.Helper()
	ctx := context.Background()
	l := mustGrant(t, ctx, a, name, time.Minute)
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	return l.Token()
}

// bellProxied returns a *sqlfence.DB on its own pool reaching the server
// through a new proxy, and a counter of the grant statements sent on it.
func bellProxied(t *testing.T) (*sql.DB, *sqlfence.DB, *faultnet.Proxy, *atomic.Int64) {
	p := faultnet.Start(t, mysqlAddr(t))
	db := proxiedMySQL(t, p)
	return db, sqlfence.MySQL(db), p, observe(p, "INSERT INTO")
}

// bellParked waits until b's head has made at least n grant attempts (sent
// through the proxy that counts them), waits between attempts, and b's
// ringer keeps the bell (ringer.free, ringer.held, or watching the row):
// the state in which B's ringer has the bell while the row is held by a
// grant without it. (Before the ringer watched the row, it woke the head,
// which found the row held and put the bell back: the bell then stayed
// there, and the holder's release rang nobody.)
func bellParked(t *testing.T, b *sqlfence.Acquirer, name string, grants *atomic.Int64, n int64) {
	t.Helper()
	bellWaitFor(t, 10*time.Second, "the waiter's ringer keeping the bell while the row is held", func() bool {
		return grants.Load() >= n && sqlfence.LineHeadWaiting(b, name) && sqlfence.BellFree(b, name)
	})
}

// bellGranted waits for the waiter's outcome within d of now.
// state, if given, describes on a timeout what the test saw then.
func bellGranted(t *testing.T, ch <-chan acquired, d time.Duration, what string, state ...func() string) fence.Lease {
	t.Helper()
	select {
	case r := <-ch:
		if r.err != nil {
			t.Fatalf("%s: %v", what, r.err)
		}
		return r.l
	case <-time.After(d):
		seen := ""
		for _, f := range state {
			seen += "; " + f()
		}
		t.Fatalf("%s: the waiter of the other Acquirer (Backoff of an hour) was not granted within %v: no bell woke it%s", what, d, seen)
		return nil
	}
}

// bellNoLeak waits until no connection stays pinned or in use and no
// session holds the bells of names.
func bellNoLeak(t *testing.T, dbs []*sql.DB, as []*sqlfence.Acquirer, check *sql.DB, keys ...string) {
	t.Helper()
	state := ""
	clean := func() bool {
		state = ""
		for i, a := range as {
			if n := sqlfence.BellPinned(a); n != 0 {
				state += fmt.Sprintf("; acquirer %d pins %d", i, n)
			}
		}
		for i, db := range dbs {
			if n := db.Stats().InUse; n != 0 {
				state += fmt.Sprintf("; pool %d has %d in use", i, n)
			}
		}
		for _, k := range keys {
			if id := bellHolderID(t, check, k); id != 0 {
				state += fmt.Sprintf("; session %d holds bell %s", id, k)
			}
		}
		return state == ""
	}
	// Pool connections stay in use after the calls return only while a
	// background read runs: a watchGrant (an Acquire whose context ended
	// with its grant in flight) reads the row for at least 2s, and on for
	// as long as its reads fail, up to GrantWatchMax; on a loaded machine
	// (31 connections were seen in use after 8s) its reads can wait for
	// seconds. So the bound is that, and a slow return is logged with what
	// held the connections.
	start := time.Now()
	logged := false
	for end := start.Add(sqlfence.GrantWatchMax + 10*time.Second); !clean(); time.Sleep(5 * time.Millisecond) { // polling observable state
		if !logged && time.Since(start) > 8*time.Second {
			logged = true
			t.Logf("not back after 8s%s%s", state, bellDiagnose(check))
		}
		if time.Now().After(end) {
			t.Fatalf("pinned and in-use connections back to 0, bells free: not within %v%s%s", time.Since(start), state, bellDiagnose(check))
		}
	}
	if logged {
		t.Logf("back after %v", time.Since(start))
	}
}

// bellDiagnose describes what may hold connections: the goroutines of the
// package's background work and the server's sessions that run a statement.
func bellDiagnose(check *sql.DB) string {
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	counts := map[string]int{}
	for _, g := range bytes.Split(buf, []byte("\n\n")) {
		for _, f := range []string{"watchGrant", "(*bells).ring", "(*bells).letGo", "settleHandoff", "keepConn"} {
			if bytes.Contains(g, []byte(f)) {
				counts[f]++
			}
		}
	}
	out := fmt.Sprintf("\n  goroutines: %v", counts)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rows, err := check.QueryContext(ctx, "SELECT ID, COMMAND, TIME, COALESCE(STATE, ''), LEFT(COALESCE(INFO, ''), 120) FROM information_schema.PROCESSLIST WHERE COMMAND <> 'Sleep' AND ID <> CONNECTION_ID() ORDER BY TIME DESC LIMIT 40")
	if err != nil {
		return out + "\n  processlist: " + err.Error()
	}
	defer rows.Close()
	for rows.Next() {
		var (
			id, secs         int64
			cmd, state, info string
		)
		if err := rows.Scan(&id, &cmd, &secs, &state, &info); err != nil {
			return out + "\n  processlist: " + err.Error()
		}
		out += fmt.Sprintf("\n  session %d %s %ds %q %q", id, cmd, secs, state, info)
	}
	return out
}

// TestBellNewRowHolderRelease: the first lease on a name creates its
// row, and takes no bell (bell.go: "a new row's grant takes no bell").
// The waiter of another Acquirer then finds the bell free: its ringer takes
// it at once, wakes its head, which finds the row held and puts the bell
// back; the ringer then keeps it and stops listening. The holder's release
// lets go of no bell, and the waiter (Backoff of an hour) is never woken.
func TestBellNewRowHolderRelease(t *testing.T) {
	ctx := context.Background()
	_, fdbA := openMySQL(t, "")
	_, fdbB, _, grants := bellProxied(t)
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("bell-new")
	l, err := a.TryAcquire(ctx, name, time.Minute) // creates the row
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ch := goAcquire(wctx, b, name, time.Minute)
	bellParked(t, b, name, grants, 1)
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	nl := bellGranted(t, ch, 5*time.Second, "after the release of a lease that created its row")
	if nl.Token() <= l.Token() {
		t.Fatalf("tokens %d then %d", l.Token(), nl.Token())
	}
	_ = nl.Release(ctx)
}

// TestBellTryAcquireWhileRingerHoldsBell: A releases, B's ringer
// gets the bell, and before B's head grants, a third Acquirer C takes the
// row with TryAcquire (its GET_LOCK fails: B's ringer holds the bell). B's
// head finds the row held and its ringer keeps the bell. C's release then
// rings nobody: B (Backoff of an hour) must still be granted promptly.
// B's connections go through a proxy whose partition holds the ringer's
// reply until C has the row.
func TestBellTryAcquireWhileRingerHoldsBell(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	_, fdbB, p, grants := bellProxied(t)
	a := newAcquirerOn(t, fdbA, nil)
	c := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	for try := 0; ; try++ {
		if try == 3 {
			t.Fatal("could not set up: B's ringer never had the bell while C held the row")
		}
		name := fencetest.Name("bell-third")
		key := sqlfence.BellKey(a, name)
		bellFreshRow(t, a, name)
		la, err := a.TryAcquire(ctx, name, time.Minute) // takes over the row: and the bell
		if err != nil {
			t.Fatal(err)
		}
		if bellHolderID(t, dbA, key) == 0 {
			t.Fatal("the takeover grant took no bell")
		}
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		ch := goAcquire(wctx, b, name, time.Minute)
		waitHeadIdle(t, b, name)
		// B's ringer waits in GET_LOCK (1s at a time): wait for a fresh one.
		bellWaitFor(t, 5*time.Second, "B's ringer in a fresh GET_LOCK", func() bool {
			var n int
			_ = dbA.QueryRow("SELECT COUNT(*) FROM information_schema.processlist WHERE info LIKE 'SELECT IS_FREE_LOCK%' AND time_ms < 300").Scan(&n)
			return n > 0
		})
		p.Partition()
		if err := la.Release(ctx); err != nil {
			p.Heal()
			t.Fatal(err)
		}
		lc, err := c.TryAcquire(ctx, name, time.Minute)
		p.Heal()
		if err != nil {
			t.Fatalf("C's TryAcquire of the released row: %v", err)
		}
		ok := true
		func() {
			defer func() {
				if recover() != nil {
					ok = false
				}
			}()
			for end := time.Now().Add(3 * time.Second); !(grants.Load() >= 1 && sqlfence.LineHeadWaiting(b, name) && sqlfence.BellFree(b, name)); {
				if time.Now().After(end) {
					panic("not parked")
				}
				time.Sleep(2 * time.Millisecond)
			}
		}()
		if !ok {
			t.Logf("try %d: B's ringer did not get the bell before C's grant (its GET_LOCK timed out first): again", try)
			_ = lc.Release(ctx)
			r := within(t, ch, 10*time.Second, "B after C's release")
			if r.err == nil {
				_ = r.l.Release(ctx)
			}
			cancel()
			grants.Store(0)
			continue
		}
		if id := bellHolderID(t, dbA, key); id == 0 {
			t.Fatal("nobody holds the bell")
		}
		if err := lc.Release(ctx); err != nil {
			t.Fatal(err)
		}
		nl := bellGranted(t, ch, 5*time.Second, "after C's release (C took the row while B's ringer held the bell)")
		if nl.Token() <= lc.Token() {
			t.Fatalf("tokens %d then %d", lc.Token(), nl.Token())
		}
		_ = nl.Release(ctx)
		cancel()
		return
	}
}

// TestBellExpiredHolder: A's lease (it holds the bell) is never
// released. At its local deadline its connection is closed, which lets the
// bell go a drift margin before the row expires on the server: B's ringer
// gets it, B's head finds the row still held, and the ringer keeps the
// bell. After the expiry, C takes the row and releases it: B (Backoff of an
// hour) must be granted then.
func TestBellExpiredHolder(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	_, fdbB, _, _ := bellProxied(t)
	a := newAcquirerOn(t, fdbA, nil)
	c := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("bell-expire")
	key := sqlfence.BellKey(a, name)
	bellFreshRow(t, a, name)
	ttl := 1500 * time.Millisecond
	la := mustGrant(t, ctx, a, name, ttl)
	if bellHolderID(t, dbA, key) == 0 {
		t.Fatal("the takeover grant took no bell")
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ch := goAcquire(wctx, b, name, time.Minute)
	waitHeadIdle(t, b, name)
	<-la.Context().Done()
	// Wait for the row to expire on the server (B, woken at the expiry,
	// may hold it already).
	bellWaitFor(t, 5*time.Second, "the row expired", func() bool {
		info, err := a.Inspect(ctx, name)
		return err == nil && (!info.Held || info.Token != la.Token())
	})
	select {
	case r := <-ch:
		if r.err != nil {
			t.Fatal(r.err)
		}
		t.Log("B was granted at the expiry")
		_ = r.l.Release(ctx)
		return
	case <-time.After(2 * time.Second):
		t.Log("B not granted within 2s of the expiry (its bell came a drift margin early)")
	}
	lc := mustGrant(t, ctx, c, name, time.Minute)
	if err := lc.Release(ctx); err != nil {
		t.Fatal(err)
	}
	nl := bellGranted(t, ch, 5*time.Second, "after C took and released the expired row")
	_ = nl.Release(ctx)
}

// TestBellKilledHolder: the connection of A's lease, which holds the
// bell, is killed (KILL from another session, as an operator or a proxy
// would). A's Release must still release the row (the row is the truth),
// and B (Backoff of an hour) must be granted promptly after it.
func TestBellKilledHolder(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	_, fdbB, _, _ := bellProxied(t)
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("bell-kill")
	key := sqlfence.BellKey(a, name)
	bellFreshRow(t, a, name)
	la := mustGrant(t, ctx, a, name, 30*time.Second)
	id := bellHolderID(t, dbA, key)
	if id == 0 {
		t.Fatal("the takeover grant took no bell")
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ch := goAcquire(wctx, b, name, time.Minute)
	waitHeadIdle(t, b, name)
	if _, err := dbA.Exec(fmt.Sprintf("KILL %d", id)); err != nil {
		t.Fatal(err)
	}
	bellWaitFor(t, 5*time.Second, "the killed session's bell taken by B's ringer", func() bool {
		h := bellHolderID(t, dbA, key)
		return h != 0 && h != id && sqlfence.LineHeadWaiting(b, name)
	})
	rerr := la.Release(ctx)
	info, ierr := a.Inspect(ctx, name)
	if ierr != nil {
		t.Fatal(ierr)
	}
	// B, woken as soon as the row is free, may already hold it: only A's
	// grant holding it is a failure.
	if info.Held && info.Token == la.Token() {
		t.Errorf("A's Release after its connection was killed returned %v and left the row held (%v left): waiters wait out the ttl", rerr, info.TimeLeft)
	} else if rerr != nil {
		t.Errorf("A's Release released the row but returned %v", rerr)
	}
	nl := bellGranted(t, ch, 5*time.Second, "after the release of a lease whose connection was killed")
	_ = nl.Release(ctx)
}

// TestBellKilledRinger: B's ringer connection is killed while it
// waits in GET_LOCK. Bells must not be turned off for good by that (only
// a server that refuses GET_LOCK turns them off), and the next release by A
// must still wake B (Backoff of an hour).
func TestBellKilledRinger(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("bell-killring")
	bellFreshRow(t, a, name)
	la := mustGrant(t, ctx, a, name, 30*time.Second)
	var mine int64
	if err := dbB.QueryRow("SELECT CONNECTION_ID()").Scan(&mine); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ch := goAcquire(wctx, b, name, time.Minute)
	waitHeadIdle(t, b, name)
	// B's ringer: a session of this test's user in GET_LOCK for B's pool.
	// The pool of B has one connection besides the ringer's (idle).
	var rid int64
	bellWaitFor(t, 5*time.Second, "B's ringer waiting in GET_LOCK", func() bool {
		// B's pinned ringer is the session of B's pool in GET_LOCK; with
		// other tests on the server, take the one opened after mine.
		return dbA.QueryRow("SELECT id FROM information_schema.processlist WHERE info LIKE 'SELECT IS_FREE_LOCK%' AND id >= ? ORDER BY id LIMIT 1", mine).Scan(&rid) == nil
	})
	if _, err := dbA.Exec(fmt.Sprintf("KILL %d", rid)); err != nil {
		t.Fatal(err)
	}
	// The ringer pins a new connection and waits again.
	bellWaitFor(t, 5*time.Second, "B's ringer back in GET_LOCK", func() bool {
		var n int
		_ = dbA.QueryRow("SELECT COUNT(*) FROM information_schema.processlist WHERE info LIKE 'SELECT IS_FREE_LOCK%' AND id > ?", rid).Scan(&n)
		return n > 0 || sqlfence.BellOff(b)
	})
	if sqlfence.BellOff(b) {
		t.Errorf("killing B's ringer connection turned B's bells off for good")
	}
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	nl := bellGranted(t, ch, 5*time.Second, "after A's release, B's ringer having been killed before")
	_ = nl.Release(ctx)
}

// TestBellChainsBothWaiting: A holds the name (with the bell); B has
// a waiter, and A has ten, every one with a Backoff of an hour, each
// releasing at once when granted. A's releases hand off 8 in a row, then
// release. Every waiter of both must be granted, promptly, with growing
// tokens, one at a time, and nothing stays pinned or held.
func TestBellChainsBothWaiting(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, &sqlfence.AcquirerOptions{Backoff: idleHead})
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("bell-chain")
	key := sqlfence.BellKey(a, name)
	bellFreshRow(t, a, name)
	l0 := mustGrant(t, ctx, a, name, time.Minute)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var (
		mu     sync.Mutex
		inside int
		last   = l0.Token()
		errs   []string
	)
	run := func(acq *sqlfence.Acquirer, who string) <-chan error {
		done := make(chan error, 1)
		go func() {
			l, err := acq.Acquire(wctx, name, time.Minute)
			if err != nil {
				done <- fmt.Errorf("%s: %w", who, err)
				return
			}
			mu.Lock()
			inside++
			if inside > 1 {
				errs = append(errs, who+": two holders")
			}
			if l.Token() <= last {
				errs = append(errs, fmt.Sprintf("%s: token %d after %d", who, l.Token(), last))
			}
			last = l.Token()
			inside--
			mu.Unlock()
			done <- l.Release(ctx)
		}()
		return done
	}
	var dones []<-chan error
	dones = append(dones, run(b, "B"))
	waitHeadIdle(t, b, name)
	for i := 0; i < 10; i++ {
		dones = append(dones, run(a, fmt.Sprintf("A%d", i)))
		bellWaitFor(t, 5*time.Second, "A's waiter in line", func() bool { return sqlfence.LineLen(a, name) == i+1 })
		if i == 0 {
			waitHeadIdle(t, a, name)
		}
	}
	if err := l0.Release(ctx); err != nil {
		t.Fatal(err)
	}
	deadline := time.After(10 * time.Second)
	for i, d := range dones {
		select {
		case err := <-d:
			if err != nil {
				t.Errorf("waiter %d: %v", i, err)
			}
		case <-deadline:
			t.Fatalf("waiter %d (0 is B's) not granted and released within 10s; A's line %d, B's line %d; bell held by %d",
				i, sqlfence.LineLen(a, name), sqlfence.LineLen(b, name), bellHolderID(t, dbA, key))
		}
	}
	mu.Lock()
	for _, e := range errs {
		t.Error(e)
	}
	mu.Unlock()
	cancel()
	bellNoLeak(t, []*sql.DB{dbA, dbB}, []*sqlfence.Acquirer{a, b}, dbA, key)
}

// TestBellSmallPools: two Acquirers on one pool of 1 to 5
// connections, several waiters each with a deadline, short critical
// sections: mutual exclusion, growing tokens, every Acquire returns by its
// deadline, and nothing stays pinned or in use.
func TestBellSmallPools(t *testing.T) {
	for n := 1; n <= 5; n++ {
		t.Run(fmt.Sprint("max=", n), func(t *testing.T) {
			db, fdb := openMySQL(t, "")
			db.SetMaxOpenConns(n)
			bo := fence.Backoff{Min: time.Millisecond, Max: 50 * time.Millisecond}
			as := []*sqlfence.Acquirer{newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Backoff: bo}), newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Backoff: bo})}
			names := []string{fencetest.Name("bell-pool"), fencetest.Name("bell-pool")}
			for _, nm := range names {
				bellFreshRow(t, as[0], nm)
			}
			var (
				mu     sync.Mutex
				inside = map[string]int{}
				last   = map[string]fence.Token{}
				wg     sync.WaitGroup
				grants atomic.Int64
			)
			start := time.Now()
			for w := 0; w < 8; w++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					a := as[w%2]
					for r := 0; r < 6; r++ {
						nm := names[(w/2+r)%2]
						actx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
						t0 := time.Now()
						l, err := a.Acquire(actx, nm, 5*time.Second)
						cancel()
						if took := time.Since(t0); took > 3*time.Second {
							t.Errorf("worker %d: Acquire with a 1.5s deadline returned after %v (%v)", w, took, err)
						}
						if err != nil {
							if !errors.Is(err, fence.ErrHeld) {
								t.Errorf("worker %d: %v", w, err)
							}
							continue
						}
						grants.Add(1)
						mu.Lock()
						inside[nm]++
						if inside[nm] > 1 {
							t.Errorf("two holders of %s", nm)
						}
						if l.Token() <= last[nm] {
							t.Errorf("%s: token %d after %d", nm, l.Token(), last[nm])
						}
						last[nm] = l.Token()
						mu.Unlock()
						time.Sleep(time.Millisecond) // the critical section
						mu.Lock()
						inside[nm]--
						mu.Unlock()
						rctx, rcancel := context.WithTimeout(context.Background(), 3*time.Second)
						if err := l.Release(rctx); err != nil {
							t.Errorf("worker %d: release: %v", w, err)
						}
						rcancel()
					}
				}()
			}
			wg.Wait()
			t.Logf("%d grants of 48 in %v", grants.Load(), time.Since(start))
			if grants.Load() < 24 {
				t.Errorf("only %d grants of 48 attempts with 1ms critical sections", grants.Load())
			}
			bellNoLeak(t, []*sql.DB{db}, as, db, sqlfence.BellKey(as[0], names[0]), sqlfence.BellKey(as[0], names[1]))
		})
	}
}

// TestBellRingersTakeThePool: four Acquirers share a pool of 4
// connections. A holds a name, the three others wait for it: each would pin
// a connection for its ringer, a quarter of the pool each, and the pool
// would be gone (it was, before the pin budget became one per pool). The holder's Renew (and any other statement on the pool) must not
// be starved by connections pinned for bells.
func TestBellRingersTakeThePool(t *testing.T) {
	ctx := context.Background()
	db, fdb := openMySQL(t, "")
	db.SetMaxOpenConns(4)
	var as []*sqlfence.Acquirer
	for i := 0; i < 4; i++ {
		as = append(as, newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Backoff: idleHead}))
	}
	name := fencetest.Name("bell-4acq")
	bellFreshRow(t, as[0], name)
	l, err := as[0].TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 8*time.Second)
	defer cancel()
	var chs []<-chan acquired
	for _, w := range as[1:] {
		ch := make(chan acquired, 1)
		go func() {
			l, err := w.Acquire(wctx, name, 10*time.Second)
			ch <- acquired{l, err, time.Now()}
			if err == nil {
				_ = l.Release(ctx) // at once: the next waiter's turn
			}
		}()
		chs = append(chs, ch)
	}
	check, _ := openMySQL(t, "")
	// The Acquirers of a pool pin a quarter of it together (one here, the
	// holder's): the ringers find no connection to pin and wait to try again.
	bellWaitFor(t, 5*time.Second, "the heads idle, at most a quarter of the pool pinned", func() bool {
		pinned := 0
		for _, a := range as {
			pinned += sqlfence.BellPinned(a)
		}
		return pinned <= 1 && sqlfence.LineHeadWaiting(as[1], name) && sqlfence.LineHeadWaiting(as[2], name) && sqlfence.LineHeadWaiting(as[3], name)
	})
	t.Logf("pinned: %d %d %d %d, in use %d of %d", sqlfence.BellPinned(as[0]), sqlfence.BellPinned(as[1]), sqlfence.BellPinned(as[2]), sqlfence.BellPinned(as[3]), db.Stats().InUse, db.Stats().MaxOpenConnections)
	rctx, rcancel := context.WithTimeout(ctx, 2*time.Second)
	t0 := time.Now()
	rerr := l.Renew(rctx)
	rcancel()
	t.Logf("renew: %v after %v; in use %d, waiting for a connection %d times", rerr, time.Since(t0), db.Stats().InUse, db.Stats().WaitCount)
	if rerr != nil {
		t.Errorf("the holder's Renew, with the pool pinned by other Acquirers' ringers: %v", rerr)
	}
	t0 = time.Now()
	if err := l.Release(ctx); err != nil {
		t.Errorf("release: %v", err)
	}
	for i, ch := range chs {
		r := within(t, ch, 9*time.Second, "a waiter")
		if r.err != nil {
			t.Errorf("waiter %d: %v after %v (the lock was free)", i, r.err, r.at.Sub(t0))
			continue
		}
		t.Logf("waiter %d granted %v after the release", i, r.at.Sub(t0))
	}
	cancel()
	bellNoLeak(t, []*sql.DB{db}, as, check, sqlfence.BellKey(as[0], name))
}

// TestBellNoLeakCancels: waiters of two Acquirers on separate pools
// whose contexts end at random moments (while waiting, as the release
// lands, during a handoff), holders that release, expire or are bumped
// away: mutual exclusion and growing tokens hold, and at the end no
// connection stays pinned or in use, and no session holds the bell.
func TestBellNoLeakCancels(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "")
	bo := fence.Backoff{Min: 5 * time.Millisecond, Max: 200 * time.Millisecond}
	as := []*sqlfence.Acquirer{newAcquirerOn(t, fdbA, &sqlfence.AcquirerOptions{Backoff: bo}), newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: bo})}
	name := fencetest.Name("bell-leak")
	key := sqlfence.BellKey(as[0], name)
	bellFreshRow(t, as[0], name)
	var (
		mu     sync.Mutex
		inside int
		last   fence.Token
		wg     sync.WaitGroup
	)
	end := time.Now().Add(5 * time.Second)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a := as[w%2]
			for i := 0; time.Now().Before(end); i++ {
				actx, cancel := context.WithTimeout(ctx, time.Duration(rand.N(60))*time.Millisecond)
				l, err := a.Acquire(actx, name, 300*time.Millisecond)
				cancel()
				if err != nil {
					if !errors.Is(err, fence.ErrHeld) && !errors.Is(err, fence.ErrUnknown) {
						t.Errorf("worker %d: %v", w, err)
					}
					continue
				}
				mu.Lock()
				inside++
				if inside > 1 {
					t.Errorf("two holders")
				}
				if l.Token() <= last {
					t.Errorf("token %d after %d", l.Token(), last)
				}
				last = l.Token()
				mu.Unlock()
				time.Sleep(time.Duration(rand.N(3)) * time.Millisecond)
				mu.Lock()
				inside--
				mu.Unlock()
				switch i % 5 {
				case 3: // never released: left to expire (its connection is closed at the local deadline)
					<-l.Context().Done()
				case 4: // released with a context that ends at once
					rctx, rcancel := context.WithTimeout(ctx, time.Duration(rand.N(2))*time.Millisecond)
					err := l.Release(rctx)
					rcancel()
					if err != nil {
						// May or may not have landed: wait out the lease.
						<-l.Context().Done()
						for wend := time.Now().Add(2 * time.Second); time.Now().Before(wend); time.Sleep(2 * time.Millisecond) {
							if info, err := a.Inspect(ctx, name); err == nil && (!info.Held || info.Token != l.Token()) {
								break
							}
						}
					}
				default:
					// A lease of 300ms can be past its local deadline here
					// on a loaded machine: then, and only then,
					// its release may report it lost.
					expired := l.Context().Err() != nil
					if err := l.Release(ctx); err != nil && !(expired && errors.Is(err, fence.ErrLost)) {
						t.Errorf("release (lease expired before it: %v): %v", expired, err)
					}
				}
			}
		}()
	}
	wg.Wait()
	bellNoLeak(t, []*sql.DB{dbA, dbB}, as, dbA, key)
}

// TestBellTransientErrorKeepsBells: one grant of B fails with a
// MySQL error that is not a refusal of GET_LOCK (its statement is killed
// with KILL QUERY while it waits for the row, as an operator or
// max_statement_time would). Bells must not be turned off for good by
// that: A's next release must still wake B's waiter (Backoff of an hour).
func TestBellTransientErrorKeepsBells(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	_, fdbB := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("bell-killq")
	bellFreshRow(t, a, name)
	// A transaction of the test's own holds the row's lock: B's grant waits.
	tx, err := dbA.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if _, err := tx.Exec("SELECT token FROM fence_leases WHERE name = CAST(? AS BINARY) FOR UPDATE", []byte(name)); err != nil {
		t.Fatal(err)
	}
	tctx, tcancel := context.WithTimeout(ctx, 10*time.Second)
	defer tcancel()
	tch := make(chan error, 1)
	go func() {
		l, err := b.TryAcquire(tctx, name, time.Minute)
		if err == nil {
			err = l.Release(ctx)
		}
		tch <- err
	}()
	var qid int64
	bellWaitFor(t, 5*time.Second, "B's grant waiting for the row", func() bool {
		return dbA.QueryRow("SELECT id FROM information_schema.processlist WHERE info LIKE 'INSERT INTO%' AND state LIKE '%lock%' LIMIT 1").Scan(&qid) == nil ||
			dbA.QueryRow("SELECT id FROM information_schema.processlist WHERE info LIKE 'INSERT INTO%' AND time_ms > 100 LIMIT 1").Scan(&qid) == nil
	})
	if _, err := dbA.Exec(fmt.Sprintf("KILL QUERY %d", qid)); err != nil {
		t.Fatal(err)
	}
	_ = tx.Rollback()
	t.Logf("B's TryAcquire after its grant statement was killed: %v", <-tch)
	if sqlfence.BellOff(b) {
		t.Errorf("one killed grant statement turned B's bells off for good")
	}
	la := mustGrant(t, ctx, a, name, time.Minute)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ch := goAcquire(wctx, b, name, time.Minute)
	waitHeadIdle(t, b, name)
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	nl := bellGranted(t, ch, 5*time.Second, "after A's release, once a grant of B was killed")
	_ = nl.Release(ctx)
}

// TestBellInterruptedGetLock: B's sessions have a
// max_statement_time of 0.2s, which interrupts its ringer's 1s GET_LOCK
// (MariaDB returns NULL, as for KILL QUERY): grants still work, B's waiters
// (a short Backoff) are granted after each release of A, with growing
// tokens, and nothing stays pinned or held.
func TestBellInterruptedGetLock(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "max_statement_time=0.2")
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: fence.Backoff{Min: 10 * time.Millisecond, Max: 200 * time.Millisecond}})
	name := fencetest.Name("bell-interrupt")
	key := sqlfence.BellKey(a, name)
	bellFreshRow(t, a, name)
	for round := 0; round < 3; round++ {
		la := mustGrant(t, ctx, a, name, time.Minute)
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		ch := goAcquire(wctx, b, name, time.Minute)
		waitHeadIdle(t, b, name)
		if err := la.Release(ctx); err != nil {
			t.Fatal(err)
		}
		r := leaseWithin(t, ch, 5*time.Second, "B")
		if r.l.Token() <= la.Token() {
			t.Fatalf("tokens %d then %d", la.Token(), r.l.Token())
		}
		if err := r.l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		cancel()
	}
	bellNoLeak(t, []*sql.DB{dbA, dbB}, []*sqlfence.Acquirer{a, b}, dbA, key)
}

// TestBellLostGrantReply: A's takeover grant lands (and takes the
// bell) but its reply is lost (a proxy cuts the connection); A's retry
// recognises its grant, on another connection, and the bell went with the
// cut session. B (Backoff of an hour) then waits; A's release must wake it.
func TestBellLostGrantReply(t *testing.T) {
	ctx := context.Background()
	pa := faultnet.Start(t, mysqlAddr(t))
	cfg := mysqlConfig(t)
	cfg.Addr = pa.Addr()
	cfg.InterpolateParams = true // the grant goes as one text statement, whose reply is lost
	dbA, err := sql.Open("mysql", cfg.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { dbA.Close() })
	fdbA := sqlfence.MySQL(dbA)
	check, _ := openMySQL(t, "")
	_, fdbB, _, grants := bellProxied(t)
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("bell-lostgrant")
	bellFreshRow(t, a, name)
	pa.LoseReply(func(req []byte) bool {
		return bytes.Contains(req, []byte("GET_LOCK")) && bytes.Contains(req, []byte("INSERT INTO"))
	})
	la := mustGrant(t, ctx, a, name, time.Minute)
	if info, err := a.Inspect(ctx, name); err != nil || info.Token != la.Token() {
		t.Fatalf("inspect: %+v %v", info, err)
	}
	t.Logf("A's grant: token %d; bell held by session %d; A pins %d", la.Token(), bellHolderID(t, check, sqlfence.BellKey(a, name)), sqlfence.BellPinned(a))
	if pa.Stats().LostReplies != 1 {
		t.Fatalf("%d replies lost, want 1", pa.Stats().LostReplies)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ch := goAcquire(wctx, b, name, time.Minute)
	waitHeadIdle(t, b, name)
	// The bell went with the cut session: B's ringer takes it, its head
	// is woken, refused, and the ringer keeps the bell.
	bellParked(t, b, name, grants, 1)
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	nl := bellGranted(t, ch, 5*time.Second, "after the release of a grant whose reply was lost")
	_ = nl.Release(ctx)
	bellNoLeak(t, nil, []*sqlfence.Acquirer{a, b}, check, sqlfence.BellKey(a, name))
}

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
	l0 := mustGrant(t, ctx, holder, name, time.Minute) // creates the row (no bell: see bell.go)
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

// The ringer's watch of the row (bell.go), the per-pool pin budget, and what they cost.

// bellNewRowHolder makes a hold name through a grant that creates its row:
// a holder without the bell (bell.go: a new row's grant takes no bell).
func bellNewRowHolder(t *testing.T, a *sqlfence.Acquirer, name string, ttl time.Duration) fence.Lease {
	t.Helper()
	l := mustGrant(t, context.Background(), a, name, ttl)
	return l
}

// bellWatching waits until b's ringer for name holds the bell and watches
// the row (or keeps it for the head).
func bellWatching(t *testing.T, b *sqlfence.Acquirer, name string) {
	t.Helper()
	bellWaitFor(t, 5*time.Second, "the waiter's ringer holding the bell", func() bool {
		return sqlfence.LineHeadWaiting(b, name) && sqlfence.BellFree(b, name)
	})
}

// TestBellHeldLeasesStarveRingers: a process holds 16 leases on
// one pool (each takeover grant pins a connection for its bell: the pool's
// whole pin budget, bellCap) and waits, with an hour's Backoff, for a 17th
// name that another process holds. The other process releases: the waiter
// must be granted within a few seconds. The pool has plenty of free
// connections, but the ringer of the 17th name can pin none (the budget is
// spent by the held leases), so no bell wakes the waiter.
func TestBellHeldLeasesStarveRingers(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	var held []fence.Lease
	defer func() {
		for _, l := range held {
			_ = l.Release(ctx)
		}
	}()
	for i := 0; i < 16; i++ {
		n := fencetest.Name("bell-held")
		bellFreshRow(t, b, n)
		l, err := b.TryAcquire(ctx, n, time.Minute) // takes over the row, pins a connection
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, l)
	}
	t.Logf("B holds 16 leases, pinning %d connections; pool in use %d, open %d", sqlfence.BellPinned(b), dbB.Stats().InUse, dbB.Stats().OpenConnections)
	name := fencetest.Name("bell-17th")
	bellFreshRow(t, a, name)
	la, err := a.TryAcquire(ctx, name, time.Minute) // with the bell
	if err != nil {
		t.Fatal(err)
	}
	if bellHolderID(t, dbA, sqlfence.BellKey(a, name)) == 0 {
		t.Fatal("the takeover grant took no bell")
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ch := goAcquire(wctx, b, name, time.Minute)
	waitHeadIdle(t, b, name)
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	nl := bellGranted(t, ch, 5*time.Second, "B's waiter, after the release of a free name", func() string {
		return fmt.Sprintf("B's 16 held leases may pin the pool's whole bell budget (%d pinned by B), leaving its ringer no connection", sqlfence.BellPinned(b))
	})
	_ = nl.Release(ctx)
}

// TestBellDroppedTableRingerSpins: the lease table is dropped while
// a ringer holds the bell and watches the row (its holder has no bell).
// Each watch read fails, the ringer closes its connection, pins a new one,
// takes the bell again at once (nobody else has it) and reads again: the
// pause after a failure (10ms doubling to 1s, bell.go's pause) must grow,
// not start again at 10ms each time. Once the table is back, the waiter
// (Backoff of an hour) is granted, with a larger token, and nothing leaks.
func TestBellDroppedTableRingerSpins(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB, p, _ := bellProxied(t)
	table := "bell_drop_" + strings.ReplaceAll(fencetest.Name("t"), "-", "_")
	t.Cleanup(func() { _, _ = dbA.Exec("DROP TABLE IF EXISTS " + table) })
	a := newAcquirerOn(t, fdbA, &sqlfence.AcquirerOptions{Table: table})
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Table: table, Backoff: idleHead})
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("bell-drop")
	la := bellNewRowHolder(t, a, name, time.Minute)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ch := goAcquire(wctx, b, name, time.Minute)
	waitHeadIdle(t, b, name)
	bellWatching(t, b, name)
	getLocks := observe(p, "SELECT IS_FREE_LOCK")
	reads := observe(p, "LOCK IN SHARE MODE")
	if _, err := dbA.Exec("DROP TABLE " + table); err != nil {
		t.Fatal(err)
	}
	g0, r0, c0 := getLocks.Load(), reads.Load(), p.Stats().Accepted
	window := 1500 * time.Millisecond
	time.Sleep(window) // a measurement window: counting what the ringer sends while the table is gone
	g, r, c := getLocks.Load()-g0, reads.Load()-r0, p.Stats().Accepted-c0
	t.Logf("in %v without the table: %d GET_LOCK, %d watch reads, %d new connections", window, g, r, c)
	if g > 20 || r > 20 || c > 20 {
		t.Errorf("while the table was gone the ringer sent %d GET_LOCK and %d watch reads and opened %d connections in %v: it spins (the failure pause restarts at 10ms after every GET_LOCK that gets the bell)", g, r, c, window)
	}
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	nl := bellGranted(t, ch, 5*time.Second, "after the table was recreated")
	if nl.Token() <= la.Token() {
		t.Errorf("token %d after %d", nl.Token(), la.Token())
	}
	_ = nl.Release(ctx)
	cancel()
	bellNoLeak(t, []*sql.DB{dbB}, []*sqlfence.Acquirer{b}, dbA, sqlfence.BellKey(b, name))
}

// TestBellWatchCost: a name held for 2s by a holder without the
// bell, waited for by three Acquirers (each on its own pool, an hour's
// Backoff). One ringer holds the bell and watches the row (2ms doubling to
// 100ms: about 10 reads a second after the ramp), the other two wait in
// GET_LOCK (one a second): what the ringers send stays within that. After
// the release every waiter is granted promptly, tokens grow, and nothing
// leaks.
func TestBellWatchCost(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	name := fencetest.Name("bell-cost")
	var (
		dbs    []*sql.DB
		as     []*sqlfence.Acquirer
		counts []func() int64
	)
	for i := 0; i < 3; i++ {
		db, fdb, p, _ := bellProxied(t)
		gl, rd := observe(p, "SELECT IS_FREE_LOCK"), observe(p, "LOCK IN SHARE MODE")
		dbs = append(dbs, db)
		as = append(as, newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Backoff: idleHead}))
		counts = append(counts, func() int64 { return gl.Load() + rd.Load() })
	}
	total := func() (n int64) {
		for _, f := range counts {
			n += f()
		}
		return n
	}
	la := bellNewRowHolder(t, a, name, time.Minute)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var chs []<-chan acquired
	for _, w := range as {
		chs = append(chs, goAcquire(wctx, w, name, time.Minute))
		waitHeadIdle(t, w, name)
	}
	bellWaitFor(t, 5*time.Second, "one ringer watching the row", func() bool {
		return sqlfence.BellFree(as[0], name) || sqlfence.BellFree(as[1], name) || sqlfence.BellFree(as[2], name)
	})
	n0 := total()
	time.Sleep(2 * time.Second) // the holder holds 2s: a measurement window
	n := total() - n0
	t.Logf("ringers sent %d GET_LOCK and watch reads in 2s", n)
	// 10 reads/s for the watcher plus the ramp, 1 GET_LOCK/s for the others.
	if n > 50 {
		t.Errorf("the ringers of 3 Acquirers sent %d statements in 2s while a bell-less holder held the name: more than documented (about 10 reads a second for the watcher, one GET_LOCK a second for each other)", n)
	}
	t0 := time.Now()
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	last := la.Token()
	for i := 0; i < 3; i++ {
		var got acquired
		var from int
		select {
		case got = <-chs[0]:
		case got = <-chs[1]:
			from = 1
		case got = <-chs[2]:
			from = 2
		case <-time.After(5 * time.Second):
			t.Fatalf("waiter %d of 3 not granted within 5s (%v after the release)", i+1, time.Since(t0))
		}
		chs[from] = nil
		if got.err != nil {
			t.Fatal(got.err)
		}
		if got.l.Token() <= last {
			t.Errorf("token %d after %d", got.l.Token(), last)
		}
		last = got.l.Token()
		if err := got.l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	cancel()
	bellNoLeak(t, dbs, as, dbA, sqlfence.BellKey(a, name))
}

// TestBellOperatorTxDuringWatch: the ringer watches a row held by a
// holder without the bell when an operator's transaction locks the row
// (SELECT ... FOR UPDATE) for longer than the watch read's 5s timeout; the
// holder's release waits behind it. Once the operator commits, the waiter
// (an hour's Backoff) is granted within a few seconds, and no session
// keeps the bell, no connection stays pinned or in use.
func TestBellOperatorTxDuringWatch(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("bell-optx")
	key := sqlfence.BellKey(a, name)
	la := bellNewRowHolder(t, a, name, time.Minute)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ch := goAcquire(wctx, b, name, time.Minute)
	waitHeadIdle(t, b, name)
	bellWatching(t, b, name)
	tx := lockRowMySQL(t, dbA, name) // an operator's SELECT ... FOR UPDATE
	rel := make(chan error, 1)
	go func() { rel <- la.Release(ctx) }()
	time.Sleep(5500 * time.Millisecond) // the operator holds the row past the watch read's 5s timeout
	t.Logf("bell held by session %d while the operator holds the row", bellHolderID(t, dbA, key))
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	select {
	case err := <-rel:
		if err != nil {
			t.Fatalf("the holder's release: %v", err)
		}
	case <-time.After(3 * time.Second):
		t.Fatal("the holder's release did not return within 3s of the operator's commit")
	}
	nl := bellGranted(t, ch, 3*time.Second, "after the operator's transaction and the release")
	t.Logf("granted %v after the commit", time.Since(t0))
	if nl.Token() <= la.Token() {
		t.Errorf("token %d after %d", nl.Token(), la.Token())
	}
	_ = nl.Release(ctx)
	cancel()
	bellNoLeak(t, []*sql.DB{dbA, dbB}, []*sqlfence.Acquirer{a, b}, dbA, key)
}

// TestBellDeletedRow: an operator deletes the row of a held name
// (DELETE FROM fence_leases WHERE name = ...). Whether the holder had the
// bell (the waiter's ringer waits in GET_LOCK) or not (the ringer watches
// the row), the waiter of another Acquirer (an hour's Backoff) is granted
// within a few seconds (of the deletion, or of the holder's release), and
// never below the holder's token.
func TestBellDeletedRow(t *testing.T) {
	for _, withBell := range []bool{false, true} {
		t.Run(fmt.Sprint("holderBell=", withBell), func(t *testing.T) {
			ctx := context.Background()
			dbA, fdbA := openMySQL(t, "")
			dbB, fdbB := openMySQL(t, "")
			a := newAcquirerOn(t, fdbA, nil)
			b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
			name := fencetest.Name("bell-del")
			key := sqlfence.BellKey(a, name)
			var la fence.Lease
			if withBell {
				bellFreshRow(t, a, name)
				var err error
				if la, err = a.TryAcquire(ctx, name, time.Minute); err != nil {
					t.Fatal(err)
				}
				if bellHolderID(t, dbA, key) == 0 {
					t.Fatal("the takeover grant took no bell")
				}
			} else {
				la = bellNewRowHolder(t, a, name, time.Minute)
			}
			wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			ch := goAcquire(wctx, b, name, time.Minute)
			waitHeadIdle(t, b, name)
			if !withBell {
				bellWatching(t, b, name)
			}
			if _, err := dbA.Exec("DELETE FROM fence_leases WHERE name = CAST(? AS BINARY)", []byte(name)); err != nil {
				t.Fatal(err)
			}
			if withBell {
				// The bell is the holder's: its release (which finds no
				// row) must still let the waiter go.
				if err := la.Release(ctx); !errors.Is(err, fence.ErrLost) {
					t.Logf("the holder's release after the deletion: %v", err)
				}
			}
			nl := bellGranted(t, ch, 3*time.Second, "after the row was deleted")
			if nl.Token() <= la.Token() {
				t.Errorf("token %d after %d (the row was deleted)", nl.Token(), la.Token())
			}
			_ = nl.Release(ctx)
			if !withBell {
				_ = la.Release(ctx)
			}
			cancel()
			bellNoLeak(t, []*sql.DB{dbA, dbB}, []*sqlfence.Acquirer{a, b}, dbA, key)
		})
	}
}

// TestBellManyNames: 40 names held by A (16 of the takeover grants
// get a bell, the pool's budget; the others none), each waited for by one
// Acquire of B (its own pool, budget 16, an hour's Backoff). A releases
// them all: every waiter is granted within seconds, and afterwards no
// connection stays pinned or in use, no bell is held, and the goroutines
// are back near where they started.
func TestBellManyNames(t *testing.T) {
	ctx := context.Background()
	g0 := runtime.NumGoroutine()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	// Bounded pools (the server allows 151 connections, shared with other
	// tests): 64 keeps the pin budget at 16.
	dbA.SetMaxOpenConns(64)
	dbB.SetMaxOpenConns(64)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	const n = 40
	var (
		names []string
		keys  []string
		ls    []fence.Lease
	)
	for i := 0; i < n; i++ {
		nm := fencetest.Name("bell-many")
		bellFreshRow(t, a, nm)
		l := mustGrant(t, ctx, a, nm, time.Minute)
		names, keys, ls = append(names, nm), append(keys, sqlfence.BellKey(a, nm)), append(ls, l)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		granted = map[string]time.Time{}
	)
	var errs []error
	fail := func(err error) {
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
	}
	for _, nm := range names {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l, err := b.Acquire(wctx, nm, time.Minute)
			if err != nil {
				fail(fmt.Errorf("%s: %w", nm, err))
				return
			}
			mu.Lock()
			granted[nm] = time.Now()
			mu.Unlock()
			if err := l.Release(ctx); err != nil {
				fail(fmt.Errorf("%s: release: %w", nm, err))
			}
		}()
	}
	for i, nm := range names {
		bellWaitFor(t, 10*time.Second, fmt.Sprintf("waiter %d's first attempt ended", i), func() bool { return sqlfence.LineHeadWaiting(b, nm) },
			func() string {
				mu.Lock()
				defer mu.Unlock()
				return fmt.Sprintf(" (line %d, trying %v, B pins %d, in use %d; errors %v)", sqlfence.LineLen(b, nm), sqlfence.LineHeadTrying(b, nm), sqlfence.BellPinned(b), dbB.Stats().InUse, errs)
			})
	}
	t0 := time.Now()
	for i, l := range ls {
		if err := l.Release(ctx); err != nil {
			t.Fatalf("release %d: %v", i, err)
		}
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(8 * time.Second):
		mu.Lock()
		t.Errorf("%d of %d waiters granted within 8s of the releases; B pins %d", len(granted), n, sqlfence.BellPinned(b))
		mu.Unlock()
		cancel()
		<-done
	}
	mu.Lock()
	for _, err := range errs {
		t.Error(err)
	}
	mu.Unlock()
	var worst time.Duration
	mu.Lock()
	for _, at := range granted {
		worst = max(worst, at.Sub(t0))
	}
	mu.Unlock()
	t.Logf("last of %d granted %v after the releases began", n, worst)
	cancel()
	bellNoLeak(t, []*sql.DB{dbA, dbB}, []*sqlfence.Acquirer{a, b}, dbA, keys...)
	dbA.SetMaxIdleConns(0)
	dbB.SetMaxIdleConns(0)
	bellWaitFor(t, 5*time.Second, "goroutines back near the start", func() bool { return runtime.NumGoroutine() <= g0+10 },
		func() string { return fmt.Sprintf(" (%d, started with %d)", runtime.NumGoroutine(), g0) })
}

// TestBellCancelWhileWatchBlocked: the ringer's watch read waits for
// a row that an operator's transaction locks; the waiter's context ends:
// Acquire returns within a second, and once the operator commits nothing
// stays pinned, in use or holding the bell.
func TestBellCancelWhileWatchBlocked(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("bell-cancel")
	key := sqlfence.BellKey(a, name)
	la := bellNewRowHolder(t, a, name, time.Minute)
	defer la.Release(ctx)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch := goAcquire(wctx, b, name, time.Minute)
	waitHeadIdle(t, b, name)
	bellWatching(t, b, name)
	tx := lockRowMySQL(t, dbA, name) // an operator's SELECT ... FOR UPDATE
	bellWaitFor(t, 5*time.Second, "the ringer's read waiting for the row", func() bool {
		var n int
		_ = dbA.QueryRow("SELECT COUNT(*) FROM information_schema.processlist WHERE info LIKE 'SELECT GREATEST(expires_at%' AND time_ms > 50").Scan(&n)
		return n > 0
	})
	t0 := time.Now()
	cancel()
	r := within(t, ch, 2*time.Second, "the cancelled waiter")
	if took := r.at.Sub(t0); took > time.Second {
		t.Errorf("the waiter returned %v after its context ended", took)
	}
	if r.err == nil {
		t.Fatal("granted while the row was held")
	}
	_ = tx.Commit()
	bellNoLeak(t, []*sql.DB{dbB}, []*sqlfence.Acquirer{b}, dbA, key)
}

// TestBellPausedWaiterKeepsBell: B's ringer holds the bell and
// watches a row held without it; then B's process stops answering (a
// partition that holds every byte, as a paused or cut-off process: its
// server session stays open, idle). A releases. C, a waiter of a third
// Acquirer (an hour's Backoff) whose ringer waits in GET_LOCK, must be
// granted within a few seconds: the lock is free and C's process is fine.
// (one dead or slow participant must not stall everyone. The
// docs say a paused holder only delays; here it is a paused waiter, and
// the delay is as long as it stays paused, not a ttl.)
func TestBellPausedWaiterKeepsBell(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	_, fdbB, p, _ := bellProxied(t)
	_, fdbC := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	c := newAcquirerOn(t, fdbC, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("bell-paused")
	key := sqlfence.BellKey(a, name)
	la := bellNewRowHolder(t, a, name, time.Minute)
	bctx, bcancel := context.WithTimeout(ctx, 30*time.Second)
	defer bcancel()
	bch := goAcquire(bctx, b, name, time.Minute)
	waitHeadIdle(t, b, name)
	bellWatching(t, b, name)
	cctx, ccancel := context.WithTimeout(ctx, 30*time.Second)
	defer ccancel()
	cch := goAcquire(cctx, c, name, time.Minute)
	waitHeadIdle(t, c, name)
	holder := bellHolderID(t, dbA, key)
	p.Partition()
	defer p.Heal()
	if err := la.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-cch:
		if r.err != nil {
			t.Fatal(r.err)
		}
		_ = r.l.Release(ctx)
	case <-time.After(4 * time.Second):
		t.Errorf("C's waiter not granted within 4s of the release of a free lock: the bell is held by session %d (B's ringer, watching, now %d), whose process stopped answering; C's ringer waits in GET_LOCK for ever and C polls once an hour", holder, bellHolderID(t, dbA, key))
	}
	p.Heal()
	bcancel()
	if r := within(t, bch, 10*time.Second, "B"); r.err == nil {
		_ = r.l.Release(ctx)
	}
}

// TestBellHolderWithoutBellExpires: a holder without the bell is never
// released (its process paused); the watching ringer of another Acquirer
// reads the row's time left and, when it expires on the server, wakes its
// head (an hour's Backoff), which is granted within a second of the expiry.
// The holder's Renew while the ringer watches is not held up by the
// ringer's locking reads.
func TestBellHolderWithoutBellExpires(t *testing.T) {
	ctx := context.Background()
	dbA, fdbA := openMySQL(t, "")
	dbB, fdbB := openMySQL(t, "")
	a := newAcquirerOn(t, fdbA, nil)
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Backoff: idleHead})
	name := fencetest.Name("bell-expire")
	key := sqlfence.BellKey(a, name)
	ttl := 1500 * time.Millisecond
	la := bellNewRowHolder(t, a, name, ttl)
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ch := goAcquire(wctx, b, name, time.Minute)
	waitHeadIdle(t, b, name)
	bellWatching(t, b, name)
	var worst time.Duration
	for i := 0; i < 10; i++ {
		t0 := time.Now()
		if err := la.Renew(ctx); err != nil {
			t.Fatal(err)
		}
		worst = max(worst, time.Since(t0))
	}
	t.Logf("slowest of 10 renewals while the ringer watches: %v", worst)
	if worst > 500*time.Millisecond {
		t.Errorf("a renewal took %v while the ringer watched the row", worst)
	}
	info, err := a.Inspect(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	expiry := time.Now().Add(info.TimeLeft)
	r := leaseWithin(t, ch, info.TimeLeft+5*time.Second, "B")
	t.Logf("B granted %v after the expiry", r.at.Sub(expiry))
	if late := r.at.Sub(expiry); late > time.Second {
		t.Errorf("B granted %v after the bell-less holder's row expired", late)
	}
	if r.l.Token() <= la.Token() {
		t.Errorf("token %d after %d", r.l.Token(), la.Token())
	}
	_ = r.l.Release(ctx)
	cancel()
	bellNoLeak(t, []*sql.DB{dbB}, []*sqlfence.Acquirer{b}, dbA, key)
}
