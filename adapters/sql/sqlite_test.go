package sqlfence_test

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/leasekit"
	"github.com/fencekit/fencekit/idempotency"
)

// openSQLite opens a fresh SQLite file in a temporary directory with both tables.
func openSQLite(t testing.TB) (*sql.DB, *sqlfence.DB) {
	t.Helper()
	db, err := sqlfence.OpenSQLite(filepath.Join(t.TempDir(), "fence.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db, sqlfence.SQLite(db)
}

func newSQLiteWriter(t testing.TB, fdb *sqlfence.DB) *sqlfence.Writer {
	t.Helper()
	w := newWriterOn(t, fdb, nil)
	if err := w.CreateTable(context.Background()); err != nil {
		t.Fatal(err)
	}
	return w
}

func newSQLiteAcquirer(t testing.TB, fdb *sqlfence.DB) *sqlfence.Acquirer {
	t.Helper()
	a := newAcquirerOn(t, fdb, nil)
	if err := a.CreateTable(context.Background()); err != nil {
		t.Fatal(err)
	}
	return a
}

func TestSQLiteWriterConformance(t *testing.T) {
	_, fdb := openSQLite(t)
	w := newSQLiteWriter(t, fdb)
	fencetest.WriterSuite{
		New:     func(t *testing.T) fence.FencedWriter { return w },
		BadKeys: badKeys,
	}.Run(t)
}

func TestSQLiteAcquirerConformance(t *testing.T) {
	t.Parallel() // its cases use names of their own; it overlaps the other suites, not the sequential tests
	raw, fdb := openSQLite(t)
	a := newSQLiteAcquirer(t, fdb)
	fencetest.AcquirerSuite{Parallel: true,
		New:    func(t *testing.T) fence.Acquirer { return a },
		MaxTTL: sqlfence.MaxTTL, BadNames: badKeys,
		DeleteState: deleteLeaseRow(stdExec(raw, dollar)),
	}.Run(t)
}

// TestSQLiteAcrossHandles runs the acquirer suite with every acquirer on its
// own database handle on one file, as separate processes would share it: the
// suite's New opens a handle each time it is called, so a case that takes two
// acquirers gets two handles.
func TestSQLiteAcrossHandles(t *testing.T) {
	t.Parallel() // its cases use names of their own; it overlaps the other suites, not the sequential tests
	path := filepath.Join(t.TempDir(), "shared.db")
	var handles atomic.Int32
	open := func(t *testing.T) fence.Acquirer {
		db, err := sqlfence.OpenSQLite(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		handles.Add(1)
		return newSQLiteAcquirer(t, sqlfence.SQLite(db))
	}
	t.Run("suite", func(t *testing.T) {
		fencetest.AcquirerSuite{Parallel: true, New: open, MaxTTL: sqlfence.MaxTTL, BadNames: badKeys}.Run(t)
	})
	// Every case of the suite asks New for its acquirers, one a case at least.
	if n := handles.Load(); n < 15 {
		t.Errorf("the suite opened %d handles: it did not get one per acquirer", n)
	}
	// Leases taken on one handle are seen on another.
	a1, a2 := open(t), open(t)
	l := mustGrant(t, context.Background(), a1, "shared", 30e9)
	if _, err := a2.TryAcquire(context.Background(), "shared", 30e9); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("second handle: err = %v, want ErrHeld", err)
	}
	if err := l.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	l2 := mustGrant(t, context.Background(), a2, "shared", 30e9)
	if l2.Token() != l.Token()+1 {
		t.Errorf("token on the second handle = %d, want %d", l2.Token(), l.Token()+1)
	}
	_ = l2.Release(context.Background())
	// The suite, with New and NewOther each on a handle of its own, and the
	// lease rows deleted through a third.
	raw, err := sqlfence.OpenSQLite(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { raw.Close() })
	fencetest.AcquirerSuite{Parallel: true, New: open, NewOther: open, MaxTTL: sqlfence.MaxTTL, BadNames: badKeys,
		DeleteState: deleteLeaseRow(stdExec(raw, dollar))}.Run(t)
}

// badKeys are keys and lock names sqlfence refuses on every dialect: what
// PostgreSQL cannot store as indexed text (NUL, invalid UTF-8, too long for a
// btree entry), and one past MaxKeyBytes.
var badKeys = []string{
	"nul\x00byte",
	"bad utf-8 \xff\xfe",
	strings.Repeat("k", sqlfence.MaxKeyBytes+1),
	strings.Repeat("k", 1<<20),
}

// TestSQLiteFloorReadWhenRowIsCreated (tokens never go backwards): on SQLite a new lease row
// starts its counter at the host's clock in microseconds. That clock must be
// read when the row is created, not when the grant (or Bump) was called: a
// call that waits for a connection of a busy pool (or for SQLite's write
// lock) while another handle creates the row, hands out its token and the
// row is deleted, must not then create the row with its older reading, a
// token below the one handed out meanwhile.
//
// Handle 1 has one connection, which the test holds; the call on it is seen
// waiting for it (the pool's WaitCount) before handle 2 grants and the row
// is deleted, so the order is forced, not slept into.
func TestSQLiteFloorReadWhenRowIsCreated(t *testing.T) {
	for _, op := range []string{"TryAcquire", "Bump"} {
		t.Run(op, func(t *testing.T) {
			ctx := context.Background()
			path := filepath.Join(t.TempDir(), "floor.db")
			h1, err := sqlfence.OpenSQLite(path)
			if err != nil {
				t.Fatal(err)
			}
			defer h1.Close()
			h1.SetMaxOpenConns(1)
			h2, err := sqlfence.OpenSQLite(path)
			if err != nil {
				t.Fatal(err)
			}
			defer h2.Close()
			a1 := newSQLiteAcquirer(t, sqlfence.SQLite(h1))
			a2 := newSQLiteAcquirer(t, sqlfence.SQLite(h2))
			name := fencetest.Name("floor-late")

			held, err := h1.Conn(ctx) // handle 1's only connection
			if err != nil {
				t.Fatal(err)
			}
			type result struct {
				l   fence.Lease
				err error
			}
			done := make(chan result, 1)
			go func() {
				if op == "Bump" {
					done <- result{nil, a1.Bump(ctx, name, 1)}
					return
				}
				l, err := a1.TryAcquire(ctx, name, time.Minute)
				done <- result{l, err}
			}()
			for deadline := time.Now().Add(10 * time.Second); h1.Stats().WaitCount == 0; time.Sleep(time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("the call on handle 1 never waited for its connection")
				}
			}
			// Meanwhile another process grants the name, and the row is deleted.
			lb := mustGrant(t, ctx, a2, name, time.Minute)
			t.Logf("handle 2 granted token %d while handle 1's %s waited", lb.Token(), op)
			if err := lb.Release(ctx); err != nil {
				t.Fatal(err)
			}
			if _, err := h2.ExecContext(ctx, "DELETE FROM fence_leases WHERE name = $1", name); err != nil {
				t.Fatal(err)
			}
			held.Close() // handle 1's call goes on
			r := <-done
			if r.err != nil {
				t.Fatalf("%s on handle 1: %v", op, r.err)
			}
			l := r.l
			if op == "Bump" { // the next grant shows where the bumped row starts
				if l, err = a2.TryAcquire(ctx, name, time.Minute); err != nil {
					t.Fatal(err)
				}
			}
			defer l.Release(ctx)
			if l.Token() <= lb.Token() {
				t.Fatalf("after %s on handle 1: token %d, not above %d, granted on handle 2 before: the row was created with a clock reading from before that grant", op, l.Token(), lb.Token())
			}
			t.Logf("after %s on handle 1: token %d", op, l.Token())
		})
	}
}

// TestSQLiteIdempotencyFenceAfterPurgeAtOnce (tokens never go backwards): Store.Begin
// promises a fence larger than any the key had, also after Purge removed its
// record. A key claimed, released, purged and claimed again within one
// millisecond must not get the fence it had: on SQLite, whose clock counts
// milliseconds, a new record's fence must come from a microsecond clock.
// Two records of one key in state claimed with one fence are one to Update's
// compare-and-set.
func TestSQLiteIdempotencyFenceAfterPurgeAtOnce(t *testing.T) {
	ctx := context.Background()
	_, fdb := openSQLite(t)
	s := idemStore(t, fdb)
	key := fencetest.Name("purged-at-once")
	var prev fence.Token
	for i := 0; i < 50; i++ {
		rec, created, err := s.Begin(ctx, key, "fp", "owner", time.Minute)
		if err != nil || !created {
			t.Fatalf("claim %d: created %v, %v", i, created, err)
		}
		if rec.Fence <= prev {
			t.Fatalf("claim %d after the record was purged: fence %d, not above the key's earlier fence %d", i, rec.Fence, prev)
		}
		prev = rec.Fence
		if _, err := s.Update(ctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Released, Fence: rec.Fence}); err != nil {
			t.Fatal(err)
		}
		if n, err := s.Purge(ctx); err != nil || n != 1 {
			t.Fatalf("Purge: %d, %v; want 1 record removed", n, err)
		}
	}
}

