package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// TestRunTxPanicRollsBack (HAZARDS 6): f guards a name and panics; the
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

// TestRunTxEndedByF (HAZARDS 3): f commits the transaction itself (after a
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
