package sqlfence_test

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/fence/fencetest/faultnet"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/fencekit/fencekit/idempotency/idempotencytest"
	"github.com/fencekit/fencekit/internal/testenv"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

func idemStore(t *testing.T, fdb *sqlfence.DB) *sqlfence.IdempotencyStore {
	s, err := sqlfence.NewIdempotencyStore(fdb, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.CreateTable(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s
}

func TestIdempotencySQLite(t *testing.T) {
	t.Parallel() // its cases use names of their own; it overlaps the other suites, not the sequential tests
	_, fdb := openSQLite(t)
	s := idemStore(t, fdb)
	idempotencytest.Suite{New: func(t *testing.T) idempotency.Store { return s }, BadKeys: badKeys}.Run(t)
}

func TestIdempotencyPostgres(t *testing.T) {
	t.Parallel() // its cases use names of their own; it overlaps the other suites, not the sequential tests
	for style, fdb := range pgHandles(t) {
		t.Run(style, func(t *testing.T) {
			s := idemStore(t, fdb)
			idempotencytest.Suite{
				New:     func(t *testing.T) idempotency.Store { return s },
				BadKeys: badKeys,
				Faulty:  func(t *testing.T) (idempotency.Store, *faultnet.Proxy) { return faultyPostgres(t, style) },
			}.Run(t)
		})
	}
}

// faultyPostgres returns an idempotency store on the test PostgreSQL server,
// reached through a fault proxy, with the handle style of pgHandles.
func faultyPostgres(t *testing.T, style string) (idempotency.Store, *faultnet.Proxy) {
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	px := faultnet.Start(t, net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))))
	cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Fallbacks = "127.0.0.1", uint16(px.Port()), nil
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	fdb := sqlfence.Pgx(p)
	if style != "pgx" {
		db := stdlib.OpenDBFromPool(p)
		t.Cleanup(func() { db.Close() })
		fdb = sqlfence.Postgres(db)
	}
	return idemStore(t, fdb), px
}

// TestIdempotencyCompleteTx: the key's completion and the caller's own write
// commit together; a rolled-back transaction leaves the key armed and the row
// unwritten.
func TestIdempotencyCompleteTx(t *testing.T) {
	ctx := context.Background()
	pool := pgPool(t, pgOpts{})
	s := idemStore(t, sqlfence.Pgx(pool))
	table := "orders_" + fencetest.Name("o")[2:]
	if _, err := pool.Exec(ctx, "CREATE TABLE "+table+" (id TEXT PRIMARY KEY, charge TEXT)"); err != nil {
		t.Fatal(err)
	}
	for _, commit := range []bool{false, true} {
		k := fencetest.Name("order")
		rec, _, err := s.Begin(ctx, k, "fp", "me", time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Update(ctx, k, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me", Lease: time.Minute}); err != nil {
			t.Fatal(err)
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES ($1, 'ch_1')", k); err != nil {
			t.Fatal(err)
		}
		if err := s.CompletePgxTx(ctx, tx, k, rec.Fence, []byte("ch_1"), time.Hour); err != nil {
			t.Fatal(err)
		}
		if commit {
			err = tx.Commit(ctx)
		} else {
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		got, err := s.Get(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+table+" WHERE id = $1", k).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if commit && (got.State != idempotency.Completed || n != 1) {
			t.Errorf("committed: state %s, %d rows; want completed and 1", got.State, n)
		}
		if !commit && (got.State != idempotency.Armed || n != 0) {
			t.Errorf("rolled back: state %s, %d rows; want armed and 0", got.State, n)
		}
	}
}