// lockSQLiteFile takes the file's write lock (a write transaction) through a
// handle of its own, as another process writing for a long time would; the
// returned function lets it go.
func lockSQLiteFile(t *testing.T, path string) (unlock func()) {
	t.Helper()
	ctx := context.Background()
	db, err := sqlfence.OpenSQLite(path)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{"BEGIN IMMEDIATE", "CREATE TABLE IF NOT EXISTS held(a)"} {
		if _, err := conn.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	done := false
	unlock = func() {
		if done {
			return
		}
		done = true
		if _, err := conn.ExecContext(ctx, "COMMIT"); err != nil {
			t.Errorf("COMMIT: %v", err)
		}
		conn.Close()
		db.Close()
	}
	t.Cleanup(unlock)
	return unlock
}

// TestSQLiteAcquireOnALockedFile (stalled waiters): while another
// handle keeps the file's write lock for longer than the 10s busy timeout, an
// Acquire keeps its context's deadline and ends as a wait that ran out
// (ErrHeld with the deadline), on the pool's idle connection and on a
// connection the pool must open then; a waiting Acquire with time to spare is
// granted once the file is free, instead of ending with SQLITE_BUSY (it did,
// after the busy timeout); and nothing is left held.
func TestSQLiteAcquireOnALockedFile(t *testing.T) {
	if testing.Short() {
		t.Skip("holds a lock past the 10s busy timeout; skipped with -short")
	}
	for _, tc := range []struct {
		name  string
		fresh bool // no idle connection: the pool opens one under the Acquire
	}{{"idle-connection", false}, {"new-connection", true}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			path := filepath.Join(t.TempDir(), "busy.db")
			db, err := sqlfence.OpenSQLite(path)
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			a := newSQLiteAcquirer(t, sqlfence.SQLite(db))
			if tc.fresh {
				db.SetMaxIdleConns(0)
			}
			unlock := lockSQLiteFile(t, path)

			const wait = time.Second
			dctx, cancel := context.WithTimeout(ctx, wait)
			start := time.Now()
			l, err := a.Acquire(dctx, "busy", time.Minute)
			took := time.Since(start)
			cancel()
			if err == nil {
				l.Release(ctx)
				t.Fatal("granted while another handle held the file locked")
			}
			if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("Acquire on the locked file: %v, want ErrHeld and DeadlineExceeded", err)
			}
			// A second for the call to notice and return, beyond its deadline.
			if took > wait+time.Second {
				t.Errorf("Acquire with a %v deadline returned after %v (the 10s busy timeout ignored the context)", wait, took)
			}

			// A waiter with time to spare, while the lock is held past the
			// busy timeout, is granted once the file is free.
			got := goLease(func() (fence.Lease, error) {
				wctx, cancel := context.WithTimeout(ctx, time.Minute)
				defer cancel()
				return a.Acquire(wctx, "busy", time.Minute)
			})
			select {
			case r := <-got:
				t.Fatalf("waiting Acquire returned while the file was locked: %v, %v", r.l, r.err)
			case <-time.After(11 * time.Second): // past the busy timeout: this wait is the fault
			}
			unlock()
			r := <-got
			if r.err != nil {
				t.Fatalf("waiting Acquire after the lock ended: %v, want granted", r.err)
			}
			if err := r.l.Release(ctx); err != nil {
				t.Fatal(err)
			}
			// The timed-out Acquire left nothing held.
			l2, err := a.TryAcquire(ctx, "busy", time.Minute)
			if err != nil {
				t.Fatalf("TryAcquire after both: %v", err)
			}
			l2.Release(ctx)
		})
	}
}

