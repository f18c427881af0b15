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
	"github.com/jackc/pgx/v5/pgxpool"
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
