package sqlfence_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	sqlfence "github.com/fencekit/fencekit/adapters/sql"
	"github.com/fencekit/fencekit/fence"
	"github.com/fencekit/fencekit/fence/fencetest"
	"github.com/fencekit/fencekit/idempotency"
	"github.com/jackc/pgx/v5"
)

// pgHandles returns the PostgreSQL handles of both driver styles.
func pgHandles(t *testing.T) map[string]*sqlfence.DB {
	return map[string]*sqlfence.DB{
		"pgx":          sqlfence.Pgx(pgPool(t, pgOpts{})),
		"database-sql": sqlfence.Postgres(pgStd(t)),
	}
}

// TestPostgresWriterOwnTable runs the writer suite on a table of the user's, in a
// schema of its own, with other column names and an extra column.
func TestPostgresWriterOwnTable(t *testing.T) {
	p := pgPool(t, pgOpts{})
	ctx := context.Background()
	for _, q := range []string{
		`CREATE SCHEMA IF NOT EXISTS fencekit_app`,
		`CREATE TABLE IF NOT EXISTS fencekit_app."Documents" (
			doc_id TEXT PRIMARY KEY,
			body BYTEA,
			version BIGINT NOT NULL DEFAULT 0,
			created_at TIMESTAMPTZ NOT NULL DEFAULT now())`,
	} {
		if _, err := p.Exec(ctx, q); err != nil && !strings.Contains(err.Error(), "already exists") {
			t.Fatal(err)
		}
	}
	w, err := sqlfence.NewWriter(sqlfence.Pgx(p), &sqlfence.WriterOptions{
		Table: `fencekit_app.Documents`, KeyColumn: "doc_id", ValueColumn: "body", FenceColumn: "version",
	})
	if err != nil {
		t.Fatal(err)
	}
	fencetest.WriterSuite{New: func(t *testing.T) fence.FencedWriter { return w }, BadKeys: badKeys}.Run(t)
}

func TestInvalidNames(t *testing.T) {
	fdb := sqlfence.Pgx(pgPool(t, pgOpts{}))
	bad := []string{"", "a b", `x";DROP TABLE y;--`, "1abc", "a.b.c", ".a", "a.", strings.Repeat("x", 64), "naïve"}
	for _, name := range bad {
		if name == "" {
			continue // empty means the default
		}
		if _, err := sqlfence.NewWriter(fdb, &sqlfence.WriterOptions{Table: name}); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewWriter(table %q): err = %v, want ErrInvalid", name, err)
		}
		if _, err := sqlfence.NewWriter(fdb, &sqlfence.WriterOptions{KeyColumn: name}); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewWriter(key column %q): err = %v, want ErrInvalid", name, err)
		}
		if _, err := sqlfence.NewAcquirer(fdb, &sqlfence.AcquirerOptions{Table: name}); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewAcquirer(table %q): err = %v, want ErrInvalid", name, err)
		}
		if _, err := sqlfence.NewGuards(fdb, &sqlfence.GuardOptions{Table: name}); !errors.Is(err, fence.ErrInvalid) {
			t.Errorf("NewGuards(table %q): err = %v, want ErrInvalid", name, err)
		}
	}
	if _, err := sqlfence.NewWriter(fdb, &sqlfence.WriterOptions{KeyColumn: "v", ValueColumn: "v"}); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("NewWriter with the same key and value column: err = %v, want ErrInvalid", err)
	}
}

func TestMissingTable(t *testing.T) {
	ctx := context.Background()
	handles := pgHandles(t)
	_, handles["sqlite"] = openSQLite(t)
	for style, fdb := range handles {
		t.Run(style, func(t *testing.T) {
			table := fencetest.Name("missing")
			table = strings.ReplaceAll(table, "-", "_")
			w := newWriterOn(t, fdb, &sqlfence.WriterOptions{Table: table})
			var te *sqlfence.TableError
			err := w.Write(ctx, "k", []byte("v"), 1)
			if !errors.As(err, &te) || te.Table != table || !strings.Contains(err.Error(), "CREATE TABLE") {
				t.Errorf("Write to a missing table: %v, want a *TableError naming %s with its DDL", err, table)
			}
			a := newAcquirerOn(t, fdb, &sqlfence.AcquirerOptions{Table: table})
			_, err = a.TryAcquire(ctx, "n", time.Second)
			if !errors.As(err, &te) || te.Table != table {
				t.Errorf("TryAcquire on a missing table: %v, want a *TableError naming %s", err, table)
			}
			// And CreateTable makes it work.
			if err := w.CreateTable(ctx); err != nil {
				t.Fatal(err)
			}
			if err := w.Write(ctx, "k", []byte("v"), 1); err != nil {
				t.Errorf("after CreateTable: %v", err)
			}
		})
	}
}