// TestOpenSQLiteWaitsOutALongLock: another connection holds the file locked
// (exclusive locking mode, in a write transaction) for longer than the 10s
// busy timeout. OpenSQLite keeps trying and opens the file once the lock is
// gone, instead of answering SQLITE_BUSY (a test sharing one file among 30
// handles on a loaded machine got "database is locked" from OpenSQLite).
func TestOpenSQLiteWaitsOutALongLock(t *testing.T) {
	t.Parallel() // a SQLite file of its own; it waits out a file lock held for seconds
	if testing.Short() {
		t.Skip("holds a lock for 11s; skipped with -short")
	}
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "locked.db")
	db, err := sqlfence.OpenSQLite(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{"PRAGMA locking_mode=EXCLUSIVE", "BEGIN EXCLUSIVE", "CREATE TABLE held(a)"} {
		if _, err := conn.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	type result struct {
		err error
		at  time.Time
	}
	opened := make(chan result, 1)
	go func() {
		db2, err := sqlfence.OpenSQLite(path)
		if err == nil {
			defer db2.Close()
			// The file is readable through the new handle.
			var n int
			err = db2.QueryRow("SELECT count(*) FROM held").Scan(&n)
		}
		opened <- result{err, time.Now()}
	}()
	// The lock is held past the busy timeout: this wait is the fault.
	select {
	case r := <-opened:
		t.Fatalf("OpenSQLite returned while the file was locked: %v", r.err)
	case <-time.After(11 * time.Second):
	}
	for _, q := range []string{"COMMIT", "PRAGMA locking_mode=NORMAL", "SELECT 1"} {
		if _, err := conn.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if err := conn.Close(); err != nil {
		t.Fatal(err)
	}
	db.Close() // the exclusive mode ends with the connection
	unlocked := time.Now()
	select {
	case r := <-opened:
		if r.err != nil {
			t.Fatalf("OpenSQLite after the lock was held 11s: %v, want the file opened once it was free", r.err)
		}
		t.Logf("opened %v after the lock ended", r.at.Sub(unlocked))
	case <-time.After(30 * time.Second):
		t.Fatal("OpenSQLite still waiting 30s after the lock ended")
	}
}

// SQLite's busy file: a waiting Acquire waits on through SQLITE_BUSY.
// Every test here runs against real SQLite files; the file's write lock is
// held through another handle with lockSQLiteFile, as
// another process writing for a long time would.

func openSQLiteAt(t *testing.T, path string) *sqlfence.DB {
	t.Helper()
	db, err := sqlfence.OpenSQLite(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return sqlfence.SQLite(db)
}

// TestSQLiteAcquireAfterALockIsNotAlreadyLost (nobody keeps a free lock from the others): an Acquire
// whose grant statement waited for the file's write lock (inside SQLite's busy
// handler, or after SQLITE_BUSY now that Acquire waits on) is granted once the
// file is free. The lease it returns with a nil error must be live: its local
// deadline may not be counted from before the wait for the lock, or the
// holder is handed a lease already lost while the row keeps the name from
// everyone else for the ttl.
func TestSQLiteAcquireAfterALockIsNotAlreadyLost(t *testing.T) {
	t.Parallel() // a SQLite file of its own; it waits out a file lock held for seconds
	if testing.Short() {
		t.Skip("holds a file lock for seconds")
	}
	for _, tc := range []struct {
		name string
		hold time.Duration
	}{
		{"within-busy-timeout", 3 * time.Second},
		{"past-busy-timeout", 12 * time.Second}, // a waiting Acquire waits on through SQLITE_BUSY
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			path := filepath.Join(t.TempDir(), "short.db")
			a := newSQLiteAcquirer(t, openSQLiteAt(t, path))
			other := newSQLiteAcquirer(t, openSQLiteAt(t, path)) // another process
			unlock := lockSQLiteFile(t, path)

			const ttl = time.Second
			type res struct {
				l     fence.Lease
				err   error
				live  bool
				cause error
			}
			got := make(chan res, 1)
			go func() {
				wctx, cancel := context.WithTimeout(ctx, time.Minute)
				defer cancel()
				l, err := a.Acquire(wctx, "short", ttl)
				r := res{l: l, err: err}
				if l != nil {
					r.live, r.cause = l.Context().Err() == nil, context.Cause(l.Context())
				}
				got <- r
			}()
			select {
			case r := <-got:
				t.Fatalf("Acquire returned while the file was locked: %v, %v", r.l, r.err)
			case <-time.After(tc.hold): // the fault: the file stays locked this long
			}
			unlock()
			r := <-got
			if r.err != nil {
				t.Fatalf("Acquire after the lock ended: %v, want granted", r.err)
			}
			defer r.l.Release(ctx)
			if !r.live {
				t.Errorf("Acquire (ttl %v) returned a nil error with a lease whose Context was already done (cause: %v): "+
					"granted after waiting %v for the file's lock, its local deadline counted from before that wait", ttl, r.cause, tc.hold)
				// The holder was told it lost the lease: the name must be free.
				if l2, err := other.TryAcquire(ctx, "short", ttl); err != nil {
					t.Errorf("another handle's TryAcquire right after: %v: the row of a lease already lost holds the name (nobody may keep a free lock from the others)", err)
				} else {
					l2.Release(ctx)
				}
			}
		})
	}
}

// TestSQLiteTryAcquireOnALockedFileBounded: on a file another handle
// keeps locked, TryAcquire without a deadline waits for the file's lock at
// most SQLite's 10s busy timeout (as its doc says: a TryAcquire never waits
// for a holder's lease, but a statement waits for the file), then returns
// SQLITE_BUSY, which is neither ErrHeld nor ErrUnknown, and nothing is granted.
// (An answer within 2s would be nicer, but the wait for the file's lock is
// kept and documented, as PostgreSQL's TryAcquire waits for a row lock.)
func TestSQLiteTryAcquireOnALockedFileBounded(t *testing.T) {
	t.Parallel() // a SQLite file of its own; it waits out a file lock held for seconds
	if testing.Short() {
		t.Skip("holds a file lock for seconds")
	}
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "try.db")
	a := newSQLiteAcquirer(t, openSQLiteAt(t, path))
	unlock := lockSQLiteFile(t, path)
	start := time.Now()
	l, err := a.TryAcquire(ctx, "try", time.Minute)
	took := time.Since(start)
	unlock()
	if err == nil {
		l.Release(ctx)
		t.Fatal("TryAcquire granted while another handle held the file locked")
	}
	if errors.Is(err, fence.ErrHeld) || errors.Is(err, fence.ErrUnknown) || !strings.Contains(err.Error(), "SQLITE_BUSY") {
		t.Errorf("TryAcquire on a locked file: %v, want SQLite's busy error (neither ErrHeld nor ErrUnknown)", err)
	}
	// One busy timeout (10s), with room for a loaded machine's late timers;
	// a second statement waiting out the timeout again would take 20s.
	if took >= 20*time.Second {
		t.Errorf("TryAcquire on a locked file took %v (error %v): more than one 10s busy timeout", took, err)
	}
	// Nothing left held.
	l2, err := a.TryAcquire(ctx, "try", time.Minute)
	if err != nil {
		t.Fatalf("TryAcquire once the file is free: %v", err)
	}
	l2.Release(ctx)
}

