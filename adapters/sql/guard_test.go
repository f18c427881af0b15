package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// guardedAccounts is a user's own table, written in guarded transactions.
func guardedAccounts(t *testing.T, db *sql.DB, mysql ...bool) string {
	t.Helper()
	table := "acct_" + fencetest.Name("g")[2:]
	seq := "seq INTEGER PRIMARY KEY"
	if len(mysql) > 0 && mysql[0] {
		seq = "seq INTEGER AUTO_INCREMENT PRIMARY KEY"
	}
	for _, q := range []string{
		fmt.Sprintf(`CREATE TABLE %s (id INTEGER PRIMARY KEY, balance BIGINT NOT NULL, written_by BIGINT NOT NULL)`, table),
		fmt.Sprintf(`CREATE TABLE %s_log (%s, token BIGINT NOT NULL)`, table, seq),
		fmt.Sprintf(`INSERT INTO %s VALUES (1, 0, 0)`, table),
	} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	return table
}

// TestGuardConcurrent runs many guarded transactions on one lock name, each with
// its own token, in random order. Each transaction guards, then does ordinary
// reads and writes. The committed transactions must form an increasing token
// sequence, the final row must be that of the largest committed token, and
// every rejected one must be stale against a committed token. Under
// PostgreSQL's REPEATABLE READ and SERIALIZABLE, two first attempts take their
// snapshots before either guards, so the later guard fails with 40001 and
// RunTx must run it again: the test counts those runs and fails without one.
func TestGuardConcurrent(t *testing.T) {
	pg := pgStd(t)
	sqliteDB, sqliteF := openSQLite(t)
	mysqlDB, mysqlF := openMySQL(t, "")
	for _, c := range []struct {
		name  string
		db    *sql.DB
		fdb   *sqlfence.DB
		iso   sql.IsolationLevel
		mysql bool
		// retried: two first attempts overlap, and the later guard must be
		// retried after a 40001.
		retried bool
	}{
		{"postgres/read-committed", pg, sqlfence.Postgres(pg), sql.LevelReadCommitted, false, false},
		{"postgres/repeatable-read", pg, sqlfence.Postgres(pg), sql.LevelRepeatableRead, false, true},
		{"postgres/serializable", pg, sqlfence.Postgres(pg), sql.LevelSerializable, false, true},
		{"sqlite", sqliteDB, sqliteF, sql.LevelDefault, false, false},
		{"mysql/repeatable-read", mysqlDB, mysqlF, sql.LevelRepeatableRead, true, false},
		{"mysql/read-committed", mysqlDB, mysqlF, sql.LevelReadCommitted, true, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := context.Background()
			table := guardedAccounts(t, c.db, c.mysql)
			g := mustGuards(t, c.fdb)
			if err := g.CreateTable(ctx); err != nil {
				t.Fatal(err)
			}
			guard, update, log := g.Guard, `UPDATE %s SET balance = $1, written_by = $2 WHERE id = 1`,
				`INSERT INTO %s_log (seq, token) VALUES ((SELECT COALESCE(MAX(seq), 0) + 1 FROM %s_log), $1)`
			if c.mysql {
				update, log = `UPDATE %s SET balance = ?, written_by = ? WHERE id = 1`, `INSERT INTO %s_log (token) VALUES (?)`
			}
			name := fencetest.Name("guard")
			const n = 24
			var (
				wg    sync.WaitGroup
				mu    sync.Mutex
				stale = map[fence.Token]fence.Token{}
				// runs counts the transactions' runs; overlap holds the first
				// attempts of two of them until both have a snapshot.
				runs    atomic.Int32
				overlap sync.WaitGroup
				gated   atomic.Int32
			)
			overlap.Add(2)
			for i := 0; i < n; i++ {
				// tokens 1..n, started in a shuffled order
				tok := fence.Token((i*7)%n + 1)
				wg.Add(1)
				go func() {
					defer wg.Done()
					first := true
					err := sqlfence.RunTx(ctx, c.db, &sqlfence.TxOptions{Isolation: c.iso, MaxAttempts: 50}, func(tx *sql.Tx) error {
						runs.Add(1)
						if first && c.retried && gated.Add(1) <= 2 {
							var one int
							if err := tx.QueryRowContext(ctx, "SELECT 1").Scan(&one); err != nil { // takes the snapshot
								return err
							}
							overlap.Done()
							overlap.Wait()
						}
						first = false
						if err := guard(ctx, tx, name, tok); err != nil {
							return err
						}
						var bal int64
						if err := tx.QueryRowContext(ctx, fmt.Sprintf(`SELECT balance FROM %s WHERE id = 1`, table)).Scan(&bal); err != nil {
							return err
						}
						if _, err := tx.ExecContext(ctx, fmt.Sprintf(update, table), bal+1, int64(tok)); err != nil {
							return err
						}
						q := fmt.Sprintf(log, table)
						if !c.mysql {
							q = fmt.Sprintf(log, table, table)
						}
						_, err := tx.ExecContext(ctx, q, int64(tok))
						return err
					})
					var se *fence.StaleError
					switch {
					case err == nil:
					case errors.As(err, &se):
						mu.Lock()
						stale[tok] = se.Current
						mu.Unlock()
					default:
						t.Errorf("token %d: %v", tok, err)
					}
				}()
			}
			wg.Wait()
			if t.Failed() {
				return
			}
			rows, err := c.db.QueryContext(ctx, fmt.Sprintf(`SELECT token FROM %s_log ORDER BY seq`, table))
			if err != nil {
				t.Fatal(err)
			}
			var committed []fence.Token
			for rows.Next() {
				var tok int64
				if err := rows.Scan(&tok); err != nil {
					t.Fatal(err)
				}
				committed = append(committed, fence.Token(tok))
			}
			rows.Close()
			if !sort.SliceIsSorted(committed, func(i, j int) bool { return committed[i] < committed[j] }) {
				t.Errorf("committed tokens out of order: %v", committed)
			}
			if len(committed)+len(stale) != n {
				t.Errorf("%d committed + %d stale != %d transactions", len(committed), len(stale), n)
			}
			if len(committed) == 0 || committed[len(committed)-1] != n {
				t.Fatalf("the largest token %d did not commit: %v", n, committed)
			}
			in := map[fence.Token]bool{}
			for _, c := range committed {
				in[c] = true
			}
			for tok, cur := range stale {
				if cur <= tok || !in[cur] {
					t.Errorf("token %d rejected naming %d, which is not a larger committed token", tok, cur)
				}
			}
			var bal, by int64
			if err := c.db.QueryRowContext(ctx, fmt.Sprintf(`SELECT balance, written_by FROM %s WHERE id = 1`, table)).Scan(&bal, &by); err != nil {
				t.Fatal(err)
			}
			if bal != int64(len(committed)) || by != n {
				t.Errorf("row = balance %d written by %d, want %d written by %d", bal, by, len(committed), n)
			}
			again := int(runs.Load()) - n
			if c.retried && again == 0 {
				t.Errorf("no transaction ran again: RunTx's retry after a serialization failure was not exercised")
			}
			t.Logf("%d committed in token order, %d rejected as stale, %d runs again after a serialization failure or deadlock", len(committed), len(stale), again)
		})
	}
}