// TestRoundTrips counts the statements an uncontended acquire + release sends.
func TestRoundTrips(t *testing.T) {
	tr := &counter{}
	p := pgPool(t, pgOpts{tracer: tr})
	a := newAcquirerOn(t, sqlfence.Pgx(p), nil)
	ctx := context.Background()
	name := fencetest.Name("rt")
	before := tr.queries.Load()
	l := mustGrant(t, ctx, a, name, time.Minute)
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if n := tr.queries.Load() - before; n != 2 {
		t.Errorf("acquire + release sent %d statements, want 2", n)
	}
	w, _ := sqlfence.NewWriter(sqlfence.Pgx(p), nil)
	// A new Writer's first call also reads its key column's type, once.
	before = tr.queries.Load()
	if err := w.Write(ctx, fencetest.Name("rt-first"), []byte("v"), 1); err != nil {
		t.Fatal(err)
	}
	if n := tr.queries.Load() - before; n != 2 {
		t.Errorf("a new Writer's first write sent %d statements, want 2 (its key column's type, then the write)", n)
	}
	key := fencetest.Name("rt")
	before = tr.queries.Load()
	if err := w.Write(ctx, key, []byte("v"), 1); err != nil {
		t.Fatal(err)
	}
	if n := tr.queries.Load() - before; n != 1 {
		t.Errorf("a write to a new key sent %d statements, want 1", n)
	}
	before = tr.queries.Load()
	if err := w.Write(ctx, key, []byte("v"), 2); err != nil {
		t.Fatal(err)
	}
	if n := tr.queries.Load() - before; n != 1 {
		t.Errorf("a write to an existing key sent %d statements, want 1", n)
	}
	// idempotency.Do: claim, arm, complete on a fresh key; claim (a no-op) and
	// read on a replay.
	s, _ := sqlfence.NewIdempotencyStore(sqlfence.Pgx(p), nil)
	if err := s.CreateTable(ctx); err != nil {
		t.Fatal(err)
	}
	ik := fencetest.Name("rt")
	effect := func(context.Context, string) ([]byte, error) { return []byte("ok"), nil }
	for _, c := range []struct {
		what string
		want int64
	}{{"a fresh key", 3}, {"a replay", 2}} {
		before = tr.queries.Load()
		if _, err := idempotency.Do(ctx, s, ik, "fp", effect, nil); err != nil {
			t.Fatal(err)
		}
		if n := tr.queries.Load() - before; n != c.want {
			t.Errorf("idempotency.Do on %s sent %d statements, want %d", c.what, n, c.want)
		}
	}
}