// TestSQLiteDeadlinesOnALockedFile: while another handle keeps the
// file's write lock (past the busy timeout), every call with a 1s deadline
// returns within about its deadline, with the outcome it reports true once the
// file is free: three Acquire calls in one acquirer's line, an Acquire with
// AdvanceGuards (grant and guard in one transaction), a TryAcquire, Renew,
// Release, Bump, and an idempotency Begin.
func TestSQLiteDeadlinesOnALockedFile(t *testing.T) {
	if testing.Short() {
		t.Skip("holds a file lock for seconds")
	}
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "deadlines.db")
	fdb := openSQLiteAt(t, path)
	a := newSQLiteAcquirer(t, fdb)
	g, err := sqlfence.NewGuards(fdb, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	ag := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{AdvanceGuards: g})
	st, err := sqlfence.NewIdempotencyStore(fdb, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	lr := mustGrant(t, ctx, a, "renew", time.Minute)
	ll := mustGrant(t, ctx, a, "release", time.Minute)
	unlock := lockSQLiteFile(t, path)

	const wait = time.Second
	type outcome struct {
		op   string
		err  error
		took time.Duration
	}
	var (
		mu   sync.Mutex
		outs []outcome
		wg   sync.WaitGroup
	)
	run := func(op string, f func(ctx context.Context) error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dctx, cancel := context.WithTimeout(ctx, wait)
			defer cancel()
			start := time.Now()
			err := f(dctx)
			mu.Lock()
			outs = append(outs, outcome{op, err, time.Since(start)})
			mu.Unlock()
		}()
	}
	acquire := func(a *sqlfence.Acquirer, name string) func(context.Context) error {
		return func(ctx context.Context) error {
			l, err := a.Acquire(ctx, name, time.Minute)
			if err == nil {
				l.Release(context.Background())
				return errors.New("granted while the file was locked")
			}
			if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
				return fmt.Errorf("%w; want ErrHeld and DeadlineExceeded", err)
			}
			return nil
		}
	}
	for i := 0; i < 3; i++ {
		run(fmt.Sprintf("Acquire in line #%d", i), acquire(a, "line"))
	}
	run("Acquire with AdvanceGuards", acquire(ag, "guarded"))
	run("TryAcquire", func(ctx context.Context) error {
		l, err := a.TryAcquire(ctx, "try", time.Minute)
		if err == nil {
			l.Release(context.Background())
			return errors.New("granted while the file was locked")
		}
		if errors.Is(err, fence.ErrUnknown) {
			return fmt.Errorf("%w; SQLite knows nothing was granted", err)
		}
		return nil
	})
	run("Renew", func(ctx context.Context) error {
		if err := lr.Renew(ctx); err == nil || errors.Is(err, fence.ErrLost) {
			return fmt.Errorf("Renew on a locked file: %v, want an error that is not ErrLost", err)
		}
		return nil
	})
	run("Release", func(ctx context.Context) error {
		if err := ll.Release(ctx); err == nil || errors.Is(err, fence.ErrLost) {
			return fmt.Errorf("Release on a locked file: %v, want an error that is not ErrLost (nothing released)", err)
		}
		return nil
	})
	run("Bump", func(ctx context.Context) error {
		if err := a.Bump(ctx, "bump", fence.MaxToken-10); err == nil {
			return errors.New("Bump on a locked file succeeded")
		}
		return nil
	})
	run("idempotency Begin", func(ctx context.Context) error {
		_, claimed, err := st.Begin(ctx, "key", "fp", "me", time.Minute)
		if err == nil || claimed {
			return fmt.Errorf("Begin on a locked file: claimed %v, %v", claimed, err)
		}
		return nil
	})
	wg.Wait()
	unlock()
	for _, o := range outs {
		if o.err != nil {
			t.Errorf("%s: %v", o.op, o.err)
		}
		if o.took > wait+time.Second {
			t.Errorf("%s with a %v deadline returned after %v", o.op, wait, o.took)
		}
	}

	// What the errors said is what the file shows.
	if !t.Failed() {
		if err := lr.Renew(ctx); err != nil {
			t.Errorf("Renew once the file is free: %v (the lease must still be held)", err)
		}
		info, err := a.Inspect(ctx, "release")
		if err != nil || !info.Held || info.Token != ll.Token() {
			t.Errorf("after a failed Release: %+v, %v; want still held with token %d", info, err, ll.Token())
		}
		if info, err := a.Inspect(ctx, "bump"); !errors.Is(err, fence.ErrNotFound) {
			t.Errorf("after a failed Bump: %+v, %v; want no row", info, err)
		}
		if rec, err := st.Get(ctx, "key"); !errors.Is(err, fence.ErrNotFound) {
			t.Errorf("after a failed Begin: %+v, %v; want no record", rec, err)
		}
		for _, n := range []string{"line", "guarded", "try"} {
			l, err := a.TryAcquire(ctx, n, time.Minute)
			if err != nil {
				t.Errorf("TryAcquire %q once the file is free: %v (something was left held)", n, err)
				continue
			}
			l.Release(ctx)
		}
	}
}

