package sqlfence_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Faults injected against the real PostgreSQL server: backends terminated with
// pg_terminate_backend, and serialization failures provoked with a concurrent
// transaction.

func appPool(t *testing.T, params map[string]string, tr *counter) (*pgxpool.Pool, string) {
	app := "fencekit-" + fencetest.Name("fault")
	if params == nil {
		params = map[string]string{}
	}
	params["application_name"] = app
	return pgPool(t, pgOpts{params: params, tracer: tr}), app
}

// waitForLockWait waits until a backend of app waits for a lock.
func waitForLockWait(t *testing.T, admin *pgxpool.Pool, app string) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var pid int
		err := admin.QueryRow(context.Background(),
			`SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock' LIMIT 1`, app).Scan(&pid)
		if err == nil {
			return pid
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("no backend of %s started waiting for a lock", app)
	return 0
}

func TestKilledConnectionMidTransaction(t *testing.T) {
	ctx := context.Background()
	p, _ := appPool(t, nil, nil)
	admin := pgPool(t, pgOpts{})
	table := "killed_" + fencetest.Name("t")[2:]
	if _, err := admin.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s (id INT PRIMARY KEY, v TEXT)`, table)); err != nil {
		t.Fatal(err)
	}
	name := fencetest.Name("killed")
	tx, err := p.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	g := pgGuards(t, admin)
	if err := g.GuardPgx(ctx, tx, name, 9); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, fmt.Sprintf(`INSERT INTO %s VALUES (1, 'half')`, table)); err != nil {
		t.Fatal(err)
	}
	var pid int
	if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err == nil {
		t.Fatal("commit on a terminated connection succeeded")
	}
	var n int
	if err := admin.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM %s`, table)).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("%d rows of the killed transaction are visible", n)
	}
	// The guard did not advance either: a lower token still passes.
	if err := sqlfence.RunPgxTx(ctx, admin, nil, func(tx pgx.Tx) error { return g.GuardPgx(ctx, tx, name, 1) }); err != nil {
		t.Errorf("guard advanced by a transaction that never committed: %v", err)
	}
}

// TestLeaseAcrossKilledConnections: every connection of the holder's pool is
// terminated while it holds a lease. Renew fails or succeeds on a fresh
// connection, the lease stays held, and Release frees it.
func TestLeaseAcrossKilledConnections(t *testing.T) {
	ctx := context.Background()
	p, app := appPool(t, nil, nil)
	admin := pgPool(t, pgOpts{})
	a, _ := sqlfence.NewAcquirer(sqlfence.Pgx(p), nil)
	other, _ := sqlfence.NewAcquirer(sqlfence.Pgx(admin), nil)
	name := fencetest.Name("killconn")
	l, err := a.TryAcquire(ctx, name, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1`, app); err != nil {
		t.Fatal(err)
	}
	var renewErr error
	for i := 0; i < 3; i++ {
		if renewErr = l.Renew(ctx); renewErr == nil {
			break
		}
		if errors.Is(renewErr, fence.ErrLost) {
			t.Fatalf("Renew after the connection was killed: %v; the lease was still held", renewErr)
		}
	}
	if renewErr != nil {
		t.Fatalf("Renew never succeeded on a fresh connection: %v", renewErr)
	}
	if _, err := other.TryAcquire(ctx, name, time.Second); !errors.Is(err, fence.ErrHeld) {
		t.Fatalf("another acquirer during the lease: %v, want ErrHeld", err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatalf("Release: %v", err)
	}
	// No grant in between: the counter is still the lease's token (a
	// PostgreSQL grant takes the larger of the counter + 1 and the clock, so
	// the next token alone cannot tell).
	if info, err := other.Inspect(ctx, name); err != nil || info.Counter != l.Token() {
		t.Errorf("counter after the release: %+v, %v; want %d", info, err, l.Token())
	}
	l2, err := other.TryAcquire(ctx, name, time.Second)
	if err != nil {
		t.Fatalf("after release: %v", err)
	}
	if l2.Token() <= l.Token() {
		t.Errorf("next token %d, want above %d", l2.Token(), l.Token())
	}
	_ = l2.Release(ctx)
}

// TestGrantKilledWhileWaiting: a grant statement is terminated while it waits
// for the lease row; no lease is granted, and the row is left as it was.
func TestGrantKilledWhileWaiting(t *testing.T) {
	ctx := context.Background()
	p, app := appPool(t, nil, nil)
	admin := pgPool(t, pgOpts{})
	a, _ := sqlfence.NewAcquirer(sqlfence.Pgx(p), nil)
	other, _ := sqlfence.NewAcquirer(sqlfence.Pgx(admin), nil)
	name := fencetest.Name("killgrant")
	first := fencetest.TryLive(ctx, t, other, name, 50*time.Millisecond)
	time.Sleep(100 * time.Millisecond) // expired: the next grant would take the row over
	lockTx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lockTx.Exec(ctx, `SELECT 1 FROM fence_leases WHERE name = $1 FOR UPDATE`, name); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := a.TryAcquire(ctx, name, time.Minute)
		done <- err
	}()
	pid := waitForLockWait(t, admin, app)
	if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	err = <-done
	_ = lockTx.Rollback(ctx)
	if err == nil || errors.Is(err, fence.ErrHeld) {
		t.Fatalf("TryAcquire on a killed connection: %v, want a connection error", err)
	}
	var tok int64
	var expires, now int64
	if err := admin.QueryRow(ctx, `SELECT token, expires_at, (extract(epoch FROM clock_timestamp())*1000)::bigint FROM fence_leases WHERE name = $1`, name).Scan(&tok, &expires, &now); err != nil {
		t.Fatal(err)
	}
	if fence.Token(tok) != first.Token() || expires > now {
		t.Errorf("lease row after a killed grant: token %d expires in %dms, want token %d and expired", tok, expires-now, first.Token())
	}
	l, err := other.TryAcquire(ctx, name, time.Second)
	if err != nil {
		t.Fatalf("the lease is not cleanly free after a killed grant: %v", err)
	}
	if l.Token() <= first.Token() {
		t.Errorf("token after a killed grant %d, want above %d (the row showed %d before it)", l.Token(), first.Token(), tok)
	}
	_ = l.Release(ctx)
}

// TestSerializationFailureRetried: with REPEATABLE READ as the server default, a
// fenced write that waited for a concurrent update of its row fails with 40001;
// the writer runs it again and succeeds.
func TestSerializationFailureRetried(t *testing.T) {
	ctx := context.Background()
	tr := &counter{}
	p, app := appPool(t, map[string]string{"default_transaction_isolation": "repeatable read"}, tr)
	admin := pgPool(t, pgOpts{})
	w, _ := sqlfence.NewWriter(sqlfence.Pgx(p), nil)
	key := fencetest.Name("serial")
	if err := w.Write(ctx, key, []byte("v1"), 1); err != nil {
		t.Fatal(err)
	}
	tx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `UPDATE fence_values SET value = 'other' WHERE key = $1`, key); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- w.Write(ctx, key, []byte("v2"), 2) }()
	waitForLockWait(t, admin, app)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("Write after a serialization failure: %v", err)
	}
	if n := tr.serialization.Load(); n < 1 {
		t.Errorf("no serialization failure was provoked (%d); the test did not test the retry", n)
	}
	v, tok, err := w.Read(ctx, key)
	if err != nil || string(v) != "v2" || tok != 2 {
		t.Errorf("Read = %q, %d, %v; want v2, 2", v, tok, err)
	}
}
