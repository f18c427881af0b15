package sqlfence_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
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
	l := mustGrant(t, ctx, a, name, 10*time.Second)
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
	// A 10s lease: a 1s one was granted past its local deadline on a
	// loaded machine, and given back.
	l2, err := other.TryAcquire(ctx, name, 10*time.Second)
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

// proxied is a database reached through a fault proxy, and the same database
// reached directly, to check what the server holds.
type proxied struct {
	name   string
	proxy  *faultnet.Proxy
	db     *sqlfence.DB // through the proxy
	direct *sqlfence.DB
	// runTx runs f in a transaction through the proxy with RunTx or RunPgxTx;
	// exec runs an operator's statement (placeholders %s) inside it.
	runTx func(ctx context.Context, f func(guard func(name string, tok fence.Token) error, exec func(q string, args ...any) error) error) error
	// count counts the rows of table whose id is id, directly.
	count  func(t *testing.T, table, id string) int
	create func(t *testing.T, table string)
	guards *sqlfence.Guards
}

// proxiedPool is a pgx pool on the test PostgreSQL server through proxy, of
// at most maxConns connections (0: pgx's default).
func proxiedPool(t testing.TB, proxy *faultnet.Proxy, maxConns int32) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.Port())
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

// checkExtendedRowGivenUp checks that other is granted name at once after
// a renewal (what) that ended past the lease's local deadline: the row it
// extended was given up.
func checkExtendedRowGivenUp(t *testing.T, other *sqlfence.Acquirer, name, what string) {
	t.Helper()
	ctx := context.Background()
	l2, err := other.TryAcquire(ctx, name, time.Second)
	if err != nil {
		info, _ := other.Inspect(ctx, name)
		t.Fatalf("another acquirer after %s: %v (%+v); the extended row was not given up", what, err, info)
	}
	_ = l2.Release(ctx)
}

// mysqlAddr is the test MySQL server's address.
func mysqlAddr(t testing.TB) string { return mysqlConfig(t).Addr }

// proxiedMySQL is a database/sql handle on the test MySQL server through proxy.
func proxiedMySQL(t testing.TB, proxy *faultnet.Proxy) *sql.DB {
	return mysqlDB(t, proxy.Addr(), "")
}

// pgTarget is the test PostgreSQL server's address.
func pgTarget(t testing.TB) string {
	cfg, err := pgx.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Host + ":" + strconv.Itoa(int(cfg.Port))
}