// TestSQLiteWaitersAcrossHandlesOnALockedFile: six waiters, three on
// each of two handles (as two processes), wait for one name while a third
// handle keeps the file locked past the busy timeout; once it is free every
// waiter is granted in turn, never two at once, with tokens that grow in grant
// order, and no lease handed out already lost.
func TestSQLiteWaitersAcrossHandlesOnALockedFile(t *testing.T) {
	t.Parallel() // a SQLite file of its own; it waits out a file lock held for seconds
	if testing.Short() {
		t.Skip("holds a file lock for seconds")
	}
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "waiters.db")
	as := []*sqlfence.Acquirer{newSQLiteAcquirer(t, openSQLiteAt(t, path)), newSQLiteAcquirer(t, openSQLiteAt(t, path))}
	unlock := lockSQLiteFile(t, path)

	const perHandle = 3
	var (
		mu      sync.Mutex
		holding bool
		last    fence.Token
		granted int
		wg      sync.WaitGroup
		errs    = make(chan error, 2*perHandle)
		started = make(chan struct{}, 2*perHandle)
	)
	for _, a := range as {
		for i := 0; i < perHandle; i++ {
			wg.Add(1)
			go func(a *sqlfence.Acquirer) {
				defer wg.Done()
				wctx, cancel := context.WithTimeout(ctx, 90*time.Second)
				defer cancel()
				started <- struct{}{}
				l, err := a.Acquire(wctx, "shared", 30*time.Second)
				if err != nil {
					errs <- fmt.Errorf("Acquire: %w", err)
					return
				}
				mu.Lock()
				if holding {
					errs <- fmt.Errorf("token %d granted while another waiter held the lease", l.Token())
				}
				if l.Token() <= last {
					errs <- fmt.Errorf("token %d granted after token %d", l.Token(), last)
				}
				if l.Context().Err() != nil {
					errs <- fmt.Errorf("token %d returned already lost: %v", l.Token(), context.Cause(l.Context()))
				}
				holding, last = true, l.Token()
				granted++
				mu.Unlock()
				// The file (through this handle) shows this grant as the holder.
				if info, err := a.Inspect(ctx, "shared"); err != nil || !info.Held || info.Token != l.Token() {
					errs <- fmt.Errorf("token %d granted, the row shows %+v, %v", l.Token(), info, err)
				}
				mu.Lock()
				holding = false // the next grant may come only after this Release
				mu.Unlock()
				if err := l.Release(ctx); err != nil {
					errs <- fmt.Errorf("Release of token %d: %w", l.Token(), err)
				}
			}(a)
		}
	}
	for i := 0; i < 2*perHandle; i++ {
		<-started
	}
	time.Sleep(11 * time.Second) // the fault: locked past the 10s busy timeout
	mu.Lock()
	if granted != 0 {
		t.Errorf("%d granted while the file was locked", granted)
	}
	mu.Unlock()
	unlock()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if granted != 2*perHandle {
		t.Errorf("%d of %d waiters granted", granted, 2*perHandle)
	}
}