// TestGuardStaleRollsBack: a stale guard changes nothing, and the caller's writes
// in the same transaction roll back with it.
func TestGuardStaleRollsBack(t *testing.T) {
	ctx := context.Background()
	pg := pgStd(t)
	table := guardedAccounts(t, pg)
	name := fencetest.Name("rollback")
	g := mustGuards(t, sqlfence.Postgres(pg))
	write := func(tok fence.Token) error {
		return sqlfence.RunTx(ctx, pg, nil, func(tx *sql.Tx) error {
			if err := g.Guard(ctx, tx, name, tok); err != nil {
				return err
			}
			_, err := tx.ExecContext(ctx, fmt.Sprintf(`UPDATE %s SET written_by = $1 WHERE id = 1`, table), int64(tok))
			return err
		})
	}
	if err := write(5); err != nil {
		t.Fatal(err)
	}
	if err := write(3); !errors.Is(err, fence.ErrStale) {
		t.Fatalf("guard with token 3 after 5: %v", err)
	}
	if err := write(5); err != nil {
		t.Fatalf("equal token: %v", err)
	}
	var by int64
	if err := pg.QueryRowContext(ctx, fmt.Sprintf(`SELECT written_by FROM %s WHERE id = 1`, table)).Scan(&by); err != nil {
		t.Fatal(err)
	}
	if by != 5 {
		t.Errorf("written_by = %d, want 5", by)
	}
}