// lostReplyTargets are PostgreSQL through pgx and through database/sql, and
// MySQL or MariaDB, each behind a fault proxy.
func lostReplyTargets(t *testing.T) []proxied {
	direct := pgPool(t, pgOpts{})
	idemStore(t, sqlfence.Pgx(direct))
	pgCount := func(t *testing.T, table, id string) int {
		var n int
		if err := direct.QueryRow(context.Background(), fmt.Sprintf("SELECT count(*) FROM %s WHERE id = $1", table), id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	pgCreate := func(t *testing.T, table string) {
		if _, err := direct.Exec(context.Background(), fmt.Sprintf("CREATE TABLE %s (id TEXT PRIMARY KEY)", table)); err != nil {
			t.Fatal(err)
		}
	}
	pgGuards := mustGuards(t, sqlfence.Pgx(direct))

	pxPgx := faultnet.Start(t, pgTarget(t))
	pool := proxiedPool(t, pxPgx, 0)
	pxStd := faultnet.Start(t, pgTarget(t))
	std := stdlib.OpenDBFromPool(proxiedPool(t, pxStd, 0))
	t.Cleanup(func() { std.Close() })

	myRaw, myDirect := openMySQL(t, "")
	pxMy := faultnet.Start(t, mysqlAddr(t))
	my := proxiedMySQL(t, pxMy)
	myGuards := mustGuards(t, myDirect)

	stdTx := func(db *sql.DB, g *sqlfence.Guards, ph string) func(context.Context, func(func(string, fence.Token) error, func(string, ...any) error) error) error {
		return func(ctx context.Context, f func(func(string, fence.Token) error, func(string, ...any) error) error) error {
			return sqlfence.RunTx(ctx, db, nil, func(tx *sql.Tx) error {
				return f(func(name string, tok fence.Token) error { return g.Guard(ctx, tx, name, tok) },
					func(q string, args ...any) error {
						_, err := tx.ExecContext(ctx, fmt.Sprintf(q, ph), args...)
						return err
					})
			})
		}
	}
	return []proxied{
		{
			name: "postgres-pgx", proxy: pxPgx, db: sqlfence.Pgx(pool), direct: sqlfence.Pgx(direct),
			runTx: func(ctx context.Context, f func(func(string, fence.Token) error, func(string, ...any) error) error) error {
				return sqlfence.RunPgxTx(ctx, pool, nil, func(tx pgx.Tx) error {
					return f(func(name string, tok fence.Token) error { return pgGuards.GuardPgx(ctx, tx, name, tok) },
						func(q string, args ...any) error { _, err := tx.Exec(ctx, fmt.Sprintf(q, "$1"), args...); return err })
				})
			},
			count: pgCount, create: pgCreate, guards: pgGuards,
		},
		{
			name: "postgres-database-sql", proxy: pxStd, db: sqlfence.Postgres(std), direct: sqlfence.Pgx(direct),
			runTx: stdTx(std, pgGuards, "$1"), count: pgCount, create: pgCreate, guards: pgGuards,
		},
		{
			name: "mysql", proxy: pxMy, db: sqlfence.MySQL(my), direct: myDirect,
			runTx: stdTx(my, myGuards, "?"),
			count: func(t *testing.T, table, id string) int {
				var n int
				if err := myRaw.QueryRow(fmt.Sprintf("SELECT count(*) FROM %s WHERE id = ?", table), id).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			},
			create: func(t *testing.T, table string) {
				if _, err := myRaw.Exec(fmt.Sprintf("CREATE TABLE %s (id VARCHAR(64) PRIMARY KEY)", table)); err != nil {
					t.Fatal(err)
				}
			},
			guards: myGuards,
		},
	}
}

// carrying matches the request that carries s (a key's bytes are in the
// request that executes the statement, not in a prepare).
func carrying(s string) func([]byte) bool {
	return func(b []byte) bool { return faultnet.Carries(b, s) }
}

// committing matches the request that commits a transaction; not a
// statement that sets synchronous_commit (sqlfence's PostgreSQL statements
// that must reach the disk do).
func committing(b []byte) bool {
	l := bytes.ToLower(b)
	return bytes.Contains(bytes.ReplaceAll(l, []byte("synchronous_commit"), nil), []byte("commit"))
}

// lose arms a lost reply for the next request that match accepts, runs f, and
// checks that the fault was taken.
func lose(t *testing.T, p *faultnet.Proxy, match func([]byte) bool, f func() error) error {
	t.Helper()
	p.LoseReply(match)
	err := f()
	if n := p.Pending(); n != 0 {
		t.Fatalf("the lost reply was never taken (%d pending): the test did not test it", n)
	}
	return err
}

func wantUnknown(t *testing.T, what string, err error) {
	t.Helper()
	if !errors.Is(err, fence.ErrUnknown) {
		t.Errorf("%s whose reply was lost: %v, want an error matching fence.ErrUnknown", what, err)
	}
}

// TestLostReplies (an unknown outcome is never reported as definite): a statement reaches the server, is applied,
// and its reply is lost. Each step must say so (fence.ErrUnknown) or
// recognise its own applied change; never a bare transport error, never a
// definite failure for a change that landed.
func TestLostReplies(t *testing.T) {
	for _, p := range lostReplyTargets(t) {
		t.Run(p.name, func(t *testing.T) {
			ctx := context.Background()
			w, _ := sqlfence.NewWriter(p.db, nil)
			check, _ := sqlfence.NewWriter(p.direct, nil)
			t.Run("write", func(t *testing.T) {
				for _, existing := range []bool{false, true} {
					key := fencetest.Name("lost-write")
					if existing {
						if err := w.Write(ctx, key, []byte("old"), 1); err != nil {
							t.Fatal(err)
						}
					}
					wantUnknown(t, "Write", lose(t, p.proxy, carrying(key), func() error { return w.Write(ctx, key, []byte("new"), 5) }))
					v, tok, err := check.Read(ctx, key)
					// On MySQL the first statement for a new key is an UPDATE
					// that finds no row: its lost reply hid nothing.
					unapplied := !existing && p.name == "mysql" && errors.Is(err, fence.ErrNotFound)
					if !unapplied && (err != nil || string(v) != "new" || tok != 5) {
						t.Errorf("the key after the lost write: %q, %d, %v; want new, 5 (the write landed)", v, tok, err)
					}
				}
			})
			t.Run("delete", func(t *testing.T) {
				key := fencetest.Name("lost-delete")
				if err := w.Write(ctx, key, []byte("v"), 1); err != nil {
					t.Fatal(err)
				}
				wantUnknown(t, "Delete", lose(t, p.proxy, carrying(key), func() error { return w.Delete(ctx, key, 2) }))
				if _, _, err := check.Read(ctx, key); !errors.Is(err, fence.ErrNotFound) {
					t.Errorf("the key after the lost delete: %v, want ErrNotFound (the delete landed)", err)
				}
				if err := check.Write(ctx, key, []byte("stale"), 1); !errors.Is(err, fence.ErrStale) {
					t.Errorf("a write below the lost delete's token: %v, want ErrStale", err)
				}
			})
			t.Run("guard commit", func(t *testing.T) {
				table := "lost_" + fencetest.Name("t")[2:]
				p.create(t, table)
				name, id := fencetest.Name("lost-guard"), fencetest.Name("row")
				err := lose(t, p.proxy, committing, func() error {
					return p.runTx(ctx, func(guard func(string, fence.Token) error, exec func(string, ...any) error) error {
						if err := guard(name, 7); err != nil {
							return err
						}
						return exec("INSERT INTO "+table+" (id) VALUES (%s)", id)
					})
				})
				wantUnknown(t, "a guarded transaction's commit", err)
				if n := p.count(t, table, id); n != 1 {
					t.Errorf("%d rows of the committed transaction, want 1", n)
				}
			})
			t.Run("acquire", func(t *testing.T) {
				a, _ := sqlfence.NewAcquirer(p.db, nil)
				other, _ := sqlfence.NewAcquirer(p.direct, nil)
				name := fencetest.Name("lost-lease")
				var l fence.Lease
				err := lose(t, p.proxy, carrying(name), func() (err error) {
					l, err = a.TryAcquire(ctx, name, time.Minute)
					return err
				})
				if err != nil {
					t.Fatalf("TryAcquire whose reply was lost: %v, want the applied grant recognised", err)
				}
				info, err := other.Inspect(ctx, name)
				if err != nil || !info.Held || info.Token != l.Token() {
					t.Fatalf("the lease row after a recognised grant: %+v, %v; want held by token %d", info, err, l.Token())
				}
				if err := l.Release(ctx); err != nil {
					t.Fatal(err)
				}
			})
			t.Run("renew release", func(t *testing.T) {
				a, _ := sqlfence.NewAcquirer(p.db, nil)
				other, _ := sqlfence.NewAcquirer(p.direct, nil)
				name := fencetest.Name("lost-renew")
				l := mustGrant(t, ctx, a, name, time.Minute)
				if err := lose(t, p.proxy, carrying(name), func() error { return l.Renew(ctx) }); err != nil {
					t.Errorf("Renew whose reply was lost: %v, want nil (it landed, or its retry did)", err)
				}
				if err := l.Context().Err(); err != nil {
					t.Errorf("the lease context after a renewal: %v", err)
				}
				if err := lose(t, p.proxy, carrying(name), func() error { return l.Release(ctx) }); err != nil {
					t.Errorf("Release whose reply was lost: %v, want nil (it landed)", err)
				}
				l2, err := other.TryAcquire(ctx, name, time.Second)
				if err != nil {
					t.Fatalf("another acquirer after the lost release: %v, want the lock free", err)
				}
				_ = l2.Release(ctx)
			})
			t.Run("idempotency", func(t *testing.T) {
				s, _ := sqlfence.NewIdempotencyStore(p.db, nil)
				direct, _ := sqlfence.NewIdempotencyStore(p.direct, nil)
				key := fencetest.Name("lost-idem")
				wantUnknown(t, "Begin", lose(t, p.proxy, carrying(key), func() error {
					_, _, err := s.Begin(ctx, key, "fp", "me", time.Minute)
					return err
				}))
				rec, err := direct.Get(ctx, key)
				if err != nil || rec.State != idempotency.Claimed || rec.Owner != "me" {
					t.Fatalf("the record after a lost claim: %+v, %v; want claimed by me", rec, err)
				}
				wantUnknown(t, "Update", lose(t, p.proxy, carrying(key), func() error {
					_, err := s.Update(ctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me", Lease: time.Minute})
					return err
				}))
				if rec, err := direct.Get(ctx, key); err != nil || rec.State != idempotency.Armed {
					t.Errorf("the record after a lost arm: %+v, %v; want armed", rec, err)
				}
			})
		})
	}
}

// TestRenewConfirmedAfterLocalDeadline (nobody keeps a free lock from the others): a renewal reaches the
// server while the lease is live there, and its reply comes back after the
// lease's local deadline (a slow network). Renew returns ErrLost, and the row
// the server extended is given up: another acquirer is granted at once.
func TestRenewConfirmedAfterLocalDeadline(t *testing.T) {
	const ttl, drift, delay = 8 * time.Second, 7 * time.Second, 700 * time.Millisecond
	for _, p := range lostReplyTargets(t) {
		t.Run(p.name, func(t *testing.T) {
			t.Parallel() // each target has its own proxy
			ctx := context.Background()
			// The local deadline is ttl - drift = 1s after the grant's
			// request; a renewal sent before it reaches the server after
			// delay (well inside its 8s) and is confirmed after 2 x delay,
			// past that deadline.
			a, _ := sqlfence.NewAcquirer(p.db, &sqlfence.AcquirerOptions{Drift: drift})
			other, _ := sqlfence.NewAcquirer(p.direct, nil)
			for try := 1; ; try++ {
				name := fencetest.Name("slow-renew")
				l := mustGrant(t, ctx, a, name, ttl)
				if l.Context().Err() != nil {
					// A loaded machine took the whole second before the
					// Renew could be sent (it happens: the Renew then
					// sends nothing, and the row is held for its first
					// ttl, as for any lease left to expire): the case
					// proves nothing; try again.
					if try == 3 {
						t.Fatalf("the lease's context was done before the Renew, 3 times: the case proved nothing")
					}
					t.Logf("try %d: the lease's context was done before the Renew could be sent: trying again", try)
					continue
				}
				p.proxy.Latency(delay, delay)
				err := l.Renew(ctx)
				p.proxy.Latency(0, 0)
				if !errors.Is(err, fence.ErrLost) {
					t.Fatalf("Renew confirmed after the local deadline: %v, want ErrLost", err)
				}
				checkExtendedRowGivenUp(t, other, name, "the late confirmation")
				return
			}
		})
	}
}

// TestMySQLLostReplyOfParameterPath (an unknown outcome is never reported as definite): on MySQL a value over the
// inline limit goes as a base64 parameter of a prepared statement (prepare,
// then execute); with a small packet limit every argument does. The execute
// reaches the server, is applied, and its reply is lost: Write says
// fence.ErrUnknown, and the value landed.
func TestMySQLLostReplyOfParameterPath(t *testing.T) {
	for _, params := range []string{"", "maxAllowedPacket=4096"} {
		t.Run("params="+params, func(t *testing.T) {
			ctx := context.Background()
			_, direct := openMySQL(t, params)
			px := faultnet.Start(t, mysqlAddr(t))
			my := mysqlDB(t, px.Addr(), params)
			w, _ := sqlfence.NewWriter(sqlfence.MySQL(my), nil)
			check, _ := sqlfence.NewWriter(direct, nil)
			for _, existing := range []bool{false, true} {
				key := fencetest.Name("lost-param")
				if existing {
					if err := w.Write(ctx, key, []byte("old"), 1); err != nil {
						t.Fatal(err)
					}
				}
				v := inlinePattern(6000)
				b64 := base64.StdEncoding.EncodeToString(v)
				err := lose(t, px, func(b []byte) bool { return bytes.Contains(b, []byte(b64[:64])) }, func() error { return w.Write(ctx, key, v, 5) })
				got, tok, rerr := check.Read(ctx, key)
				landed := rerr == nil && tok == 5 && bytes.Equal(got, v)
				if !errors.Is(err, fence.ErrUnknown) && !(err == nil && landed) {
					t.Errorf("Write (existing %v) whose execute reply was lost: %v (the value landed: %v), want ErrUnknown", existing, err, landed)
				}
			}
		})
	}
}

// pgExpiresAt reads name's expires_at in the default lease table, directly.
func pgExpiresAt(t *testing.T, direct *pgxpool.Pool, name string) int64 {
	t.Helper()
	var e int64
	if err := direct.QueryRow(context.Background(), "SELECT expires_at FROM fence_leases WHERE name = $1", name).Scan(&e); err != nil {
		t.Fatal(err)
	}
	return e
}

// TestRenewRetryNotSentAfterLostReply (an unknown outcome is never reported as definite): a renewal reaches the
// server and extends the row, and its reply is lost; Renew runs it again,
// and that retry sends nothing: the pool has no connection for it (a refused
// dial, or the context ends while another caller holds the pool's only
// connection). The first attempt may have extended the lease, so Renew
// cannot know: it must return an error matching fence.ErrUnknown (as
// Release and Acquire do in the same case), never a definite failure.
func TestRenewRetryNotSentAfterLostReply(t *testing.T) {
	direct := pgPool(t, pgOpts{})
	type handle struct {
		fdb *sqlfence.DB
		// hold takes the handle's only connection as soon as one is free,
		// and gives it back when release is called.
		hold func(ctx context.Context) (release func(), err error)
	}
	styles := map[string]func(t *testing.T, px *faultnet.Proxy) handle{
		"pgx": func(t *testing.T, px *faultnet.Proxy) handle {
			p := proxiedPool(t, px, 1)
			return handle{sqlfence.Pgx(p), func(ctx context.Context) (func(), error) {
				c, err := p.Acquire(ctx)
				if err != nil {
					return nil, err
				}
				return c.Release, nil
			}}
		},
		"database-sql": func(t *testing.T, px *faultnet.Proxy) handle {
			cc, err := pgx.ParseConfig(pgURLVia(t, px))
			if err != nil {
				t.Fatal(err)
			}
			db := stdlib.OpenDB(*cc)
			db.SetMaxOpenConns(1)
			t.Cleanup(func() { db.Close() })
			return handle{sqlfence.Postgres(db), func(ctx context.Context) (func(), error) {
				c, err := db.Conn(ctx)
				if err != nil {
					return nil, err
				}
				return func() { c.Close() }, nil
			}}
		},
	}
	for style, open := range styles {
		for _, retry := range []string{"refused dial", "context ends waiting for the pool"} {
			t.Run(style+"/"+retry, func(t *testing.T) {
				px := faultnet.Start(t, pgTarget(t))
				h := open(t, px)
				a := newAcquirerOn(t, h.fdb, nil)
				name := fencetest.Name("renew-retry")
				ctx := context.Background()
				l, err := a.TryAcquire(ctx, name, time.Minute) // the pool's one connection is open
				if err != nil {
					t.Fatal(err)
				}
				before := pgExpiresAt(t, direct, name)

				held := make(chan func(), 1)
				rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				defer cancel()
				switch retry {
				case "refused dial":
					px.Refuse(true) // the open connection goes on; a new one is refused
				default:
					// The connection is cut 300ms after the renewal is
					// forwarded; meanwhile another caller waits for the
					// pool's only connection, and takes the one the pool
					// opens once the cut one is gone.
					px.ReplyWindow(300 * time.Millisecond)
				}
				px.LoseReply(carrying(name))
				done := make(chan error, 1)
				go func() { done <- l.Renew(rctx) }()
				if retry != "refused dial" {
					for px.Pending() != 0 {
						select {
						case err := <-done:
							t.Fatalf("Renew returned before its request reached the proxy: %v", err)
						case <-time.After(time.Millisecond): // polling the proxy's state
						}
					}
					go func() {
						rel, err := h.hold(ctx)
						if err != nil {
							t.Error(err)
							rel = func() {}
						}
						held <- rel
					}()
				}
				err = <-done
				if retry != "refused dial" {
					(<-held)()
				}
				px.Refuse(false)
				if st := px.Stats(); st.LostReplies != 1 {
					t.Fatalf("%d lost replies, want 1: the test did not test it", st.LostReplies)
				}
				after := pgExpiresAt(t, direct, name)
				if after <= before {
					t.Fatalf("expires_at %d after the renewal, %d before: the lost renewal did not land, the test did not test it", after, before)
				}
				if err == nil {
					return // recognised (a later attempt got through): fine
				}
				if !errors.Is(err, fence.ErrUnknown) {
					t.Errorf("Renew whose first attempt extended the row (expires_at %d -> %d) and whose retry was not sent: %v; want an error matching fence.ErrUnknown", before, after, err)
				}
			})
		}
	}
}

// pgURLVia is the test server's URL with its host and port replaced by px's.
func pgURLVia(t *testing.T, px *faultnet.Proxy) string {
	t.Helper()
	cc, err := pgx.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	u := "postgres://" + cc.User + "@" + px.Addr() + "/" + cc.Database + "?sslmode=disable"
	if cc.Password != "" {
		u = "postgres://" + cc.User + ":" + cc.Password + "@" + px.Addr() + "/" + cc.Database + "?sslmode=disable"
	}
	return u
}

// TestRenewReplyLostPastLocalDeadline (nobody keeps a free lock from the others; an unknown outcome is never reported as definite): a renewal is sent
// before the lease's local deadline, reaches the server after it (the server
// still holds the lease: its ttl is longer than the local deadline by the
// drift), is applied, and its reply is lost. Renew must not leave the row
// extended for another ttl while telling the holder it lost the lease:
// another acquirer is granted at once afterwards.
func TestRenewReplyLostPastLocalDeadline(t *testing.T) {
	const ttl, drift = 10 * time.Second, 9700 * time.Millisecond
	for _, p := range lostReplyTargets(t) {
		t.Run(p.name, func(t *testing.T) {
			ctx := context.Background()
			a, _ := sqlfence.NewAcquirer(p.db, &sqlfence.AcquirerOptions{Drift: drift})
			other, _ := sqlfence.NewAcquirer(p.direct, nil)
			name := fencetest.Name("lost-late-renew")
			l := mustGrant(t, ctx, a, name, ttl)
			// The renewal's request waits in the proxy until the local
			// deadline (300ms after the grant) has passed, then reaches the
			// server (which holds the lease for 10s) and its reply is lost.
			err := lose(t, p.proxy, func(b []byte) bool {
				if !faultnet.Carries(b, name) {
					return false
				}
				<-l.Context().Done()
				return true
			}, func() error { return l.Renew(ctx) })
			if err == nil {
				t.Fatalf("Renew past the local deadline returned nil")
			}
			if !errors.Is(err, fence.ErrLost) && !errors.Is(err, fence.ErrUnknown) {
				t.Errorf("Renew past the local deadline: %v, want ErrLost or ErrUnknown", err)
			}
			checkExtendedRowGivenUp(t, other, name, "the renewal whose reply was lost")
		})
	}
}

// TestReleaseReplyLostThenRegranted (an unknown outcome is never reported as definite): a release is applied and
// its reply lost; before the release runs again another acquirer is granted
// the name. The retry finds the row under a newer token: Release cannot know
// whether its own release landed first, and must not report a definite
// fence.ErrLost (the lease expired before the release) for a release that
// landed.
func TestReleaseReplyLostThenRegranted(t *testing.T) {
	for _, p := range lostReplyTargets(t) {
		t.Run(p.name, func(t *testing.T) {
			ctx := context.Background()
			a, _ := sqlfence.NewAcquirer(p.db, nil)
			other, _ := sqlfence.NewAcquirer(p.direct, nil)
			name := fencetest.Name("lost-release-regrant")
			l := mustGrant(t, ctx, a, name, time.Minute)
			var l2 fence.Lease
			var otherErr error
			seen := 0
			// The first request carrying the name is the release: it is
			// applied and its reply lost (LoseReply). The second is its
			// retry: before it is forwarded, the other acquirer takes the
			// name.
			p.proxy.DropRequest(func(b []byte) bool {
				if faultnet.Carries(b, name) {
					if seen++; seen == 2 {
						l2, otherErr = other.TryAcquire(ctx, name, time.Minute)
					}
				}
				return false
			})
			p.proxy.LoseReply(carrying(name))
			err := l.Release(ctx)
			if otherErr != nil || l2 == nil {
				t.Fatalf("the other acquirer after the applied release: %v", otherErr)
			}
			t.Cleanup(func() { _ = l2.Release(context.Background()) })
			if errors.Is(err, fence.ErrLost) {
				t.Errorf("Release whose applied release's reply was lost, name granted again since: %v; want nil or ErrUnknown, not a definite ErrLost", err)
			}
		})
	}
}

// TestLostGrantReplyWithAdvanceGuards (an unknown outcome is never reported as definite): with AdvanceGuards, a
// grant whose reply (or whose commit's reply) was lost is recognised or run
// again, as without it: TryAcquire returns the lease, never a bare
// transport error, and the guard row holds the lease's token.
func TestLostGrantReplyWithAdvanceGuards(t *testing.T) {
	for _, p := range lostReplyTargets(t) {
		for _, step := range []string{"grant", "commit"} {
			if step == "commit" && p.name != "mysql" {
				continue // one statement on PostgreSQL
			}
			t.Run(p.name+"/"+step, func(t *testing.T) {
				ctx := context.Background()
				if err := p.guards.CreateTable(ctx); err != nil {
					t.Fatal(err)
				}
				a := newAcquirerOn(t, p.db, &sqlfence.AcquirerOptions{AdvanceGuards: p.guards})
				other, _ := sqlfence.NewAcquirer(p.direct, nil)
				name := fencetest.Name("lost-grant-adv")
				match := carrying(name)
				if step == "commit" {
					match = committing
				}
				var l fence.Lease
				err := lose(t, p.proxy, match, func() (err error) {
					l, err = a.TryAcquire(ctx, name, time.Minute)
					return err
				})
				if err != nil {
					t.Fatalf("TryAcquire whose %s reply was lost: %v, want the grant recognised or run again", step, err)
				}
				t.Cleanup(func() { _ = l.Release(context.Background()) })
				info, err := other.Inspect(ctx, name)
				if err != nil || !info.Held || info.Token != l.Token() {
					t.Fatalf("the lease row: %+v, %v; want held by token %d", info, err, l.Token())
				}
			})
		}
	}
}

// closedAddr returns a loopback address nothing listens on: a connection to
// it is refused, so no request can reach a server.
func closedAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// TestUnreachableServerIsDefinite (an unknown outcome is never reported as definite): when the connection to the
// server is refused, no statement was sent: the steps report the error as
// it is, never fence.ErrUnknown ("may have been applied").
func TestUnreachableServerIsDefinite(t *testing.T) {
	addr := closedAddr(t)
	pcfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	host, port, _ := net.SplitHostPort(addr)
	n, _ := strconv.Atoi(port)
	pcfg.ConnConfig.Host, pcfg.ConnConfig.Port, pcfg.ConnConfig.Fallbacks = host, uint16(n), nil
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	std := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { std.Close() })
	my := mysqlDB(t, addr, "")
	for name, db := range map[string]*sqlfence.DB{"postgres-pgx": sqlfence.Pgx(pool), "postgres-database-sql": sqlfence.Postgres(std), "mysql": sqlfence.MySQL(my)} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			w, _ := sqlfence.NewWriter(db, nil)
			a, _ := sqlfence.NewAcquirer(db, nil)
			s, _ := sqlfence.NewIdempotencyStore(db, nil)
			_, tryErr := a.TryAcquire(ctx, "unreachable", time.Minute)
			_, _, beginErr := s.Begin(ctx, "unreachable", "fp", "me", time.Minute)
			_, updErr := s.Update(ctx, "unreachable", idempotency.Claimed, 1, idempotency.Change{State: idempotency.Armed, Fence: 1, Owner: "me", Lease: time.Minute})
			for step, err := range map[string]error{
				"Write":      w.Write(ctx, "unreachable", []byte("v"), 1),
				"Delete":     w.Delete(ctx, "unreachable", 1),
				"TryAcquire": tryErr,
				"Bump":       a.Bump(ctx, "unreachable", 5),
				"Begin":      beginErr,
				"Update":     updErr,
			} {
				if err == nil {
					t.Errorf("%s with the server unreachable: nil", step)
				} else if errors.Is(err, fence.ErrUnknown) {
					t.Errorf("%s with the connection refused: %v; nothing was sent, want the error as it is, not ErrUnknown", step, err)
				}
			}
		})
	}
}