// TestSQLiteContextEndingAsAStatementCommits (an unknown outcome is never reported as definite): on SQLite
// every error is taken as definite (db.ambiguous is false), but
// modernc.org/sqlite returns ctx.Err() for a statement during which the
// context ended, also when the statement had committed by then. A Bump or a
// Release whose context ends as it commits must then not report a definite
// failure: the row shows what happened. The deadlines are spread over the
// statements' own duration, so some end just after the commit.
func TestSQLiteContextEndingAsAStatementCommits(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "race.db")
	fdb := openSQLiteAt(t, path)
	a := newSQLiteAcquirer(t, fdb)
	st, err := sqlfence.NewIdempotencyStore(fdb, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	// The statements' duration here, to spread the deadlines over it.
	start := time.Now()
	const probe = 50
	for i := 0; i < probe; i++ {
		if err := a.Bump(ctx, fmt.Sprintf("probe-%d", i), 1); err != nil {
			t.Fatal(err)
		}
	}
	d := time.Since(start) / probe
	t.Logf("a Bump takes about %v", d)
	// raced counts, per step, the tries in which the context ended after
	// the change landed (an error, and the row shows the change): the
	// window this test is for. It goes on until each step has been caught
	// in it, so a pass shows the race happened.
	var bumpHits, releaseHits, beginHits, tries int
	raced := map[string]int{}
	for i := 0; i < 3000 && (raced["bump"] == 0 || raced["release"] == 0 || raced["begin"] == 0); i++ {
		tries++
		timeout := time.Duration(i%60) * d / 40 // 0 .. 1.5 d
		// Bump of a name without a row: it creates one.
		name := fmt.Sprintf("bump-%d", i)
		bctx, cancel := context.WithTimeout(ctx, timeout)
		err := a.Bump(bctx, name, 1)
		cancel()
		if err != nil {
			if _, ierr := a.Inspect(ctx, name); ierr == nil {
				raced["bump"]++
			}
		}
		if err != nil && !errors.Is(err, fence.ErrUnknown) {
			if _, ierr := a.Inspect(ctx, name); ierr == nil {
				bumpHits++
				t.Errorf("Bump returned a definite error (%v), yet its row was created: the bump landed (an unknown outcome must not be reported as definite: want ErrUnknown or nil)", err)
			}
		}
		// Release of a held lease.
		name = fmt.Sprintf("release-%d", i)
		l := mustGrant(t, ctx, a, name, time.Minute)
		rctx, cancel := context.WithTimeout(ctx, timeout)
		err = l.Release(rctx)
		cancel()
		if err != nil {
			if info, ierr := a.Inspect(ctx, name); ierr == nil && !info.Held {
				raced["release"]++
			}
		}
		if err != nil && !errors.Is(err, fence.ErrUnknown) {
			if info, ierr := a.Inspect(ctx, name); ierr == nil && !info.Held {
				releaseHits++
				t.Errorf("Release returned a definite error (%v), yet the row shows it released (an unknown outcome must not be reported as definite: want ErrUnknown or nil)", err)
			}
		}
		// An idempotency claim.
		key := fmt.Sprintf("key-%d", i)
		cctx, cancel := context.WithTimeout(ctx, timeout)
		_, claimed, err := st.Begin(cctx, key, "fp", "me", time.Minute)
		cancel()
		if err != nil && !claimed {
			if rec, gerr := st.Get(ctx, key); gerr == nil && rec.Owner == "me" {
				raced["begin"]++
			}
		}
		if err != nil && !claimed && !errors.Is(err, fence.ErrUnknown) {
			if rec, gerr := st.Get(ctx, key); gerr == nil && rec.Owner == "me" {
				beginHits++
				t.Errorf("idempotency Begin returned a definite error (%v), yet the key is claimed by its owner (%s, fence %d) (an unknown outcome must not be reported as definite: want ErrUnknown)", err, rec.State, rec.Fence)
			}
		}
	}
	t.Logf("%d tries: the context ended after the change landed %d times on Bump, %d on Release, %d on Begin; %d, %d and %d of those misreported", tries, raced["bump"], raced["release"], raced["begin"], bumpHits, releaseHits, beginHits)
	for _, step := range []string{"bump", "release", "begin"} {
		if raced[step] == 0 {
			t.Errorf("%s: in %d tries the context never ended after the change landed: the race this test is for did not happen", step, tries)
		}
	}
}

