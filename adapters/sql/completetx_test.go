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
	"github.com/fencekit/fencekit/idempotency"
	"github.com/jackc/pgx/v5"
)

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
			armed := func() (string, fence.Token) {
				k := fencetest.Name("complete-tx")
				rec, _, err := s.Begin(ctx, k, "fp", "me", time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				if _, err := s.Update(ctx, k, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me", Lease: time.Minute}); err != nil {
					t.Fatal(err)
				}
				return k, rec.Fence
			}

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
