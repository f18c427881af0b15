package sqlfence_test

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
)

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

// TestSQLiteAcquireOnALockedFile (HAZARDS: stalled waiters): while another
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
			type res struct {
				l   fence.Lease
				err error
			}
			got := make(chan res, 1)
			go func() {
				wctx, cancel := context.WithTimeout(ctx, time.Minute)
				defer cancel()
				l, err := a.Acquire(wctx, "busy", time.Minute)
				got <- res{l, err}
			}()
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