// TestSQLiteAcquireDeadlinePastTheBusyTimeout: a deadline longer than
// the 10s busy timeout, on a file locked throughout: the first attempt ends
// with SQLITE_BUSY (now taken as held), the next one must still end with the
// deadline, as a wait that ran out (ErrHeld and DeadlineExceeded), for the
// head of a line, the waiter behind it, and an Acquire with AdvanceGuards;
// and nothing is left held.
func TestSQLiteAcquireDeadlinePastTheBusyTimeout(t *testing.T) {
	if testing.Short() {
		t.Skip("holds a file lock for seconds")
	}
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "past.db")
	fdb := openSQLiteAt(t, path)
	a := newSQLiteAcquirer(t, fdb)
	g, err := sqlfence.NewGuards(fdb, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	ag := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{AdvanceGuards: g})
	unlock := lockSQLiteFile(t, path)
	const wait = 12 * time.Second
	var wg sync.WaitGroup
	for i, c := range []struct {
		a    *sqlfence.Acquirer
		name string
	}{{a, "line"}, {a, "line"}, {ag, "guarded"}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dctx, cancel := context.WithTimeout(ctx, wait)
			defer cancel()
			start := time.Now()
			l, err := c.a.Acquire(dctx, c.name, time.Minute)
			took := time.Since(start)
			if err == nil {
				l.Release(ctx)
				t.Errorf("#%d: granted while the file was locked", i)
				return
			}
			if !errors.Is(err, fence.ErrHeld) || !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("#%d %s: %v, want ErrHeld and DeadlineExceeded", i, c.name, err)
			}
			if took > wait+time.Second {
				t.Errorf("#%d %s with a %v deadline returned after %v", i, c.name, wait, took)
			}
		}()
	}
	wg.Wait()
	unlock()
	for _, n := range []string{"line", "guarded"} {
		l, err := a.TryAcquire(ctx, n, time.Minute)
		if err != nil {
			t.Errorf("TryAcquire %q once the file is free: %v", n, err)
			continue
		}
		l.Release(ctx)
	}
}

