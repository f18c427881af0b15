package sqlfence_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
)

// Review of the MySQL bell (bell.go): the tests run two or more Acquirers
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
	l, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
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
	// (CI run of stop 39: 31 in use after 8s) its reads can wait for
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
	name := fencetest.Name("bellrev-new")
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
		name := fencetest.Name("bellrev-third")
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
	name := fencetest.Name("bellrev-expire")
	key := sqlfence.BellKey(a, name)
	bellFreshRow(t, a, name)
	ttl := 1500 * time.Millisecond
	la, err := a.TryAcquire(ctx, name, ttl)
	if err != nil {
		t.Fatal(err)
	}
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
	lc, err := c.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
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
	name := fencetest.Name("bellrev-kill")
	key := sqlfence.BellKey(a, name)
	bellFreshRow(t, a, name)
	la, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
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
	name := fencetest.Name("bellrev-killring")
	bellFreshRow(t, a, name)
	la, err := a.TryAcquire(ctx, name, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
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
	name := fencetest.Name("bellrev-chain")
	key := sqlfence.BellKey(a, name)
	bellFreshRow(t, a, name)
	l0, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
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
			names := []string{fencetest.Name("bellrev-pool"), fencetest.Name("bellrev-pool")}
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
	name := fencetest.Name("bellrev-4acq")
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
	name := fencetest.Name("bellrev-leak")
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
					// on a loaded machine (CI run c5): then, and only then,
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
	name := fencetest.Name("bellrev-killq")
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
	la, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
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
	name := fencetest.Name("bellrev-interrupt")
	key := sqlfence.BellKey(a, name)
	bellFreshRow(t, a, name)
	for round := 0; round < 3; round++ {
		la, err := a.TryAcquire(ctx, name, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		ch := goAcquire(wctx, b, name, time.Minute)
		waitHeadIdle(t, b, name)
		if err := la.Release(ctx); err != nil {
			t.Fatal(err)
		}
		r := within(t, ch, 5*time.Second, "B")
		if r.err != nil {
			t.Fatal(r.err)
		}
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
	name := fencetest.Name("bellrev-lostgrant")
	bellFreshRow(t, a, name)
	pa.LoseReply(func(req []byte) bool {
		return bytes.Contains(req, []byte("GET_LOCK")) && bytes.Contains(req, []byte("INSERT INTO"))
	})
	la, err := a.TryAcquire(ctx, name, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
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