// TestGuardRefusesNonTransactions: a pool, a database handle or a connection
// would run the guard in autocommit and leave the writes after it unfenced; it
// does not compile as the tx of Guard, GuardPgx, CompleteTx or CompletePgxTx.
// What still compiles is refused with ErrInvalid before any statement runs: a
// nil transaction, and a pgx transaction given to Guards or a store whose
// database is not PostgreSQL. The refused guard does not advance the guard row
// even in a transaction that then commits.
func TestGuardRefusesNonTransactions(t *testing.T) {
	ctx := context.Background()
	pool := pgPool(t, pgOpts{})
	_, sqliteF := openSQLite(t)
	pgG, pgStore := pgGuards(t, pool), mustStore(t, sqlfence.Pgx(pool))
	liteG, liteStore := mustGuards(t, sqliteF), mustStore(t, sqliteF)
	name := fencetest.Name("notx")
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	for what, err := range map[string]error{
		"Guard(nil *sql.Tx)":             pgG.Guard(ctx, nil, name, 7),
		"GuardPgx(nil)":                  pgG.GuardPgx(ctx, nil, name, 7),
		"GuardPgx(nil *pgxpool.Tx)":      pgG.GuardPgx(ctx, (*pgxpool.Tx)(nil), name, 7),
		"CompleteTx(nil *sql.Tx)":        pgStore.CompleteTx(ctx, nil, "k", 1, []byte("r"), 0),
		"CompletePgxTx(nil)":             pgStore.CompletePgxTx(ctx, nil, "k", 1, []byte("r"), 0),
		"CompletePgxTx(nil *pgxpool.Tx)": pgStore.CompletePgxTx(ctx, (*pgxpool.Tx)(nil), "k", 1, []byte("r"), 0),
		"SQLite Guards' GuardPgx":        liteG.GuardPgx(ctx, tx, name, 7),
		"SQLite store's CompletePgxTx":   liteStore.CompletePgxTx(ctx, tx, "k", 1, []byte("r"), 0),
	} {
		if !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", what, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM fence_guards WHERE name = $1`, name).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("a refused guard advanced the guard row (%d rows)", n)
	}
}