// FuzzSQLiteEntryPoints drives the public entry points with arbitrary keys,
// names, ttls, tokens and values. Every call either succeeds with the documented
// outcome or fails with a documented error (ErrInvalid before touching the
// database, ErrStale, ErrHeld): never a panic, never a raw driver error from
// input that should have been refused, never a lease that does not exclude.
func FuzzSQLiteEntryPoints(f *testing.F) {
	f.Add("k", "n", int64(time.Second), uint64(1), []byte("v"))
	f.Add("", "", int64(0), uint64(0), []byte(nil))
	f.Add("nul\x00", "bad\xff", int64(-1), uint64(math.MaxUint64), []byte{0})
	f.Add("k", "n", int64(math.MaxInt64), uint64(fence.MaxToken), []byte("top"))
	f.Add("k", "n", int64(math.MinInt64), uint64(fence.MaxToken+1), []byte(""))
	f.Add(string(bytes.Repeat([]byte("k"), 1025)), "n", int64(1), uint64(2), []byte("x"))
	_, fdb := openSQLite(f)
	w, a := newSQLiteWriter(f, fdb), newSQLiteAcquirer(f, fdb)
	e := &fencetest.EntryPoints{Writer: w, Acquirer: a, MinTTL: 3 * time.Millisecond, MaxTTL: sqlfence.MaxTTL,
		Refuses: func(s string) bool { return leasekit.CheckText("", "", s, sqlfence.MaxKeyBytes) != nil }}
	f.Fuzz(func(t *testing.T, key, name string, ttlNs int64, token uint64, value []byte) {
		e.Check(t, key, name, ttlNs, token, value)
	})
}
