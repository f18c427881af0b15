package sqlfence_test

import (
	"context"
	"errors"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
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

// TestIdempotencyStore runs the idempotency suite on SQLite, on
// PostgreSQL through pgx and database/sql, and on MySQL with and without
// clientFoundRows; each server's subtests run beside the others'.
func TestIdempotencyStore(t *testing.T) {
	t.Parallel() // its cases use names of their own; it overlaps the other suites, not the sequential tests
	t.Run("sqlite", func(t *testing.T) {
		t.Parallel()
		_, fdb := openSQLite(t)
		s := idemStore(t, fdb)
		idempotencytest.Suite{New: func(t *testing.T) idempotency.Store { return s }, BadKeys: badKeys}.Run(t)
	})
	runByServer(t, serverStyles("", "clientFoundRows=true"), true, func(t *testing.T, st serverStyle) {
		s := idemStore(t, st.open(t, ""))
		idempotencytest.Suite{
			New:     func(t *testing.T) idempotency.Store { return s },
			BadKeys: badKeys,
			Faulty:  st.faultyStore,
		}.Run(t)
	})
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

// armedKey claims a new key (named from stem) in s as owner "me" and arms it,
// with a minute's lease; it returns the key and its fence.
func armedKey(t *testing.T, s idempotency.Store, stem string) (string, fence.Token) {
	t.Helper()
	ctx := context.Background()
	k := fencetest.Name(stem)
	rec, _, err := s.Begin(ctx, k, "fp", "me", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Update(ctx, k, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me", Lease: time.Minute}); err != nil {
		t.Fatal(err)
	}
	return k, rec.Fence
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
		k, f := armedKey(t, s, "order")
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "INSERT INTO "+table+" VALUES ($1, 'ch_1')", k); err != nil {
			t.Fatal(err)
		}
		if err := s.CompletePgxTx(ctx, tx, k, f, []byte("ch_1"), time.Hour); err != nil {
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

// TestIdempotencyLongRetention (inputs at the limits): a completed record kept for 30
// days (more than 2^31 milliseconds) is stored, on every dialect, through
// Update and CompleteTx.
func TestIdempotencyLongRetention(t *testing.T) {
	const retention = 30 * 24 * time.Hour
	ctx := context.Background()
	for _, d := range everyDialect(t) {
		t.Run(d.name, func(t *testing.T) {
			_, _, s := d.parts(t)
			key := fencetest.Name("long-retention")
			rec, claimed, err := s.Begin(ctx, key, "fp", "me", time.Minute)
			if err != nil || !claimed {
				t.Fatalf("Begin: %+v, %v, %v", rec, claimed, err)
			}
			rec, err = s.Update(ctx, key, idempotency.Claimed, rec.Fence, idempotency.Change{State: idempotency.Armed, Fence: rec.Fence, Owner: "me", Lease: time.Minute})
			if err != nil {
				t.Fatalf("arm: %v", err)
			}
			rec, err = s.Update(ctx, key, idempotency.Armed, rec.Fence, idempotency.Change{State: idempotency.Completed, Fence: rec.Fence, Owner: "me", Result: []byte("ok"), Retention: retention})
			if err != nil {
				t.Fatalf("complete with a %v retention: %v", retention, err)
			}
			if rec.State != idempotency.Completed || string(rec.Result) != "ok" {
				t.Errorf("the completed record: %+v", rec)
			}
		})
	}
}

// TestLongFingerprint (a retried request replays its first result; inputs at the limits): a fingerprint over 64 KiB (a request
// body used as the fingerprint) either works on every dialect (a retry of
// the same request replays the first result) or is refused by the store with
// fence.ErrInvalid before anything runs; never cut on the way so that the
// same request no longer matches itself.
func TestLongFingerprint(t *testing.T) {
	ctx := context.Background()
	fp := strings.Repeat("f", 70000)
	for _, d := range everyDialect(t) {
		t.Run(d.name, func(t *testing.T) {
			_, _, s := d.parts(t)
			key := fencetest.Name("long-fp")
			runs := 0
			effect := func(context.Context, string) ([]byte, error) { runs++; return []byte("done"), nil }
			_, err := idempotency.Do(ctx, s, key, fp, effect, nil)
			if err != nil {
				if !errors.Is(err, fence.ErrInvalid) || runs != 0 {
					t.Fatalf("Do with a %d-byte fingerprint: %.300v (%d runs); want it to work or ErrInvalid before the effect", len(fp), err, runs)
				}
				return
			}
			res, err := idempotency.Do(ctx, s, key, fp, effect, nil)
			if err != nil || !res.Replayed || string(res.Value) != "done" || runs != 1 {
				t.Errorf("the same request again: %+v, %v (%d runs); want the first result replayed", res, err, runs)
			}
		})
	}
}