func mustGuards(t testing.TB, db *sqlfence.DB) *sqlfence.Guards {
	t.Helper()
	g, err := sqlfence.NewGuards(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	return g
}

func mustStore(t testing.TB, db *sqlfence.DB) *sqlfence.IdempotencyStore {
	t.Helper()
	s, err := sqlfence.NewIdempotencyStore(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestAdvanceGuardsMissingTable: with AdvanceGuards on a guard table that was
// never created, a grant fails with a *TableError that names the guard
// table and carries its DDL, not the lease table's (which exists), on every
// dialect; the failed grant holds nothing: once the guard table is created
// the same acquirer is granted the same name.
func TestAdvanceGuardsMissingTable(t *testing.T) {
	ctx := context.Background()
	_, sqliteF := openSQLite(t)
	_, mysqlF := openMySQL(t, "")
	for _, c := range []struct {
		dialect string
		fdb     *sqlfence.DB
	}{{"postgres", sqlfence.Postgres(pgStd(t))}, {"sqlite", sqliteF}, {"mysql", mysqlF}} {
		t.Run(c.dialect, func(t *testing.T) {
			table := strings.ReplaceAll(fencetest.Name("noguard"), "-", "_")
			g, err := sqlfence.NewGuards(c.fdb, &sqlfence.GuardOptions{Table: table})
			if err != nil {
				t.Fatal(err)
			}
			a := newAcquirerOn(t, c.fdb, &sqlfence.AcquirerOptions{AdvanceGuards: g})
			if err := a.CreateTable(ctx); err != nil {
				t.Fatal(err)
			}
			name := fencetest.Name("n")
			l, err := a.TryAcquire(ctx, name, time.Minute)
			if l != nil {
				_ = l.Release(ctx)
			}
			var te *sqlfence.TableError
			if !errors.As(err, &te) || te.Table != table || te.DDL != g.DDL() {
				t.Fatalf("TryAcquire with a missing guard table: %v, want a *TableError naming %s with its DDL", err, table)
			}
			if err := g.CreateTable(ctx); err != nil {
				t.Fatal(err)
			}
			// The failed grant held nothing: the name is free at once.
			l, err = a.TryAcquire(ctx, name, time.Minute)
			if err != nil {
				t.Fatalf("after the guard table's CreateTable: %v", err)
			}
			_ = l.Release(ctx)
		})
	}
}

// TestCompleteTxAfterChangeInSnapshot: the caller's transaction reads first
// (so under MySQL's REPEATABLE READ it has its snapshot), then, outside it,
// the record is taken over with a larger fence, completed by its owner, or
// deleted by an operator; then CompleteTx runs in the transaction. It must
// report what the record is now, as its doc says: a *fence.StaleError
// naming the new fence, idempotency.ErrStateChanged naming the new state,
// fence.ErrNotFound; not what the snapshot saw ("armed, not armed").
// PostgreSQL (READ COMMITTED, its default, through database/sql and pgx) and
// MySQL under READ COMMITTED run the same cases.
func TestCompleteTxAfterChangeInSnapshot(t *testing.T) {
	ctx := context.Background()
	rawMy, my := openMySQL(t, "")
	p := pgPool(t, pgOpts{})
	std := pgStd(t)
	idemStore(t, sqlfence.Pgx(p))
	type target struct {
		name string
		fdb  *sqlfence.DB
		// complete runs a read, then change, then CompleteTx (or
		// CompletePgxTx) in one transaction, and rolls it back.
		complete func(t *testing.T, s *sqlfence.IdempotencyStore, change func(), key string, f fence.Token) error
	}
	stdTarget := func(name string, fdb *sqlfence.DB, db *sql.DB, iso sql.IsolationLevel) target {
		return target{name, fdb, func(t *testing.T, s *sqlfence.IdempotencyStore, change func(), key string, f fence.Token) error {
			tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: iso})
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback()
			var n int
			if err := tx.QueryRowContext(ctx, "SELECT count(*) FROM fence_idempotency").Scan(&n); err != nil {
				t.Fatal(err)
			}
			change()
			return s.CompleteTx(ctx, tx, key, f, []byte("r"), time.Hour)
		}}
	}
	targets := []target{
		stdTarget("mysql", my, rawMy, sql.LevelDefault),
		stdTarget("mysql-read-committed", my, rawMy, sql.LevelReadCommitted),
		stdTarget("postgres-database-sql", sqlfence.Postgres(std), std, sql.LevelDefault),
		{"postgres-pgx", sqlfence.Pgx(p), func(t *testing.T, s *sqlfence.IdempotencyStore, change func(), key string, f fence.Token) error {
			tx, err := p.BeginTx(ctx, pgx.TxOptions{})
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			var n int
			if err := tx.QueryRow(ctx, "SELECT count(*) FROM fence_idempotency").Scan(&n); err != nil {
				t.Fatal(err)
			}
			change()
			return s.CompletePgxTx(ctx, tx, key, f, []byte("r"), time.Hour)
		}},
	}
	for _, tg := range targets {
		t.Run(tg.name, func(t *testing.T) {
			s := mustStore(t, tg.fdb)
			armed := func() (string, fence.Token) { return armedKey(t, s, "complete-tx") }

			k, f := armed()
			err := tg.complete(t, s, func() {
				if _, err := s.Update(ctx, k, idempotency.Armed, f, idempotency.Change{State: idempotency.Armed, Fence: f + 1, Owner: "other", Lease: time.Minute}); err != nil {
					t.Fatal(err)
				}
			}, k, f)
			var stale *fence.StaleError
			if !errors.As(err, &stale) || stale.Current != f+1 {
				t.Errorf("after a takeover with fence %d: %v, want a StaleError naming %d", f+1, err, f+1)
			}

			k, f = armed()
			err = tg.complete(t, s, func() {
				if _, err := s.Update(ctx, k, idempotency.Armed, f, idempotency.Change{State: idempotency.Completed, Fence: f, Owner: "me", Result: []byte("x"), Retention: time.Hour}); err != nil {
					t.Fatal(err)
				}
			}, k, f)
			var se *idempotency.StateError
			if !errors.As(err, &se) || se.Got != idempotency.Completed {
				t.Errorf("after another completion: %v, want ErrStateChanged naming completed", err)
			}

			k, f = armed()
			err = tg.complete(t, s, func() {
				if _, err := s.Update(ctx, k, idempotency.Armed, f, idempotency.Change{State: idempotency.Released, Fence: f, Owner: "me"}); err != nil {
					t.Fatal(err)
				}
				if _, err := s.Purge(ctx); err != nil {
					t.Fatal(err)
				}
			}, k, f)
			if !errors.Is(err, fence.ErrNotFound) {
				t.Errorf("after the record was released and purged: %v, want ErrNotFound", err)
			}
		})
	}
}

// TestRunTxPanicRollsBack (nobody keeps a free lock from the others): f guards a name and panics; the
// caller recovers (as net/http does for a handler). The transaction must be
// rolled back on the way out, or its connection keeps the guard row locked
// (on SQLite the whole database) for as long as the process lives, and every
// later guard of the name waits. A second guarded transaction on the name
// must commit within 5s.
func TestRunTxPanicRollsBack(t *testing.T) {
	ctx := context.Background()
	rawLite, lite := openSQLite(t)
	if err := mustGuards(t, lite).CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	rawMy, my := openMySQL(t, "")
	pgPool(t, pgOpts{}) // the default tables
	// A pool of this test's own: pgxpool's Close waits for a connection a
	// leaked transaction holds, so it is closed only when the test passed.
	p, err := pgxpool.New(ctx, testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	std := stdlib.OpenDBFromPool(p)
	t.Cleanup(func() {
		if !t.Failed() {
			std.Close()
			p.Close()
		}
	})
	stdRun := func(db *sql.DB, g *sqlfence.Guards) func(ctx context.Context, name string, panics bool) error {
		return func(ctx context.Context, name string, panics bool) error {
			return sqlfence.RunTx(ctx, db, nil, func(tx *sql.Tx) error {
				if err := g.Guard(ctx, tx, name, 1); err != nil {
					return err
				}
				if panics {
					panic("f panics after its guard")
				}
				return nil
			})
		}
	}
	pgG := mustGuards(t, sqlfence.Pgx(p))
	for _, c := range []struct {
		name string
		run  func(ctx context.Context, name string, panics bool) error
	}{
		{"sqlite", stdRun(rawLite, mustGuards(t, lite))},
		{"mysql", stdRun(rawMy, mustGuards(t, my))},
		{"postgres-database-sql", stdRun(std, pgG)},
		{"postgres-pgx", func(ctx context.Context, name string, panics bool) error {
			return sqlfence.RunPgxTx(ctx, p, nil, func(tx pgx.Tx) error {
				if err := pgG.GuardPgx(ctx, tx, name, 1); err != nil {
					return err
				}
				if panics {
					panic("f panics after its guard")
				}
				return nil
			})
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			name := fencetest.Name("panic")
			func() {
				defer func() {
					if r := recover(); r == nil {
						t.Fatal("f's panic did not reach the caller")
					}
				}()
				_ = c.run(ctx, name, true)
			}()
			ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			if err := c.run(ctx, name, false); err != nil {
				t.Errorf("a guarded transaction after the panicking one: %v; the panicking transaction still holds its locks", err)
			}
		})
	}
}

// TestRunTxEndedByF (an unknown outcome is never reported as definite): f commits the transaction itself (after a
// guard and an insert) and returns nil; RunTx's own commit then finds it
// closed. The transaction committed, so RunTx must not report a definite
// failure ("commit: tx is closed"): it cannot know whether f committed or
// rolled back, and says so with fence.ErrUnknown. The row is there.
func TestRunTxEndedByF(t *testing.T) {
	ctx := context.Background()
	rawLite, lite := openSQLite(t)
	if err := mustGuards(t, lite).CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	p := pgPool(t, pgOpts{})
	std := pgStd(t)
	pgG := mustGuards(t, sqlfence.Pgx(p))
	count := func(db *sql.DB, name string) int {
		var n int
		if err := db.QueryRowContext(ctx, "SELECT count(*) FROM fence_guards WHERE name = $1", name).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for _, c := range []struct {
		name string
		db   *sql.DB
		run  func(name string) error
	}{
		{"sqlite", rawLite, func(name string) error {
			return sqlfence.RunTx(ctx, rawLite, nil, func(tx *sql.Tx) error {
				if err := mustGuards(t, lite).Guard(ctx, tx, name, 1); err != nil {
					return err
				}
				return tx.Commit()
			})
		}},
		{"postgres-database-sql", std, func(name string) error {
			return sqlfence.RunTx(ctx, std, nil, func(tx *sql.Tx) error {
				if err := pgG.Guard(ctx, tx, name, 1); err != nil {
					return err
				}
				return tx.Commit()
			})
		}},
		{"postgres-pgx", std, func(name string) error {
			return sqlfence.RunPgxTx(ctx, p, nil, func(tx pgx.Tx) error {
				if err := pgG.GuardPgx(ctx, tx, name, 1); err != nil {
					return err
				}
				return tx.Commit(ctx)
			})
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			name := fencetest.Name("ended-by-f")
			err := c.run(name)
			if n := count(c.db, name); n != 1 {
				t.Fatalf("the guard row after f committed: %d rows, want 1", n)
			}
			if !errors.Is(err, fence.ErrUnknown) {
				t.Errorf("RunTx whose f committed the transaction itself: %v, want ErrUnknown", err)
			}
		})
	}
}

// missingDB is one database for the missing-table tests: the sqlfence handle
// and a plain handle to drop tables with.
type missingDB struct {
	dialect string
	fdb     *sqlfence.DB
	raw     *sql.DB
	schema  string // the database's default schema, for qualified names
}

func missingDBs(t *testing.T) []missingDB {
	var dbs []missingDB
	p := pgPool(t, pgOpts{})
	pgRaw := stdlib.OpenDBFromPool(p)
	t.Cleanup(func() { pgRaw.Close() })
	std := pgStd(t)
	dbs = append(dbs,
		missingDB{"pgx", sqlfence.Pgx(p), pgRaw, "public"},
		missingDB{"postgres", sqlfence.Postgres(std), std, "public"})
	sdb, sf := openSQLite(t)
	dbs = append(dbs, missingDB{"sqlite", sf, sdb, "main"})
	mdb, mf := openMySQL(t, "")
	dbs = append(dbs, missingDB{"mysql", mf, mdb, "test"})
	return dbs
}

// missingTableName is a fresh table name with the given stem, unique per test.
func missingTableName(stem string) string {
	return strings.ReplaceAll(fencetest.Name("r3"), "-", "_") + stem
}

func (d missingDB) drop(t *testing.T, tables ...string) {
	for _, tb := range tables {
		q := `"` + strings.ReplaceAll(tb, ".", `"."`) + `"`
		if d.dialect == "mysql" {
			q = "`" + strings.ReplaceAll(tb, ".", "`.`") + "`"
		}
		if _, err := d.raw.ExecContext(context.Background(), "DROP TABLE IF EXISTS "+q); err != nil {
			t.Errorf("drop %s: %v", tb, err)
		}
	}
}

// parts returns Guards on table guard, and an acquirer on lease table lease
// that advances them.
func (d missingDB) parts(t *testing.T, lease, guard string) (*sqlfence.Guards, *sqlfence.Acquirer) {
	t.Helper()
	g, err := sqlfence.NewGuards(d.fdb, &sqlfence.GuardOptions{Table: guard})
	if err != nil {
		t.Fatal(err)
	}
	return g, newAcquirerOn(t, d.fdb, &sqlfence.AcquirerOptions{Table: lease, AdvanceGuards: g})
}

// missingGrant runs one grant with an acquirer (lease table lease,
// AdvanceGuards on table guard) and checks that it fails with a
// *TableError naming want, carrying want's DDL. It also checks Acquire,
// which must end at once with the same error rather than wait.
func missingGrant(t *testing.T, d missingDB, lease, guard, want string) {
	t.Helper()
	ctx := context.Background()
	g, a := d.parts(t, lease, guard)
	wantDDL := a.DDL()
	if want == guard {
		wantDDL = g.DDL()
	}
	name := fencetest.Name("n")
	l, err := a.TryAcquire(ctx, name, time.Minute)
	if l != nil {
		_ = l.Release(ctx)
		t.Fatalf("granted with %s missing", want)
	}
	var te *sqlfence.TableError
	if !errors.As(err, &te) || te.Table != want || te.DDL != wantDDL {
		got := "no *TableError"
		if te != nil {
			got = "Table " + te.Table
		}
		t.Errorf("TryAcquire (lease table %s, guard table %s) with %s missing: %v (%s), want a *TableError naming %s with its DDL", lease, guard, want, err, got, want)
	}
	actx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	start := time.Now()
	l, err = a.Acquire(actx, name, time.Minute)
	if l != nil {
		_ = l.Release(ctx)
		t.Fatalf("Acquire granted with %s missing", want)
	}
	te = nil
	if !errors.As(err, &te) || te.Table != want {
		t.Errorf("Acquire with %s missing: %v, want a *TableError naming %s", want, err, want)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("Acquire with %s missing waited %v instead of failing at once", want, took)
	}
}

// missingGranted checks that, with both tables there, a fresh acquirer (as
// another process would make) is granted a name at once: the failed grants
// held nothing.
func missingGranted(t *testing.T, d missingDB, lease, guard string) {
	t.Helper()
	ctx := context.Background()
	_, a := d.parts(t, lease, guard)
	l, err := a.TryAcquire(ctx, fencetest.Name("n"), time.Minute)
	if err != nil {
		t.Fatalf("with both tables created: %v", err)
	}
	_ = l.Release(ctx)
}

func missingCreate(t *testing.T, d missingDB, lease, guard string, which ...string) {
	t.Helper()
	ctx := context.Background()
	g, a := d.parts(t, lease, guard)
	for _, w := range which {
		var err error
		if w == lease {
			err = a.CreateTable(ctx)
		} else {
			err = g.CreateTable(ctx)
		}
		if err != nil {
			t.Fatalf("create %s: %v", w, err)
		}
	}
}

// TestGuardsMissingTableNamed: with AdvanceGuards, a grant on a missing
// table fails with a *TableError naming the table that is missing (lease or
// guard) with that table's DDL, on PostgreSQL (pgx and database/sql), SQLite
// and MariaDB, for names that contain one another (in both directions),
// schema-qualified names and mixed case; Acquire fails the same way at
// once; and once the tables exist another acquirer is granted at once.
func TestGuardsMissingTableNamed(t *testing.T) {
	for _, d := range missingDBs(t) {
		t.Run(d.dialect, func(t *testing.T) {
			type pair struct{ what, lease, guard string }
			base := missingTableName("")
			pairs := []pair{
				{"guard name contains the lease name", base + "locks", base + "locks_guard"},
				{"lease name contains the guard name", base + "locks_guard", base + "locks"},
				{"mixed case", base + "Locks", base + "Locks_Guard"},
				{"qualified", d.schema + "." + base + "ql", d.schema + "." + base + "ql_guard"},
				{"qualified guard only", base + "qg", d.schema + "." + base + "qg_guard"},
			}
			for _, p := range pairs {
				t.Run(p.what, func(t *testing.T) {
					t.Cleanup(func() { d.drop(t, p.lease, p.guard) })
					// The guard table missing, the lease table there.
					missingCreate(t, d, p.lease, p.guard, p.lease)
					missingGrant(t, d, p.lease, p.guard, p.guard)
					// The lease table missing, the guard table there.
					d.drop(t, p.lease)
					missingCreate(t, d, p.lease, p.guard, p.guard)
					missingGrant(t, d, p.lease, p.guard, p.lease)
					// Both missing: either may be named, with its own DDL;
					// creating it, the grant names the other.
					d.drop(t, p.lease, p.guard)
					ctx := context.Background()
					g, _ := sqlfence.NewGuards(d.fdb, &sqlfence.GuardOptions{Table: p.guard})
					a := newAcquirerOn(t, d.fdb, &sqlfence.AcquirerOptions{Table: p.lease, AdvanceGuards: g})
					_, err := a.TryAcquire(ctx, fencetest.Name("n"), time.Minute)
					var te *sqlfence.TableError
					if !errors.As(err, &te) {
						t.Fatalf("both tables missing: %v, want a *TableError", err)
					}
					switch {
					case te.Table == p.lease && te.DDL == a.DDL():
						missingCreate(t, d, p.lease, p.guard, p.lease)
						missingGrant(t, d, p.lease, p.guard, p.guard)
						missingCreate(t, d, p.lease, p.guard, p.guard)
					case te.Table == p.guard && te.DDL == g.DDL():
						missingCreate(t, d, p.lease, p.guard, p.guard)
						missingGrant(t, d, p.lease, p.guard, p.lease)
						missingCreate(t, d, p.lease, p.guard, p.lease)
					default:
						t.Fatalf("both tables missing: a *TableError naming %s with DDL\n%s\nwant the lease table %s or the guard table %s, each with its own DDL", te.Table, te.DDL, p.lease, p.guard)
					}
					missingGranted(t, d, p.lease, p.guard)
				})
			}
		})
	}
}

// TestGuardsMissingGuardTableLikeLeaseName: the guard table missing, the
// lease table there, where the database's error names a table that
// namesTable cannot tell from the lease table: the grant must still name the
// guard table (the one missing, whose DDL creates what the grant needs),
// not the lease table (which exists: its DDL changes nothing, and the next
// grant fails the same way).
//   - PostgreSQL and MariaDB (on Linux) quote identifiers case-sensitively:
//     lease table x_locks and guard table X_LOCKS are two tables.
//   - PostgreSQL: lease table s1.locks and guard table s2.locks, two schemas.
//   - MariaDB: the error names the database ("Table 'test.g' doesn't exist"):
//     a lease table named like its database ("test").
func TestGuardsMissingGuardTableLikeLeaseName(t *testing.T) {
	ctx := context.Background()
	for _, d := range missingDBs(t) {
		t.Run(d.dialect, func(t *testing.T) {
			type pair struct{ what, lease, guard string }
			base := missingTableName("")
			var pairs []pair
			switch d.dialect {
			case "pgx", "postgres":
				s1, s2 := base+"s1", base+"s2"
				for _, s := range []string{s1, s2} {
					if _, err := d.raw.ExecContext(ctx, `CREATE SCHEMA "`+s+`"`); err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { _, _ = d.raw.ExecContext(ctx, `DROP SCHEMA "`+s+`" CASCADE`) })
				}
				pairs = append(pairs,
					pair{"names differing in case", base + "locks", strings.ToUpper(base + "locks")},
					pair{"one name in two schemas", s1 + ".locks", s2 + ".locks"})
			case "mysql":
				var n int
				if err := d.raw.QueryRowContext(ctx, "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = 'test'").Scan(&n); err != nil {
					t.Fatal(err)
				}
				var db string
				if err := d.raw.QueryRowContext(ctx, "SELECT DATABASE()").Scan(&db); err != nil {
					t.Fatal(err)
				}
				var lower int
				if err := d.raw.QueryRowContext(ctx, "SELECT @@lower_case_table_names").Scan(&lower); err != nil {
					t.Fatal(err)
				}
				if lower == 0 { // else the two names are one table
					pairs = append(pairs, pair{"names differing in case", base + "locks", strings.ToUpper(base + "locks")})
				}
				if n == 0 && db == "test" {
					pairs = append(pairs, pair{"lease table named like the database", "test", base + "guard"})
				}
			default:
				t.Skip("SQLite table names are not case-sensitive, and its error names no schema")
			}
			for _, p := range pairs {
				t.Run(p.what, func(t *testing.T) {
					t.Cleanup(func() { d.drop(t, p.lease, p.guard) })
					missingCreate(t, d, p.lease, p.guard, p.lease)
					missingGrant(t, d, p.lease, p.guard, p.guard)
					missingCreate(t, d, p.lease, p.guard, p.guard)
					missingGranted(t, d, p.lease, p.guard)
				})
			}
		})
	}
}
