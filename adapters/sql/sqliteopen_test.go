package sqlfence_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
)

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