// TestAdvanceOnGrant: with AdvanceGuards, a newer grant fences the older holder's
// guarded transactions at once, before the new holder has written anything.
func TestAdvanceOnGrant(t *testing.T) {
	ctx := context.Background()
	sqliteDB, sqliteF := openSQLite(t)
	newSQLiteAcquirer(t, sqliteF) // creates the lease table
	pg := pgStd(t)
	mysqlDB, mysqlF := openMySQL(t, "")
	for _, c := range []struct {
		name string
		db   *sql.DB
		fdb  *sqlfence.DB
	}{{"postgres", pg, sqlfence.Postgres(pg)}, {"sqlite", sqliteDB, sqliteF}, {"mysql", mysqlDB, mysqlF}} {
		t.Run(c.name, func(t *testing.T) {
			g, err := sqlfence.NewGuards(c.fdb, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := g.CreateTable(ctx); err != nil {
				t.Fatal(err)
			}
			a := newAcquirerOn(t, c.fdb, &sqlfence.AcquirerOptions{AdvanceGuards: g})
			name := fencetest.Name("advance")
			// A second's ttl: a grant on a loaded machine can take longer
			// than 100ms (on SQLite three grants in a row have come back
			// past a 100ms lease's local deadline).
			old := fencetest.TryLive(ctx, t, a, name, time.Second)
			<-old.Context().Done()
			var newer fence.Lease
			for end := time.Now().Add(10 * time.Second); ; {
				newer, err = a.TryAcquire(ctx, name, time.Minute)
				if err == nil {
					break
				}
				if !errors.Is(err, fence.ErrHeld) || time.Now().After(end) {
					t.Fatal(err)
				}
				time.Sleep(20 * time.Millisecond) // until the row expires on the server's clock
			}
			defer newer.Release(ctx)
			err = sqlfence.RunTx(ctx, c.db, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, name, old.Token()) })
			var se *fence.StaleError
			if !errors.As(err, &se) || se.Current != newer.Token() {
				t.Fatalf("old holder's Guard after a newer grant: %v, want StaleError naming token %d", err, newer.Token())
			}
			if err := sqlfence.RunTx(ctx, c.db, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, name, newer.Token()) }); err != nil {
				t.Fatalf("new holder's Guard: %v", err)
			}
			// A held lease does not advance the guard: TryAcquire fails, fence unchanged.
			if _, err := a.TryAcquire(ctx, name, time.Minute); !errors.Is(err, fence.ErrHeld) {
				t.Fatalf("TryAcquire on a held lease: %v", err)
			}
			err = sqlfence.RunTx(ctx, c.db, nil, func(tx *sql.Tx) error { return g.Guard(ctx, tx, name, newer.Token()) })
			if err != nil {
				t.Errorf("a refused grant moved the guard: %v", err)
			}
		})
	}
}

// TestPgxTxGuard guards a native pgx transaction.
func TestPgxTxGuard(t *testing.T) {
	p := pgPool(t, pgOpts{})
	ctx := context.Background()
	name := fencetest.Name("pgxtx")
	g, err := sqlfence.NewGuards(sqlfence.Pgx(p), nil)
	if err != nil {
		t.Fatal(err)
	}
	err = sqlfence.RunPgxTx(ctx, p, nil, func(tx pgx.Tx) error { return g.GuardPgx(ctx, tx, name, 7) })
	if err != nil {
		t.Fatal(err)
	}
	err = sqlfence.RunPgxTx(ctx, p, nil, func(tx pgx.Tx) error { return g.GuardPgx(ctx, tx, name, 6) })
	var se *fence.StaleError
	if !errors.As(err, &se) || se.Offered != 6 || se.Current != 7 || se.Key != name {
		t.Fatalf("Guard with a lower token: %v", err)
	}
	tx, err := p.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if err := g.GuardPgx(ctx, tx, name, 0); !errors.Is(err, fence.ErrInvalid) {
		t.Errorf("GuardPgx with token 0: %v, want ErrInvalid", err)
	}
}

// TestRunPgxTxOptions: PgxTxOptions.TxOptions begins every attempt, and
// MaxAttempts bounds the runs after a serialization failure (a real 40001 from
// the server), 10 by default.
func TestRunPgxTxOptions(t *testing.T) {
	p := pgPool(t, pgOpts{})
	ctx := context.Background()
	opts := &sqlfence.PgxTxOptions{TxOptions: pgx.TxOptions{IsoLevel: pgx.Serializable, AccessMode: pgx.ReadOnly}, MaxAttempts: 3}
	for _, c := range []struct {
		opts *sqlfence.PgxTxOptions
		runs int
		iso  string
		ro   string
	}{{opts, 3, "serializable", "on"}, {nil, 10, "read committed", "off"}} {
		runs := 0
		err := sqlfence.RunPgxTx(ctx, p, c.opts, func(tx pgx.Tx) error {
			runs++
			var iso, ro string
			if err := tx.QueryRow(ctx, `SELECT current_setting('transaction_isolation'), current_setting('transaction_read_only')`).Scan(&iso, &ro); err != nil {
				return err
			}
			if iso != c.iso || ro != c.ro {
				t.Errorf("attempt %d with %+v: isolation %q, read only %q, want %q, %q", runs, c.opts, iso, ro, c.iso, c.ro)
			}
			_, err := tx.Exec(ctx, `DO $$ BEGIN RAISE EXCEPTION 'provoked' USING ERRCODE = 'serialization_failure'; END $$`)
			return err
		})
		if !sqlfence.IsSerializationFailure(err) || runs != c.runs {
			t.Errorf("RunPgxTx with %+v: %d runs, %v; want %d runs and the serialization failure", c.opts, runs, err, c.runs)
		}
	}
}

var _ = sync.Mutex{}