// TestCommitOfFailedTxIsDefinite (an unknown outcome is never reported as definite): a transaction in which a
// statement failed (the caller ignored the error) is rolled back by the
// server at COMMIT, which says so: RunTx and RunPgxTx report an error that
// is not fence.ErrUnknown ("may have committed"), and nothing committed.
func TestCommitOfFailedTxIsDefinite(t *testing.T) {
	ctx := context.Background()
	p := pgPool(t, pgOpts{})
	std := pgStd(t)
	err := sqlfence.RunPgxTx(ctx, p, nil, func(tx pgx.Tx) error {
		_, _ = tx.Exec(ctx, "SELECT 1/0")
		return nil
	})
	if err == nil || errors.Is(err, fence.ErrUnknown) {
		t.Errorf("RunPgxTx whose commit the server answered with ROLLBACK: %v, want a definite error", err)
	}
	err = sqlfence.RunTx(ctx, std, nil, func(tx *sql.Tx) error {
		_, _ = tx.ExecContext(ctx, "SELECT 1/0")
		return nil
	})
	if err == nil || errors.Is(err, fence.ErrUnknown) {
		t.Errorf("RunTx whose commit the server answered with ROLLBACK: %v, want a definite error", err)
	}
}

// TestDoneContextIsDefinite (an unknown outcome is never reported as definite): a step called with a context that
// has already ended sends nothing: it reports the context's error, never
// fence.ErrUnknown ("may have been applied").
func TestDoneContextIsDefinite(t *testing.T) {
	done, cancel := context.WithCancel(context.Background())
	cancel()
	for _, d := range everyDialect(t) {
		t.Run(d.name, func(t *testing.T) {
			w, a, s := d.parts(t)
			_, tryErr := a.TryAcquire(done, "done-ctx", time.Minute)
			_, _, beginErr := s.Begin(done, "done-ctx", "fp", "me", time.Minute)
			_, updErr := s.Update(done, "done-ctx", idempotency.Claimed, 1, idempotency.Change{State: idempotency.Armed, Fence: 1, Owner: "me", Lease: time.Minute})
			l := mustGrant(t, context.Background(), a, fencetest.Name("done-ctx"), time.Minute)
			renewErr, releaseErr := l.Renew(done), l.Release(done)
			if err := l.Release(context.Background()); err != nil {
				t.Errorf("Release after a Release with a cancelled context: %v; want the lease still held and released now", err)
			}
			for step, err := range map[string]error{
				"Renew":      renewErr,
				"Release":    releaseErr,
				"Write":      w.Write(done, "done-ctx", []byte("v"), 1),
				"Delete":     w.Delete(done, "done-ctx", 1),
				"TryAcquire": tryErr,
				"Bump":       a.Bump(done, "done-ctx", 5),
				"Begin":      beginErr,
				"Update":     updErr,
			} {
				if !errors.Is(err, context.Canceled) || errors.Is(err, fence.ErrUnknown) {
					t.Errorf("%s with a context already cancelled: %v; want context.Canceled, not ErrUnknown", step, err)
				}
			}
		})
	}
}
