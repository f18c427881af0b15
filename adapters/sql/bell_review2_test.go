package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
)

// Second review of the MySQL bell (bell.go), after 6d273cd: the ringer's
// watch of the row, the per-pool pin budget, and what they cost.

// bellNewRowHolder makes a hold name through a grant that creates its row:
// a holder without the bell (bell.go: a new row's grant takes no bell).
func bellNewRowHolder(t *testing.T, a *sqlfence.Acquirer, name string, ttl time.Duration) fence.Lease {
	t.Helper()
	l, err := a.TryAcquire(context.Background(), name, ttl)
	if err != nil {
		t.Fatal(err)
	}
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
		n := fencetest.Name("bellrev2-held")
		bellFreshRow(t, b, n)
		l, err := b.TryAcquire(ctx, n, time.Minute) // takes over the row, pins a connection
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, l)
	}
	t.Logf("B holds 16 leases, pinning %d connections; pool in use %d, open %d", sqlfence.BellPinned(b), dbB.Stats().InUse, dbB.Stats().OpenConnections)
	name := fencetest.Name("bellrev2-17th")
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
	table := "bellrev2_drop_" + strings.ReplaceAll(fencetest.Name("t"), "-", "_")
	t.Cleanup(func() { _, _ = dbA.Exec("DROP TABLE IF EXISTS " + table) })
	a := newAcquirerOn(t, fdbA, &sqlfence.AcquirerOptions{Table: table})
	b := newAcquirerOn(t, fdbB, &sqlfence.AcquirerOptions{Table: table, Backoff: idleHead})
	if err := a.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("bellrev2-drop")
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
	name := fencetest.Name("bellrev2-cost")
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
	name := fencetest.Name("bellrev2-optx")
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
			name := fencetest.Name("bellrev2-del")
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
		nm := fencetest.Name("bellrev2-many")
		bellFreshRow(t, a, nm)
		l, err := a.TryAcquire(ctx, nm, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
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
	name := fencetest.Name("bellrev2-cancel")
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
// (HAZARDS 6: one dead or slow participant must not stall everyone. The
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
	name := fencetest.Name("bellrev2-paused")
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
	name := fencetest.Name("bellrev2-expire")
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
	r := within(t, ch, info.TimeLeft+5*time.Second, "B")
	if r.err != nil {
		t.Fatal(r.err)
	}
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
